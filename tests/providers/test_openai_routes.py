"""The key strict and degrading outcomes with `OpenAICompatible` as the binding: a small app
in process (ASGI), calling the fake OpenAI-compatible server over real HTTP. Each case checks
the status, the whole body and the number of calls the provider saw.

Only single-model behaviour: what a route does for each provider outcome when it has one model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from fixtures import Drop, Fail, FakeOpenAI, Hang, Raw, Reply
from guards import AI, Guards
from guards.providers import OpenAICompatible

from ..conftest import AppClient, assert_error, assert_fallback, no_sleep

MODEL = "gpt-4o-mini"
SERVED = "gpt-4o-mini-2024-07-18"
MakeClient = Callable[..., httpx.Client]
GOOD = {"label": "billing", "confidence": 0.9}
FALLBACK = {"label": "general", "confidence": 0.1}


class Ask(BaseModel):
    text: str = Field(min_length=1, max_length=200)


class Label(BaseModel):
    label: str = Field(min_length=1, max_length=80)
    confidence: float = Field(ge=0, le=1)


class Answer(Label):
    model: str
    attempts: int


def create_app(server: FakeOpenAI, *, timeout_s: float = 2.0, retry_after_s: float = 17) -> FastAPI:
    guards = Guards(
        OpenAICompatible(base_url=server.base_url, api_key="test-key"),
        sleep=no_sleep,
        retry_after_s=retry_after_s,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with guards:
            yield

    app = FastAPI(lifespan=lifespan)
    guards.install(app)

    @app.post("/strict")
    @guards.route(model=MODEL, timeout_s=timeout_s)
    async def strict(body: Ask, ai: AI[Label]) -> Answer:
        label = await ai.run({"prompt": body.text})
        return Answer(**label.model_dump(), model=ai.model or MODEL, attempts=ai.attempts)

    @app.post("/degrading")
    @guards.route(model=MODEL, timeout_s=timeout_s, fallback=Label(**FALLBACK))
    async def degrading(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run({"messages": [{"role": "user", "content": body.text}]})

    return app


@pytest.fixture
def make_client(fake_openai: FakeOpenAI, app_client: AppClient) -> MakeClient:
    def make(**options: Any) -> httpx.Client:
        return app_client(create_app(fake_openai, **options))

    return make


@pytest.fixture
def client(make_client: MakeClient) -> httpx.Client:
    return make_client()


def strict(client: httpx.Client) -> httpx.Response:
    return client.post("/strict", json={"text": "I was charged twice."})


def degrading(client: httpx.Client) -> httpx.Response:
    return client.post("/degrading", json={"text": "I was charged twice."})


# --- strict -------------------------------------------------------------------------------------


def test_success_in_one_call(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply(GOOD, model=SERVED))
    response = strict(client)
    assert response.status_code == 200, response.text
    assert response.json() == {**GOOD, "model": SERVED, "attempts": 1}
    [call] = fake_openai.calls
    assert call.model == MODEL
    assert call.inputs["messages"] == [{"role": "user", "content": "I was charged twice."}]
    response_format = call.inputs["response_format"]
    assert response_format["type"] == "json_schema"
    assert response_format["json_schema"]["name"] == "Label"
    assert response_format["json_schema"]["strict"] is False
    assert response_format["json_schema"]["schema"]["required"] == ["label", "confidence"]
    assert "stream" not in call.inputs


def test_json_answer_in_a_code_fence_is_accepted(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply('```json\n{"label": "billing", "confidence": 0.8}\n```'))
    response = strict(client)
    assert response.status_code == 200, response.text
    assert response.json()["confidence"] == 0.8


def test_rate_limit_is_503_in_one_call(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Fail(status=429, error_code="rate_limit_exceeded"))
    assert_error(strict(client), 503, "model_rate_limited", False)
    assert len(fake_openai.calls) == 1


def test_a_short_rate_limit_is_waited_out_once_then_503(
    client: httpx.Client, fake_openai: FakeOpenAI
) -> None:
    """A one-model route: a wait of 200 ms is waited out (`Retry.wait_out_s`), once."""
    limited = Fail(status=429, error_code="rate_limit_exceeded", retry_after_ms="200")
    fake_openai.script(MODEL, limited, limited)
    assert_error(strict(client), 503, "model_rate_limited", False)
    assert len(fake_openai.calls) == 2


def test_insufficient_quota_is_503_quota_exhausted_in_one_call(
    client: httpx.Client, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        MODEL, Fail(status=429, error_type="insufficient_quota", error_code="insufficient_quota")
    )
    assert_error(strict(client), 503, "model_quota_exhausted", False)
    assert len(fake_openai.calls) == 1


def test_rate_limit_wait_in_milliseconds_is_sent_as_retry_after(
    client: httpx.Client, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(MODEL, Fail(status=429, retry_after_ms="1500"))
    response = strict(client)
    assert_error(response, 503, "model_rate_limited", False)
    assert response.headers["retry-after"] == "2"  # 1.5 s, rounded up to whole seconds
    # Not waited out: the 2 s deadline leaves less than `min_room_s` (0.5 s) after 1.5 s.
    assert len(fake_openai.calls) == 1


@pytest.mark.parametrize(
    "transient",
    [
        pytest.param(Fail(status=503), id="503"),
        pytest.param(Fail(status=500), id="500"),
        # A gateway (LiteLLM, a proxy) whose upstream timed out.
        pytest.param(Fail(status=408, error_type="timeout"), id="408-gateway-timeout"),
        pytest.param(Raw(502, b"<html><body>502 Bad Gateway</body></html>"), id="html-502"),
        pytest.param(Drop(), id="dropped-connection"),
    ],
)
def test_transient_failure_recovers_on_the_retry(
    client: httpx.Client, fake_openai: FakeOpenAI, transient: Any
) -> None:
    fake_openai.script(MODEL, transient, Reply(GOOD))
    response = strict(client)
    assert response.status_code == 200, response.text
    assert response.json() == {**GOOD, "model": MODEL, "attempts": 2}
    assert len(fake_openai.calls) == 2


def test_transient_failure_that_persists_is_503_with_retry_after(
    client: httpx.Client, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(MODEL, Fail(status=503), Fail(status=503), Reply(GOOD))
    response = strict(client)
    assert_error(response, 503, "model_temporarily_unavailable", True)
    assert response.headers["retry-after"] == "17"
    assert len(fake_openai.calls) == 2  # one retry, never more


@pytest.mark.parametrize("status", [400, 404])
def test_incompatible_model_is_502_in_one_call(
    client: httpx.Client, fake_openai: FakeOpenAI, status: int
) -> None:
    fake_openai.script(MODEL, Fail(status=status, error_code="model_not_found"))
    assert_error(strict(client), 502, "model_incompatible", False)
    assert len(fake_openai.calls) == 1


def test_bad_key_is_503_model_unavailable(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.api_key = "another-key"
    assert_error(strict(client), 503, "model_unavailable", False)
    assert fake_openai.calls == []  # refused before it reached a model


@pytest.mark.parametrize(
    "content",
    ["not json at all", '{"label": "billing"}', '{"label": "billing", "confidence": 7}', "[1, 2]", ""],
    ids=["not-json", "missing-field", "out-of-range", "array", "empty"],
)
def test_malformed_output_is_502_incompatible_response(
    client: httpx.Client, fake_openai: FakeOpenAI, content: str
) -> None:
    fake_openai.script(MODEL, Reply(content))
    assert_error(strict(client), 502, "incompatible_model_response", False)
    assert len(fake_openai.calls) == 1


def test_content_filter_is_502_incompatible_response(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply(GOOD, finish_reason="content_filter"))
    assert_error(strict(client), 502, "incompatible_model_response", False)


def test_error_object_in_a_200_is_503_in_one_call(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Fail(status=200, error_type="server_error"))
    assert_error(strict(client), 503, "model_unavailable", False)
    assert len(fake_openai.calls) == 1


def test_hang_answers_by_the_deadline_and_closes_the_connection(
    make_client: MakeClient, fake_openai: FakeOpenAI
) -> None:
    client = make_client(timeout_s=0.5, retry_after_s=9)
    fake_openai.script(MODEL, Hang())
    response = strict(client)
    assert_error(response, 503, "model_temporarily_unavailable", True)
    assert response.headers["retry-after"] == "9"
    assert response.elapsed.total_seconds() < 2.0
    # The provider request was really cancelled: the fake server saw its connection close.
    assert fake_openai.wait_for(lambda calls: len(calls) == 1 and calls[0].disconnected, timeout=5)


# --- degrading ----------------------------------------------------------------------------------


def test_degrading_success_has_no_fallback(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply(GOOD))
    response = degrading(client)
    assert response.status_code == 200
    assert response.json() == {"ok": True, "data": GOOD, "fallback": None}
    assert len(fake_openai.calls) == 1


def test_degrading_timeout(make_client: MakeClient, fake_openai: FakeOpenAI) -> None:
    client = make_client(timeout_s=0.3)
    fake_openai.script(MODEL, Hang())
    detail = assert_fallback(degrading(client), "call", "timeout", FALLBACK)["fallback"]["detail"]
    assert "0.3s" in detail
    assert fake_openai.wait_for(lambda calls: len(calls) == 1 and calls[0].disconnected)


def test_degrading_quota_is_a_provider_error(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(
        MODEL, Fail(status=429, error_type="insufficient_quota", error_code="insufficient_quota")
    )
    detail = assert_fallback(degrading(client), "call", "provider_error", FALLBACK)["fallback"]["detail"]
    assert "model_quota_exhausted" in detail
    assert len(fake_openai.calls) == 1


def test_content_filter_is_moderation_blocked(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply(GOOD, finish_reason="content_filter"))
    assert_fallback(degrading(client), "output", "moderation_blocked", FALLBACK)
    assert len(fake_openai.calls) == 1


@pytest.mark.parametrize("content", ["", "  \n ", None], ids=["empty", "blank", "null"])
def test_empty_content_is_empty_response(client: httpx.Client, fake_openai: FakeOpenAI, content: Any) -> None:
    fake_openai.script(MODEL, Reply(content))
    assert_fallback(degrading(client), "output", "empty_response", FALLBACK)
    assert len(fake_openai.calls) == 1


def test_schema_invalid(client: httpx.Client, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply('{"label": "billing", "confidence": "high"}'))
    assert_fallback(degrading(client), "output", "schema_invalid", FALLBACK)
