"""The example app under the servers users deploy it on: `uvicorn app.main:app`, `hypercorn
app.main:app` and `granian --interface asgi app.main:app`, each in a process of its own on a
free loopback port, with the fake Workers AI as its provider.

Through each: the Quick start's requests, a stream its client leaves after the first event
(the server's log stays free of tracebacks and error lines), and a 3 MiB body (refused; how
much of it the server read before answering is measured and printed).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fixtures import FakeWorkersAI, Reply, Stream, Text

from ..conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
#: Settings of the example app: none of the test machine's own may leak into a server run here.
_SETTINGS = re.compile(
    r"^(AI_|CLOUDFLARE_|OPENAI_|GUARDS_|CORS_|DAILY_|RATE_|BREAKER_|RETRY_|PROMETHEUS_|OTEL_|STATUS_|GRANIAN_|FORWARDED_)"
)
#: The commands, as the docs write them, on `port`.
SERVERS: dict[str, Callable[[int], list[str]]] = {
    "uvicorn": lambda port: ["uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port)],
    "hypercorn": lambda port: ["hypercorn", "app.main:app", "--bind", f"127.0.0.1:{port}"],
    "granian": lambda port: [
        *("granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port)),
        "app.main:app",
    ],
}
#: Lines no server may write: a traceback, an error or a warning (uvicorn's, hypercorn's and
#: granian's forms, and asyncio's complaint about writes to a closed socket).
TROUBLE = re.compile(
    r"Traceback|Exception in ASGI|socket\.send\(\) raised|^(ERROR|WARNING):|\[(ERROR|WARNING|WARN)\]", re.M
)
BIG_BODY = 3 << 20
#: The stream of the Quick start: 200 events, 5 ms apart.
STREAM = Stream(parts=[Text("word ")] * 200, interval_s=0.005)
#: A stream to leave: 5,000 events as fast as the fake sends them, so that the app has the
#: next ones in hand when its client leaves (a server must tell it the client is gone).
LEFT_MESSAGE = "I will not read the whole answer"
FAST_STREAM = Stream(parts=[Text("word ")] * 5000)
SUMMARY = Reply({"label": "billing", "confidence": 0.9})
DRAFT = Reply("Thank you for your message: we are looking into it.")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def choose(model: str, inputs: Any) -> Stream | Reply:
    """The fake's answer: a label in JSON mode, a stream to a streaming call, else a draft."""
    if isinstance(inputs, dict) and inputs.get("stream"):
        return FAST_STREAM if LEFT_MESSAGE in json.dumps(inputs) else STREAM
    if isinstance(inputs, dict) and "response_format" in inputs:
        return SUMMARY
    return DRAFT


@dataclass
class Served:
    name: str
    url: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]
    #: Where this test's part of the log begins (the server serves every test of its module).
    log_start: int = 0

    @property
    def log(self) -> str:
        """What the server wrote since this test began."""
        with self.log_path.open("rb") as log:
            log.seek(self.log_start)
            return log.read().decode(errors="replace")


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The example app under one server, with the fake Workers AI, started once for the
    module's tests (pytest runs them server by server); stopped (SIGTERM) after."""
    name: str = request.param
    fake = FakeWorkersAI(default=choose)
    with fake:
        port = free_port()
        environ = {k: v for k, v in os.environ.items() if not _SETTINGS.match(k)}
        environ.update(
            AI_PROVIDER="workers-ai",
            CLOUDFLARE_ACCOUNT_ID=fake.account_id,
            CLOUDFLARE_API_TOKEN=fake.api_token,
            CLOUDFLARE_API_BASE=fake.base_url,
        )
        command, *args = SERVERS[name](port)
        log_path = tmp_path_factory.mktemp("servers") / f"{name}.log"
        with log_path.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", command, *args], cwd=ROOT, env=environ, stdout=out, stderr=out
            )
        server = Served(name, f"http://127.0.0.1:{port}", port, log_path, process)
        try:
            wait_until(lambda: healthy(server.url) or process.poll() is not None, timeout_s=30)
            assert process.poll() is None, f"{name} did not start:\n{server.log}"
            yield server
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


@pytest.fixture
def served(server: Served) -> Served:
    """`server` for one test: its log from here on, with no line of an earlier test. The app
    writes its lines behind, in order: the fixture's own request, and its line awaited, come
    after every earlier one. (The app's own state, budgets and idempotency keys, stays: no two
    tests share a key.)"""
    assert server.process.poll() is None, f"{server.name} exited:\n{server.log}"
    server.log_start = 0
    answer = httpx.post(server.url + "/draft-reply", json={"message": "Where is my parcel?"}, timeout=10)
    assert answer.status_code == 200
    marker = f'"trace_id":"{answer.headers["x-trace-id"]}"'.encode()

    def marker_written() -> bool:
        log = server.log_path.read_bytes()
        at = log.find(marker)
        if at >= 0 and (end := log.find(b"\n", at)) >= 0:
            server.log_start = end + 1
            return True
        return False

    wait_until(marker_written, timeout_s=10)
    return server


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def request_lines(log: str) -> list[dict[str, Any]]:
    return [
        line
        for line in (json.loads(text) for text in log.splitlines() if text.startswith('{"event":'))
        if line["event"] == "request"
    ]


def test_the_quick_start_answers_as_the_docs_say(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=10) as client:
        assert client.get("/health").json() == {"ok": True, "level": "full", "down": []}
        draft = client.post("/draft-reply", json={"message": "Where is my parcel?"})
        assert draft.status_code == 200
        assert draft.json()["reply"] == DRAFT.response
        summary = client.post(
            "/summary", json={"text": "I was charged twice, please refund me"}, headers={"x-user-id": "ada"}
        )
        assert summary.json() == {"ok": True, "data": SUMMARY.response, "fallback": None}
        empty = client.post("/draft-reply", json={"message": ""})
        assert empty.status_code == 400
        assert empty.json()["error"] == "invalid_request"
        with client.stream("POST", "/draft-reply/stream", json={"message": "Where is my parcel?"}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = [line for line in stream.iter_lines() if line.startswith("event: ")]
        assert events == ["event: delta"] * 200 + ["event: done"]
        headers = {"x-user-id": "ada", "Idempotency-Key": "6f1c2a"}
        first = client.post("/report", json={"text": "I was charged twice"}, headers=headers)
        again = client.post("/report", json={"text": "I was charged twice"}, headers=headers)
        assert first.status_code == again.status_code == 200
        assert again.json() == first.json()
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert "guards_requests_total" in metrics.text
    assert not TROUBLE.search(served.log), served.log


def test_a_client_that_leaves_a_stream_after_its_first_event_leaves_a_clean_log(served: Served) -> None:
    body = json.dumps({"message": LEFT_MESSAGE}).encode()
    head = (
        "POST /draft-reply/stream HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            sock.sendall(head.encode() + body)
            received = b""
            while b"\n\n" not in received.partition(b"event: delta")[2]:  # the first event, whole
                chunk = sock.recv(65536)
                assert chunk, received
                received += chunk
    # Each request is logged once its stream ended: left by its client, not completed. (The
    # Quick start ran before on this server: none of its lines, written behind, is counted.)
    wait_until(lambda: len(request_lines(served.log)) == 3, timeout_s=10)
    assert [line["outcome"] for line in request_lines(served.log)] == ["cancelled"] * 3
    # What a server logs once a stream's request has ended (a traceback, an error) comes
    # before its next request's line: one more request, and its line, close the stream's log.
    with httpx.Client(base_url=served.url, timeout=10) as client:
        assert client.post("/draft-reply", json={"message": "Where is my parcel?"}).status_code == 200
    wait_until(lambda: len(request_lines(served.log)) == 4, timeout_s=10)
    assert not TROUBLE.search(served.log), served.log


@dataclass
class Upload:
    #: Body bytes sent before the answer came, and in all (until the server closed the
    #: connection or stopped reading for a second).
    before: int
    total: int
    answer: bytes
    #: Whether the server closed the connection within a second of the last write.
    closed: bool


def upload(port: int, path: str, size: int, timeout_s: float = 10.0) -> Upload:
    """POST `size` bytes of body to `path` in 16 KiB writes, reading the answer as soon as it
    arrives and sending on until the server closes the connection or stops reading. A 64 KiB
    send buffer keeps what the kernel holds for the server small; the counts include what the
    server's own receive buffer took."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        sock.settimeout(timeout_s)
        sock.connect(("127.0.0.1", port))
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            f"content-length: {size}\r\n\r\n".encode()
        )
        sent, before, answer = 0, None, b""
        chunk = b"x" * (16 << 10)
        deadline = time.monotonic() + timeout_s
        while sent < size and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable and before is None:
                before = sent
                with contextlib.suppress(ConnectionResetError):
                    answer = sock.recv(4096)
                if not answer:
                    break  # closed
            elif writable:
                try:
                    sent += sock.send(chunk[: size - sent])
                except (BrokenPipeError, ConnectionResetError):
                    break
            elif not readable:
                break  # the server stopped reading
        if before is None:
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                answer = sock.recv(4096)
        sock.settimeout(1.0)
        closed = False
        with contextlib.suppress(TimeoutError):
            while True:
                try:
                    if not sock.recv(65536):
                        closed = True
                        break
                except ConnectionResetError:
                    closed = True
                    break
        return Upload(sent if before is None else before, sent, answer, closed)


def test_a_body_over_the_limit_is_refused(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    sent = upload(served.port, "/draft-reply", BIG_BODY)
    answer = sent.answer
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
    assert status in (400, 413), answer[:200]
    with capsys.disabled():
        print(
            f"\n{served.name}: {status} after {sent.before} of {BIG_BODY} bytes of body, "
            f"{sent.total} sent in all, connection {'closed' if sent.closed else 'open'}"
        )
    assert not TROUBLE.search(served.log), served.log
