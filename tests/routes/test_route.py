"""The route decorator, driven in process through ASGI with the fake binding: signatures and
dependencies survive, OpenAPI tells the truth, declarations are checked at start-up, fallbacks
and hooks behave."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel, Field

from fixtures import Fail, FakeBinding, Reply
from guards import (
    AI,
    AIResult,
    Breaker,
    Budget,
    ConfigurationError,
    Envelope,
    Guards,
    GuardTripped,
    Reason,
    Retry,
    Throttled,
)

from ..conftest import asgi_client

MODEL = "@cf/test/model"


class Item(BaseModel):
    name: str
    score: float = Field(ge=0, le=1)


class Query(BaseModel):
    text: str = Field(min_length=1, max_length=50)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def guards(fake_ai: FakeBinding) -> Guards:
    async def no_sleep(seconds: float) -> None:
        pass

    return Guards(fake_ai, sleep=no_sleep)


@pytest.fixture
def app(guards: Guards) -> FastAPI:
    app = FastAPI()
    guards.install(app)
    return app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(app) as client:
        yield client


def tenant(x_tenant: Annotated[str, Header()]) -> str:
    return x_tenant.upper()


@pytest.mark.anyio
async def test_parameters_and_dependencies_reach_the_handler(
    app: FastAPI, guards: Guards, client: httpx.AsyncClient, fake_ai: FakeBinding
) -> None:
    @app.post("/items/{item_id}")
    @guards.route(model=MODEL)
    async def rate_item(
        item_id: int, body: Query, ai: AI[Item], verbose: bool = False, who: str = Depends(tenant)
    ) -> dict[str, Any]:
        item = await ai.run({"prompt": body.text})
        return {"id": item_id, "verbose": verbose, "who": who, "item": item.model_dump()}

    fake_ai.script(MODEL, Reply({"name": "lamp", "score": 0.5}))
    response = await client.post(
        "/items/7?verbose=true", json={"text": "a lamp"}, headers={"x-tenant": "acme"}
    )
    assert response.status_code == 200
    assert response.json() == {
        "id": 7,
        "verbose": True,
        "who": "ACME",
        "item": {"name": "lamp", "score": 0.5},
    }
    operation = app.openapi()["paths"]["/items/{item_id}"]["post"]
    assert sorted(p["name"] for p in operation["parameters"]) == ["item_id", "verbose", "x-tenant"]
    # A bad path parameter is invalid input too.
    assert (
        await client.post("/items/seven", json={"text": "a"}, headers={"x-tenant": "a"})
    ).status_code == 400
    assert len(fake_ai.calls) == 1


@pytest.mark.anyio
async def test_openapi_documents_every_status_of_a_strict_route(app: FastAPI, guards: Guards) -> None:
    @app.post("/strict")
    @guards.route(model=MODEL, budget=Budget(per_day=5))
    async def strict(body: Query, ai: AI[Item]) -> Item:
        return await ai.run({"prompt": body.text})

    @app.post("/no-breaker")
    @guards.route(model=MODEL, breaker=None)
    async def no_breaker(body: Query, ai: AI[str]) -> str:
        return await ai.run({"prompt": body.text})

    schema = app.openapi()
    responses = schema["paths"]["/strict"]["post"]["responses"]
    assert sorted(responses) == ["200", "400", "429", "500", "502", "503"]
    assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Item"}

    def errors(status: str, responses: dict[str, Any] = responses) -> list[str]:
        body = responses[status]["content"]["application/json"]["schema"]
        assert body["allOf"][0] == {"$ref": "#/components/schemas/ErrorBody"}
        return list(body["allOf"][1]["properties"]["error"]["enum"])

    # A strict route answers 400 for invalid input, and for an input no model's window holds.
    assert errors("400") == ["invalid_request", "context_length_exceeded"]
    assert errors("429") == ["budget_exceeded"]  # no per-minute limit declared
    assert errors("500") == ["application_failure"]
    assert errors("502") == ["model_incompatible", "incompatible_model_response"]
    assert "circuit_open" in errors("503")
    assert "retry-after" in responses["503"]["headers"]
    assert all("x-trace-id" in r["headers"] for r in responses.values())
    assert schema["components"]["schemas"]["ErrorBody"]["required"] == ["error", "retryable"]

    no_breaker_responses = schema["paths"]["/no-breaker"]["post"]["responses"]
    assert sorted(no_breaker_responses) == ["200", "400", "500", "502", "503"]
    assert "circuit_open" not in errors("503", no_breaker_responses)


@pytest.mark.anyio
async def test_openapi_documents_the_envelope_of_a_degrading_route(app: FastAPI, guards: Guards) -> None:
    @app.post("/degrading")
    @guards.route(model=MODEL, fallback=Item(name="unknown", score=0))
    async def degrading(body: Query, ai: AI[Item]) -> Item:
        return await ai.run({"prompt": body.text})

    schema = app.openapi()
    responses = schema["paths"]["/degrading"]["post"]["responses"]
    assert sorted(responses) == ["200", "400", "500"]
    ref = responses["200"]["content"]["application/json"]["schema"]["$ref"]
    envelope = schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert envelope["properties"]["data"] == {"$ref": "#/components/schemas/Item"}
    assert set(envelope["required"]) == {"data"}
    fallback_info = schema["components"]["schemas"]["FallbackInfo"]
    assert fallback_info["required"] == ["guard", "reason", "detail"]
    reasons = schema["components"]["schemas"]["Reason"]["enum"]
    assert reasons == [r.value for r in Reason]


@pytest.mark.anyio
async def test_static_fallback(
    app: FastAPI, guards: Guards, client: httpx.AsyncClient, fake_ai: FakeBinding
) -> None:
    @app.post("/static")
    @guards.route(model=MODEL, fallback={"name": "unknown", "score": 0})
    async def static(ai: AI[Item]) -> Item:
        return await ai.run({"prompt": "x"})

    fake_ai.script(MODEL, Fail(code=5035, status=403))
    body = (await client.post("/static")).json()
    assert body["data"] == {"name": "unknown", "score": 0.0}
    assert body["fallback"]["reason"] == "provider_error"
    assert body["fallback"]["guard"] == "call"


@pytest.mark.anyio
async def test_async_fallback_function_sees_arguments_and_failure(
    app: FastAPI, guards: Guards, client: httpx.AsyncClient, fake_ai: FakeBinding
) -> None:
    seen: list[tuple[str, Reason]] = []

    async def from_query(arguments: Mapping[str, Any], tripped: GuardTripped) -> Item:
        seen.append((arguments["body"].text, tripped.reason))
        return Item(name=arguments["body"].text.upper(), score=0.1)

    @app.post("/computed")
    @guards.route(model=MODEL, fallback=from_query)
    async def computed(body: Query, ai: AI[Item]) -> Item:
        return await ai.run({"prompt": body.text})

    fake_ai.script(MODEL, Reply(""))
    body = (await client.post("/computed", json={"text": "desk"})).json()
    assert body["data"] == {"name": "DESK", "score": 0.1}
    assert body["fallback"]["reason"] == "empty_response"
    assert seen == [("desk", Reason.empty_response)]


@pytest.mark.anyio
@pytest.mark.parametrize("bad", ["raises", "invalid"])
async def test_broken_fallback_function_is_application_failure(
    app: FastAPI, guards: Guards, client: httpx.AsyncClient, fake_ai: FakeBinding, bad: str
) -> None:
    def broken(arguments: Mapping[str, Any], tripped: GuardTripped) -> Any:
        if bad == "raises":
            raise RuntimeError("fallback bug")
        return {"name": "x", "score": 5}

    @app.post("/broken")
    @guards.route(model=MODEL, fallback=broken)
    async def broken_route(ai: AI[Item]) -> Item:
        return await ai.run({"prompt": "x"})

    fake_ai.script(MODEL, Fail(code=3036, status=429))
    response = await client.post("/broken")
    assert response.status_code == 500
    assert response.json()["error"] == "application_failure"


@pytest.mark.anyio
async def test_handler_returning_the_wrong_shape_is_application_failure(
    app: FastAPI, guards: Guards, client: httpx.AsyncClient
) -> None:
    @app.post("/wrong-shape")
    @guards.route(model=MODEL)
    async def wrong_shape(ai: AI[str]) -> Item:
        text = await ai.run({"prompt": "x"})
        return {"name": text}  # type: ignore[return-value]

    response = await client.post("/wrong-shape")
    assert response.status_code == 500
    assert response.json()["error"] == "application_failure"


@pytest.mark.anyio
async def test_http_exception_from_the_handler_passes_through(
    app: FastAPI, guards: Guards, client: httpx.AsyncClient, fake_ai: FakeBinding
) -> None:
    @app.get("/things/{thing_id}")
    @guards.route(model=MODEL)
    async def thing(thing_id: int, ai: AI[str]) -> str:
        if thing_id != 1:
            raise HTTPException(status_code=404, detail="no such thing")
        return await ai.run({"prompt": "x"})

    response = await client.get("/things/2")
    assert response.status_code == 404
    assert response.json() == {"detail": "no such thing"}
    assert fake_ai.calls == []


@pytest.mark.anyio
async def test_async_moderation_hook_blocks(
    app: FastAPI, guards: Guards, client: httpx.AsyncClient, fake_ai: FakeBinding
) -> None:
    async def no_lamps(item: Item) -> bool:
        return item.name == "lamp"

    @app.post("/moderated")
    @guards.route(model=MODEL, moderation=no_lamps)
    async def moderated(ai: AI[Item]) -> Item:
        return await ai.run({"prompt": "x"})

    fake_ai.script(MODEL, Reply({"name": "lamp", "score": 0.5}), Reply({"name": "desk", "score": 0.5}))
    blocked = await client.post("/moderated")
    assert blocked.status_code == 502
    assert blocked.json()["error"] == "incompatible_model_response"
    assert (await client.post("/moderated")).json() == {"name": "desk", "score": 0.5}


@pytest.mark.anyio
async def test_trace_id_is_taken_from_the_request_when_well_formed(
    app: FastAPI, guards: Guards, client: httpx.AsyncClient
) -> None:
    @app.post("/traced")
    @guards.route(model=MODEL)
    async def traced(ai: AI[str]) -> dict[str, str]:
        await ai.run({"prompt": "x"})
        return {"trace_id": ai.trace_id}

    given = await client.post("/traced", headers={"x-trace-id": "abc-123-DEF_456"})
    assert given.headers["x-trace-id"] == "abc-123-DEF_456"
    assert given.json() == {"trace_id": "abc-123-DEF_456"}
    malformed = await client.post("/traced", headers={"x-trace-id": "<script>"})
    assert malformed.headers["x-trace-id"] != "<script>"
    assert len(malformed.headers["x-trace-id"]) == 32


@pytest.mark.anyio
async def test_unguarded_routes_keep_fastapi_validation(app: FastAPI, client: httpx.AsyncClient) -> None:
    @app.post("/plain")
    async def plain(body: Query) -> dict[str, str]:
        return {"text": body.text}

    response = await client.post("/plain", json={})
    assert response.status_code == 422
    assert "422" in app.openapi()["paths"]["/plain"]["post"]["responses"]


@pytest.mark.anyio
async def test_retry_waits_with_the_injected_sleep_and_respects_the_deadline(fake_ai: FakeBinding) -> None:
    delays: list[float] = []

    async def record_sleep(seconds: float) -> None:
        delays.append(seconds)

    guards = Guards(fake_ai, sleep=record_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/roomy")
    @guards.route(model=MODEL, timeout_s=5, retry=Retry(attempts=3, delay_s=0.2, jitter=0.5))
    async def roomy(ai: AI[str]) -> str:
        return await ai.run({"prompt": "x"})

    @app.post("/tight")
    @guards.route(model="tight", timeout_s=0.6, retry=Retry(delay_s=0.2, min_room_s=0.5))
    async def tight(ai: AI[str]) -> str:
        return await ai.run({"prompt": "x"})

    async with asgi_client(app) as client:
        fake_ai.script(MODEL, Fail(code=3040, status=429), Fail(code=3040, status=429), Reply("third"))
        assert (await client.post("/roomy")).json() == "third"
        assert len(delays) == 2
        assert all(0.1 <= d <= 0.3 for d in delays)

        # 0.6 s deadline: after a 0.1-0.3 s delay less than 0.5 s would be left, so no retry.
        fake_ai.script("tight", Fail(code=3040, status=429), Reply("never"))
        response = await client.post("/tight")
        assert response.json()["error"] == "model_temporarily_unavailable"
        assert len(fake_ai.calls_to("tight")) == 1


@pytest.mark.anyio
async def test_guards_close_the_binding(fake_ai: FakeBinding) -> None:
    async with Guards(fake_ai):
        assert not fake_ai.closed
    assert fake_ai.closed


def test_use_fake_ai_swaps_the_binding_of_the_example_app(use_fake_ai: Any) -> None:
    import anyio

    from app.service import create_app
    from app.settings import Settings

    app = create_app(Settings())
    fake = use_fake_ai(app)
    fake.script("*", Reply("From the fake."))

    async def scenario() -> httpx.Response:
        async with asgi_client(app) as client:
            return await client.post("/draft-reply", json={"message": "hi"})

    assert anyio.run(scenario).json()["reply"] == "From the fake."
    assert len(fake.calls) == 1


@pytest.mark.anyio
async def test_throttled_binding_waits_for_capacity_within_the_deadline(fake_ai: FakeBinding) -> None:
    """Two calls per minute: the third waits for capacity, and the deadline ends the wait
    before it reaches the provider."""
    guards = Guards(Throttled(fake_ai, max_rate=2, time_period_s=60))
    app = FastAPI()
    guards.install(app)

    @app.post("/paced")
    @guards.route(model=MODEL, timeout_s=0.2, fallback="paced out")
    async def paced(ai: AI[str]) -> str:
        return await ai.run({"prompt": "x"})

    async with asgi_client(app) as client:
        answers = [(await client.post("/paced")).json() for _ in range(3)]
    assert [a["fallback"] for a in answers[:2]] == [None, None]
    assert answers[2]["fallback"]["reason"] == "timeout"
    assert answers[2]["data"] == "paced out"
    assert len(fake_ai.calls) == 2


@pytest.mark.anyio
async def test_a_binding_may_flag_moderation_itself(app: FastAPI, guards: Guards) -> None:
    class Filtering:
        async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
            return AIResult("something unsafe", model=model, moderated=True)

        async def aclose(self) -> None:
            pass

    guards.binding = Filtering()

    @app.post("/filtered")
    @guards.route(model=MODEL)
    async def filtered(ai: AI[str]) -> str:
        return await ai.run({"prompt": "x"})

    async with asgi_client(app) as client:
        response = await client.post("/filtered")
    assert response.status_code == 502
    assert response.json()["error"] == "incompatible_model_response"
    assert "something unsafe" not in response.text


def test_declaration_errors_are_reported_at_start_up(guards: Guards) -> None:
    def sync_handler(ai: AI[str]) -> str:
        return ""

    async def no_ai() -> str:
        return ""

    async def no_return(ai: AI[str]):  # type: ignore[no-untyped-def]
        return ""

    async def star_args(ai: AI[str], *args: Any) -> str:
        return ""

    async def fine(ai: AI[str]) -> Item:
        return Item(name="x", score=0)

    with pytest.raises(ConfigurationError, match="async def"):
        guards.route(model=MODEL)(sync_handler)  # type: ignore[type-var]
    with pytest.raises(ConfigurationError, match="AI\\[OutputType\\]"):
        guards.route(model=MODEL)(no_ai)
    with pytest.raises(ConfigurationError, match="return type"):
        guards.route(model=MODEL, fallback="x")(no_return)
    with pytest.raises(ConfigurationError, match="args"):
        guards.route(model=MODEL)(star_args)
    with pytest.raises(ConfigurationError, match="does not validate"):
        guards.route(model=MODEL, fallback={"name": "x"})(fine)
    with pytest.raises(ConfigurationError, match="model"):
        guards.route(model="")(fine)
    with pytest.raises(ConfigurationError, match="stream_max_s"):
        guards.route(model=MODEL, stream_max_s=0)(fine)
    with pytest.raises(ConfigurationError, match="stream_max_chars"):
        guards.route(model=MODEL, stream_max_chars=0)(fine)
    for max_tokens in (0, 1_000_001):  # 1 to 1,000,000: the most a call may ask for
        with pytest.raises(ConfigurationError, match="max_tokens must be a whole number from 1 to 1,000,000"):
            guards.route(model=MODEL, max_tokens=max_tokens)(fine)
    with pytest.raises(ValueError, match="at least 1"):
        Breaker(failure_threshold=0)
    with pytest.raises(ValueError, match="per_day"):
        Budget(per_day=0)


def test_install_once_and_find_it_again(guards: Guards) -> None:
    app = FastAPI()
    with pytest.raises(ConfigurationError, match="install"):
        Guards.of(app)
    guards.install(app)
    assert Guards.of(app) is guards
    with pytest.raises(ConfigurationError, match="already"):
        guards.install(app)


def test_envelope_is_a_generic_pydantic_model() -> None:
    envelope = Envelope[Item](data=Item(name="x", score=1))
    assert envelope.model_dump() == {"ok": True, "data": {"name": "x", "score": 1.0}, "fallback": None}
    with pytest.raises(ValueError, match="reason"):
        Envelope[Item].model_validate(
            {
                "ok": True,
                "data": {"name": "x", "score": 1},
                "fallback": {"guard": "call", "reason": "nope", "detail": ""},
            }
        )


# Mistakes a newcomer makes, as module source: they must fail when the module is imported, with
# a ConfigurationError that says what to write instead.
MODULE_HEAD = """
from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import FakeBinding
from guards import AI, Guards



class Ask(BaseModel):
    message: str


guards = Guards(FakeBinding())
app = FastAPI()
guards.install(app)
"""

BARE_AI = """
@app.post("/reply")
@guards.route(model="@cf/test/model")
async def reply(body: Ask, ai: AI) -> str:
    return await ai.run({"prompt": body.message})
"""

WRONG_ORDER = """
@guards.route(model="@cf/test/model")
@app.post("/reply")
async def reply(body: Ask, ai: AI[str]) -> str:
    return await ai.run({"prompt": body.message})
"""


def import_module(source: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "newcomer_app"}
    exec(compile(MODULE_HEAD + source, "newcomer_app.py", "exec"), namespace)
    return namespace


def test_a_bare_ai_parameter_fails_at_import() -> None:
    with pytest.raises(ConfigurationError, match=r"reply.*AI\[str\].*AI\[YourModel\]"):
        import_module(BARE_AI)


def test_decorators_in_the_wrong_order_fail_at_import() -> None:
    with pytest.raises(ConfigurationError, match=r"@app\.post\(\.\.\.\) above @guards\.route\(\.\.\.\)"):
        import_module(WRONG_ORDER)


def test_the_right_order_imports(fake_ai: FakeBinding) -> None:
    module = import_module(
        WRONG_ORDER.replace(
            '@guards.route(model="@cf/test/model")\n@app.post("/reply")',
            '@app.post("/reply")\n@guards.route(model="@cf/test/model")',
        )
    )
    assert [route.path for route in module["app"].routes][-1] == "/reply"
