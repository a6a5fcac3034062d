"""The example app under `python -m guards.serve`, as an operator runs it: what a stopping
server does to the streams it relays (under plain uvicorn too), and what clients can put into
its log.

Real processes and real HTTP: the app is served by the supervisor (or by `python -m uvicorn`)
with the fake Workers AI as its provider.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from fixtures import FakeWorkersAI, Hang, Reply, Stream, Text
from guards.stores import open_store

from ..app.test_ui_stream import check_ui_stream
from ..conftest import wait_until
from .served import STACKS, ServedApp

#: Streams in flight when the server is told to stop.
STREAMS = 20
#: `tests/e2e/serve_spend.py`'s price of a call, and the spend key of its caller `ada`.
CALL_PRICE = 1.0
ADA = "guards:stream:ada"
MESSAGE = {"message": "Where is my order?"}
#: The model `app_env` configures.
MODEL_OF_APP = "@cf/meta/llama-3.1-8b-instruct"
#: A control character in a log line (the newline and the tab aside).
CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def app_env(fake: FakeWorkersAI, **extra: str) -> dict[str, str]:
    return {
        "AI_PROVIDER": "workers-ai",
        "CLOUDFLARE_ACCOUNT_ID": fake.account_id,
        "CLOUDFLARE_API_TOKEN": fake.api_token,
        "CLOUDFLARE_API_BASE": fake.base_url,
        "AI_MODEL": MODEL_OF_APP,
        "GUARDS_STORE": "memory://",
        **extra,
    }


def events_of(lines: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The Server-Sent Events of a stream's lines, as (event, data)."""
    found: list[tuple[str, dict[str, Any]]] = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: ") and name is not None:
            found.append((name, json.loads(line.removeprefix("data: "))))
            name = None
    return found


def json_lines(log: str) -> list[dict[str, Any]]:
    lines = []
    for line in log.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def raw_get(port: int, target: str, headers: dict[str, str]) -> bytes:
    """One GET over a socket of its own, header values sent as given (an HTTP client would
    refuse to send control characters); the answer's first bytes."""
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = f"GET {target} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n{head}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode("latin-1"))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("stack", STACKS)
def test_a_stream_cut_by_a_shutdown_ends_with_an_error_event_and_no_traceback(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path, stack: tuple[str, ...]
) -> None:
    """Twenty streams from a slow provider, then SIGTERM with a one-second graceful period:
    past it, every stream ends with one `error` event (`call`/`timeout`, the server stopping),
    each request's spend is settled (a cut stream costs its call: 1 unit, not its 2-unit
    hold), the request log says each was cut by the shutdown (not that its client left), and
    the server writes no traceback; the supervisor exits 0 (no worker had to be killed)."""
    fake_workers_ai.default = Stream(parts=[Text("word ")] * 200, interval_s=0.1)
    started = threading.Barrier(STREAMS + 1, timeout=20)

    def stream(client: httpx.Client) -> list[str]:
        lines: list[str] = []
        ask = {"message": "Where is my order?"}
        with client.stream("POST", "/stream", json=ask, headers={"x-user-id": "ada"}) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(lines) == 2:
                    started.wait()  # the first delta is here: the stream is committed
        return lines

    database = tmp_path / "guards.db"
    env = {
        "FAKE_ACCOUNT_ID": fake_workers_ai.account_id,
        "FAKE_API_TOKEN": fake_workers_ai.api_token,
        "FAKE_BASE_URL": fake_workers_ai.base_url,
        "SPEND_DB": str(database),
    }
    args = ("--timeout-graceful-shutdown", "1", *stack)
    with ServedApp(tmp_path / "log", "tests.e2e.serve_spend:app", *args, env=env) as served:
        served.wait_started(1)
        limits = httpx.Limits(max_connections=STREAMS)
        with (
            httpx.Client(base_url=served.url, timeout=20, limits=limits) as client,
            ThreadPoolExecutor(STREAMS) as pool,
        ):
            futures = [pool.submit(stream, client) for _ in range(STREAMS)]
            started.wait()
            served.process.send_signal(signal.SIGTERM)
            streams = [events_of(future.result(timeout=30)) for future in futures]
        assert served.process.wait(30) == 0
        log = served.log
    for events in streams:
        names = [name for name, _ in events]
        assert names[:-1] == ["delta"] * (len(names) - 1)
        assert names[-1] == "error", names[-3:]
        data = events[-1][1]
        assert (data["guard"], data["reason"]) == ("call", "timeout")
        assert "server is stopping" in data["detail"]
    requests = [line for line in json_lines(log) if line.get("event") == "request"]
    assert len(requests) == STREAMS
    for line in requests:
        assert (line["outcome"], line["reason"], line["cut"]) == ("error", "timeout", "shutdown")
    assert "Traceback" not in log
    assert "Exception in ASGI application" not in log
    assert "CancelledError" not in log

    async def spent() -> float:
        store = open_store(f"sqlite:///{database}")
        try:
            return await store.spent(ADA)
        finally:
            await store.aclose()

    assert anyio.run(spent) == STREAMS * CALL_PRICE


#: Streams of each format in flight when plain uvicorn is told to stop.
UVICORN_STREAMS = 5


@pytest.mark.parametrize("stack", STACKS)
def test_a_stream_cut_by_plain_uvicorns_shutdown_ends_with_an_error_event(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path, stack: tuple[str, ...]
) -> None:
    """Plain `uvicorn --timeout-graceful-shutdown 1` (no `guards.serve` to end the streams):
    past the grace period uvicorn cancels the requests still in flight. A relayed stream whose
    client is still reading ends as under `guards.serve`: guards' events with one `error`
    event (`call`/`timeout`, the server stopping), the UI message stream with its `error`
    chunk and `[DONE]`, each response complete; the spend is settled (1 unit a stream) and
    each request's log line says it was cut by the shutdown."""
    fake_workers_ai.default = Stream(parts=[Text("word ")] * 200, interval_s=0.1)
    started = threading.Barrier(2 * UVICORN_STREAMS + 1, timeout=20)

    def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
        received = b""
        waiting = True
        try:
            with client.stream("POST", path, json=body, headers={"x-user-id": "ada"}) as answer:
                assert answer.status_code == 200, answer.read()
                for chunk in answer.iter_raw():
                    received += chunk
                    if waiting and received.count(b"\n\n") >= 3:  # output is here: committed
                        started.wait()
                        waiting = False
        except BaseException:
            if waiting:
                started.abort()  # the others stop waiting: the test fails with this exception
            raise
        return httpx.Response(200, headers=answer.headers, content=received)

    database = tmp_path / "guards.db"
    env = {
        "FAKE_ACCOUNT_ID": fake_workers_ai.account_id,
        "FAKE_API_TOKEN": fake_workers_ai.api_token,
        "FAKE_BASE_URL": fake_workers_ai.base_url,
        "SPEND_DB": str(database),
    }
    chat = {"messages": [{"role": "user", "parts": [{"type": "text", "text": "Where is my order?"}]}]}
    args = ("--timeout-graceful-shutdown", "1", *stack)
    with ServedApp(tmp_path / "log", "tests.e2e.serve_spend:app", *args, env=env, uvicorn=True) as served:
        served.wait_started(1)
        limits = httpx.Limits(max_connections=2 * UVICORN_STREAMS)
        with (
            httpx.Client(base_url=served.url, timeout=20, limits=limits) as client,
            ThreadPoolExecutor(2 * UVICORN_STREAMS) as pool,
        ):
            guards_events = [pool.submit(stream, client, "/stream", MESSAGE) for _ in range(UVICORN_STREAMS)]
            ui_streams = [pool.submit(stream, client, "/chat", chat) for _ in range(UVICORN_STREAMS)]
            with contextlib.suppress(threading.BrokenBarrierError):  # a stream's own error is raised below
                started.wait()
            served.process.send_signal(signal.SIGTERM)
            answers = [future.result(timeout=30) for future in guards_events]
            ui_answers = [future.result(timeout=30) for future in ui_streams]
        # uvicorn raises the signal it caught again once it has shut down.
        assert served.process.wait(30) == -signal.SIGTERM
        log = served.log
    for answer in answers:
        events = events_of(answer.text.splitlines())
        names = [name for name, _ in events]
        assert names[:-1] == ["delta"] * (len(names) - 1)
        assert names[-1] == "error", names[-3:]
        data = events[-1][1]
        assert (data["guard"], data["reason"]) == ("call", "timeout")
        assert "server is stopping" in data["detail"]
    for answer in ui_answers:
        chunks = check_ui_stream(answer)
        assert chunks[-1] == {"type": "error", "errorText": "timeout"}
        guards = chunks[-2]["messageMetadata"]["guards"]
        assert (guards["guard"], guards["reason"]) == ("call", "timeout")
        assert "server is stopping" in guards["detail"]
    requests = [line for line in json_lines(log) if line.get("event") == "request"]
    assert len(requests) == 2 * UVICORN_STREAMS, log
    for line in requests:
        assert (line["outcome"], line["reason"], line["cut"]) == ("error", "timeout", "shutdown")

    async def spent() -> float:
        store = open_store(f"sqlite:///{database}")
        try:
            return await store.spent(ADA)
        finally:
            await store.aclose()

    assert anyio.run(spent) == 2 * UVICORN_STREAMS * CALL_PRICE


@pytest.mark.parametrize("stack", STACKS)
def test_forwarded_headers_are_not_trusted_and_the_log_is_escaped(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path, stack: tuple[str, ...]
) -> None:
    """A client's `X-Forwarded-For` carrying terminal escapes: by default no proxy is trusted,
    so the address logged is the peer's, and no raw control character reaches the log.
    httptools refuses a header with a control character (400) before the app sees it; h11
    lets it through to the app."""
    escape = "\x1b[2J\x1b[31m"
    hostile = {"x-forwarded-for": f"6.6.6.6{escape}", "x-forwarded-proto": f"https{escape}"}
    env = app_env(fake_workers_ai)
    served_hostile = "h11" in stack
    with ServedApp(tmp_path / "log", "app.main:app", *stack, env=env) as served:
        served.wait_started(1)
        answer = raw_get(served.port, "/health", hostile)
        assert answer.startswith(b"HTTP/1.1 200" if served_hostile else b"HTTP/1.1 400")
        assert raw_get(served.port, "/health", {"x-forwarded-for": "6.6.6.6"}).startswith(b"HTTP/1.1 200")
        # The path and query are the client's too.
        raw_get(served.port, f"/nowhere%1b[2J?q=%1b[2J{escape}", hostile)
        assert served.stop() == 0
        log = served.log
    assert "6.6.6.6" not in log
    logged = re.findall(r'127\.0\.0\.1:\d+ - "GET /health HTTP/1\.1" 200', log)
    assert len(logged) == (2 if served_hostile else 1)
    assert not re.search(CONTROLS, log), repr(log[-400:])


@pytest.mark.parametrize("stack", STACKS)
def test_forwarded_headers_of_a_trusted_proxy_name_the_client(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path, stack: tuple[str, ...]
) -> None:
    """`--forwarded-allow-ips 127.0.0.1`: the proxy on loopback is trusted, so the client it
    names is the one logged, its escapes still escaped."""
    env = app_env(fake_workers_ai)
    args = ("--forwarded-allow-ips", "127.0.0.1", *stack)
    with ServedApp(tmp_path / "log", "app.main:app", *args, env=env) as served:
        served.wait_started(1)
        assert raw_get(served.port, "/health", {"x-forwarded-for": "6.6.6.6"}).startswith(b"HTTP/1.1 200")
        raw_get(served.port, "/health", {"x-forwarded-for": "7.7.7.7\x1b[2J"})
        assert served.stop() == 0
        log = served.log
    assert '6.6.6.6:0 - "GET /health HTTP/1.1" 200' in log
    assert not re.search(CONTROLS, log), repr(log[-400:])


@pytest.mark.parametrize("stack", STACKS)
def test_a_traceback_quoting_a_client_is_escaped(tmp_path: Path, stack: tuple[str, ...]) -> None:
    """An app that crashes with a client's path (percent-decoded: terminal escapes) in its
    exception: uvicorn logs the traceback, its last line escaped."""
    with ServedApp(tmp_path / "log", "tests.e2e.serve_probe:app", *stack) as served:
        served.wait_started(1)
        answer = raw_get(served.port, "/raise/hello%1b%5b2J%1b%5b31m", {})
        assert answer.startswith(b"HTTP/1.1 500")
        assert served.stop() == 0
        log = served.log
    assert "Exception in ASGI application" in log
    assert "RuntimeError: the client said hello\\x1b[2J\\x1b[31m" in log
    assert not re.search(CONTROLS, log), repr(log[-400:])


@pytest.mark.parametrize("stack", STACKS)
def test_the_redis_store_answers_on_each_stack(
    fake_workers_ai: FakeWorkersAI, redis_url: str, tmp_path: Path, stack: tuple[str, ...]
) -> None:
    """The example app on Redis, served on asyncio and on uvloop (whose transports are not
    asyncio's classes): its store steps answer, and the model's answers are served."""
    env = app_env(fake_workers_ai, GUARDS_STORE=redis_url)
    with ServedApp(tmp_path / "log", "app.main:app", *stack, env=env) as served:
        served.wait_started(1)
        with httpx.Client(base_url=served.url, timeout=20) as client:
            for _ in range(3):
                answer = client.post("/draft-reply", json=MESSAGE, headers={"x-user-id": "ada"})
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-ai-model"] == env["AI_MODEL"]
        assert served.stop() == 0
        log = served.log
    assert "store_unavailable" not in log
    assert len([line for line in json_lines(log) if line.get("event") == "request"]) == 3


def post_then_leave(port: int, path: str, body: dict[str, Any], after_s: float) -> bytes:
    """A POST over a socket of its own, closed `after_s` after it was sent unless the answer's
    first bytes came first (returned)."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"x-user-id: ada\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=after_s) as sock:
        sock.sendall(head.encode() + payload)
        with contextlib.suppress(TimeoutError):
            return sock.recv(65536)
    return b""


@pytest.mark.parametrize("stack", STACKS)
def test_a_client_that_leaves_a_long_call_cancels_it_at_once(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path, stack: tuple[str, ...]
) -> None:
    """guards.serve tells a walk that its client left by a callback from the connection (no
    task per call watching `receive`): a client that leaves a call its model hangs on, past
    the deadline's mark, ends it at once (the provider's connection closed, the request line
    `cancelled`), long before its 30 s deadline; on a kept-alive connection, a slow call's
    answer and the next request's are served whole."""
    fake_workers_ai.script(MODEL_OF_APP, Hang())
    env = app_env(fake_workers_ai, AI_TIMEOUT_S="30")
    with ServedApp(tmp_path / "log", "app.main:app", *stack, env=env) as served:
        served.wait_started(1)
        assert post_then_leave(served.port, "/draft-reply", MESSAGE, after_s=0.5) == b""
        assert fake_workers_ai.wait_for(lambda calls: calls[0].disconnected, timeout=5)
        wait_until(lambda: "request" in [line.get("event") for line in json_lines(served.log)], 5)
        fake_workers_ai.reset()
        fake_workers_ai.default = Reply("A slow answer.", delay_s=0.3)  # past the mark
        with httpx.Client(base_url=served.url, timeout=20) as client:
            for _ in range(2):
                answer = client.post("/draft-reply", json=MESSAGE, headers={"x-user-id": "ada"})
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-ai-model"] == MODEL_OF_APP
        assert served.stop() == 0
        log = served.log
    left, *served_lines = [line for line in json_lines(log) if line.get("event") == "request"]
    assert (left["outcome"], left["kind"]) == ("cancelled", "cancelled")
    assert left["latency_ms"] < 5_000
    assert [line["outcome"] for line in served_lines] == ["ok", "ok"]
    assert "Traceback" not in log
