"""The degrading matrix: `POST /summary` of the example service, in process (ASGI), calling the
fake Workers AI server over real HTTP. Every envelope reason, with the whole body and the number
of provider calls; the daily cap and the breaker with a controllable clock."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.service import create_app
from fixtures import Fail, FakeWorkersAI, Hang, ManualClock, Reply
from guards import AI, Budget, Guards, header_key

from ..conftest import AppClient, ExampleClient, assert_error, assert_fallback, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
TEXT = "I was charged twice and need a refund for the second invoice."
#: What the keyword fallback answers for TEXT.
FALLBACK = {"label": "billing", "confidence": 0.3}
#: What the model answers in these tests; once it did, the last good answer to TEXT.
ANSWER = {"label": "billing", "confidence": 0.9}


@pytest.fixture
def make_client(example_client: ExampleClient, manual_clock: ManualClock) -> ExampleClient:
    return functools.partial(example_client, clock=manual_clock)


@pytest.fixture
def client(make_client: Callable[..., httpx.Client]) -> httpx.Client:
    return make_client()


def summarize(client: httpx.Client, text: Any = TEXT, user: str = "user-1") -> httpx.Response:
    return client.post("/summary", json={"text": text}, headers={"x-user-id": user})


def fallback(response: httpx.Response, guard: str, reason: str) -> dict[str, Any]:
    """The envelope of a fallback carrying the keyword label, whole; returned for more checks."""
    return assert_fallback(response, guard, reason, FALLBACK)


def last_good(response: httpx.Response, guard: str, reason: str) -> dict[str, Any]:
    """The envelope of a fallback carrying the last good answer to TEXT (`ANSWER`), whole."""
    body = assert_fallback(response, guard, reason, ANSWER)
    assert body["fallback"]["detail"].startswith("the last good answer, ")
    return body


def test_model_answer_in_json_mode(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Reply({"label": "billing", "confidence": 0.92}))
    response = summarize(client)
    assert response.status_code == 200
    assert response.json() == {"ok": True, "data": {"label": "billing", "confidence": 0.92}, "fallback": None}
    [call] = fake_workers_ai.calls
    schema = call.inputs["response_format"]["json_schema"]
    assert call.inputs["response_format"]["type"] == "json_schema"
    assert schema["required"] == ["label", "confidence"]


def test_json_answer_sent_as_a_string_is_accepted(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Reply('```json\n{"label": "billing", "confidence": 0.8}\n```'))
    assert summarize(client).json()["data"] == {"label": "billing", "confidence": 0.8}


@pytest.mark.parametrize(
    "body",
    [{}, {"text": ""}, {"text": "  \n "}, {"text": "t" * 4001}, {"text": 7}, []],
    ids=["missing", "empty", "blank", "4001-chars", "number", "array"],
)
def test_invalid_input_is_400_without_a_call(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, body: Any
) -> None:
    response = client.post("/summary", json=body)
    assert_error(response, 400, "invalid_request", False)
    assert fake_workers_ai.calls == []


def test_rate_limited(make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI) -> None:
    client = make_client(rate_limit_per_minute=2)
    fake_workers_ai.default = Reply({"label": "billing", "confidence": 0.9})
    assert summarize(client).json()["fallback"] is None
    assert summarize(client).json()["fallback"] is None
    last_good(summarize(client), "budget", "rate_limited")  # the model answered this text before
    fallback(summarize(client, text="My invoice is wrong."), "budget", "rate_limited")  # not this one
    assert len(fake_workers_ai.calls) == 2
    # Another user has a budget of their own.
    assert summarize(client, user="user-2").json()["fallback"] is None


def test_rate_limit_frees_up_after_a_minute(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, manual_clock: ManualClock
) -> None:
    client = make_client(rate_limit_per_minute=1)
    fake_workers_ai.default = Reply({"label": "billing", "confidence": 0.9})
    assert summarize(client).json()["fallback"] is None
    manual_clock.advance(59)
    last_good(summarize(client), "budget", "rate_limited")
    manual_clock.advance(1.5)
    assert summarize(client).json()["fallback"] is None


def test_budget_exceeded_counts_failed_calls_too(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, manual_clock: ManualClock
) -> None:
    """The daily cap is charged before the call: calls that fail still spend it."""
    client = make_client(daily_call_limit=2)
    fake_workers_ai.script(MODEL, Fail(code=5007, status=400), Fail(code=5035, status=403))
    fallback(summarize(client), "call", "provider_error")
    fallback(summarize(client), "call", "provider_error")
    fallback(summarize(client), "budget", "budget_exceeded")
    assert len(fake_workers_ai.calls) == 2
    # A new UTC day brings a new budget.
    manual_clock.set((manual_clock.time() // 86400 + 1) * 86400 + 1)
    fake_workers_ai.default = Reply({"label": "billing", "confidence": 0.9})
    assert summarize(client).json()["fallback"] is None


def test_retries_are_charged_once(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI
) -> None:
    client = make_client(daily_call_limit=1)
    fake_workers_ai.script(MODEL, Fail(code=3040, status=429), Reply({"label": "billing", "confidence": 0.9}))
    assert summarize(client).json()["fallback"] is None
    assert len(fake_workers_ai.calls) == 2
    last_good(summarize(client), "budget", "budget_exceeded")


def test_timeout(make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI) -> None:
    client = make_client(ai_timeout_s=0.3)
    fake_workers_ai.script(MODEL, Hang())
    body = fallback(summarize(client), "call", "timeout")
    assert "0.3s" in body["fallback"]["detail"]
    assert fake_workers_ai.wait_for(lambda calls: len(calls) == 1 and calls[0].disconnected)


def test_provider_error(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Fail(code=3036, status=429))
    body = fallback(summarize(client), "call", "provider_error")
    assert "model_quota_exhausted" in body["fallback"]["detail"]
    assert len(fake_workers_ai.calls) == 1


def test_provider_error_after_the_retry(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Fail(code=3040, status=429), Fail(code=3040, status=429))
    body = fallback(summarize(client), "call", "provider_error")
    assert "2 attempt" in body["fallback"]["detail"]
    assert len(fake_workers_ai.calls) == 2


@pytest.mark.parametrize(
    "answer",
    [{"label": "billing"}, {"label": "billing", "confidence": 7}, "not json at all", ["billing", 0.9], 12],
    ids=["missing-field", "out-of-range", "not-json", "array", "number"],
)
def test_schema_invalid(client: httpx.Client, fake_workers_ai: FakeWorkersAI, answer: Any) -> None:
    fake_workers_ai.script(MODEL, Reply(answer))
    fallback(summarize(client), "output", "schema_invalid")
    assert len(fake_workers_ai.calls) == 1


def test_json_mode_not_met_is_schema_invalid(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(
        MODEL, Fail(code=5024, status=400, message="AiError: JSON Mode couldn't be met (abc)")
    )
    fallback(summarize(client), "output", "schema_invalid")
    assert len(fake_workers_ai.calls) == 1


@pytest.mark.parametrize("answer", ["", "   \n", None], ids=["empty", "blank", "null"])
def test_empty_response(client: httpx.Client, fake_workers_ai: FakeWorkersAI, answer: Any) -> None:
    fake_workers_ai.script(MODEL, Reply(answer))
    fallback(summarize(client), "output", "empty_response")


def test_moderation_blocked(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Reply({"label": "call jane.doe@example.com", "confidence": 0.9}))
    fallback(summarize(client), "output", "moderation_blocked")


def test_fallback_without_keywords_is_general_with_low_confidence(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Fail(code=3036, status=429))
    data = summarize(client, text="Hello there").json()["data"]
    assert data == {"label": "general", "confidence": 0.1}


def test_breaker_opens_short_circuits_and_closes_after_the_reset_timeout(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, manual_clock: ManualClock
) -> None:
    client = make_client(breaker_failure_threshold=2, breaker_reset_s=30)
    ok = Reply({"label": "billing", "confidence": 0.9})
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403), Fail(code=5035, status=403))
    fake_workers_ai.default = ok
    fallback(summarize(client), "call", "provider_error")
    fallback(summarize(client), "call", "provider_error")  # second failure: the breaker opens

    fallback(summarize(client), "budget", "circuit_open")
    manual_clock.advance(29)
    fallback(summarize(client), "budget", "circuit_open")
    assert len(fake_workers_ai.calls) == 2  # open: no call reached the provider

    manual_clock.advance(1)  # reset timeout passed: half-open, one probe at a time
    assert summarize(client).json()["fallback"] is None
    assert summarize(client).json()["fallback"] is None  # two successes close it
    assert len(fake_workers_ai.calls) == 4

    # Closed again: one failure is not enough to reopen it.
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403))
    last_good(summarize(client), "call", "provider_error")
    assert summarize(client).json()["fallback"] is None
    assert len(fake_workers_ai.calls) == 6


def test_breaker_counts_a_request_with_a_retry_as_one_failure(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI
) -> None:
    client = make_client(breaker_failure_threshold=2)
    fake_workers_ai.script(MODEL, *[Fail(code=3040, status=429)] * 2)
    fallback(summarize(client), "call", "provider_error")  # 2 calls, 1 failure
    assert len(fake_workers_ai.calls) == 2
    fake_workers_ai.default = Reply({"label": "billing", "confidence": 0.9})
    assert summarize(client).json()["fallback"] is None


def test_strict_route_answers_circuit_open_with_retry_after(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, manual_clock: ManualClock
) -> None:
    client = make_client(breaker_failure_threshold=1, breaker_reset_s=30)
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403))
    fallback(summarize(client), "call", "provider_error")
    manual_clock.advance(10)
    response = client.post("/draft-reply", json={"message": "hello"})
    assert response.status_code == 503
    assert response.json()["error"] == "circuit_open"
    assert response.json()["retryable"] is True
    assert response.headers["retry-after"] == "20"


def test_strict_budget_errors(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, manual_clock: ManualClock
) -> None:
    """A strict route with a budget answers 429 rate_limited / budget_exceeded with Retry-After."""
    app = create_app(workers_ai_settings(fake_workers_ai), clock=manual_clock, sleep=no_sleep)

    @app.post("/strict-budget")
    @Guards.of(app).route(model=MODEL, budget=Budget(per_minute=2, per_day=3, key=header_key("x-user-id")))
    async def strict_budget(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hi"})

    client = app_client(app)
    manual_clock.set(86400 * 20000 + 3600)  # 01:00 UTC
    assert client.post("/strict-budget").status_code == 200
    assert client.post("/strict-budget").status_code == 200
    limited = client.post("/strict-budget")
    assert limited.status_code == 429
    assert limited.json()["error"] == "rate_limited"
    assert limited.json()["retryable"] is False
    assert limited.headers["retry-after"] == "60"
    manual_clock.advance(61)
    assert client.post("/strict-budget").status_code == 200
    manual_clock.advance(61)
    exceeded = client.post("/strict-budget")
    assert exceeded.status_code == 429
    assert exceeded.json()["error"] == "budget_exceeded"
    assert int(exceeded.headers["retry-after"]) == 86400 - 3600 - 122  # until UTC midnight
    assert len(fake_workers_ai.calls) == 3
