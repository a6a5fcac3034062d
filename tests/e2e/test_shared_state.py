"""Shared state across workers and machines: exact budgets and breakers with SQLite and Redis.

Real servers only: uvicorn worker processes, SQLite files, a Redis server started by the tests,
and the fake Workers AI server counting the calls that reach the provider.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY

from app.service import create_app
from fixtures import Fail, FakeBinding, FakeWorkersAI, ManualClock, Reply
from fixtures.redis_server import RedisServer, free_port
from guards import AI, Breaker, Budget, Guards, Price, Retry, header_key
from guards.stores import RedisStore, Store

from ..conftest import Serve, asgi_client, no_sleep, workers_ai_settings

# Bursts of 200 requests across processes, counted exactly. On a machine another test loads,
# a store round trip can outlast its bound (Redis: 100 ms; the worker's own busy event loop
# counts) and the budget, failing closed, answers `circuit_open`: not what these tests check.
pytestmark = pytest.mark.serial

MODEL = "@cf/test/model"
SUMMARY = Reply({"label": "billing", "confidence": 0.9}, delay_s=0.02)


def app_process_env(fake: FakeWorkersAI, store_url: str, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "AI_PROVIDER": "workers-ai",
        "CLOUDFLARE_ACCOUNT_ID": fake.account_id,
        "CLOUDFLARE_API_TOKEN": fake.api_token,
        "CLOUDFLARE_API_BASE": fake.base_url,
        "AI_MODEL": MODEL,
        "GUARDS_STORE": store_url,
        "DAILY_CALL_LIMIT": "20",
        "RATE_LIMIT_PER_MINUTE": "100000",
    }
    env.update(extra)
    return env


class AppProcess:
    """`uvicorn app.main:app` (or `app`) in a process of its own (with `workers` worker
    processes)."""

    def __init__(
        self,
        env: dict[str, str],
        workers: int = 1,
        stdout: IO[bytes] | None = None,
        app: str = "app.main:app",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--workers", str(workers), "--log-level", "warning"]
        # stdout carries the app's JSON log lines: dropped unless the test wants them.
        out = subprocess.DEVNULL if stdout is None else stdout
        self.process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.PIPE)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"app exited: {self.process.stderr.read().decode() if self.process.stderr else ''}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)  # bounded polling until the port answers
        raise RuntimeError("app did not become ready")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        if self.process.stderr is not None:
            self.process.stderr.close()


async def burst(urls: list[str], count: int, user: str = "same-user") -> list[httpx.Response]:
    """`count` concurrent POST /summary from one user, spread over `urls`."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post(
                    f"{urls[i % len(urls)]}/summary", json={"text": "refund"}, headers={"x-user-id": user}
                )
                for i in range(count)
            )
        )


def assert_exact_daily_cap(responses: list[httpx.Response], fake: FakeWorkersAI, cap: int) -> None:
    assert all(r.status_code == 200 for r in responses)
    bodies = [r.json() for r in responses]
    answered = [b for b in bodies if b["fallback"] is None]
    refused = [b for b in bodies if b["fallback"] is not None]
    assert len(fake.calls) == cap
    assert len(answered) == cap
    assert {b["fallback"]["reason"] for b in refused} == {"budget_exceeded"}


def test_sqlite_daily_cap_is_exact_across_four_uvicorn_workers(
    tmp_path: Path, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = SUMMARY
    app = AppProcess(app_process_env(fake_workers_ai, f"sqlite:///{tmp_path}/guards.db"), workers=4)
    try:
        app.wait_ready()
        responses = asyncio.run(burst([app.url], 200))
    finally:
        app.stop()
    assert_exact_daily_cap(responses, fake_workers_ai, 20)


def test_redis_daily_cap_is_exact_across_two_app_processes(
    redis_url: str, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = SUMMARY
    # A database of its own, so no other test's keys meet these.
    url = redis_url.rsplit("/", 1)[0] + "/3"
    asyncio.run(_flush(url))
    responses = burst_across_processes(app_process_env(fake_workers_ai, url), 200)
    assert_exact_daily_cap(responses, fake_workers_ai, 20)


def test_a_burst_over_http_shares_script_calls_and_stays_exact(fake_workers_ai: FakeWorkersAI) -> None:
    """Over real HTTP, one app process on a Redis of its own: a burst of 100 requests against a
    daily cap of 20 makes exactly 20 calls, and the worker's steps share script calls: each
    request takes a step and a last good answer's operation (put on a success, read on a
    fallback; those are not coalesced), 202 EVALSHA measured when each step was its own call,
    about 105 coalesced (the 100 steps in a handful of calls)."""
    import redis as sync_redis

    fake_workers_ai.default = SUMMARY
    with RedisServer() as server, sync_redis.Redis.from_url(server.url) as admin:
        responses = burst_across_processes(app_process_env(fake_workers_ai, server.url), 100, processes=1)
        calls = int(admin.info("commandstats")["cmdstat_evalsha"]["calls"])
    assert_exact_daily_cap(responses, fake_workers_ai, 20)
    assert calls < 150, calls


def burst_across_processes(env: dict[str, str], count: int, processes: int = 2) -> list[httpx.Response]:
    """`burst` of `count` requests spread over `processes` app processes started with `env`."""
    apps = [AppProcess(env) for _ in range(processes)]
    try:
        for app in apps:
            app.wait_ready()
        return asyncio.run(burst([app.url for app in apps], count))
    finally:
        for app in apps:
            app.stop()


async def _flush(url: str) -> None:
    import redis.asyncio as redis

    client = redis.Redis.from_url(url)
    try:
        await client.flushdb()
    finally:
        await client.aclose()


# --- in process, for each store, with a controllable clock ------------------------------------


def guarded_app(store: Store, fake: FakeBinding, **route: Any) -> FastAPI:
    guards = Guards(
        fake, store=store, sleep=no_sleep, prices={MODEL: Price(input_token=0.001, output_token=0.01)}
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, fallback="fallback", **route)
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label this"})

    return app


async def concurrent_posts(app: FastAPI, count: int) -> list[dict[str, Any]]:
    async with asgi_client(app, timeout=30) as client:
        responses = await asyncio.gather(
            *(client.post("/label", headers={"x-user-id": "u"}) for _ in range(count))
        )
    return [r.json() for r in responses]


def test_daily_cap_is_exact_under_a_burst_for_each_store(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    """200 concurrent requests from one user against a daily cap of 20, in one process."""
    fake = FakeBinding(Reply("ok", delay_s=0.01))
    app = guarded_app(make_store(manual_clock), fake, budget=Budget(per_day=20, key=header_key("x-user-id")))
    bodies = anyio.run(concurrent_posts, app, 200)
    assert len(fake.calls) == 20
    assert sum(b["fallback"] is None for b in bodies) == 20
    assert {b["fallback"]["reason"] for b in bodies if b["fallback"]} == {"budget_exceeded"}


def test_half_open_stampede_lets_exactly_one_probe_through(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    fake = FakeBinding()
    app = guarded_app(
        make_store(manual_clock), fake, breaker=Breaker(failure_threshold=2, reset_timeout_s=30)
    )

    async def scenario() -> list[dict[str, Any]]:
        fake.script(MODEL, Fail(code=5035, status=403), Fail(code=5035, status=403))
        for _ in range(2):
            assert (await concurrent_posts(app, 1))[0]["fallback"]["reason"] == "provider_error"
        manual_clock.advance(30)  # half-open now
        fake.default = Reply("answered", delay_s=0.2)  # the probe is in flight while the rest arrive
        return await concurrent_posts(app, 50)

    bodies = anyio.run(scenario)
    assert len(fake.calls) == 3  # two failures, then exactly one probe
    assert sum(b["fallback"] is None for b in bodies) == 1
    assert {b["fallback"]["reason"] for b in bodies if b["fallback"]} == {"circuit_open"}


def test_spend_race_never_passes_the_cap(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    """Room for two worst-case holds, ten concurrent requests: two calls, settled spend within
    the cap."""
    store = make_store(manual_clock)
    fake = FakeBinding(Reply("ok", delay_s=0.1))
    # Worst case per attempt: input bound (JSON of the inputs) x 0.001 + 50 x 0.01; one attempt.
    inputs_bytes = len(b'{"prompt":"label this","max_tokens":50}')
    worst = inputs_bytes * 0.001 + 50 * 0.01
    cap = 2.5 * worst
    app = guarded_app(
        store,
        fake,
        budget=Budget(spend_per_day=cap, key=header_key("x-user-id")),
        max_tokens=50,
        retry=Retry(attempts=1),
    )
    bodies = anyio.run(concurrent_posts, app, 10)
    assert len(fake.calls) == 2
    assert sum(b["fallback"] is None for b in bodies) == 2
    assert {b["fallback"]["reason"] for b in bodies if b["fallback"]} == {"budget_exceeded"}
    spent = anyio.run(store.spent, "guards:label:u")
    usage = Price(input_token=0.001, output_token=0.01).cost(10, 5)  # the fake's usage per call
    assert spent == pytest.approx(2 * usage)
    assert spent <= cap
    assert all(call.inputs["max_tokens"] == 50 for call in fake.calls)


def test_daily_cap_rolls_over_at_utc_midnight(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    manual_clock.set(86_400 * 20_000 - 5)  # five seconds before a UTC midnight
    fake = FakeBinding(Reply("ok"))
    app = guarded_app(make_store(manual_clock), fake, budget=Budget(per_day=2, key=header_key("x-user-id")))

    async def scenario() -> list[str | None]:
        reasons = []
        for step in range(4):
            if step == 3:
                manual_clock.advance(6)  # 00:00:01 the next day
            body = (await concurrent_posts(app, 1))[0]
            reasons.append(body["fallback"]["reason"] if body["fallback"] else None)
        return reasons

    assert anyio.run(scenario) == [None, None, "budget_exceeded", None]
    assert len(fake.calls) == 3


# --- Redis going away -------------------------------------------------------------------------


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_stopped_mid_traffic_follows_the_failure_mode(
    own_redis: RedisServer,
    fake_workers_ai: FakeWorkersAI,
    serve: Serve,
    mode: str,
) -> None:
    fake_workers_ai.default = Reply({"label": "billing", "confidence": 0.9})
    settings = workers_ai_settings(
        fake_workers_ai, guards_store=own_redis.url, guards_store_failure=mode, daily_call_limit=3
    )
    client = serve(create_app(settings, sleep=no_sleep))

    def summary() -> httpx.Response:
        return client.post("/summary", json={"text": "refund"}, headers={"x-user-id": "u"})

    def draft() -> httpx.Response:
        return client.post("/draft-reply", json={"message": "hi"})

    fake_workers_ai.default = Reply({"label": "billing", "confidence": 0.9})
    assert summary().json()["fallback"] is None
    own_redis.stop()
    calls_before = len(fake_workers_ai.calls)
    for _ in range(3):
        started = time.monotonic()
        down_summary, down_draft = summary(), draft()
        assert time.monotonic() - started < 2.0  # bounded by the store's own timeout, no hang
        assert down_summary.status_code == 200
        if mode == "closed":
            assert down_summary.json()["fallback"]["reason"] == "circuit_open"
            assert down_draft.status_code == 503
            assert down_draft.json()["error"] == "circuit_open"
            assert down_draft.headers["retry-after"] == "5"
        else:
            assert down_summary.json()["fallback"] is None
            assert down_draft.status_code in (200, 502)  # the fake answers the summary's JSON
    if mode == "closed":
        assert len(fake_workers_ai.calls) == calls_before
    own_redis.start()  # same port, empty: counters start again
    answers = [summary().json()["fallback"] for _ in range(4)]
    assert [a["reason"] if a else None for a in answers] == [None, None, None, "budget_exceeded"]


def test_no_url_or_password_in_store_errors(guards_log: Any) -> None:
    """A store that cannot be reached says so without its URL or password."""
    secret = "CANARY-REDIS-PASSWORD-77"
    port = free_port()  # nothing listens there
    store = RedisStore(f"redis://:{secret}@127.0.0.1:{port}/0", timeout_s=0.1)
    fake = FakeBinding(Reply("ok"))
    app = guarded_app(store, fake, budget=Budget(per_day=5, key=header_key("x-user-id")))
    refused_before = REGISTRY.get_sample_value(
        "guards_store_unavailable_total", {"guard": "budget", "action": "closed"}
    )
    bodies = anyio.run(concurrent_posts, app, 2)
    assert all(b["fallback"]["reason"] == "circuit_open" for b in bodies)
    # The breaker failed open (its default), then the budget failed closed: both counted.
    refused_after = REGISTRY.get_sample_value(
        "guards_store_unavailable_total", {"guard": "budget", "action": "closed"}
    )
    assert (refused_after or 0) - (refused_before or 0) == 2
    assert (
        REGISTRY.get_sample_value("guards_store_unavailable_total", {"guard": "breaker", "action": "open"})
        or 0
    ) >= 2
    assert guards_log.events("store_unavailable")
    for line in guards_log.lines:
        assert secret not in line
        assert str(port) not in line
