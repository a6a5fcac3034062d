"""`python -m guards.serve`: n uvicorn workers, each on a SO_REUSEPORT socket of its own.

Real processes and real TCP: the supervisor is started as a user starts it, and what a worker
did with a connection is read from inside the worker (`tests/e2e/serve_probe.py`).
"""

from __future__ import annotations

import fcntl
import importlib.util
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
from pathlib import Path

import httpx
import pytest

from guards.serve import ServeError, serve

from .served import ROOT, STACKS, ServedApp

PROBE = "tests.e2e.serve_probe:app"
#: Connections opened at once (with two workers, all on one by chance: probability 2 / 2**20).
CLIENTS = 20


def get(sock: socket.socket, path: str) -> tuple[int, dict[str, object]]:
    """One keep-alive request on `sock`; the status and the JSON body."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nhost: test\r\n\r\n".encode())
    return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict[str, object]]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), json.loads(body) if body else {}


class Clients:
    """Client sockets of a test, all closed at its end."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []

    def connect(self, port: int, count: int = 1) -> list[socket.socket]:
        """`count` connections opened at once, before any request (the way a loaded server
        sees a client pool open)."""
        new = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]
        self.sockets += new
        return new


@pytest.fixture
def clients() -> Iterator[Clients]:
    opened = Clients()
    yield opened
    for sock in opened.sockets:
        sock.close()


def closed_by_server(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent before closing `sock` (raises TimeoutError if it stays open)."""
    sock.settimeout(timeout_s)  # a bound, not a wait: recv returns as soon as the server closes
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def wait_for_files(folder: Path, pattern: str, count: int, timeout_s: float = 10.0) -> None:
    """Until the probe app has written `count` files matching `pattern` (bounded poll)."""
    deadline = time.monotonic() + timeout_s
    while len(list(folder.glob(pattern))) < count:
        assert time.monotonic() < deadline, f"fewer than {count} {pattern} in {timeout_s} s"
        time.sleep(0.02)  # polling for the app to have the requests, bounded by the deadline


@pytest.mark.parametrize("stack", STACKS)
def test_every_accepted_connection_has_tcp_nodelay(
    tmp_path: Path, clients: Clients, stack: tuple[str, ...]
) -> None:
    with ServedApp(tmp_path / "log", PROBE, "--workers", "2", *stack) as served:
        served.wait_started(2)
        probes = [get(sock, "/probe") for sock in clients.connect(served.port, CLIENTS)]
    assert [status for status, _ in probes] == [200] * CLIENTS
    assert [body["nodelay"] for _, body in probes] == [True] * CLIENTS


def test_workers_freeze_what_start_up_made_out_of_the_garbage_collector(
    tmp_path: Path, clients: Clients
) -> None:
    """Each worker freezes the objects its start-up made (the app's modules, classes, schemas)
    once the app has started, so a full collection does not walk them again (see README)."""
    with ServedApp(tmp_path / "log", PROBE, "--workers", "2") as served:
        served.wait_started(2)
        probes = [get(sock, "/probe") for sock in clients.connect(served.port, CLIENTS)]
    frozen = {body["pid"]: body["frozen"] for _, body in probes}
    assert len(frozen) == 2
    assert all(isinstance(count, int) and count > 10_000 for count in frozen.values()), frozen


@pytest.mark.parametrize("stack", STACKS)
def test_keep_alive_connections_are_spread_across_workers(
    tmp_path: Path, clients: Clients, stack: tuple[str, ...]
) -> None:
    """The kernel hashes each connection to one worker's socket: of 40 connections opened at
    once, each of two workers serves at least 8 (by chance fewer: probability 4e-5). uvicorn's
    shared socket gave all 40 to one worker in 6 of 8 tries."""
    with ServedApp(tmp_path / "log", PROBE, "--workers", "2", *stack) as served:
        served.wait_started(2)
        sockets = clients.connect(served.port, 40)
        # Three requests per connection: a kept-alive connection stays with its worker.
        pids = [{get(sock, "/probe")[1]["pid"] for _ in range(3)} for sock in sockets]
        workers = served.started_pids()
    assert all(len(per_connection) == 1 for per_connection in pids)
    served_by = [pid for per_connection in pids for pid in per_connection]
    assert sorted(set(served_by)) == sorted(workers)
    assert min(served_by.count(pid) for pid in workers) >= 8, served_by


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_gracefully(
    tmp_path: Path, clients: Clients, sig: signal.Signals, stack: tuple[str, ...]
) -> None:
    """The supervisor forwards the stop: the request in flight is answered, each worker runs
    its lifespan shutdown, the port closes, and the exit status is 0."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    env = {"PROBE_DIR": str(probe_dir)}
    with ServedApp(tmp_path / "log", PROBE, "--workers", "2", *stack, env=env) as served:
        served.wait_started(2)
        [holding] = clients.connect(served.port)
        holding.sendall(b"GET /hold?s=1.5 HTTP/1.1\r\nhost: test\r\n\r\n")
        wait_for_files(probe_dir, "held-*", 1)
        status = served.stop(sig, timeout_s=15)
        answered = read_response(holding)
        log = served.log
    assert status == 0
    assert answered[0] == 200
    # Each worker's last lines are written (by the log writer) before it exits.
    assert sorted(re.findall(r"Finished server process \[(\d+)\]", log)) == sorted(
        map(str, served.started_pids())
    )
    assert sorted(p.name for p in probe_dir.glob("shutdown-*")) == sorted(
        f"shutdown-{pid}" for pid in served.started_pids()
    )
    with pytest.raises(ConnectionRefusedError):
        clients.connect(served.port)


def test_a_killed_worker_is_replaced(tmp_path: Path, clients: Clients) -> None:
    with ServedApp(tmp_path / "log", PROBE, "--workers", "2") as served:
        served.wait_started(2)
        first, second = served.started_pids()
        os.kill(first, signal.SIGKILL)
        served.wait_started(3)  # the replacement has started
        replacement = served.started_pids()[2]
        pids = {get(sock, "/probe")[1]["pid"] for sock in clients.connect(served.port, CLIENTS)}
        assert served.process.poll() is None
        assert f"Worker [{first}] died" in served.log
    assert pids == {second, replacement}


def test_workers_stop_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    with ServedApp(tmp_path / "log", PROBE, "--workers", "2") as served:
        served.wait_started(2)
        served.process.kill()
        served.process.wait(5)
        deadline = time.monotonic() + 10  # each worker checks its parent once a second
        while alive := [pid for pid in served.started_pids() if Path(f"/proc/{pid}").exists()]:
            assert time.monotonic() < deadline, f"workers {alive} outlived their supervisor"
            time.sleep(0.05)  # polling for the workers to exit, bounded by the deadline


def test_a_worker_that_cannot_start_stops_the_server(tmp_path: Path) -> None:
    with ServedApp(tmp_path / "log", "tests.e2e.serve_probe:no_such_app", "--workers", "2") as served:
        assert served.process.wait(30) == 3
    assert "failed to start" in served.log


@pytest.mark.parametrize("stack", STACKS)
def test_a_request_head_must_arrive_within_the_header_timeout(
    tmp_path: Path, clients: Clients, stack: tuple[str, ...]
) -> None:
    """uvicorn alone waits forever for a head; here a partial head gets 408 and a connection
    that sends nothing is closed, both after `--timeout-header`, also on a kept-alive
    connection; a head sent in many small pieces within the timeout is served."""
    timeout_s = 1.0
    with ServedApp(tmp_path / "log", PROBE, "--timeout-header", str(timeout_s), *stack) as served:
        served.wait_started(1)
        start = time.monotonic()
        partial, silent, kept, trickled = clients.connect(served.port, 4)
        partial.sendall(b"GET /probe HTTP/1.1\r\nhost: te")
        assert get(kept, "/probe")[0] == 200
        kept.sendall(b"GET /probe HTTP/1.1\r\n")
        trickled.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in b"GET /probe HTTP/1.1\r\nhost: test\r\n\r\n":
            trickled.send(bytes([byte]))
        assert read_response(trickled)[0] == 200
        answers = [closed_by_server(sock, timeout_s + 5) for sock in (partial, silent, kept)]
        elapsed = time.monotonic() - start
    assert answers[0].startswith(b"HTTP/1.1 408 ")
    assert answers[1] == b""
    assert answers[2].startswith(b"HTTP/1.1 408 ")
    assert timeout_s <= elapsed < timeout_s + 5


@pytest.mark.parametrize("stack", STACKS)
def test_past_the_limit_requests_get_503_and_waiting_connections_make_room(
    tmp_path: Path, clients: Clients, stack: tuple[str, ...]
) -> None:
    """`--limit-concurrency 4`: idle connections never keep a request out (the longest
    waiting is closed to make room), while requests in flight at the limit get 503."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    env = {"PROBE_DIR": str(probe_dir)}
    with ServedApp(tmp_path / "log", PROBE, "--limit-concurrency", "4", *stack, env=env) as served:
        served.wait_started(1)
        idle = clients.connect(served.port, 10)
        [ready] = clients.connect(served.port)
        assert get(ready, "/probe")[0] == 200
        # The open connections stay below 4: the oldest waiting ones were closed, silently.
        assert [closed_by_server(sock, 5) for sock in idle[:-2]] == [b""] * 8

        holders = clients.connect(served.port, 3)
        for sock in holders:
            sock.sendall(b"GET /hold?s=2 HTTP/1.1\r\nhost: test\r\n\r\n")
        wait_for_files(probe_dir, "held-*", 3)
        refused = httpx.get(f"{served.url}/probe", timeout=5)
        held = [read_response(sock)[0] for sock in holders]
    assert refused.status_code == 503
    assert held == [200, 200, 200]


def test_an_explicit_limit_the_open_file_limit_cannot_hold_is_refused(tmp_path: Path) -> None:
    with ServedApp(tmp_path / "log", PROBE, "--limit-concurrency", "2000", open_files=1024) as served:
        assert served.process.wait(30) == 2
    assert "needs an open file limit of 2384" in served.log


@pytest.mark.parametrize(
    ("args", "loop", "protocol"),
    [
        pytest.param((), "uvloop", "BoundedHttpToolsProtocol", id="auto", marks=STACKS[1].marks),
        (("--loop", "asyncio", "--http", "h11"), "asyncio.unix_events", "BoundedH11Protocol"),
        pytest.param(
            ("--loop", "uvloop", "--http", "h11"), "uvloop", "BoundedH11Protocol", marks=STACKS[1].marks
        ),
    ],
)
def test_the_stack_is_chosen_and_named_at_start_up(
    tmp_path: Path, clients: Clients, args: tuple[str, ...], loop: str, protocol: str
) -> None:
    """By default uvloop and httptools, as uvicorn chooses when they are installed (the extra
    [serve] installs them); `--loop` and `--http` force either. The start-up line names the
    stack, and the worker runs it: its event loop's class, its connections' protocol."""
    with ServedApp(tmp_path / "log", PROBE, *args) as served:
        served.wait_started(1)
        [sock] = clients.connect(served.port)
        status, body = get(sock, "/probe")
        log = served.log
    assert status == 200
    assert body["loop"] == loop
    assert body["protocols"] == [protocol]
    http = "httptools" if protocol == "BoundedHttpToolsProtocol" else "h11"
    assert f"1 worker(s), {loop.partition('.')[0]} + {http}, limit_concurrency" in log


@pytest.mark.parametrize(("option", "module"), [("loop", "uvloop"), ("http", "httptools")])
def test_a_stack_that_is_not_installed_is_refused(
    monkeypatch: pytest.MonkeyPatch, option: str, module: str
) -> None:
    """Forced but missing: refused before anything starts, naming what to install."""
    monkeypatch.setitem(sys.modules, module, None)  # importing it fails, as where it is missing
    expected = rf"^--{option} {module} needs {module}: pip install 'route-guards\[serve\]'$"
    with pytest.raises(ServeError, match=expected):
        serve("tests.e2e.serve_probe:app", **{option: module})


@pytest.mark.skipif(importlib.util.find_spec("httptools") is None, reason="httptools is not installed")
def test_auto_falls_back_to_what_uvicorn_always_has(tmp_path: Path, clients: Clients) -> None:
    """Where uvloop is missing (a module of that name that fails to import, first on the path
    of the supervisor and its workers), "auto" serves on asyncio's loop, still with httptools."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "uvloop.py").write_text("raise ImportError('not installed here')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    with ServedApp(tmp_path / "log", PROBE, env=env) as served:
        served.wait_started(1)
        [sock] = clients.connect(served.port)
        status, body = get(sock, "/probe")
        log = served.log
    assert status == 200
    assert body["loop"] == "asyncio.unix_events"
    assert "1 worker(s), asyncio + httptools, limit_concurrency" in log


#: The pipe the tests below give a server for its stdout and stderr: one page, so that a few
#: dozen lines fill it.
PIPE_BYTES = 4096
#: uvicorn's access line of a request to `/health` that was answered.
ACCESS_LINE = '"GET /health HTTP/1.1" 200'


class PipedServer:
    """`python -m guards.serve` whose stdout and stderr are one pipe of `PIPE_BYTES` that the
    test reads only when it says so: a log shipper that stopped reading."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        read_end, write_end = os.pipe()
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        command = [sys.executable, "-m", "guards.serve", PROBE, "--port", "0", *args]
        self.process = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=write_end, stderr=write_end
        )
        os.close(write_end)
        self.pipe = read_end
        self.log = ""

    def read_until(self, done: Callable[[str], bool], timeout_s: float = 30.0) -> str:
        """Read the pipe until `done(what was read so far)` (bounded)."""
        deadline = time.monotonic() + timeout_s
        while not done(self.log):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"not found in {timeout_s} s:\n{self.log}"
            ready, _, _ = select.select([self.pipe], [], [], remaining)
            if ready:
                chunk = os.read(self.pipe, 65536)
                assert chunk, f"the server closed its log:\n{self.log}"
                self.log += chunk.decode(errors="replace")
        return self.log

    def started(self, workers: int) -> tuple[int, list[int]]:
        """Read until `workers` workers have started: the port, the workers' process ids."""
        log = self.read_until(lambda log: log.count("Application startup complete.") >= workers)
        found = re.search(r"guards\.serve: http://127\.0\.0\.1:(\d+)", log)
        assert found is not None
        port = int(found.group(1))
        deadline = time.monotonic() + 10  # a worker listens just after its start-up line
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "no worker listens"
                time.sleep(0.01)  # polling for the listening socket, bounded by the deadline
        return port, [int(pid) for pid in re.findall(r"Started server process \[(\d+)\]", log)]

    def __enter__(self) -> PipedServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.close(self.pipe)  # a write blocked on it fails: a stuck server can stop
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


@pytest.mark.parametrize("stack", STACKS)
def test_a_log_pipe_nobody_reads_holds_up_no_request_and_no_stop(stack: tuple[str, ...]) -> None:
    """stdout and stderr a full pipe: uvicorn's access lines, the warning of a malformed request,
    asyncio's error lines (a task nobody awaited) and the lines of the stop are dropped, never
    waited for. Every request is answered, and
    SIGTERM stops the server, its workers included, at once (it froze a worker at its 60th
    access line or so, and SIGTERM took 36 s and ended in a kill)."""
    requests = 300  # about 60 access lines fill the pipe
    with PipedServer("--workers", "2", *stack) as served:
        port, workers = served.started(2)
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        try:
            statuses = [get(sock, "/health")[0] for _ in range(requests // 4) for sock in sockets]
            with socket.create_connection(("127.0.0.1", port), timeout=5) as malformed:
                malformed.sendall(b"GET /health HTTP/1.1\r\nhost test\r\n\r\n")
                refused = closed_by_server(malformed, 5)
            # About 450 bytes each: together more than the pipe holds, even empty.
            orphans = [get(sock, "/orphan")[0] for _ in range(5) for sock in sockets]
            after = [get(sock, "/health")[0] for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        start = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        status = served.process.wait(15)
        stopped_s = time.monotonic() - start
    assert statuses == [200] * requests
    assert refused.startswith(b"HTTP/1.1 400 ")
    assert orphans == [200] * 20
    assert after == [200] * 4
    assert status == 0
    assert stopped_s < 10, stopped_s  # (36 s, and a kill, when a worker froze)
    assert [pid for pid in workers if Path(f"/proc/{pid}").exists()] == []


def test_lines_a_full_log_pipe_cannot_take_are_dropped_and_counted() -> None:
    """Each worker's writer holds at most `GUARDS_LOG_BUFFER_LINES` lines, uvicorn's and
    guards' alike; past them, lines are dropped and counted. Once the pipe is read again, the
    writer writes what it held and says how many it dropped: with the access lines written,
    exactly one per request."""
    requests = 200
    with PipedServer(env={"GUARDS_LOG_BUFFER_LINES": "20"}) as served:
        port, _ = served.started(1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            statuses = [get(sock, "/health")[0] for _ in range(requests)]

        def accounted(log: str) -> bool:
            return log.count(ACCESS_LINE) + sum(_said_dropped(log)) >= requests

        log = served.read_until(accounted, timeout_s=10)
    assert statuses == [200] * requests
    assert sum(_said_dropped(log)) > 0
    assert log.count(ACCESS_LINE) + sum(_said_dropped(log)) == requests


def _said_dropped(log: str) -> list[int]:
    """The counts of the `log_lines_dropped` lines in `log`."""
    return [json.loads(line)["count"] for line in log.splitlines() if '"event":"log_lines_dropped"' in line]


@pytest.mark.skipif(importlib.util.find_spec("httptools") is None, reason="httptools is not installed")
def test_a_line_longer_than_the_cap_is_cut_in_its_middle(tmp_path: Path, clients: Clients) -> None:
    """A line of uvicorn's waits in the writer's queue at most 16,384 characters long (the
    middle cut): a traceback whose exception quotes a 20,000-character path keeps its head
    and the end of its message, and so does the request's access line. (httptools takes a
    request line that long; h11 answers 400.)"""
    words = "a" * 20_000 + "the-end"
    with ServedApp(tmp_path / "log", PROBE, "--http", "httptools") as served:
        served.wait_started(1)
        [sock] = clients.connect(served.port)
        sock.sendall(f"GET /raise/{words} HTTP/1.1\r\nhost: test\r\n\r\n".encode())
        answer = closed_by_server(sock, 5)
        served.stop()
        log = served.log
    assert answer.startswith(b"HTTP/1.1 500 ")
    assert "Exception in ASGI application\nTraceback" in log
    assert log.count("characters cut ...]") == 2  # the traceback, the access line
    assert log.count("the-end") == 2
    assert len(log) < 2 * 16_384 + 2_000  # the two lines, and the start and stop
