"""Canaries: the API token, the user's text, the model's text and the provider's error message
never reach a response (other than the reply a route is meant to return) or a log line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.service import create_app
from app.settings import Settings, SettingsError, load_settings
from fixtures import Drop, Fail, FakeOpenAI, FakeWorkersAI, Hang, ManualClock, Raw, Reply, Stream, Text

from ..conftest import AppClient, LogLines, no_sleep, workers_ai_settings

TOKEN = "CANARY-TOKEN-7f3a9e"
USER = "CANARY-USER-91b2c4"
PROVIDER = "CANARY-PROVIDER-5c0d11"
REPLY = "CANARY-REPLY-3e8f20"
CANARIES = (TOKEN, USER, PROVIDER, REPLY)
MODEL = "@cf/test/model"


@pytest.fixture
def all_logs() -> Iterator[LogLines]:
    """Every log record of the process (root and `guards`, which does not propagate)."""
    handler = LogLines()
    loggers = [logging.getLogger(), logging.getLogger("guards")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield handler
    for logger, level in zip(loggers, levels, strict=True):
        logger.removeHandler(handler)
        logger.setLevel(level)


def provider_failures() -> list[Any]:
    return [
        Fail(code=3036, status=429, message=f"AiError: quota used up for {PROVIDER}"),
        Fail(code=3040, status=429, message=f"AiError: capacity {PROVIDER}"),
        Fail(code=5035, status=403, message=f"AiError: {PROVIDER} needs paid plan"),
        Fail(code=5006, status=200, message=f"AiError: bad input {USER} {PROVIDER}"),
        Fail(code=3036, status=429, message=f"{PROVIDER} {USER}", shape="aierror"),
        Fail(status=400, message=f"AiError: JSON Mode couldn't be met {PROVIDER}"),
        Raw(502, f"<html>{PROVIDER} {TOKEN}</html>".encode()),
        Raw(200, f'{{"oops": "{PROVIDER}"'.encode()),
        Drop(),
    ]


def model_answers() -> list[Any]:
    return [
        Reply(f"{REPLY} " * 400),  # too long for /draft-reply
        Reply({"label": REPLY, "confidence": 3}),
        Reply(f"not json {REPLY}"),
        Reply({"label": f"{REPLY} mail me at a@example.com", "confidence": 0.9}),
        Reply({"label": REPLY, "confidence": 0.5}),
        Reply(f"  {REPLY}  "),
    ]


def stream_failures() -> list[Any]:
    """Streams that fail after HTTP 200, their error text carrying the provider canary."""
    return [
        Stream(parts=(Text("Hello"),), error_after=0, error_message=f"AiError: {PROVIDER}"),
        Stream(parts=(Text("Hello"), Text(" there")), error_after=1, error_code=3040, error_message=PROVIDER),
        Stream(parts=(Text("Hello"),), cut_after=1, partial_tail=True),
    ]


@pytest.fixture
def canary_server() -> Iterator[FakeWorkersAI]:
    with FakeWorkersAI(api_token=TOKEN) as server:
        yield server


def test_canaries_never_leak(
    canary_server: FakeWorkersAI,
    app_client: AppClient,
    all_logs: LogLines,
    manual_clock: ManualClock,
) -> None:
    clock = manual_clock
    app = create_app(
        workers_ai_settings(
            canary_server, cloudflare_api_token=TOKEN, ai_timeout_s=0.5, breaker_failure_threshold=1000
        ),
        sleep=no_sleep,
        clock=clock,
    )
    client = app_client(app)
    seen: list[str] = []

    def record(response: httpx.Response, *, reply_allowed: bool = False) -> None:
        text = response.text
        if reply_allowed:
            text = text.replace(REPLY, "")
        seen.append(f"{response.status_code} {dict(response.headers)} {text}")

    outcomes = provider_failures() + model_answers() + stream_failures() + [Hang()]
    paths = (
        ("/draft-reply", {"message": f"Hi {USER}"}),
        ("/draft-reply/stream", {"message": f"Hi {USER}"}),
        ("/summary", {"text": f"Hi {USER}"}),
    )
    for outcome in outcomes:
        for path, body in paths:
            canary_server.script(MODEL, outcome, outcome)
            record(client.post(path, json=body), reply_allowed=path.startswith("/draft-reply"))
            clock.advance(3_601)  # past any cooldown a quota failure started
    # Invalid inputs that carry the canary.
    record(client.post("/draft-reply", json={"message": USER * 100}))
    record(client.post("/draft-reply", json={"message": {"nested": USER}}))
    record(client.post("/summary", json={"text": USER * 1000}))
    record(
        client.post("/summary", content=f"{{{USER}".encode(), headers={"content-type": "application/json"})
    )

    assert len(canary_server.calls) > 20
    assert all_logs.lines, "the requests were logged"
    for text in seen + all_logs.lines:
        for canary in CANARIES:
            assert canary not in text


def test_settings_errors_name_variables_not_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_PROVIDER", "workers-ai")
    monkeypatch.setenv("CLOUDFLARE_API_TOKEN", TOKEN)
    monkeypatch.delenv("CLOUDFLARE_ACCOUNT_ID", raising=False)
    with pytest.raises(SettingsError) as missing:
        load_settings()
    assert "CLOUDFLARE_ACCOUNT_ID" in str(missing.value)
    assert TOKEN not in str(missing.value)

    monkeypatch.setenv("CLOUDFLARE_ACCOUNT_ID", "acct")
    monkeypatch.setenv("AI_TIMEOUT_S", f"-{TOKEN}")
    with pytest.raises(SettingsError) as invalid:
        load_settings()
    assert "AI_TIMEOUT_S" in str(invalid.value)
    assert TOKEN not in str(invalid.value)


# --- identifiers a provider sends ---------------------------------------------------------------

#: A served-model name (and finish reason) as a hostile provider could send it: control
#: characters, a line break, the canary past the first 200 characters, 900 KB in all.
HOSTILE_NAME = "gpt-\x1b[31m\u2028\n\r\t" + "x" * 300 + PROVIDER + "y" * 900_000


@pytest.fixture
def openai_client(app_client: AppClient, fake_openai: FakeOpenAI) -> httpx.Client:
    settings = Settings(
        ai_provider="openai",
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key or "",
        ai_model="gpt-4o-mini",
        breaker_failure_threshold=1000,
    )
    return app_client(create_app(settings, sleep=no_sleep))


def assert_bounded_identifier(value: str) -> None:
    assert 0 < len(value) <= 200
    assert value.isprintable()
    assert PROVIDER not in value


def test_provider_identifiers_are_bounded_and_printable(
    openai_client: httpx.Client, fake_openai: FakeOpenAI, all_logs: LogLines
) -> None:
    """Over real HTTP: the name a provider gives the model that served (in an answer, in a
    stream's chunks) and its finish reason reach the response body, `x-ai-model`, the `done`
    event and the log lines (request, attempt) cut to 200 printable characters."""
    fake_openai.script("gpt-4o-mini", Reply("Hello.", model=HOSTILE_NAME))
    plain = openai_client.post("/draft-reply", json={"message": "Hi"})
    assert plain.status_code == 200
    assert_bounded_identifier(plain.json()["model"])
    assert_bounded_identifier(plain.headers["x-ai-model"])

    fake_openai.script(
        "gpt-4o-mini",
        Stream(parts=(Text("Hel"), Text("lo.")), model=HOSTILE_NAME, finish_reason=HOSTILE_NAME[:50_000]),
    )
    streamed = openai_client.post("/draft-reply/stream", json={"message": "Hi"})
    done = json.loads(streamed.text.rstrip().splitlines()[-1].removeprefix("data: "))
    assert_bounded_identifier(done["model"])
    assert_bounded_identifier(done["finish_reason"])
    assert_bounded_identifier(streamed.headers["x-ai-model"])
    assert len(streamed.content) < 2_000

    assert len(fake_openai.calls) == 2
    assert all_logs.wait_for(lambda: sum('"event":"request"' in line for line in all_logs.lines) >= 2)
    for line in all_logs.lines:
        assert len(line) < 2_000
        assert PROVIDER not in line
    # Each request made one call: the model that served is named on its request line.
    requests = [json.loads(line) for line in all_logs.lines if line.startswith('{"event":"request"')]
    served = [request["model"] for request in requests]
    assert len(served) == 2
    for name in served:
        assert_bounded_identifier(name)
