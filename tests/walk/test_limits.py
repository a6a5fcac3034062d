"""The request's limits (issue 28, items 3 and 4): context windows and content filters, over
real HTTP against the fake Workers AI and OpenAI-compatible servers, with the calls each model
saw.

- A model whose declared window cannot hold the request (its estimated input tokens plus its
  `max_tokens`) is skipped without a call.
- A `context_length_exceeded` answer (Workers AI's 3006/413, a vLLM-served model's message,
  OpenAI's code) is never retried and moves on only to a model with a larger declared window;
  a strict route answers 400 `context_length_exceeded`, a degrading one the envelope's
  `call`/`context_length_exceeded`.
- A content filter (AI Gateway's guardrail codes, OpenAI's and Azure's codes) is
  `moderation_blocked`, never retried, and moves on to another provider's model only with
  `content_filter_fallback=True`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

import guards as guards_package
from fixtures import Fail, FakeBinding, FakeOpenAI, FakeWorkersAI, ManualClock, Reply
from guards import AI, Breaker, ConfigurationError, EventStream, Guards, Kind, ProviderError, classify
from guards.providers import OpenAICompatible, WorkersAI
from guards.stores import MemoryStore

from ..conftest import AppClient, LogLines, assert_error, assert_fallback, no_sleep, run_binding_once

SMALL, MID, BIG, OPEN = "@cf/small", "@cf/mid", "@cf/big", "@cf/unknown"
GPT_SMALL, GPT_MID, GPT_BIG = "gpt-small", "gpt-mid", "gpt-big"
WINDOWS = {
    SMALL: 1_000,
    MID: 4_000,
    BIG: 100_000,
    f"openai:{GPT_SMALL}": 1_000,
    f"openai:{GPT_MID}": 4_000,
    f"openai:{GPT_BIG}": 100_000,
}
FALLBACK = "the fallback"
#: 4,400 characters: about 1,100 tokens (characters / 4), past the small window.
LONG = "x" * 4_400
SHORT = "Is this too long?"


class Ask(BaseModel):
    text: str = Field(min_length=1, max_length=100_000)
    max_tokens: int | None = None


def create_app(
    workers: FakeWorkersAI,
    openai: FakeOpenAI,
    chain: list[str],
    *,
    windows: dict[str, int] | None = None,
    max_tokens: int | None = None,
    content_filter_fallback: bool = False,
    breaker: Breaker | None = None,
    store: MemoryStore | None = None,
) -> FastAPI:
    guards = Guards(
        WorkersAI(account_id=workers.account_id, api_token=workers.api_token, base_url=workers.base_url),
        providers={"openai": OpenAICompatible(base_url=openai.base_url, api_key="test-key")},
        context_windows=WINDOWS if windows is None else windows,
        sleep=no_sleep,
        store=store,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with guards:
            yield

    app = FastAPI(lifespan=lifespan)
    guards.install(app)
    options: dict[str, Any] = {
        "model": chain[0],
        "fallbacks": chain[1:],
        "max_tokens": max_tokens,
        "content_filter_fallback": content_filter_fallback,
        "timeout_s": 5.0,
        "breaker": breaker,
    }

    def inputs(body: Ask) -> dict[str, Any]:
        given: dict[str, Any] = {"messages": [{"role": "user", "content": body.text}]}
        if body.max_tokens is not None:
            given["max_tokens"] = body.max_tokens
        return given

    @app.post("/strict")
    @guards.route(**options)
    async def strict(body: Ask, ai: AI[str]) -> dict[str, Any]:
        return {"reply": await ai.run(inputs(body)), "model": ai.model, "attempts": ai.attempts}

    @app.post("/degrading")
    @guards.route(**options, fallback=FALLBACK)
    async def degrading(body: Ask, ai: AI[str]) -> str:
        return await ai.run(inputs(body))

    @app.post("/stream")
    @guards.route(**options, name="stream")
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream(inputs(body))

    return app


@pytest.fixture
def make(app_client: AppClient, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI) -> Any:
    def client(chain: list[str], **options: Any) -> httpx.Client:
        return app_client(create_app(fake_workers_ai, fake_openai, chain, **options))

    return client


def calls(workers: FakeWorkersAI, openai: FakeOpenAI) -> dict[str, int]:
    """The calls each model saw (OpenAI's as `openai:model`), the models called only."""
    seen: dict[str, int] = {}
    for call in workers.calls:
        seen[call.model] = seen.get(call.model, 0) + 1
    for call in openai.calls:
        seen[f"openai:{call.model}"] = seen.get(f"openai:{call.model}", 0) + 1
    return seen


# --- skipped before the call ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "route_max_tokens", "own_max_tokens", "small_called"),
    [
        pytest.param(LONG, None, None, False, id="the-input-alone-is-too-long"),
        pytest.param("x" * 3_600, None, None, True, id="900-tokens-fit-1000"),
        pytest.param("x" * 3_600, 200, None, False, id="900-tokens-and-the-routes-200-do-not"),
        pytest.param("x" * 3_600, 200, 50, True, id="the-inputs-own-max-tokens-win"),
    ],
)
def test_a_model_whose_window_cannot_hold_the_request_is_never_called(
    make: Any,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    guards_log: LogLines,
    text: str,
    route_max_tokens: int | None,
    own_max_tokens: int | None,
    small_called: bool,
) -> None:
    client = make([SMALL, BIG], max_tokens=route_max_tokens)
    response = client.post("/strict", json={"text": text, "max_tokens": own_max_tokens})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == (SMALL if small_called else BIG)
    assert calls(fake_workers_ai, fake_openai) == ({SMALL: 1} if small_called else {BIG: 1})
    guards_log.wait_for(lambda: small_called or guards_log.events("skip"))
    assert guards_log.skips() == ({} if small_called else {(SMALL, "context_window"): 1})


def test_a_model_the_store_admits_past_a_resting_one_is_still_skipped(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """Another worker put the first model in cooldown: the store admits the next one, whose
    window is too small; it is skipped all the same, and the one after it answers."""
    store = MemoryStore()
    chain = [BIG, SMALL, f"openai:{GPT_BIG}"]
    fake_workers_ai.script(BIG, Fail(status=429, retry_after="60"))
    other_worker = make([BIG], store=store)
    assert_error(other_worker.post("/strict", json={"text": SHORT}), 503, "model_rate_limited", False)
    client = make(chain, store=store)
    response = client.post("/strict", json={"text": LONG})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == GPT_BIG
    assert calls(fake_workers_ai, fake_openai) == {BIG: 1, f"openai:{GPT_BIG}": 1}


def test_a_half_open_model_too_small_for_the_request_gives_its_probe_back(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """The store admits a half-open model as its one probe past a resting one; too small for
    the request, it is skipped, and the probe slot is freed for a request it can hold."""
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    breaker = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1)
    fake_workers_ai.script(SMALL, Fail(status=500), Fail(status=500))
    fake_workers_ai.script(BIG, Fail(status=429, retry_after="600"))
    small_only = make([SMALL], store=store, breaker=breaker)
    assert small_only.post("/strict", json={"text": SHORT}).status_code == 503  # its breaker opens
    assert make([BIG], store=store, breaker=breaker).post("/strict", json={"text": SHORT}).status_code == 503
    clock.advance(31)  # SMALL's breaker half-opens at its next admission; BIG still cools down
    response = make([BIG, SMALL, f"openai:{GPT_BIG}"], store=store, breaker=breaker).post(
        "/strict", json={"text": LONG}
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == GPT_BIG
    # The probe was not spent: a request SMALL can hold gets it.
    assert small_only.post("/strict", json={"text": SHORT}).status_code == 200
    assert calls(fake_workers_ai, fake_openai) == {SMALL: 3, BIG: 1, f"openai:{GPT_BIG}": 1}


def test_every_model_too_small_answers_400_with_no_call(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    client = make([SMALL, MID, f"openai:{GPT_MID}"])
    response = client.post("/strict", json={"text": "x" * 20_000})  # 5,000 tokens
    assert_error(response, 400, "context_length_exceeded", False)
    assert response.json()["problems"] == [{"field": "body", "problem": "too_long"}]
    fallback = client.post("/degrading", json={"text": "x" * 20_000})
    body = assert_fallback(fallback, "call", "context_length_exceeded", FALLBACK)
    assert "skipped (context_window)" in body["fallback"]["detail"]
    assert calls(fake_workers_ai, fake_openai) == {}


def test_a_model_with_no_declared_window_is_never_skipped_for_it(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    client = make([OPEN, BIG], windows={BIG: 10})
    response = client.post("/strict", json={"text": LONG})
    assert response.status_code == 200, response.text
    assert calls(fake_workers_ai, fake_openai) == {OPEN: 1}


def test_a_bindings_own_estimate_is_asked(app_client: AppClient) -> None:
    """A binding that defines `estimate_tokens(model, inputs)` is asked instead of the default."""

    class Counting(FakeBinding):
        def estimate_tokens(self, model: str, inputs: Any) -> int:
            return 5_000 if model == SMALL else 1

    binding = Counting()
    guards = Guards(binding, context_windows={SMALL: 4_000, MID: 4_000}, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/ask")
    @guards.route(model=SMALL, fallbacks=[MID])
    async def ask(body: Ask, ai: AI[str]) -> str:
        return await ai.run({"prompt": body.text})

    response = app_client(app).post("/ask", json={"text": SHORT})
    assert response.status_code == 200, response.text
    assert [call.model for call in binding.calls] == [MID]


def test_the_default_estimate_is_public() -> None:
    """Characters / 4, rounded up: the prompt, each message's text, and the schemas' JSON."""
    estimate = guards_package.estimate_tokens
    assert estimate("any", {"prompt": "x" * 9}) == 3
    messages = [
        {"role": "user", "content": "x" * 8},
        {"role": "user", "content": [{"type": "text", "text": "abcd"}]},
    ]
    assert estimate("any", {"messages": messages}) == 3
    assert estimate("any", {}) == 0


# --- a context-length error: never retried, only to a larger window -------------------------------

#: Per wire: the too-long answer, and the chain (a mid window, a smaller one, a larger one).
CONTEXT_ERRORS = [
    pytest.param(Fail(code=3006, status=413), [MID, SMALL, BIG], id="workers-ai-3006-413"),
    pytest.param(
        Fail(
            status=400,
            message="AiError: This model's maximum context length is 4096 tokens. However, you "
            "requested 8000 output tokens. Please reduce the length of the input prompt.",
        ),
        [MID, SMALL, BIG],
        id="workers-ai-vllm-message",
    ),
    pytest.param(
        Fail(status=400, error_code="context_length_exceeded"),
        [f"openai:{GPT_MID}", f"openai:{GPT_SMALL}", f"openai:{GPT_BIG}"],
        id="openai-context-length-exceeded",
    ),
]


def _script(workers: FakeWorkersAI, openai: FakeOpenAI, entry: str, *outcomes: Any) -> None:
    provider, _, model = entry.rpartition(":")
    (openai if provider == "openai" else workers).script(model, *outcomes)


@pytest.mark.parametrize(("failure", "chain"), CONTEXT_ERRORS)
def test_a_context_length_error_moves_only_to_a_larger_window(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, failure: Fail, chain: list[str]
) -> None:
    middle, smaller, larger = chain
    _script(fake_workers_ai, fake_openai, middle, failure, failure)
    client = make(chain)
    response = client.post("/strict", json={"text": SHORT})
    assert response.status_code == 200, response.text
    assert response.json()["attempts"] == 2
    # Never retried, the smaller window in between never called.
    assert calls(fake_workers_ai, fake_openai) == {middle: 1, larger: 1}
    assert smaller not in calls(fake_workers_ai, fake_openai)


@pytest.mark.parametrize(("failure", "chain"), CONTEXT_ERRORS)
def test_a_context_length_error_with_no_larger_window_is_the_clients_to_fix(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, failure: Fail, chain: list[str]
) -> None:
    middle, smaller, _ = chain
    _script(fake_workers_ai, fake_openai, middle, failure, failure)
    client = make([middle, smaller])
    response = client.post("/strict", json={"text": SHORT})
    assert_error(response, 400, "context_length_exceeded", False)
    assert response.json()["problems"] == [{"field": "body", "problem": "too_long"}]
    degraded = client.post("/degrading", json={"text": SHORT})
    body = assert_fallback(degraded, "call", "context_length_exceeded", FALLBACK)
    assert body["fallback"]["detail"].startswith("context_length_exceeded after 1 attempt(s)")
    assert calls(fake_workers_ai, fake_openai) == {middle: 2}  # one call per request


@pytest.mark.parametrize(("failure", "chain"), CONTEXT_ERRORS)
def test_a_streaming_route_walks_the_same_way(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, failure: Fail, chain: list[str]
) -> None:
    """Before its first output a stream is a call like any: the same limits, the same 400."""
    middle, smaller, larger = chain
    _script(fake_workers_ai, fake_openai, middle, failure, failure)
    client = make(chain)
    streamed = client.post("/stream", json={"text": SHORT})
    assert streamed.status_code == 200, streamed.text
    assert "event: done" in streamed.text
    assert calls(fake_workers_ai, fake_openai) == {middle: 1, larger: 1}
    assert_error(
        make([middle, smaller]).post("/stream", json={"text": SHORT}), 400, "context_length_exceeded", False
    )
    assert calls(fake_workers_ai, fake_openai) == {middle: 2, larger: 1}


def test_after_a_declared_window_a_model_without_one_is_skipped(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """Nothing says an undeclared window is larger than the one the request did not fit."""
    fake_workers_ai.script(MID, Fail(code=3006, status=413))
    client = make([MID, OPEN, BIG])
    response = client.post("/strict", json={"text": SHORT})
    assert response.status_code == 200, response.text
    assert calls(fake_workers_ai, fake_openai) == {MID: 1, BIG: 1}


def test_with_no_window_declared_a_context_length_error_moves_on(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """A route that declares no window: the next model is tried (nothing says it is smaller)."""
    fake_workers_ai.script(OPEN, Fail(code=3006, status=413))
    client = make([OPEN, f"openai:{GPT_BIG}"], windows={})
    response = client.post("/strict", json={"text": SHORT})
    assert response.status_code == 200, response.text
    assert calls(fake_workers_ai, fake_openai) == {OPEN: 1, f"openai:{GPT_BIG}": 1}


def test_a_context_length_error_is_not_the_models_failure(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """The breaker counts the model's health: a request too long for it is no failure of it."""
    fake_workers_ai.script(MID, *[Fail(code=3006, status=413)] * 3)
    client = make([MID], breaker=Breaker(failure_threshold=1))
    for _ in range(3):
        assert_error(client.post("/strict", json={"text": SHORT}), 400, "context_length_exceeded", False)
    response = client.post("/strict", json={"text": SHORT})
    assert response.status_code == 200, response.text
    assert calls(fake_workers_ai, fake_openai) == {MID: 4}


# --- content filters ------------------------------------------------------------------------------

#: Per wire: the content filter's answer, and a chain of two models of that provider and one of
#: the other.
CONTENT_FILTERS = [
    pytest.param(
        Fail(code=2016, status=400, shape="gateway"),
        [MID, BIG, f"openai:{GPT_BIG}"],
        id="workers-ai-gateway-guardrail-2016",
    ),
    pytest.param(
        Fail(status=400, error_code="content_filter"),
        [f"openai:{GPT_MID}", f"openai:{GPT_BIG}", BIG],
        id="azure-openai-content-filter",
    ),
    pytest.param(
        Fail(status=400, error_code="content_policy_violation"),
        [f"openai:{GPT_MID}", f"openai:{GPT_BIG}", BIG],
        id="openai-content-policy-violation",
    ),
]


@pytest.mark.parametrize(("failure", "chain"), CONTENT_FILTERS)
def test_a_content_filter_is_moderation_and_ends_the_walk(
    make: Any, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, failure: Fail, chain: list[str]
) -> None:
    first = chain[0]
    _script(fake_workers_ai, fake_openai, first, failure, failure)
    client = make(chain)
    assert_error(client.post("/strict", json={"text": SHORT}), 502, "incompatible_model_response", False)
    degraded = client.post("/degrading", json={"text": SHORT})
    body = assert_fallback(degraded, "output", "moderation_blocked", FALLBACK)
    assert body["fallback"]["detail"].startswith("moderation_blocked after 1 attempt(s)")
    # Never retried, no other model called.
    assert calls(fake_workers_ai, fake_openai) == {first: 2}


@pytest.mark.parametrize(("failure", "chain"), CONTENT_FILTERS)
def test_with_content_filter_fallback_another_providers_model_answers(
    make: Any,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    guards_log: LogLines,
    failure: Fail,
    chain: list[str],
) -> None:
    first, same_provider, other_provider = chain
    _script(fake_workers_ai, fake_openai, first, failure)
    _script(fake_workers_ai, fake_openai, other_provider, Reply("Answered elsewhere."))
    client = make(chain, content_filter_fallback=True)
    response = client.post("/strict", json={"text": SHORT})
    assert response.status_code == 200, response.text
    assert response.json()["reply"] == "Answered elsewhere."
    assert calls(fake_workers_ai, fake_openai) == {first: 1, other_provider: 1}
    guards_log.wait_for(lambda: guards_log.events("skip"))
    assert guards_log.skips() == {(same_provider, "content_filter"): 1}


# --- the adapters' signals, over HTTP ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "failure", "kind"),
    [
        ("workers-ai", Fail(code=3006, status=413), Kind.context_length_exceeded),
        ("workers-ai", Fail(code=3006, status=413, shape="aierror"), Kind.context_length_exceeded),
        (
            "workers-ai",
            Fail(
                code=5006, status=400, message="AiError: This model's maximum context length is 8192 tokens."
            ),
            Kind.context_length_exceeded,
        ),
        ("workers-ai", Fail(code=2017, status=400, shape="gateway"), Kind.moderation_blocked),
        ("workers-ai", Fail(code=5006, status=400), Kind.model_incompatible),
        ("openai", Fail(status=400, error_code="context_length_exceeded"), Kind.context_length_exceeded),
        ("openai", Fail(status=400, error_code="string_above_max_length"), Kind.context_length_exceeded),
        (
            "openai",
            Fail(status=400, message="This model's maximum context length is 4096 tokens."),  # vLLM, no code
            Kind.context_length_exceeded,
        ),
        ("openai", Fail(status=400, error_code="content_filter"), Kind.moderation_blocked),
        ("openai", Fail(status=400, error_code="content_policy_violation"), Kind.moderation_blocked),
        ("openai", Fail(code=2016, status=400, shape="gateway"), Kind.moderation_blocked),
        ("openai", Fail(status=400), Kind.model_incompatible),
    ],
)
def test_the_adapters_flag_each_limit(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, wire: str, failure: Fail, kind: Kind
) -> None:
    server: FakeWorkersAI | FakeOpenAI
    if wire == "workers-ai":
        server = fake_workers_ai

        def binding() -> Any:
            return WorkersAI(
                account_id=fake_workers_ai.account_id,
                api_token=fake_workers_ai.api_token,
                base_url=fake_workers_ai.base_url,
            )
    else:
        server = fake_openai

        def binding() -> Any:
            return OpenAICompatible(base_url=fake_openai.base_url, api_key="test-key")

    server.script("m", failure)
    with pytest.raises(ProviderError) as raised:
        run_binding_once(binding, "m", {"prompt": SHORT})
    assert classify(raised.value).kind is kind
    assert "maximum context length" not in str(raised.value)  # the provider's text is never kept


# --- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [0, -1, 1.5, "8192", True, None])
def test_a_window_must_be_a_positive_int(tokens: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"context_windows\['@cf/small'\] must be a positive"):
        Guards(FakeBinding(), context_windows={SMALL: tokens})


def test_a_window_is_keyed_by_model_key() -> None:
    with pytest.raises(ConfigurationError, match="context_windows: '' is not a model key"):
        Guards(FakeBinding(), context_windows={"": 8192})
