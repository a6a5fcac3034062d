"""A client's `max_tokens` on a chat proxy (a route that passes it to the model), over HTTP
through uvicorn to a fake OpenAI-compatible server: read as any JSON number (integral floats
included, never a bool), capped to `MAX_TOKENS` (1,000,000), held by what is sent, and sent
as an integer; anything else is the route's own `max_tokens`. The token hold and the spend
hold are both priced by it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Body, FastAPI, Response

from fixtures import FakeOpenAI, Reply
from guards import AI, Budget, Guards, Price, Retry, render_metrics
from guards.providers import OpenAICompatible

from ..conftest import Serve, guards_samples, no_sleep

MODEL = "gpt-proxy"
ROUTE_MAX = 256
#: The most a call may ask for (`guards` caps a larger ask to it).
MAX_TOKENS = 1_000_000
#: `{"role": "user", "content": "hi"}`: 2 characters, an estimate of 1 input token.
MESSAGES = [{"role": "user", "content": "hi"}]
INPUT_ESTIMATE = 1


def spends_all(model: str, inputs: Mapping[str, Any]) -> Reply:
    """A model that writes every token it was allowed: the hold settles to what it held, so
    nothing is freed whatever the timing."""
    asked = inputs.get("max_tokens")
    completion = asked if isinstance(asked, int) and not isinstance(asked, bool) else 0
    return Reply("ok", usage={"prompt_tokens": INPUT_ESTIMATE, "completion_tokens": completion})


def proxy_app(server: FakeOpenAI, budget: Budget, **guards: Any) -> FastAPI:
    """A chat proxy: the client's body's `messages` and `max_tokens` go to the model."""
    binding = OpenAICompatible(api_key="test-key", base_url=server.base_url)
    guarded = Guards(binding, sleep=no_sleep, **guards)
    app = FastAPI()
    guarded.install(app)

    @app.post("/chat")
    @guarded.route(model=MODEL, max_tokens=ROUTE_MAX, budget=budget, fallback="busy", retry=Retry(attempts=1))
    async def chat(ai: AI[str], body: Annotated[dict[str, Any], Body()]) -> str:
        inputs: dict[str, Any] = {"messages": body["messages"]}
        if "max_tokens" in body:
            inputs["max_tokens"] = body["max_tokens"]
        return await ai.run(inputs)

    @app.get("/metrics")
    def metrics() -> Response:
        payload, content_type = render_metrics()
        return Response(payload, media_type=content_type)

    return app


def body_with(max_tokens: str) -> bytes:
    """A request body whose `max_tokens` is the JSON text `max_tokens`, exactly as written."""
    return b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + max_tokens.encode() + b"}"


async def burst(url: str, body: bytes, count: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post("/chat", content=body, headers={"content-type": "application/json"})
                for _ in range(count)
            )
        )


def moved(before: Mapping[Any, float], after: Mapping[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.mark.parametrize(
    ("sent", "held"),
    [
        pytest.param("1e6", MAX_TOKENS, id="1e6"),
        pytest.param("1000000.0", MAX_TOKENS, id="1000000.0"),
        pytest.param("1" + "0" * 400, MAX_TOKENS, id="400-digit-integer"),
        pytest.param("1e400", MAX_TOKENS, id="1e400"),
        pytest.param("true", ROUTE_MAX, id="true"),
        pytest.param("0.5", ROUTE_MAX, id="0.5"),
        pytest.param("-3", ROUTE_MAX, id="negative"),
        pytest.param("null", ROUTE_MAX, id="null"),
        pytest.param('"1000000"', ROUTE_MAX, id="a string"),
    ],
)
def test_a_burst_holds_exactly_what_the_provider_is_sent(
    serve: Serve, fake_openai: FakeOpenAI, sent: str, held: int
) -> None:
    """Ten concurrent requests against room for one hold of a million tokens and a half: a
    client's million (however written, or more) admits exactly one call, sent
    `max_tokens: 1000000` as a JSON integer; what is not a number of tokens is the route's
    256, and all ten fit. No 500, and the metrics keep moving (a scrape after the burst counts
    it exactly)."""
    fake_openai.default = spends_all
    budget = Budget(tokens_per_minute=1_500_000)
    client = serve(proxy_app(fake_openai, budget))
    before = guards_samples(client)
    answers = asyncio.run(burst(str(client.base_url), body_with(sent), 10))
    assert [answer.status_code for answer in answers] == [200] * 10
    bodies = [answer.json() for answer in answers]
    admitted = 1 if held == MAX_TOKENS else 10
    assert sum(body["fallback"] is None for body in bodies) == admitted
    assert {body["fallback"]["reason"] for body in bodies if body["fallback"]} <= {"rate_limited"}
    assert len(fake_openai.calls) == admitted
    for call in fake_openai.calls:  # sent what was held, as a JSON integer
        assert type(call.inputs["max_tokens"]) is int
        assert call.inputs["max_tokens"] == held
    after = guards_samples(client)
    scope = "chat"  # the route's name
    assert moved(before, after, "guards_requests_total", route="chat", outcome="ok") == admitted
    assert moved(before, after, "guards_requests_total", route="chat", outcome="fallback") == 10 - admitted
    assert moved(before, after, "guards_budget_held_total", scope=scope, unit="tokens") == 10 * (
        INPUT_ESTIMATE + held
    )
    assert moved(before, after, "guards_budget_settled_total", scope=scope, unit="tokens") == admitted * (
        INPUT_ESTIMATE + held
    )


def test_the_spend_hold_is_priced_by_the_max_tokens_sent(serve: Serve, fake_openai: FakeOpenAI) -> None:
    """A spend cap with room for a call at the route's 256 output tokens, not at the client's
    100,000: the client's ask is refused before any call (`budget_exceeded`), the route's is
    answered."""
    fake_openai.default = spends_all
    price = Price(input_token=1e-6, output_token=1e-5)  # 100,000 output tokens: 1.0
    app = proxy_app(fake_openai, Budget(spend_per_day=0.5), prices={MODEL: price})
    client = serve(app)
    asked = client.post("/chat", content=body_with("1e5"), headers={"content-type": "application/json"})
    assert asked.status_code == 200
    assert asked.json()["fallback"]["reason"] == "budget_exceeded"
    assert fake_openai.calls == []
    default = client.post("/chat", json={"messages": MESSAGES})
    assert default.json()["fallback"] is None
    [call] = fake_openai.calls
    assert call.inputs["max_tokens"] == ROUTE_MAX
