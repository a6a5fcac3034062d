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
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from app.service import create_app
from fixtures import FakeWorkersAI, Reply
from fixtures.redis_server import RedisServer, free_port

from ..conftest import Serve, no_sleep, workers_ai_settings

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
