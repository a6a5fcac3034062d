"""`AzureOpenAI` over real HTTP against `FakeAzureOpenAI`: both endpoints (v1, and a
deployment's with `api-version`), both credentials (`api-key`, an Entra ID token), and the
issue's outcomes on guarded routes: strict and degrading answers, a stream ending with `done`,
a transient failure moving to the next deployment, a 429's bounded `Retry-After`, a context
window, Azure's content filters, an error event after the first output, credentials and
unknown deployments as the operator's fault; never a credential or provider text in an
answer or a log line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fixtures import Fail, FakeAzureOpenAI, Reply, Stream, Text
from guards import AI, ConfigurationError, EventStream, Guards
from guards.providers import AzureOpenAI
from guards.testing import UseFakeAI, UseFakeServers

from ..conftest import AppClient, LogLines, assert_error, assert_fallback, no_sleep

DEPLOYMENT = "gpt-4o-mini-prod"
SECOND = "gpt-4o-mini-backup"
VERSION = "2024-10-21"
#: Provider text that must reach no answer and no log line.
CANARY = "CANARY-AZURE-TEXT"
FALLBACK = "Sorry, try again later."


def create_app(binding: AzureOpenAI) -> FastAPI:
    guards = Guards(binding, sleep=no_sleep, retry_after_s=17)
    app = FastAPI()
    guards.install(app)
    chain = {"model": DEPLOYMENT, "fallbacks": [SECOND], "timeout_s": 5}

    @app.post("/strict")
    @guards.route(**chain)
    async def strict(body: dict[str, str], ai: AI[str]) -> dict[str, Any]:
        return {"reply": await ai.run({"prompt": body["text"]}), "model": ai.model}

    @app.post("/degrading")
    @guards.route(**chain, fallback=FALLBACK)
    async def degrading(body: dict[str, str], ai: AI[str]) -> str:
        return await ai.run({"prompt": body["text"]})

    @app.post("/stream")
    @guards.route(**chain)
    async def stream(body: dict[str, str], ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": body["text"]})

    return app


Client = Callable[..., httpx.Client]


@pytest.fixture
def client(fake_azure_openai: FakeAzureOpenAI, app_client: AppClient) -> Client:
    def make(**options: Any) -> httpx.Client:
        options.setdefault("api_key", fake_azure_openai.api_key)
        return app_client(create_app(AzureOpenAI(endpoint=fake_azure_openai.endpoint, **options)))

    return make


def ask(client: httpx.Client, path: str = "/strict") -> httpx.Response:
    return client.post(path, json={"text": "Where is my parcel?"})


def test_the_v1_endpoint_answers_a_strict_route(client: Client, fake_azure_openai: FakeAzureOpenAI) -> None:
    fake_azure_openai.script(DEPLOYMENT, Reply("On its way."))
    response = ask(client())
    assert response.json() == {"reply": "On its way.", "model": DEPLOYMENT}
    [call] = fake_azure_openai.calls
    assert call.inputs["model"] == DEPLOYMENT
    assert call.headers["api-key"] == fake_azure_openai.api_key
    assert "authorization" not in call.headers


def test_the_deployment_endpoint_with_an_entra_token(
    client: Client, fake_azure_openai: FakeAzureOpenAI
) -> None:
    """With `api_version`, the deployment's address; the token is asked for per request."""
    asked: list[int] = []

    async def token() -> str:
        asked.append(1)
        return "test-entra-token"

    fake_azure_openai.script(DEPLOYMENT, Reply("On its way."), Stream([Text("On"), Text(" its way.")]))
    app = client(api_key=None, token_provider=token, api_version=VERSION)
    assert ask(app).json() == {"reply": "On its way.", "model": DEPLOYMENT}
    streamed = ask(app, "/stream")
    assert streamed.text.count("event: delta") == 2
    assert "event: done" in streamed.text
    calls = fake_azure_openai.calls
    assert [c.headers["authorization"] for c in calls] == ["Bearer test-entra-token"] * 2
    assert len(asked) == 2


def test_a_token_provider_that_fails_is_the_operators_fault(client: Client, guards_log: LogLines) -> None:
    async def token() -> str:
        raise RuntimeError(f"tenant {CANARY} refused")

    response = ask(client(api_key=None, token_provider=token))
    assert response.status_code == 503
    assert CANARY not in response.text
    assert not any(CANARY in line for line in guards_log.lines)


def test_a_degrading_route_answers(client: Client, fake_azure_openai: FakeAzureOpenAI) -> None:
    fake_azure_openai.script(DEPLOYMENT, Reply("On its way."))
    assert ask(client(), "/degrading").json() == {"ok": True, "data": "On its way.", "fallback": None}


def test_a_stream_relays_text_and_ends_with_done(client: Client, fake_azure_openai: FakeAzureOpenAI) -> None:
    fake_azure_openai.script(DEPLOYMENT, Stream([Text("On"), Text(" its"), Text(" way.")]))
    streamed = ask(client(), "/stream")
    assert streamed.status_code == 200
    assert streamed.text.count("event: delta") == 3
    assert streamed.text.rstrip().splitlines()[-2] == "event: done"


def test_an_overload_moves_to_the_next_deployment(client: Client, fake_azure_openai: FakeAzureOpenAI) -> None:
    fake_azure_openai.script(DEPLOYMENT, Fail(status=503), Fail(status=503))
    fake_azure_openai.script(SECOND, Reply("On its way."))
    assert ask(client()).json() == {"reply": "On its way.", "model": SECOND}
    assert [c.model for c in fake_azure_openai.calls] == [DEPLOYMENT, DEPLOYMENT, SECOND]


@pytest.mark.parametrize(
    ("failure", "retry_after"),
    [
        pytest.param(Fail(status=429, retry_after_ms="4000"), "4", id="retry-after-ms"),
        pytest.param(Fail(status=429, retry_after="86400"), "600", id="a-day-capped"),
    ],
)
def test_a_rate_limit_sends_a_bounded_retry_after(
    client: Client, fake_azure_openai: FakeAzureOpenAI, failure: Fail, retry_after: str
) -> None:
    """Azure's `retry-after-ms` is read; a day's wait is told as the cooldown's cap."""
    fake_azure_openai.script("*", failure, failure)
    response = ask(client())
    assert_error(response, 503, "model_rate_limited", False)
    assert response.headers["retry-after"] == retry_after
    assert [c.model for c in fake_azure_openai.calls] == [DEPLOYMENT, SECOND]


def test_a_context_window_is_400_on_a_strict_route(
    client: Client, fake_azure_openai: FakeAzureOpenAI
) -> None:
    """Each deployment refuses the input (a longer window would have been tried next)."""
    too_long = Fail(status=400, error_code="context_length_exceeded")
    fake_azure_openai.script("*", too_long, too_long)
    assert_error(ask(client()), 400, "context_length_exceeded", False)


@pytest.mark.parametrize(
    "outcome",
    [
        pytest.param(Fail(status=400, error_code="content_filter", message=CANARY), id="prompt-filtered"),
        pytest.param(Reply(CANARY, finish_reason="content_filter"), id="answer-filtered"),
    ],
)
def test_a_content_filter_is_moderation(
    client: Client, fake_azure_openai: FakeAzureOpenAI, guards_log: LogLines, outcome: Fail | Reply
) -> None:
    fake_azure_openai.script(DEPLOYMENT, outcome)
    response = ask(client(), "/degrading")
    assert_fallback(response, "output", "moderation_blocked", FALLBACK)
    assert [c.model for c in fake_azure_openai.calls] == [DEPLOYMENT]  # the same provider: no move
    assert CANARY not in response.text
    assert not any(CANARY in line for line in guards_log.lines)


def test_an_error_event_after_output_ends_the_stream_with_error(
    client: Client, fake_azure_openai: FakeAzureOpenAI, guards_log: LogLines
) -> None:
    fake_azure_openai.script(
        DEPLOYMENT, Stream([Text("On"), Text(" its")], error_after=2, error_message=CANARY)
    )
    streamed = ask(client(), "/stream")
    assert streamed.status_code == 200
    assert streamed.text.count("event: delta") == 2
    assert "event: error" in streamed.text
    assert "event: done" not in streamed.text
    assert [c.model for c in fake_azure_openai.calls] == [DEPLOYMENT]
    assert CANARY not in streamed.text
    assert not any(CANARY in line for line in guards_log.lines)


@pytest.mark.parametrize(
    ("options", "outcome", "status", "error"),
    [
        pytest.param({"api_key": "wrong-key"}, None, 503, "model_unavailable", id="bad-key"),
        pytest.param(
            {},
            Fail(status=404, error_code="DeploymentNotFound"),
            502,
            "model_incompatible",
            id="no-deployment",
        ),
    ],
)
def test_credentials_and_deployments_are_the_operators_fault(
    client: Client,
    fake_azure_openai: FakeAzureOpenAI,
    guards_log: LogLines,
    options: dict[str, Any],
    outcome: Fail | None,
    status: int,
    error: str,
) -> None:
    """Never a 4xx: the client can fix neither."""
    if outcome is not None:
        fake_azure_openai.script("*", outcome, outcome)
    response = ask(client(**options))
    assert response.status_code == status
    assert response.json()["error"] == error
    assert "wrong-key" not in response.text
    assert not any("wrong-key" in line or "Access denied" in line for line in guards_log.lines)


def test_the_key_is_in_no_repr() -> None:
    binding = AzureOpenAI(endpoint="https://res.openai.azure.com", api_key="secret-key")
    assert "secret-key" not in repr(binding)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="no-credential"),
        pytest.param({"api_key": "k", "token_provider": lambda: None}, id="both"),
        pytest.param({"api_key": ""}, id="empty-key"),
        pytest.param({"api_key": "k", "api_version": ""}, id="empty-version"),
    ],
)
def test_a_wrong_configuration_is_refused_at_start_up(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="AzureOpenAI"):
        AzureOpenAI(endpoint="https://res.openai.azure.com", **options)


def _app() -> FastAPI:
    return create_app(AzureOpenAI(endpoint="http://127.0.0.1:9", api_key="unused", api_version=VERSION))


def test_use_fake_ai_and_use_fake_servers_speak_azures_wire(
    use_fake_ai: UseFakeAI,
    use_fake_servers: UseFakeServers,
    fake_azure_openai: FakeAzureOpenAI,
    app_client: AppClient,
) -> None:
    faked, served = _app(), _app()
    fake = use_fake_ai(faked)
    use_fake_servers(served)
    for script in (fake.script, fake_azure_openai.script):
        script(DEPLOYMENT, Fail(status=400, error_code="content_filter"))
    for app in (faked, served):
        assert_error(ask(app_client(app)), 502, "incompatible_model_response", False)
    assert fake.provider == "azure-openai"
    assert len(fake.calls) == len(fake_azure_openai.calls) == 1
