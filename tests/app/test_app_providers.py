"""The example app on each of the new providers (`AI_PROVIDER` = `anthropic`, `gemini`,
`bedrock`, `azure-openai`): `/draft-reply`, `/draft-reply/stream`, `/summary` and `/chat` over
real HTTP against that provider's fake server, configured only through the app's settings; and
the start-up error that names each missing credential."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.service import create_app
from app.settings import Settings, SettingsError, load_settings
from fixtures import FakeAnthropic, FakeAzureOpenAI, FakeBedrock, FakeGemini, Reply, Stream, Text

from ..conftest import AppClient, no_sleep
from .test_ui_stream import chat_body, check_ui_stream, text_of

#: Each provider's model, as an operator would name it in AI_MODEL (Bedrock's id carries a
#: colon: it is still the main binding's model, not a provider prefix).
MODELS = {
    "anthropic": "claude-haiku-4-5",
    "gemini": "gemini-2.5-flash",
    "bedrock": "anthropic.claude-3-5-haiku-20241022-v1:0",
    "azure-openai": "support-gpt-4o-mini",  # a deployment
}
FakeProvider = FakeAnthropic | FakeGemini | FakeBedrock | FakeAzureOpenAI
#: Every variable the new providers read, cleared before each test sets its own.
PROVIDER_VARIABLES = (
    "AI_PROVIDER",
    "AI_FALLBACK_MODELS",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "GEMINI_API_KEY",
    "GEMINI_BASE_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL_BEDROCK_RUNTIME",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_BEARER_TOKEN_BEDROCK",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AZURE_OPENAI_ENDPOINT",
    "AZURE_OPENAI_API_KEY",
    "OPENAI_API_VERSION",
)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """An environment with none of the providers' variables, and an AWS chain that finds
    nothing of the machine's (no shared files, no instance metadata)."""
    for name in PROVIDER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return monkeypatch


def provider_settings(name: str, server: Any, env: pytest.MonkeyPatch) -> dict[str, Any]:
    """The app's settings for provider `name` pointed at its fake `server` (Bedrock's key pair
    in the environment, as the standard AWS chain reads it: the requests are SigV4-signed)."""
    if name == "anthropic":
        return {"anthropic_api_key": server.api_key, "anthropic_base_url": server.base_url}
    if name == "gemini":
        return {"gemini_api_key": server.api_key, "gemini_base_url": server.base_url}
    if name == "bedrock":
        env.setenv("AWS_ACCESS_KEY_ID", server.access_key_id)
        env.setenv("AWS_SECRET_ACCESS_KEY", server.secret_access_key)
        return {"aws_region": server.region, "aws_endpoint_url_bedrock_runtime": server.base_url}
    return {
        "azure_openai_endpoint": server.endpoint,
        "azure_openai_api_key": server.api_key,
        "openai_api_version": "2024-10-21",  # the deployment endpoint
    }


@pytest.fixture(params=list(MODELS))
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(provider: str, request: pytest.FixtureRequest) -> FakeProvider:
    fake: FakeProvider = request.getfixturevalue(f"fake_{provider.replace('-', '_')}")
    return fake


@pytest.fixture
def client(
    provider: str, server: FakeProvider, aws_env: pytest.MonkeyPatch, app_client: AppClient
) -> httpx.Client:
    settings = Settings(
        ai_provider=provider,  # type: ignore[arg-type]
        ai_model=MODELS[provider],
        ai_timeout_s=2.0,
        **provider_settings(provider, server, aws_env),
    )
    return app_client(create_app(settings, sleep=no_sleep))


ANSWER = Stream(parts=(Text("Your parcel"), Text(" ships today.")))


def test_draft_reply(client: httpx.Client, provider: str, server: FakeProvider) -> None:
    server.script(MODELS[provider], Reply("Your parcel ships today."))
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert response.status_code == 200, response.text
    assert response.json()["reply"] == "Your parcel ships today."
    assert "x-ai-fallback" not in response.headers
    assert [call.model for call in server.calls] == [MODELS[provider]]


def test_draft_reply_stream(client: httpx.Client, provider: str, server: FakeProvider) -> None:
    server.script(MODELS[provider], ANSWER)
    response = client.post("/draft-reply/stream", json={"message": "Where is my parcel?"})
    assert response.status_code == 200, response.text
    events = [
        dict(line.split(": ", 1) for line in block.splitlines())
        for block in response.text.split("\n\n")
        if block.strip()
    ]
    names = [event["event"] for event in events]
    assert names[-1] == "done", names
    assert "error" not in names
    text = "".join(json.loads(e["data"])["text"] for e in events if e["event"] == "delta")
    assert text == "Your parcel ships today."
    assert [call.model for call in server.calls] == [MODELS[provider]]


def test_summary(client: httpx.Client, provider: str, server: FakeProvider) -> None:
    server.script(MODELS[provider], Reply({"label": "shipping", "confidence": 0.8}))
    response = client.post("/summary", json={"text": "Where is my parcel?"}, headers={"x-user-id": "ann"})
    assert response.json() == {"ok": True, "data": {"label": "shipping", "confidence": 0.8}, "fallback": None}
    assert [call.model for call in server.calls] == [MODELS[provider]]


def test_chat(client: httpx.Client, provider: str, server: FakeProvider) -> None:
    server.script(MODELS[provider], ANSWER)
    response = client.post("/chat", json=chat_body(), headers={"x-user-id": "ann"})
    chunks = check_ui_stream(response)
    assert text_of(chunks) == "Your parcel ships today."
    assert chunks[-1]["type"] == "finish"
    assert [call.model for call in server.calls] == [MODELS[provider]]


# --- start-up ----------------------------------------------------------------------------------

MISSING = [
    pytest.param("anthropic", {}, "needs ANTHROPIC_API_KEY to be set", id="anthropic"),
    pytest.param("gemini", {}, "needs GEMINI_API_KEY to be set", id="gemini"),
    pytest.param(
        "azure-openai",
        {"AZURE_OPENAI_API_KEY": "azure-canary"},
        "needs AZURE_OPENAI_ENDPOINT to be set",
        id="azure-endpoint",
    ),
    pytest.param(
        "azure-openai",
        {"AZURE_OPENAI_ENDPOINT": "https://support.openai.azure.com"},
        "needs AZURE_OPENAI_API_KEY to be set",
        id="azure-key",
    ),
    pytest.param(
        "bedrock",
        {"AWS_ACCESS_KEY_ID": "AKIDCANARY", "AWS_SECRET_ACCESS_KEY": "secret-canary"},
        "needs AWS_REGION to be set",
        id="bedrock-region",
    ),
    pytest.param(
        "bedrock",
        {"AWS_REGION": "us-east-1"},
        "found no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
        "a role, or AWS_BEARER_TOKEN_BEDROCK",
        id="bedrock-credentials",
    ),
]


@pytest.mark.parametrize(("provider", "env", "message"), MISSING)
def test_a_missing_credential_is_a_start_up_error_naming_it(
    provider: str, env: dict[str, str], message: str, aws_env: pytest.MonkeyPatch
) -> None:
    aws_env.setenv("AI_PROVIDER", provider)
    for name, value in env.items():
        aws_env.setenv(name, value)
    with pytest.raises(SettingsError) as raised:
        load_settings()
    assert f"AI_PROVIDER uses {provider}, which {message}" in str(raised.value)
    assert "canary" not in str(raised.value)


def test_a_chain_entry_names_its_providers_missing_credential(aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AI_PROVIDER", "anthropic")
    aws_env.setenv("ANTHROPIC_API_KEY", "sk-ant-canary")
    aws_env.setenv("AI_FALLBACK_MODELS", "gemini:gemini-2.5-flash")
    with pytest.raises(SettingsError, match="AI_FALLBACK_MODELS uses gemini, which needs GEMINI_API_KEY"):
        load_settings()


def test_bedrock_takes_the_aws_chain_or_a_bedrock_api_key(aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AI_PROVIDER", "bedrock")
    aws_env.setenv("AWS_REGION", "eu-west-1")
    aws_env.setenv("AWS_BEARER_TOKEN_BEDROCK", "bedrock-api-key")
    assert load_settings().aws_region == "eu-west-1"
    aws_env.delenv("AWS_BEARER_TOKEN_BEDROCK")
    aws_env.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    assert load_settings().ai_provider == "bedrock"


def test_bedrock_without_botocore_names_the_extra(aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AI_PROVIDER", "bedrock")
    aws_env.setenv("AWS_REGION", "eu-west-1")
    aws_env.setitem(sys.modules, "botocore.session", None)  # an import of it now fails
    with pytest.raises(
        SettingsError, match=r"bedrock, which needs botocore: pip install 'route-guards\[bedrock\]'"
    ):
        load_settings()
