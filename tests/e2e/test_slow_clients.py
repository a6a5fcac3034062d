"""Slow clients cannot exhaust the example app served as `make run` serves it.

The issue's attack: 1,017 half-sent requests under a 1,024 open file limit made `/health` time
out under plain uvicorn, and asyncio then logged "Too many open files" tracebacks by the
hundred megabytes. Here 1,000 connections each send part of a request head and stop, against
`python -m guards.serve app.main:app` with its defaults under the same 1,024 limit.
"""

from __future__ import annotations

import re
import resource
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .served import ServedApp

SLOW_CLIENTS = 1_000
OPEN_FILES = 1_024
#: guards.serve's defaults: 10 s header timeout; limit_concurrency lowered from 1,000 to fit
#: the file limit: 1,024 - backlog 128 - 256 reserved for the app.
TIMEOUT_HEADER_S = 10.0
LIMIT = OPEN_FILES - 128 - 256
#: Bounds of the test.
HEALTH_CHECKS = 20
HEALTH_WITHIN_S = 1.0  # each /health answer, while the slow clients hold on
CLOSED_WITHIN_S = TIMEOUT_HEADER_S + 5  # every slow connection closed by the server, after the flood
LOG_AT_MOST_BYTES = 32_000  # the server's whole log, start to stop


@pytest.fixture
def many_files() -> Iterator[None]:
    """This process needs a descriptor per slow client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = SLOW_CLIENTS + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.fail(f"the test needs an open file limit of {need}, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def half_sent_request(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /summary HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n")
    return sock


def wait_closed(sockets: list[socket.socket], timeout_s: float) -> dict[socket.socket, bytes]:
    """What the server sent on each socket before it closed it; the sockets still open when
    `timeout_s` runs out are left out."""
    received: dict[socket.socket, bytes] = {sock: b"" for sock in sockets}
    closed: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while received and (remaining := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(remaining):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data:
                    received[sock] += data
                else:
                    closed[sock] = received.pop(sock)
                    selector.unregister(sock)
    return closed


def open_files(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


@pytest.mark.stress
def test_a_thousand_slow_clients_cannot_exhaust_the_example_app(tmp_path: Path, many_files: None) -> None:
    env = {"AI_PROVIDER": "fake", "GUARDS_STORE": "memory://"}
    slow: list[socket.socket] = []
    with ServedApp(tmp_path / "log", "app.main:app", env=env, open_files=OPEN_FILES) as served:
        served.wait_started(1)
        assert f"limit_concurrency {LIMIT}," in served.log
        [worker] = served.started_pids()
        try:
            slow = [half_sent_request(served.port) for _ in range(SLOW_CLIENTS)]
            flooded = time.monotonic()

            latencies = []
            for _ in range(HEALTH_CHECKS):
                start = time.monotonic()
                response = httpx.get(f"{served.url}/health", timeout=5)
                latencies.append(time.monotonic() - start)
                assert response.status_code == 200
            assert max(latencies) < HEALTH_WITHIN_S, latencies
            # The worker held no more connections than its limit while the flood went on.
            held_files = open_files(worker)
            assert held_files < LIMIT + 64

            closed = wait_closed(slow, CLOSED_WITHIN_S - (time.monotonic() - flooded))
            assert len(closed) == SLOW_CLIENTS
            evicted = [data for data in closed.values() if data == b""]
            timed_out = [data for data in closed.values() if data.startswith(b"HTTP/1.1 408 ")]
            assert len(evicted) + len(timed_out) == SLOW_CLIENTS
            assert len(evicted) >= SLOW_CLIENTS - LIMIT

            assert httpx.get(f"{served.url}/health", timeout=5).status_code == 200
            deadline = time.monotonic() + 15
            while "Closed " not in served.log:
                assert time.monotonic() < deadline, "no report of the closed connections"
                time.sleep(0.1)  # polling the log for the worker's report, bounded
        finally:
            for sock in slow:
                sock.close()
        assert served.stop() == 0
    log = served.log
    # One line per 10 s at most, counting what happened (the last period may end unreported).
    reports = re.findall(r"Closed (\d+) connection\(s\) .* and (\d+) waiting", log)
    assert reports
    assert sum(int(t) for t, _ in reports) <= len(timed_out)
    assert sum(int(e) for _, e in reports) <= len(evicted)
    assert "Too many open files" not in log
    assert "Traceback" not in log
    assert len(log.encode()) < LOG_AT_MOST_BYTES
    print(
        f"\nslow clients: {SLOW_CLIENTS}, limit {LIMIT}: /health max {max(latencies) * 1000:.0f} ms, "
        f"worker's open files {held_files}, "
        f"{len(evicted)} evicted, {len(timed_out)} timed out (408), log {len(log.encode())} bytes"
    )
