"""Chains across providers, through the example app over real HTTP: Anthropic first, then
Gemini, then an OpenAI-compatible model (`AI_PROVIDER=anthropic`,
`AI_FALLBACK_MODELS=gemini:...,openai:...`), each fake speaking its own wire. Each provider's
overload moves the walk on; breakers and cooldowns are kept per provider and model; a content
filter moves on only to another provider's model."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.service import create_app
from app.settings import Settings
from fixtures import Fail, FakeAnthropic, FakeGemini, FakeOpenAI, Reply

from ..conftest import AppClient, no_sleep

CLAUDE = "claude-haiku-4-5"
CLAUDE_2 = "claude-sonnet-4-5"
GEMINI = "gemini-2.5-flash"
GPT = "gpt-4o-mini"
MESSAGE = {"message": "Where is my parcel?"}


@pytest.fixture
def app_on(
    app_client: AppClient, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> Any:
    """`app_on(**settings)`: the example app on Anthropic, with the Gemini and OpenAI fakes'
    credentials, its retries not waited."""

    def make(**settings: Any) -> httpx.Client:
        values: dict[str, Any] = {
            "ai_provider": "anthropic",
            "ai_model": CLAUDE,
            "anthropic_api_key": fake_anthropic.api_key,
            "anthropic_base_url": fake_anthropic.base_url,
            "gemini_api_key": fake_gemini.api_key,
            "gemini_base_url": fake_gemini.base_url,
            "openai_api_key": fake_openai.api_key,
            "openai_base_url": fake_openai.base_url,
            "ai_timeout_s": 2.0,
            **settings,
        }
        return app_client(create_app(Settings(**values), sleep=no_sleep))

    return make


def models(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["model"]: entry for entry in status["models"]}


def test_a_chain_walks_from_anthropic_to_gemini_to_openai(
    app_on: Any, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    client = app_on(ai_fallback_models=f"gemini:{GEMINI},openai:{GPT}", breaker_failure_threshold=2)
    fake_anthropic.script(CLAUDE, Fail(status=529), Fail(status=529))  # overloaded_error
    fake_gemini.script(GEMINI, Fail(status=503))  # UNAVAILABLE
    fake_openai.script(GPT, Reply("Your parcel ships today."))
    response = client.post("/draft-reply", json=MESSAGE)
    assert response.status_code == 200, response.text
    assert response.json()["reply"] == "Your parcel ships today."
    assert response.headers["x-ai-model"] == GPT
    assert response.headers["x-ai-fallback"] == f"openai:{GPT}"
    # The overloaded first model retried once; the second had a call left for the last model.
    assert [call.model for call in fake_anthropic.calls] == [CLAUDE, CLAUDE]
    assert [call.model for call in fake_gemini.calls] == [GEMINI]
    assert [call.model for call in fake_openai.calls] == [GPT]

    # Each provider's model is counted on its own (calls, failures, the kind of the last).
    status = models(client.get("/status").json())
    claude, gemini, gpt = status[CLAUDE], status[f"gemini:{GEMINI}"], status[f"openai:{GPT}"]
    assert (claude["calls"], claude["failures"], claude["last_failure"]["kind"]) == (
        2,
        2,
        "model_temporarily_unavailable",
    )
    assert (gemini["calls"], gemini["failures"], gemini["last_failure"]["kind"]) == (
        1,
        1,
        "model_temporarily_unavailable",
    )
    # (`last_failure` is this worker's newest, of any test before: not this request's to say.)
    assert (gpt["calls"], gpt["failures"]) == (1, 0)

    # Anthropic overloaded again: its breaker opens (a second failed leg), Gemini answers and
    # its own breaker stays closed.
    fake_anthropic.script(CLAUDE, Fail(status=529), Fail(status=529))
    fake_gemini.script(GEMINI, Reply("Your parcel ships today."))
    assert client.post("/draft-reply", json=MESSAGE).headers["x-ai-fallback"] == f"gemini:{GEMINI}"
    status = models(client.get("/status").json())
    breakers = {model: entry["breaker"] for model, entry in status.items()}
    assert breakers == {CLAUDE: "open", f"gemini:{GEMINI}": "closed", f"openai:{GPT}": "closed"}

    # The next request skips Anthropic's open breaker without a call; Gemini answers.
    fake_anthropic.reset()
    fake_gemini.reset()
    fake_gemini.script(GEMINI, Reply({"label": "shipping", "confidence": 0.8}))
    summary = client.post("/summary", json={"text": "Where is my parcel?"}, headers={"x-user-id": "ann"})
    assert summary.json() == {"ok": True, "data": {"label": "shipping", "confidence": 0.8}, "fallback": None}
    assert summary.headers["x-ai-fallback"] == f"gemini:{GEMINI}"
    assert not fake_anthropic.calls
    assert [call.model for call in fake_gemini.calls] == [GEMINI]


def test_a_rate_limit_cools_down_only_that_providers_model(
    app_on: Any, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    client = app_on(ai_fallback_models=f"gemini:{GEMINI}")
    fake_anthropic.script(CLAUDE, Fail(status=429, retry_after="20"))
    fake_gemini.script(GEMINI, Reply("Your parcel ships today."))
    response = client.post("/draft-reply", json=MESSAGE)
    assert response.status_code == 200, response.text
    assert response.headers["x-ai-fallback"] == f"gemini:{GEMINI}"
    status = models(client.get("/status").json())
    assert 0 < status[CLAUDE]["cooldown_s"] <= 20
    assert status[f"gemini:{GEMINI}"]["cooldown_s"] == 0


def test_an_anthropic_content_filter_moves_on_only_to_another_provider(
    app_on: Any, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    client = app_on(
        ai_fallback_models=f"anthropic:{CLAUDE_2},gemini:{GEMINI}", ai_content_filter_fallback="on"
    )
    fake_anthropic.script(CLAUDE, Reply(refusal="I can't help with that."))
    fake_gemini.script(GEMINI, Reply("Your parcel ships today."))
    response = client.post("/draft-reply", json=MESSAGE)
    assert response.status_code == 200, response.text
    assert response.json()["reply"] == "Your parcel ships today."
    assert response.headers["x-ai-fallback"] == f"gemini:{GEMINI}"
    # The second Anthropic model is skipped without a call: the same provider's filter.
    assert [call.model for call in fake_anthropic.calls] == [CLAUDE]
    assert [call.model for call in fake_gemini.calls] == [GEMINI]
    assert "I can't help" not in response.text


def test_with_no_other_provider_left_the_filter_ends_the_request(
    app_on: Any, fake_anthropic: FakeAnthropic
) -> None:
    client = app_on(ai_fallback_models=f"anthropic:{CLAUDE_2}", ai_content_filter_fallback="on")
    fake_anthropic.script(CLAUDE, Reply(refusal="I can't help with that."))
    response = client.post("/draft-reply", json=MESSAGE)
    assert (response.status_code, response.json()["error"]) == (502, "incompatible_model_response")
    assert [call.model for call in fake_anthropic.calls] == [CLAUDE]
    assert "I can't help" not in response.text
    fake_anthropic.script(CLAUDE, Reply(refusal="I can't help with that."))
    summary = client.post("/summary", json={"text": "Where is my parcel?"}, headers={"x-user-id": "ann"})
    assert summary.json()["fallback"]["reason"] == "moderation_blocked"
