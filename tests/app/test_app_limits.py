"""The example app's limits settings: `AI_CONTEXT_WINDOWS` (a JSON object of model name to
tokens) and `AI_CONTENT_FILTER_FALLBACK` (`off`, the default, or `on`), over real HTTP against
the fake Workers AI and OpenAI-compatible servers, and the start-up errors naming them."""

from __future__ import annotations

from typing import Any

import pytest

from app.settings import SettingsError, load_settings
from fixtures import Fail, FakeOpenAI, FakeWorkersAI, Reply

from ..conftest import ExampleClient, assert_error

MODEL = "@cf/test/model"
BIG = "@cf/test/big"
FALLBACK = "gpt-4o-mini"
ASK = {"message": "Where is my parcel? It was due on Monday."}


def test_a_model_whose_window_is_too_small_is_skipped(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    client = example_client(ai_fallback_models=BIG, ai_context_windows=f'{{"{MODEL}": 10, "{BIG}": 100000}}')
    response = client.post("/draft-reply", json=ASK)
    assert response.status_code == 200, response.text
    assert [call.model for call in fake_workers_ai.calls] == [BIG]


def test_a_plain_name_holds_for_a_prefixed_chain_entry(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """A plain name in AI_CONTEXT_WINDOWS also names the model behind any provider prefix."""
    client = example_client(
        ai_fallback_models=f"openai:{FALLBACK},{BIG}",
        ai_context_windows=f'{{"{FALLBACK}": 10}}',
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key,
    )
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403))
    response = client.post("/draft-reply", json=ASK)
    assert response.status_code == 200, response.text
    assert fake_openai.calls == []
    assert [call.model for call in fake_workers_ai.calls] == [MODEL, BIG]


@pytest.mark.parametrize(
    ("setting", "other_called"), [({}, False), ({"ai_content_filter_fallback": "on"}, True)]
)
def test_a_content_filter_moves_on_only_when_the_app_says_so(
    example_client: ExampleClient,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    setting: dict[str, Any],
    other_called: bool,
) -> None:
    client = example_client(
        ai_fallback_models=f"openai:{FALLBACK}",
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key,
        **setting,
    )
    fake_workers_ai.script(MODEL, Fail(code=2016, status=400, shape="gateway"))
    fake_openai.script(FALLBACK, Reply("It is on its way."))
    response = client.post("/draft-reply", json=ASK)
    if other_called:
        assert response.status_code == 200, response.text
        assert response.json()["reply"] == "It is on its way."
    else:
        assert_error(response, 502, "incompatible_model_response", False)
    assert len(fake_workers_ai.calls) == 1
    assert len(fake_openai.calls) == (1 if other_called else 0)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("AI_CONTEXT_WINDOWS", "{not json", "AI_CONTEXT_WINDOWS: Value error, must be a JSON object"),
        ("AI_CONTEXT_WINDOWS", "[8192]", "AI_CONTEXT_WINDOWS: Value error, must be a JSON object"),
        ("AI_CONTEXT_WINDOWS", '{"@cf/x": 0}', "AI_CONTEXT_WINDOWS: Value error, must be a JSON object"),
        ("AI_CONTEXT_WINDOWS", '{"@cf/x": "8k"}', "AI_CONTEXT_WINDOWS: Value error, must be a JSON object"),
        ("AI_CONTENT_FILTER_FALLBACK", "yes", "AI_CONTENT_FILTER_FALLBACK: Input should be 'off' or 'on'"),
        ("AI_DEPLOYMENTS", "north", "AI_DEPLOYMENTS: Value error, must be comma-separated name=weight"),
        ("AI_DEPLOYMENTS", "north=0", "AI_DEPLOYMENTS: Value error, must be comma-separated name=weight"),
        ("AI_DEPLOYMENTS", "n/rth=1", "AI_DEPLOYMENTS: Value error, must be comma-separated name=weight"),
        ("AI_DEPLOYMENTS", "north=1,north=2", "AI_DEPLOYMENTS: Value error, must name each deployment once"),
        ("AI_DEPLOYMENT_STRATEGY", "fastest", "AI_DEPLOYMENT_STRATEGY: Input should be"),
    ],
)
def test_a_bad_setting_fails_start_up_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=message) as raised:
        load_settings()
    assert value not in str(raised.value)  # named, never echoed
