"""The example app's chain settings: `AI_FALLBACK_MODELS` across providers (Workers AI first,
an OpenAI-compatible fallback), `AI_ATTRIBUTION`, and start-up failures for chains that name a
provider without its credentials."""

from __future__ import annotations

import time

import httpx
import pytest

from app.service import create_app
from app.settings import Settings, SettingsError, load_settings
from fixtures import Fail, FakeOpenAI, FakeWorkersAI, Hang, Reply
from guards import ConfigurationError

from ..conftest import AppClient, ExampleClient, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
FALLBACK = "gpt-4o-mini"


@pytest.fixture
def client(example_client: ExampleClient, fake_openai: FakeOpenAI) -> httpx.Client:
    return example_client(
        ai_fallback_models=f" openai:{FALLBACK} , ",
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key,
    )


def test_draft_reply_falls_back_to_the_openai_model(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403))
    fake_openai.script(FALLBACK, Reply("Your parcel is on its way.", model="gpt-4o-mini-2024-07-18"))
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert response.status_code == 200
    assert response.json()["reply"] == "Your parcel is on its way."
    assert response.json()["model"] == "gpt-4o-mini-2024-07-18"
    assert response.headers["x-ai-model"] == "gpt-4o-mini-2024-07-18"
    assert response.headers["x-ai-fallback"] == f"openai:{FALLBACK}"
    assert len(fake_workers_ai.calls) == 1
    assert len(fake_openai.calls) == 1
    assert fake_openai.calls[0].inputs["messages"][-1]["content"] == "Where is my parcel?"


def test_summary_uses_json_mode_on_the_fallback_too(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    fake_workers_ai.script(MODEL, Fail(status=429, retry_after="30"))
    fake_openai.script(FALLBACK, Reply({"label": "shipping", "confidence": 0.8}))
    response = client.post("/summary", json={"text": "Where is my parcel?"})
    assert response.json() == {"ok": True, "data": {"label": "shipping", "confidence": 0.8}, "fallback": None}
    assert fake_openai.calls[0].inputs["response_format"]["type"] == "json_schema"


def test_an_openai_fallback_without_a_key_fails_start_up(
    fake_workers_ai: FakeWorkersAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AI_PROVIDER", "workers-ai")
    monkeypatch.setenv("CLOUDFLARE_ACCOUNT_ID", "acc")
    monkeypatch.setenv("CLOUDFLARE_API_TOKEN", "tok")
    monkeypatch.setenv("AI_FALLBACK_MODELS", "openai:gpt-4o-mini")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(SettingsError, match="AI_FALLBACK_MODELS uses openai, which needs OPENAI_API_KEY"):
        load_settings()


def test_a_local_openai_compatible_server_needs_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_PROVIDER", "openai")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:11434/v1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert load_settings().ai_provider == "openai"


def test_an_unknown_provider_prefix_fails_start_up(fake_workers_ai: FakeWorkersAI) -> None:
    settings = workers_ai_settings(fake_workers_ai, ai_fallback_models="mistral:mistral-small")
    with pytest.raises(ConfigurationError, match="provider 'mistral', which is not configured"):
        create_app(settings)


def test_attribution_off_sends_no_model_headers(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(
        create_app(workers_ai_settings(fake_workers_ai, ai_attribution="off"), sleep=no_sleep)
    )
    response = client.post("/draft-reply", json={"message": "Hello"})
    assert response.status_code == 200
    assert not [name for name in response.headers if name.startswith("x-ai-")]


def test_the_app_on_openai_alone(fake_openai: FakeOpenAI, app_client: AppClient) -> None:
    settings = Settings(
        ai_provider="openai",
        ai_model=FALLBACK,
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key,
    )
    client = app_client(create_app(settings, sleep=no_sleep))
    fake_openai.script(FALLBACK, Reply("Hi there."))
    response = client.post("/draft-reply", json={"message": "Hello"})
    assert response.status_code == 200
    assert response.headers["x-ai-model"] == FALLBACK


@pytest.mark.parametrize(
    "name",
    [
        "AI_FIRST_OUTPUT_S",  # unset: the deadline alone
        "AI_HEDGE_AFTER_S",  # unset: never hedged
    ],
)
def test_an_optional_seconds_setting_is_read_and_checked(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("AI_PROVIDER", "fake")
    monkeypatch.delenv(name, raising=False)
    assert getattr(load_settings(), name.lower()) is None
    monkeypatch.setenv(name, "2.5")
    assert getattr(load_settings(), name.lower()) == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(SettingsError, match=name):
            load_settings()


def test_without_ai_first_output_s_a_silent_model_gets_its_share_of_the_deadline(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    """Unset, the route's default: a model that never answers holds the request for a third of
    a two-model chain's deadline, then the next model answers."""
    client = example_client(ai_fallback_models="@cf/test/backup", ai_timeout_s=1.5)
    fake_workers_ai.script(MODEL, Hang())
    fake_workers_ai.script("@cf/test/backup", Reply("Your parcel is on its way."))
    started = time.monotonic()
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert response.status_code == 200, response.text
    assert 0.5 <= time.monotonic() - started < 1.5
    assert [call.model for call in fake_workers_ai.calls] == [MODEL, "@cf/test/backup"]


@pytest.mark.parametrize(
    ("on_rejected", "calls", "summary"),
    [
        ("fallback", (1, 0), None),  # the default: the keyword label
        ("next_model", (1, 1), {"label": "shipping", "confidence": 0.8}),
        ("reask", (2, 0), {"label": "shipping", "confidence": 0.9}),
    ],
)
def test_ai_on_rejected(
    example_client: ExampleClient,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    on_rejected: str,
    calls: tuple[int, int],
    summary: dict[str, object] | None,
) -> None:
    """AI_ON_REJECTED: a schema-failing first answer on /summary ends in its fallback, moves on
    to the OpenAI fallback model, or is asked for again from the same model."""
    settings = {} if on_rejected == "fallback" else {"ai_on_rejected": on_rejected}
    client = example_client(
        ai_fallback_models=f"openai:{FALLBACK}",
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key,
        **settings,
    )
    fake_workers_ai.script(
        MODEL, Reply({"label": "shipping"}), Reply({"label": "shipping", "confidence": 0.9})
    )
    fake_openai.script(FALLBACK, Reply({"label": "shipping", "confidence": 0.8}))
    response = client.post("/summary", json={"text": "Where is my parcel?"}, headers={"x-user-id": "ada"})
    body = response.json()
    if summary is None:
        assert body["fallback"]["reason"] == "schema_invalid"
        assert "x-ai-rejected" not in response.headers
    else:
        assert body == {"ok": True, "data": summary, "fallback": None}
        assert response.headers["x-ai-rejected"] == MODEL
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == calls


def test_an_unknown_ai_on_rejected_fails_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_ON_REJECTED", "retry")
    with pytest.raises(
        SettingsError, match="AI_ON_REJECTED: Input should be 'fallback', 'next_model' or 'reask'"
    ):
        load_settings()
