"""The in-process fake speaks the wire of the binding it stands in for: a failure scripted for an
OpenAI app answers the same through `use_fake_ai` as through the fake OpenAI server and the
real adapter, a provider of the app's own gets a fake on its own wire, and a `Fail` field the
wire cannot carry is an error, not left out."""

from __future__ import annotations

import inspect
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

import guards.providers
from fixtures import Fail, FakeBinding, FakeOpenAI, FakeWorkersAI, Stream
from guards import AI, Binding, Guards, ProviderError, StreamEvent, Throttled
from guards.providers import OpenAICompatible, WorkersAI
from guards.testing import UseFakeAI, UseFakeServers
from guards.testing.fake_binding import ADAPTER_WIRES, wire_of

from ..conftest import AppClient, no_sleep

MODEL = "gpt-4o-mini"
CF_MODEL = "@cf/meta/llama-3.1-8b-instruct"


class Ask(BaseModel):
    text: str


def create_app(
    binding: OpenAICompatible | WorkersAI, *, chain: tuple[str, ...] = (MODEL,), openai: bool = False
) -> FastAPI:
    """A strict route on `chain`; with `openai`, an OpenAI provider besides the main binding."""
    providers = {"openai": OpenAICompatible(api_key="sk-unused", base_url="http://127.0.0.1:9/v1")}
    guards = Guards(binding, sleep=no_sleep, providers=providers if openai else None)
    app = FastAPI()
    guards.install(app)

    @app.post("/strict")
    @guards.route(model=chain[0], fallbacks=list(chain[1:]), timeout_s=5)
    async def strict(body: Ask, ai: AI[str]) -> str:
        return await ai.run({"prompt": body.text})

    return app


def openai_app(base_url: str = "http://127.0.0.1:9/v1") -> FastAPI:
    return create_app(OpenAICompatible(api_key="test-key", base_url=base_url))


def workers_ai_app(**options: Any) -> FastAPI:
    return create_app(WorkersAI(account_id="acc", api_token="token"), **options)


def outcome(response: httpx.Response) -> tuple[int, str, bool, str | None]:
    body = response.json()
    return response.status_code, body.get("error"), body.get("retryable"), response.headers.get("retry-after")


#: OpenAI's failures, and the public answer each is over HTTP: status, token, retryable,
#: Retry-After, and the calls made (a transient failure is retried once).
FAILURES = [
    pytest.param(
        Fail(status=429, error_code="insufficient_quota"),
        (503, "model_quota_exhausted", False, "600"),
        1,
        id="429-insufficient-quota",
    ),
    pytest.param(
        Fail(status=429, error_code="rate_limit_exceeded", retry_after="20"),
        (503, "model_rate_limited", False, "20"),
        1,
        id="429-rate-limit-exceeded",
    ),
    pytest.param(
        Fail(status=400, error_code="context_length_exceeded"),
        (400, "context_length_exceeded", False, None),
        1,
        id="400-context-length",
    ),
    pytest.param(
        Fail(status=400, error_code="content_filter"),
        (502, "incompatible_model_response", False, None),
        1,
        id="400-content-filter",
    ),
    pytest.param(Fail(status=500), (503, "model_temporarily_unavailable", True, "30"), 2, id="500"),
    pytest.param(Fail(status=503), (503, "model_temporarily_unavailable", True, "30"), 2, id="503"),
]

#: Workers AI's, the same way (its numeric codes decide).
WORKERS_AI_FAILURES = [
    pytest.param(Fail(code=3036, status=429), (503, "model_quota_exhausted", False, "600"), 1, id="3036"),
    pytest.param(
        Fail(code=3040, status=429), (503, "model_temporarily_unavailable", True, "30"), 2, id="3040"
    ),
    pytest.param(Fail(code=3006, status=413), (400, "context_length_exceeded", False, None), 1, id="3006"),
]


@pytest.mark.parametrize(("failure", "public", "calls"), FAILURES)
def test_a_failure_answers_the_same_in_process_as_over_http(
    use_fake_ai: UseFakeAI,
    fake_openai: FakeOpenAI,
    app_client: AppClient,
    failure: Fail,
    public: tuple[int, str, bool, str | None],
    calls: int,
) -> None:
    in_process = openai_app()
    fake = use_fake_ai(in_process)
    fake.script(MODEL, failure, failure)
    over_http = openai_app(fake_openai.base_url)
    fake_openai.script(MODEL, failure, failure)

    faked = outcome(app_client(in_process).post("/strict", json={"text": "hi"}))
    served = outcome(app_client(over_http).post("/strict", json={"text": "hi"}))

    assert faked == served == public
    assert len(fake.calls) == len(fake_openai.calls) == calls


@pytest.mark.parametrize(("failure", "public", "calls"), FAILURES)
def test_use_fake_servers_answers_as_use_fake_ai_on_openai(
    use_fake_ai: UseFakeAI,
    use_fake_servers: UseFakeServers,
    fake_openai: FakeOpenAI,
    app_client: AppClient,
    failure: Fail,
    public: tuple[int, str, bool, str | None],
    calls: int,
) -> None:
    faked, served = openai_app(), openai_app()
    fake = use_fake_ai(faked)
    use_fake_servers(served)
    fake.script(MODEL, failure, failure)
    fake_openai.script(MODEL, failure, failure)
    assert outcome(app_client(faked).post("/strict", json={"text": "hi"})) == public
    assert outcome(app_client(served).post("/strict", json={"text": "hi"})) == public
    assert len(fake.calls) == len(fake_openai.calls) == calls


@pytest.mark.parametrize(("failure", "public", "calls"), WORKERS_AI_FAILURES)
def test_use_fake_servers_answers_as_use_fake_ai_on_workers_ai(
    use_fake_ai: UseFakeAI,
    use_fake_servers: UseFakeServers,
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
    failure: Fail,
    public: tuple[int, str, bool, str | None],
    calls: int,
) -> None:
    faked, served = workers_ai_app(chain=(CF_MODEL,)), workers_ai_app(chain=(CF_MODEL,))
    fake = use_fake_ai(faked)
    use_fake_servers(served)
    fake.script(CF_MODEL, failure, failure)
    fake_workers_ai.script(CF_MODEL, failure, failure)
    assert outcome(app_client(faked).post("/strict", json={"text": "hi"})) == public
    assert outcome(app_client(served).post("/strict", json={"text": "hi"})) == public
    assert len(fake.calls) == len(fake_workers_ai.calls) == calls


def test_each_provider_gets_the_fake_on_its_own_wire(use_fake_ai: UseFakeAI, app_client: AppClient) -> None:
    """A Workers AI app with an OpenAI provider: one script for both, every call recorded."""
    app = workers_ai_app(chain=(CF_MODEL, f"openai:{MODEL}"), openai=True)
    fake = use_fake_ai(app)
    fake.script(CF_MODEL, Fail(code=3040, status=429), Fail(code=3040, status=429))  # then the next model
    fake.script(MODEL, Fail(status=429, error_code="insufficient_quota"))
    response = app_client(app).post("/strict", json={"text": "hi"})
    assert outcome(response) == (503, "model_quota_exhausted", False, "600")
    assert [c.model for c in fake.calls] == [CF_MODEL, CF_MODEL, MODEL]


def test_the_fakes_speak_their_bindings_wires(use_fake_ai: UseFakeAI) -> None:
    app = workers_ai_app(openai=True)
    guards = Guards.of(app)
    fake = use_fake_ai(app)
    assert guards.binding is fake
    assert (wire_of(guards.binding), wire_of(guards.providers["openai"])) == ("workers-ai", "openai")


# --- what a wire cannot carry ----------------------------------------------------------------------

UNCARRIED = [
    pytest.param(
        "workers-ai", Fail(status=429, error_code="insufficient_quota"), "error_code", id="wai-code"
    ),
    pytest.param("workers-ai", Fail(status=500, error_type="server_error"), "error_type", id="wai-type"),
    pytest.param(
        "workers-ai",
        Fail(code=2016, status=400, shape="gateway", error_code="content_filter"),
        "error_code",
        id="wai-gateway-code",
    ),
    pytest.param("openai", Fail(code=3036, status=429), "code", id="openai-numeric-code"),
    pytest.param("openai", Fail(code=3006, status=413, shape="aierror"), "shape", id="openai-aierror"),
    pytest.param(
        "openai",
        Fail(code=2016, status=400, shape="gateway", error_type="invalid_request_error"),
        "error_type",
        id="openai-gateway-type",
    ),
]


@pytest.mark.parametrize(("wire", "failure", "field"), UNCARRIED)
def test_a_field_the_wire_cannot_carry_is_refused_when_scripted(
    use_fake_ai: UseFakeAI, wire: str, failure: Fail, field: str
) -> None:
    fake = use_fake_ai(openai_app() if wire == "openai" else workers_ai_app())
    with pytest.raises(ValueError, match=rf"Fail\({field}=.* {wire} wire") as refused:
        fake.script("*", failure)
    assert "script it for a model of" in str(refused.value)
    assert not fake.calls


@pytest.mark.parametrize(("wire", "failure", "field"), UNCARRIED)
def test_a_field_the_wire_cannot_carry_is_refused_when_played(wire: str, failure: Fail, field: str) -> None:
    """Where the wire is not known when scripted (a default), the call that plays it fails."""
    fake = FakeBinding(failure, wire="openai" if wire == "openai" else "workers-ai")

    async def call() -> None:
        await fake.run(MODEL, {"prompt": "hi"})

    with pytest.raises(ValueError, match=rf"Fail\({field}=.* {wire} wire"):
        anyio.run(call)


def test_a_mixed_app_takes_what_one_of_its_wires_carries(use_fake_ai: UseFakeAI) -> None:
    """Scripted for any model, `error_code` is fine while the OpenAI provider can play it; a
    field neither wire carries is refused."""
    fake = use_fake_ai(workers_ai_app(openai=True))
    fake.script("*", Fail(status=429, error_code="insufficient_quota"))
    with pytest.raises(ValueError, match="workers-ai wire"):
        fake.script("*", Fail(code=3036, status=429, shape="aierror", error_type="x"))


def test_every_adapter_has_a_wire() -> None:
    """An adapter added to `guards.providers` gets a fake on its wire, or this fails."""
    adapters = [
        value
        for name in guards.providers.__all__
        if inspect.isclass(value := getattr(guards.providers, name)) and hasattr(value, "run")
    ]
    assert adapters
    assert sorted(a.__name__ for a in adapters) == sorted(a.__name__ for a in ADAPTER_WIRES)
    throttled = Throttled(OpenAICompatible(api_key="k"), max_rate=1)
    assert wire_of(throttled) == "openai"


# --- streams on the OpenAI wire ------------------------------------------------------------------

STREAMS = [
    pytest.param(Stream(error_after=2, error_code=3040), id="in-band-error-with-code"),
    pytest.param(Stream(error_after=1, error_message="JSON Mode couldn't be met"), id="in-band-json-mode"),
    pytest.param(Stream(cut_after=2), id="cut"),
    pytest.param(Stream(done=False), id="no-end"),
    pytest.param(
        Fail(status=429, error_code="insufficient_quota", retry_after="9"), id="quota-before-the-body"
    ),
]


def stream_failure(binding: Binding, model: str) -> tuple[list[StreamEvent], ProviderError]:
    async def go() -> tuple[list[StreamEvent], ProviderError]:
        events: list[StreamEvent] = []
        try:
            async for event in binding.stream(model, {"prompt": "hi"}):  # type: ignore[attr-defined]
                events.append(event)
        except ProviderError as error:
            return events, error
        finally:
            await binding.aclose()
        raise AssertionError("the stream did not fail")

    return anyio.run(go)


@pytest.mark.parametrize("scripted", STREAMS)
def test_a_stream_fails_on_the_openai_wire_as_the_adapter_reads_it(
    fake_openai: FakeOpenAI, scripted: Stream | Fail
) -> None:
    """The events before the failure and the failure's facts (provider, code, status, wait,
    flags, note) through `FakeBinding(wire="openai")` and through the adapter over HTTP."""
    fake = FakeBinding(wire="openai")
    fake.script(MODEL, scripted)
    fake_openai.script(MODEL, scripted)
    faked_events, faked = stream_failure(fake, MODEL)
    served_events, served = stream_failure(
        OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url), MODEL
    )
    facts = (
        "provider", "code", "status", "retry_after_s", "json_mode_failed", "quota_exhausted", "note"
    )  # fmt: skip
    assert [getattr(faked, f) for f in facts] == [getattr(served, f) for f in facts]
    assert faked_events == served_events
