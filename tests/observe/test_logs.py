"""What the logs tell an operator: credentials a provider rejects are named as such (not as an
outage), each failed attempt carries the provider's status and code, an application failure
logs where it happened. Against the fake providers."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.service import create_app
from fixtures import Fail, FakeBinding, FakeOpenAI, FakeWorkersAI, ManualClock, Reply
from guards import AI, Guards, flush_logs

from ..conftest import (
    AppClient,
    LogLines,
    answers,
    assert_error,
    capture_guards_log,
    no_sleep,
    wait_until,
    workers_ai_settings,
)

ROOT = Path(__file__).resolve().parents[2]

MODEL = "@cf/test/model"
CANARY = "CANARY-MESSAGE-0b7e52"


class Records(LogLines):
    """LogLines that keep each record's level too."""

    def __init__(self) -> None:
        super().__init__()
        self.levels: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.levels[record.getMessage()] = record.levelno  # a line's event decides its level
        super().emit(record)

    def at_level(self, event: str, level: int) -> list[dict[str, Any]]:
        """The lines of `event`, each asserted to be at `level`."""
        found = []
        for line in list(self.lines):
            parsed = json.loads(line)
            if parsed["event"] == event:
                assert self.levels[line] == level, line
                found.append(parsed)
        return found


@pytest.fixture
def records() -> Iterator[Records]:
    yield from capture_guards_log(Records())


def draft(client: httpx.Client) -> httpx.Response:
    return client.post("/draft-reply", json={"message": "Where is my parcel?"})


def warnings(records: Records, event: str) -> list[dict[str, Any]]:
    return records.at_level(event, logging.WARNING)


def test_a_rejected_token_is_logged_once_per_model_and_minute(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, records: Records, manual_clock: ManualClock
) -> None:
    settings = workers_ai_settings(fake_workers_ai, cloudflare_api_token="wrong-token")
    client = app_client(create_app(settings, sleep=no_sleep, clock=manual_clock))
    for _ in range(3):
        assert_error(draft(client), 503, "model_unavailable", False)
    assert warnings(records, "provider_rejected_credentials") == [
        {"event": "provider_rejected_credentials", "model": MODEL, "status": 401, "code": 10000}
    ]
    manual_clock.advance(61)
    draft(client)
    assert len(warnings(records, "provider_rejected_credentials")) == 2


def test_a_403_is_a_rejected_credential_too(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, records: Records
) -> None:
    client = app_client(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    fake_workers_ai.script(MODEL, Fail(code=3023, status=403, message=CANARY))
    assert_error(draft(client), 502, "model_incompatible", False)
    [warning] = warnings(records, "provider_rejected_credentials")
    assert warning["status"] == 403
    assert CANARY not in "".join(records.lines)


def test_each_model_of_a_chain_is_named(
    app_client: AppClient, records: Records, fake_workers_ai: FakeWorkersAI
) -> None:
    with FakeOpenAI(api_key="the-right-key") as openai:
        settings = workers_ai_settings(
            fake_workers_ai,
            cloudflare_api_token="wrong-token",
            ai_fallback_models="openai:gpt-4o-mini",
            openai_base_url=openai.base_url,
            openai_api_key="a-wrong-key",
        )
        client = app_client(create_app(settings, sleep=no_sleep))
        draft(client)
        draft(client)
    logged = warnings(records, "provider_rejected_credentials")
    assert [(w["model"], w["status"]) for w in logged] == [(MODEL, 401), ("openai:gpt-4o-mini", 401)]


def test_failed_attempts_carry_the_provider_status_and_code(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, records: Records
) -> None:
    client = app_client(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    fake_workers_ai.script(MODEL, Fail(code=3040, status=429, message=CANARY), Reply("Fine."))
    assert draft(client).status_code == 200
    failed, ok = records.events("attempt")
    assert (failed["outcome"], failed["status"], failed["code"]) == (
        "model_temporarily_unavailable",
        429,
        3040,
    )
    assert ok["outcome"] == "ok"
    assert CANARY not in "".join(records.lines)


def test_an_application_failure_logs_its_frames_not_its_message(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, records: Records
) -> None:
    app = create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep)

    def count_words(reply: str, secret: str) -> int:
        raise ValueError(f"cannot count {secret}")

    @app.post("/crashing")
    @Guards.of(app).route(model=MODEL)
    async def crashing(ai: AI[str]) -> int:
        secret = CANARY  # a local value: never logged
        return count_words(await ai.run({"prompt": "hello"}), secret)

    assert_error(app_client(app).post("/crashing"), 500, "application_failure", False)
    [failure] = records.at_level("application_failure", logging.ERROR)
    assert failure["route"] == "crashing"
    assert failure["exc_type"] == "ValueError"
    frames = failure["frames"]
    assert [f["function"] for f in frames][-2:] == ["crashing", "count_words"]
    assert all(f["file"].endswith("test_logs.py") for f in frames[-2:])
    assert all(isinstance(f["line"], int) for f in frames)
    assert CANARY not in "".join(records.lines)


def test_frames_are_bounded(fake_workers_ai: FakeWorkersAI, app_client: AppClient, records: Records) -> None:
    app = create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep)

    def deep(n: int) -> int:
        return deep(n - 1) if n else 1 // 0

    @app.post("/deep")
    @Guards.of(app).route(model=MODEL)
    async def deep_route(ai: AI[str]) -> int:
        await ai.run({"prompt": "hello"})
        return deep(200)

    assert_error(app_client(app).post("/deep"), 500, "application_failure", False)
    [failure] = records.events("application_failure")
    assert len(failure["frames"]) == 20
    assert failure["frames_omitted"] > 180
    assert failure["frames"][-1]["function"] == "deep"  # the innermost frames are kept


# --- logs show up in an app that configured no logging ----------------------------------------

USER_APP = """
import sys

from fixtures import FakeBinding
from tests.test_readme import readme_example

example = readme_example()  # README's "Guard a route of your own", as a user writes it
app, guards = example["app"], example["guards"]
guards.binding = FakeBinding()


@app.post("/crash")
@guards.route(model="@cf/meta/llama-3.3-70b-instruct-fp8-fast")
async def crash(ai: example["AI"][str]) -> str:
    secret = "CANARY-LOCAL-88c1d0"
    return str(len(await ai.run({"prompt": secret})) / 0)
"""


@pytest.fixture
def user_app(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """The README's example app, served by uvicorn in a process of its own that configures no
    logging: (its URL, the process)."""
    (tmp_path / "user_app.py").write_text(USER_APP)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "user_app:app", "--port", str(port), "--log-level", "warning"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(url) or process.poll() is not None, timeout_s=20)
        yield url, process
    finally:
        process.terminate()
        process.wait(10)


def test_an_app_without_logging_config_shows_request_lines_and_failures(
    user_app: tuple[str, subprocess.Popen[str]],
) -> None:
    url, process = user_app
    assert httpx.post(url + "/triage", json={"text": "The site is down"}).status_code == 200
    assert httpx.post(url + "/crash").status_code == 500
    process.terminate()
    out, err = process.communicate(timeout=10)
    lines = [json.loads(line) for line in (out + err).splitlines() if line.startswith("{")]
    events = [(line["event"], line.get("route"), line.get("status")) for line in lines]
    assert ("request", "triage", 200) in events
    assert ("request", "crash", 500) in events
    [failure] = [line for line in lines if line["event"] == "application_failure"]
    assert failure["frames"][-1]["function"] == "crash"
    assert "CANARY-LOCAL" not in out + err


def test_an_app_with_its_own_handler_gets_each_line_once(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], app_client: AppClient
) -> None:
    app = FastAPI()
    guards = Guards(FakeBinding())
    guards.install(app)

    @app.post("/hello")
    @guards.route(model=MODEL)
    async def hello(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    # Records come from the app's record factory (apps add fields there), at INFO, by `guards`.
    factory = logging.getLogRecordFactory()

    def tagged(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.tag = "app"
        return record

    caplog.set_level(logging.INFO, logger="guards")
    logging.setLogRecordFactory(tagged)
    try:
        assert app_client(app).post("/hello").status_code == 200
        assert flush_logs()  # written by guards' log writer, on a thread of its own
    finally:
        logging.setLogRecordFactory(factory)
    # One line for the request, its only call on it.
    assert [json.loads(r.getMessage())["event"] for r in caplog.records] == ["request"]
    assert {(r.name, r.levelno, getattr(r, "tag", None)) for r in caplog.records} == {
        ("guards", logging.INFO, "app")
    }
    # The app's handler (here pytest's, on the root logger) has them: guards' own is quiet.
    assert '"event"' not in capfd.readouterr().err
