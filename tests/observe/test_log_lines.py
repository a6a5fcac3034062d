"""What guards writes per request by default, and how its log writer behaves when the reader
of its lines does not keep up (docs/operating/logs.md)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fixtures import Fail, FakeBinding, Reply
from guards import AI, Attempt, Breaker, ConfigurationError, Guards

from ..conftest import AppClient, LogLines, answers, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "@cf/test/model"


def app_of(guards: Guards, *, degrade: bool = False) -> FastAPI:
    app = FastAPI()
    guards.install(app)

    @app.post("/hello")
    @guards.route(
        model=MODEL,
        breaker=Breaker(failure_threshold=1, reset_timeout_s=600),
        **({"fallback": "later"} if degrade else {}),
    )
    async def hello(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    return app


def test_a_plain_success_writes_one_line_that_carries_its_call(
    app_client: AppClient, guards_log: LogLines
) -> None:
    client = app_client(app_of(Guards(FakeBinding(Reply("Hi.")))))
    assert client.post("/hello").status_code == 200
    [line] = guards_log.events()
    assert line["event"] == "request"
    assert (line["outcome"], line["attempts"], line["model"]) == ("ok", 1, MODEL)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (10, 5)
    assert 0 <= line["call_ms"] <= line["latency_ms"]


def test_a_line_is_the_standard_librarys_json_text_whatever_its_characters(
    app_client: AppClient, guards_log: LogLines
) -> None:
    # Lines are made with orjson (guards/observe/_json.py); a character outside ASCII is
    # escaped as `json.dumps` escapes it, so a line's bytes do not depend on the encoder.
    model = "@cf/test/modèle-✓"
    guards = Guards(FakeBinding(Reply("Hi.")))
    app = FastAPI()
    guards.install(app)

    @app.post("/hello")
    @guards.route(model=model)
    async def hello(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    assert app_client(app).post("/hello").status_code == 200
    [text] = guards_log.lines
    line = json.loads(text)
    assert line["model"] == model
    assert text == json.dumps(line, separators=(",", ":"))
    assert text.isascii()


def test_a_request_that_made_two_calls_writes_both_then_its_line(
    app_client: AppClient, guards_log: LogLines
) -> None:
    guards = Guards(FakeBinding(), sleep=_no_sleep)
    guards.binding.script(MODEL, Fail(code=3040, status=429), Reply("Hi."))  # type: ignore[attr-defined]
    client = app_client(app_of(guards))
    assert client.post("/hello").status_code == 200
    events = [
        (e["event"], e.get("attempt"), e.get("outcome")) for e in guards_log.events() if e["event"] != "retry"
    ]
    assert events == [
        ("attempt", 1, "model_temporarily_unavailable"),
        ("attempt", 2, "ok"),
        ("request", None, "ok"),
    ]
    assert "call_ms" not in guards_log.events("request")[0]  # its calls have lines of their own


def test_every_call_has_a_line_when_the_app_asks_and_its_own_ledger_gets_every_record(
    app_client: AppClient, guards_log: LogLines
) -> None:
    client = app_client(app_of(Guards(FakeBinding(Reply("Hi.")), log_attempts="all")))
    assert client.post("/hello").status_code == 200
    assert [e["event"] for e in guards_log.events()] == ["attempt", "request"]

    records: list[Attempt] = []

    class Kept:
        def record(self, attempt: Attempt) -> None:
            records.append(attempt)

    kept = app_client(app_of(Guards(FakeBinding(Reply("Hi.")), ledger=Kept())))
    assert kept.post("/hello").status_code == 200
    assert [(r.attempt, r.outcome) for r in records] == [(1, "ok")]


def test_sampled_request_lines_keep_every_fallback(app_client: AppClient, guards_log: LogLines) -> None:
    guards = Guards(FakeBinding(Reply("Hi.")), log_sample=0.0)
    client = app_client(app_of(guards, degrade=True))
    for _ in range(5):
        assert client.post("/hello").status_code == 200
    assert guards_log.events("request") == []  # successes: sampled out
    guards.binding.default = Fail(code=5035, status=403)  # type: ignore[attr-defined]
    assert client.post("/hello").json()["fallback"] is not None
    [line] = guards_log.events("request")
    assert (line["outcome"], line["provider_status"]) == ("fallback", 403)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"log_attempts": "some"}, 'log_attempts must be "retries" or "all"'),
        ({"log_sample": 1.5}, "log_sample must be between 0.0 and 1.0"),
    ],
)
def test_log_settings_are_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        Guards(FakeBinding(), **options)


def test_a_bad_buffer_size_says_what_to_fix() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from guards import Guards"],
        cwd=ROOT,
        env={**os.environ, "GUARDS_LOG_BUFFER_LINES": "lots"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "GUARDS_LOG_BUFFER_LINES must be a whole number of lines, at least 1 (got 'lots')" in done.stderr


def test_refusals_in_a_storm_write_one_skip_line_per_second(
    app_client: AppClient, guards_log: LogLines
) -> None:
    guards = Guards(FakeBinding(Fail(code=5035, status=403)))
    client = app_client(app_of(guards, degrade=True))
    client.post("/hello")  # the failure that opens the breaker
    started = time.time()
    for _ in range(200):
        assert client.post("/hello").json()["fallback"]["reason"] == "circuit_open"
    seconds = int(time.time()) - int(started) + 1
    lines = guards_log.events("skip")
    assert 1 <= len(lines) <= seconds
    assert guards_log.skips() == {(MODEL, "circuit_open"): 200}
    assert len(guards_log.events("request")) == 201  # every request keeps its own line


async def _no_sleep(_: float) -> None:
    return None


# --- a reader that does not keep up -------------------------------------------------------------

STUCK_APP = """
from fastapi import FastAPI, Response

from fixtures import FakeBinding, Reply
from guards import AI, Guards, render_metrics

guards = Guards(FakeBinding(Reply("Hi.")))
app = FastAPI()
guards.install(app)


@app.post("/hello")
@guards.route(model="@cf/test/model", timeout_s=2.0)
async def hello(ai: AI[str]) -> str:
    return await ai.run({"prompt": "hello"})


@app.get("/metrics")
def metrics() -> Response:
    body, content_type = render_metrics()
    return Response(body, media_type=content_type)
"""
#: The smallest pipe Linux makes (F_SETPIPE_SZ): a page.
PIPE_BYTES = 4096
#: The log writer's queue in the stuck app (GUARDS_LOG_BUFFER_LINES).
BUFFER_LINES = 50


@pytest.fixture
def stuck_app(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """An app with no logging set-up (its lines go to stderr) whose stderr is a one-page pipe
    that nobody reads: (its URL, the pipe's reading end)."""
    (tmp_path / "stuck_app.py").write_text(STUCK_APP)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, PIPE_BYTES)  # F_SETPIPE_SZ
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "GUARDS_LOG_BUFFER_LINES": str(BUFFER_LINES),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "stuck_app:app", "--port", str(port), "--log-level", "warning"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=write_end,
    )
    os.close(write_end)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(url) or process.poll() is not None, timeout_s=30)
        assert process.poll() is None, "the app did not start"
        yield url, read_end
    finally:
        process.kill()
        process.wait(10)
        os.close(read_end)


def test_a_worker_whose_stderr_is_not_read_keeps_answering_and_counts_what_it_dropped(
    stuck_app: tuple[str, int],
) -> None:
    url, stderr = stuck_app
    requests = 400  # about 80 lines fill the pipe, 50 the queue: the rest are dropped
    with httpx.Client(base_url=url, timeout=5.0) as client:  # each answer within its deadline
        for _ in range(requests):
            assert client.post("/hello").status_code == 200
        dropped = _dropped(client.get("/metrics").text)
        assert 0 < dropped <= requests
        # Read the pipe: the writer catches up, and says how many lines it dropped (in one
        # line or several: each says how many were dropped since the one before).
        said: list[int] = []
        deadline = time.monotonic() + 10
        buffered = b""
        while sum(said) < dropped and time.monotonic() < deadline:
            ready, _, _ = select.select([stderr], [], [], 0.1)
            if ready:
                buffered += os.read(stderr, 65536)
            said = [
                json.loads(line)["count"]
                for line in buffered.decode(errors="replace").splitlines()
                if '"event":"log_lines_dropped"' in line
            ]
        assert sum(said) == dropped
        assert _dropped(client.get("/metrics").text) == dropped


def _dropped(exposition: str) -> float:
    [value] = re.findall(r"^guards_log_lines_dropped_total (\S+)$", exposition, re.MULTILINE)
    return float(value)
