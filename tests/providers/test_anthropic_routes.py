"""Routes on the `Anthropic` binding over real HTTP against the fake Anthropic server (issue 40,
"Done when"): a strict and a degrading route answer; a stream relays text and ends with
`done`; an overload moves to the next model (also as an `error` event before the first
output); a rate limit sends a bounded `Retry-After`; a context-length refusal is `400
context_length_exceeded`; a refusal is moderation; an `error` event after the first output
ends the stream with `error` and no second model; bad credentials and unknown models are a
502/503, never a 4xx; no credential or provider text in any response or log line."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from fixtures import Fail, FakeAnthropic, Raw, Reply, Stream, Text
from guards import AI, EventStream, Guards
from guards.providers import Anthropic

from ..conftest import AppClient, LogLines, assert_error, assert_fallback, no_sleep

PRIMARY = "claude-sonnet-4-5"
BACKUP = "claude-haiku-4-5"
GOOD = {"label": "billing", "confidence": 0.9}
FALLBACK = {"label": "general", "confidence": 0.1}
ANSWER = Stream(parts=(Text("Your parcel"), Text(" is on"), Text(" its way.")))
CANARY = "CANARY-PROVIDER-TEXT"
KEY = "sk-ant-CANARY-KEY"


class Ask(BaseModel):
    text: str = Field(min_length=1, max_length=200)


class Label(BaseModel):
    label: str = Field(min_length=1, max_length=80)
    confidence: float = Field(ge=0, le=1)


class GetWeather(BaseModel):
    """The weather now in a city."""

    city: str


def create_app(server: FakeAnthropic) -> FastAPI:
    guards = Guards(Anthropic(api_key=server.api_key, base_url=server.base_url), sleep=no_sleep)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with guards:
            yield

    app = FastAPI(lifespan=lifespan)
    guards.install(app)

    @app.post("/strict")
    @guards.route(model=PRIMARY, timeout_s=5)
    async def strict(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run(
            {"messages": [{"role": "system", "content": "Label it."}, {"role": "user", "content": body.text}]}
        )

    @app.post("/chain")
    @guards.route(model=PRIMARY, fallbacks=[BACKUP], timeout_s=5)
    async def chain(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run({"prompt": body.text})

    @app.post("/degrading")
    @guards.route(model=PRIMARY, timeout_s=5, fallback=Label(**FALLBACK))
    async def degrading(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run({"prompt": body.text})

    @app.post("/weather")
    @guards.route(model=PRIMARY, timeout_s=5, tools={"get_weather": GetWeather})
    async def weather(body: Ask, ai: AI[str]) -> dict[str, Any]:
        text = await ai.run({"prompt": body.text})
        return {"text": text, "calls": [(c.name, c.arguments.model_dump(), c.id) for c in ai.tool_calls]}

    @app.post("/stream")
    @guards.route(model=PRIMARY, fallbacks=[BACKUP], timeout_s=5)
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream({"messages": [{"role": "user", "content": body.text}]})

    return app


@pytest.fixture
def client(fake_anthropic: FakeAnthropic, app_client: AppClient) -> httpx.Client:
    return app_client(create_app(fake_anthropic))


def post(client: httpx.Client, path: str) -> httpx.Response:
    return client.post(path, json={"text": "I was charged twice."})


def events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for block in response.text.split("\n\n"):
        if block.strip():
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            found.append((fields["event"], json.loads(fields["data"])))
    return found


def text_of(found: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(data["text"] for name, data in found if name == "delta")


def models(server: FakeAnthropic) -> list[str]:
    return [call.model for call in server.calls]


# --- answers --------------------------------------------------------------------------------------


def test_a_strict_route_answers(client: httpx.Client, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(PRIMARY, Reply(GOOD))
    response = post(client, "/strict")
    assert response.status_code == 200, response.text
    assert response.json() == GOOD
    [call] = fake_anthropic.calls
    assert call.inputs["system"] == "Label it."
    assert call.inputs["messages"] == [{"role": "user", "content": "I was charged twice."}]
    assert call.inputs["max_tokens"] == 4096
    assert call.inputs["tool_choice"] == {"type": "tool", "name": "json_answer"}
    [tool] = call.inputs["tools"]
    assert tool["input_schema"]["required"] == ["label", "confidence"]
    assert call.headers["x-api-key"] == fake_anthropic.api_key
    assert call.headers["anthropic-version"] == "2023-06-01"


def test_a_degrading_route_answers(client: httpx.Client, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(PRIMARY, Reply(GOOD))
    response = post(client, "/degrading")
    assert response.status_code == 200
    assert response.json() == {"ok": True, "data": GOOD, "fallback": None}


def test_a_stream_relays_text_and_ends_with_done(client: httpx.Client, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(PRIMARY, ANSWER)
    found = events(post(client, "/stream"))
    assert text_of(found) == ANSWER.text
    name, done = found[-1]
    assert name == "done"
    assert (done["finish_reason"], done["model"]) == ("stop", PRIMARY)
    assert done["usage"]["prompt_tokens"] == 10
    assert fake_anthropic.calls[0].inputs["stream"] is True


def test_a_tool_use_block_is_a_validated_tool_call(
    client: httpx.Client, fake_anthropic: FakeAnthropic
) -> None:
    call = {"id": "toolu_01", "name": "get_weather", "arguments": {"city": "Paris"}}
    fake_anthropic.script(PRIMARY, Reply("Let me look.", tool_calls=(call,)))
    response = post(client, "/weather")
    assert response.status_code == 200, response.text
    assert response.json() == {
        "text": "Let me look.",
        "calls": [["get_weather", {"city": "Paris"}, "toolu_01"]],
    }
    [tool] = fake_anthropic.calls[0].inputs["tools"]
    assert (tool["name"], tool["description"]) == ("get_weather", "The weather now in a city.")
    assert tool["input_schema"]["required"] == ["city"]


# --- failures -------------------------------------------------------------------------------------


def test_an_overload_is_retried_once_then_the_next_model_answers(
    client: httpx.Client, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.script(PRIMARY, Fail(status=529), Fail(status=529))
    fake_anthropic.script(BACKUP, Reply(GOOD))
    response = post(client, "/chain")
    assert response.status_code == 200, response.text
    assert response.json() == GOOD
    assert models(fake_anthropic) == [PRIMARY, PRIMARY, BACKUP]


def test_an_overload_event_before_the_first_output_moves_to_the_next_model(
    client: httpx.Client, fake_anthropic: FakeAnthropic
) -> None:
    overloaded = Stream(parts=ANSWER.parts, error_after=0)
    fake_anthropic.script(PRIMARY, overloaded, overloaded)
    fake_anthropic.script(BACKUP, ANSWER)
    found = events(post(client, "/stream"))
    assert text_of(found) == ANSWER.text
    assert found[-1][0] == "done"
    assert models(fake_anthropic) == [PRIMARY, PRIMARY, BACKUP]


def test_an_error_event_after_the_first_output_ends_the_stream_with_error(
    client: httpx.Client, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.script(PRIMARY, Stream(parts=ANSWER.parts, error_after=1))
    fake_anthropic.script(BACKUP, ANSWER)
    found = events(post(client, "/stream"))
    assert text_of(found) == "Your parcel"
    name, error = found[-1]
    assert name == "error"
    assert (error["guard"], error["reason"]) == ("call", "provider_error")
    assert "done" not in [n for n, _ in found]
    assert models(fake_anthropic) == [PRIMARY]  # no second model


@pytest.mark.parametrize(
    ("wait", "retry_after"),
    [pytest.param("20", "20", id="its-own-wait"), pytest.param("86400", "600", id="capped-by-the-cooldown")],
)
def test_a_rate_limit_sends_a_bounded_retry_after(
    client: httpx.Client, fake_anthropic: FakeAnthropic, wait: str, retry_after: str
) -> None:
    fake_anthropic.script(PRIMARY, Fail(status=429, retry_after=wait))
    response = post(client, "/strict")
    assert_error(response, 503, "model_rate_limited", False)
    assert response.headers["retry-after"] == retry_after
    assert len(fake_anthropic.calls) == 1


def test_a_rate_limit_without_retry_after_waits_for_the_spent_limit(
    client: httpx.Client, fake_anthropic: FakeAnthropic
) -> None:
    """The reset of the limit that is spent (`-remaining: 0`), not of the others."""
    headers = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2099-01-01T00:00:00Z",
        "anthropic-ratelimit-tokens-remaining": "9000",
        "anthropic-ratelimit-tokens-reset": "2000-01-01T00:00:00Z",
    }
    body = b'{"type":"error","error":{"type":"rate_limit_error","message":"' + CANARY.encode() + b'"}}'
    fake_anthropic.script(PRIMARY, Raw(429, body, content_type="application/json", headers=headers))
    response = post(client, "/strict")
    assert_error(response, 503, "model_rate_limited", False)
    assert response.headers["retry-after"] == "600"  # years away: the cooldown's longest


def test_a_prompt_too_long_is_400_context_length_exceeded(
    client: httpx.Client, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.script(
        PRIMARY, Fail(status=400, message="prompt is too long: 210000 tokens > 200000 maximum")
    )
    assert_error(post(client, "/strict"), 400, "context_length_exceeded", False)
    assert len(fake_anthropic.calls) == 1


def test_a_refusal_is_moderation(client: httpx.Client, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(PRIMARY, Reply(refusal="I can't help with that."), Reply(refusal="No."))
    assert_fallback(post(client, "/degrading"), "output", "moderation_blocked", FALLBACK)
    assert_error(post(client, "/strict"), 502, "incompatible_model_response", False)


def test_a_refused_stream_ends_with_moderation(client: httpx.Client, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(PRIMARY, Stream(parts=(Text("I can't"),), finish_reason="content_filter"))
    name, error = events(post(client, "/stream"))[-1]
    assert (name, error["reason"]) == ("error", "moderation_blocked")


@pytest.mark.parametrize(
    ("failure", "status", "token"),
    [
        pytest.param(Fail(status=401), 503, "model_unavailable", id="401-authentication"),
        pytest.param(Fail(status=403), 502, "model_incompatible", id="403-permission"),
        pytest.param(Fail(status=404), 502, "model_incompatible", id="404-not-found"),
        pytest.param(Fail(status=402), 503, "model_quota_exhausted", id="402-billing"),
    ],
)
def test_the_operators_faults_are_never_a_4xx(
    client: httpx.Client, fake_anthropic: FakeAnthropic, failure: Fail, status: int, token: str
) -> None:
    fake_anthropic.script(PRIMARY, failure)
    assert_error(post(client, "/strict"), status, token, False)
    assert len(fake_anthropic.calls) == 1


def test_a_wrong_key_is_503(app_client: AppClient, fake_anthropic: FakeAnthropic) -> None:
    app = create_app(fake_anthropic)
    fake_anthropic.api_key = "another-key"
    assert_error(post(app_client(app), "/strict"), 503, "model_unavailable", False)
    assert fake_anthropic.calls == []  # refused before it reached a model


# --- privacy --------------------------------------------------------------------------------------


def test_no_credential_or_provider_text_in_any_response_or_log_line(
    app_client: AppClient, guards_log: LogLines
) -> None:
    """Each failure's message, and the key, carry canaries: none reaches a client or a log."""
    said = f"{CANARY} {KEY}"
    overloaded, broken = Fail(status=529, message=said), Fail(status=500, message=said)
    cases: list[tuple[str, dict[str, tuple[Any, ...]], int]] = [
        ("/chain", {PRIMARY: (overloaded, overloaded), BACKUP: (broken,)}, 3),  # the attempt budget: 3
        ("/strict", {PRIMARY: (Fail(status=400, message=f"prompt is too long: {said}"),)}, 1),
        ("/strict", {PRIMARY: (Fail(status=429, message=said, retry_after="5"),)}, 1),
        ("/strict", {PRIMARY: (Fail(status=401, message=said),)}, 1),
        ("/degrading", {PRIMARY: (overloaded, overloaded)}, 2),
        ("/stream", {PRIMARY: (Stream(parts=ANSWER.parts, error_after=1, error_message=said),)}, 1),
        (
            "/stream",
            {
                PRIMARY: (Stream(parts=ANSWER.parts, error_after=0, error_message=said),) * 2,
                BACKUP: (broken,),
            },
            3,
        ),
    ]
    seen: list[str] = []
    with FakeAnthropic(api_key=KEY) as server:
        for path, scripts, calls in cases:
            server.reset()
            for model, outcomes in scripts.items():
                server.script(model, *outcomes)
            response = post(app_client(create_app(server)), path)  # a fresh app: no cooldown carried over
            seen.append(response.text + json.dumps(dict(response.headers)))
            assert len(server.calls) == calls, path
            assert all(call.headers["x-api-key"] == KEY for call in server.calls)
    assert len(guards_log.lines) > len(cases)
    leaked = [
        line
        for line in seen + guards_log.lines
        if CANARY.lower() in line.lower() or KEY.lower() in line.lower()
    ]
    assert leaked == []
