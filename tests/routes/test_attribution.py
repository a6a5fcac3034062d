"""`x-ai-model` names the model whenever a model answered: on success, and also when the output
guard rejected its answer (a degrading route's fallback, a strict route's 502
`incompatible_model_response`) or the route's own code failed after it (500). Never when no
model answered. Through the example app, against the fake Workers AI server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.service import create_app
from fixtures import Fail, FakeWorkersAI, Reply, Stream
from guards import AI, Guards

from ..conftest import AppClient, assert_error, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
SERVED = "@cf/test/served-by"


@pytest.fixture
def app(fake_workers_ai: FakeWorkersAI) -> FastAPI:
    return create_app(workers_ai_settings(fake_workers_ai, breaker_failure_threshold=1000), sleep=no_sleep)


def summarize(client: httpx.Client) -> httpx.Response:
    return client.post("/summary", json={"text": "I was charged twice"}, headers={"x-user-id": "ada"})


def draft(client: httpx.Client, path: str = "/draft-reply") -> httpx.Response:
    return client.post(path, json={"message": "Where is my parcel?"})


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (Reply({"label": "billing", "confidence": 7}), "schema_invalid"),
        (Reply({"label": "mail me at a@example.com", "confidence": 0.9}), "moderation_blocked"),
        (Reply("   "), "empty_response"),
        (Fail(status=400, message="AiError: JSON Mode couldn't be met"), "schema_invalid"),
    ],
    ids=["schema-invalid", "moderation", "empty", "json-mode-not-met"],
)
def test_degrading_fallback_after_the_output_guard_names_the_model(
    app: FastAPI, app_client: AppClient, fake_workers_ai: FakeWorkersAI, answer: Any, reason: str
) -> None:
    fake_workers_ai.script(MODEL, answer)
    response = summarize(app_client(app))
    assert response.json()["fallback"]["reason"] == reason
    assert response.headers["x-ai-model"] == MODEL
    assert "x-ai-fallback" not in response.headers


@pytest.mark.parametrize(
    "answer",
    [Reply(""), Reply("z" * 1201), Fail(status=400, message="AiError: JSON Mode couldn't be met")],
    ids=["empty", "too-long", "json-mode-not-met"],
)
def test_strict_incompatible_model_response_names_the_model(
    app: FastAPI, app_client: AppClient, fake_workers_ai: FakeWorkersAI, answer: Any
) -> None:
    fake_workers_ai.script(MODEL, answer)
    response = draft(app_client(app))
    assert_error(response, 502, "incompatible_model_response", False)
    assert response.headers["x-ai-model"] == MODEL


def test_stream_the_provider_filtered_names_the_model(app_client: AppClient) -> None:
    # OpenAI-style chunks carry the finish reason (Workers AI's native events do not).
    with FakeWorkersAI(openai_chunks=True) as server:
        app = create_app(workers_ai_settings(server), sleep=no_sleep)
        server.script(MODEL, Stream(parts=(), finish_reason="content_filter", model=SERVED))
        response = draft(app_client(app), "/draft-reply/stream")
        assert_error(response, 502, "incompatible_model_response", False)
        assert response.headers["x-ai-model"] == SERVED


def test_application_failure_names_the_model_that_answered(
    app: FastAPI, app_client: AppClient, fake_workers_ai: FakeWorkersAI
) -> None:
    @app.post("/crashing")
    @Guards.of(app).route(model=MODEL)
    async def crashing(ai: AI[str]) -> str:
        reply = await ai.run({"prompt": "hello"})
        return str(len(reply) / 0)

    fake_workers_ai.script(MODEL, Reply("fine", model=SERVED))
    response = app_client(app).post("/crashing")
    assert_error(response, 500, "application_failure", False)
    assert response.headers["x-ai-model"] == MODEL  # Workers AI does not name the model that served


@pytest.mark.parametrize("path", ["/summary", "/draft-reply"])
def test_no_model_header_when_no_model_answered(
    app: FastAPI, app_client: AppClient, fake_workers_ai: FakeWorkersAI, path: str
) -> None:
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403))
    client = app_client(app)
    response = summarize(client) if path == "/summary" else draft(client)
    assert response.status_code in (200, 502)
    assert "x-ai-model" not in response.headers
