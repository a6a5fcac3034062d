"""A store that knows when it forgot: a flush (Redis `FLUSHALL`; SQLite tables emptied or the file
replaced by an empty one) under traffic makes each worker warn once (`store_reset`) and count it
(`guards_store_reset_total`), and again at the next flush. Redis' settings are read at connect:
a policy that may evict guards' keys, or no persistence, is warned (naming the setting); a write
refused for memory is named (`store_out_of_memory`). Real servers, two workers (two `Guards`,
each with its own store object on the same state), requests over ASGI."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from fastapi import FastAPI
from prometheus_client import REGISTRY

from fixtures import FakeBinding, Reply
from guards import AI, Budget, Guards, header_key
from guards.stores import RedisStore, SQLiteStore, TaskClaim, TaskStatus
from guards.testing.redis_cluster import RedisCluster
from guards.testing.redis_server import RedisServer

from ..conftest import STORE_TIMEOUT_S, AppClient, LogLines, wait_until

CAP = 3


def cap_app(store: RedisStore | SQLiteStore) -> FastAPI:
    """A strict route whose daily cap is `CAP` calls per `x-user-id`."""
    guards = Guards(FakeBinding(Reply("ok")), store=store)
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model="@cf/test/model", budget=Budget(per_day=CAP, key=header_key("x-user-id")))
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label"})

    return app


def resets_counted(kind: str) -> float:
    return REGISTRY.get_sample_value("guards_store_reset_total", {"store": kind}) or 0.0


class Traffic:
    """Requests from distinct users, to both workers in turn, from a thread, until stopped."""

    def __init__(self, clients: list[httpx.Client]) -> None:
        self._clients = clients
        self._stop = threading.Event()
        self.statuses: list[int] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for n in itertools.count():
            if self._stop.is_set():
                return
            client = self._clients[n % len(self._clients)]
            self.statuses.append(client.post("/label", headers={"x-user-id": f"t{n}"}).status_code)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def private_redis() -> Iterator[Callable[..., RedisServer]]:
    """`private_redis(*options)`: a Redis server of the test's own (it is flushed, or its
    settings are what the test is about), stopped at the end."""
    started: list[RedisServer] = []

    def start(*options: str) -> RedisServer:
        server = RedisServer(options=options).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.__exit__()


def empty_sqlite(path: Path) -> None:
    """What a flush is to SQLite: every table emptied, the epoch marker's too."""
    with sqlite3.connect(path, timeout=5, isolation_level=None) as conn:
        conn.execute("BEGIN IMMEDIATE")
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            conn.execute(f"DELETE FROM {table}")
        conn.execute("COMMIT")
    conn.close()


@pytest.mark.parametrize("kind", ["redis", "redis-cluster", "sqlite"])
def test_a_flush_under_traffic_warns_once_per_worker_and_again_at_the_next(
    kind: str,
    app_client: AppClient,
    guards_log: LogLines,
    private_redis: Callable[..., RedisServer],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """On Redis Cluster every primary is flushed: each slot's marker goes, and each worker
    still warns once per flush (the slots it finds reset after the first are that reset)."""
    if kind == "redis":
        server = private_redis()
        stores = [RedisStore(server.url, timeout_s=STORE_TIMEOUT_S) for _ in range(2)]
        admin = redis.Redis(port=server.port)

        def flush() -> None:
            admin.flushall()
    elif kind == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        stores = [RedisStore(cluster.url, timeout_s=STORE_TIMEOUT_S) for _ in range(2)]

        def flush() -> None:
            for host, port in cluster.primaries:
                with redis.Redis(host=host, port=port) as primary:
                    primary.flushall()
    else:
        path = tmp_path / "guards.db"
        stores = [SQLiteStore(path, timeout_s=STORE_TIMEOUT_S) for _ in range(2)]

        def flush() -> None:
            empty_sqlite(path)

    label = "sqlite" if kind == "sqlite" else "redis"  # (the metric's and the line's `store`)
    before = resets_counted(label)
    workers = [app_client(cap_app(store)) for store in stores]
    # A user at the cap, both workers agreeing.
    spent = [workers[i % 2].post("/label", headers={"x-user-id": "ada"}).status_code for i in range(CAP + 1)]
    assert spent == [200] * CAP + [429]

    def resets() -> int:
        return len(guards_log.events("store_reset"))

    traffic = Traffic(workers)
    try:
        wait_until(lambda: len(traffic.statuses) >= 20, 10)
        flush()
        wait_until(lambda: resets() >= 2, 10)  # each worker's next step
        seen = len(traffic.statuses)
        wait_until(lambda: len(traffic.statuses) >= seen + 40, 10)  # and many steps after
        assert resets() == 2
        assert [store.epoch.resets for store in stores] == [1, 1]
        assert resets_counted(label) == before + 2
        # What the warning is about: the cap's count is gone, so `ada` is admitted again.
        assert workers[0].post("/label", headers={"x-user-id": "ada"}).status_code == 200
        # A second flush: each worker warns again, once.
        flush()
        wait_until(lambda: resets() >= 4, 10)
        seen = len(traffic.statuses)
        wait_until(lambda: len(traffic.statuses) >= seen + 40, 10)
    finally:
        traffic.stop()
    assert resets() == 4
    assert [store.epoch.resets for store in stores] == [2, 2]
    assert resets_counted(label) == before + 4
    warnings = guards_log.events("store_reset")
    assert {line["store"] for line in warnings} == {label}
    assert sorted(line["resets"] for line in warnings) == [1, 1, 2, 2]
    assert all("127.0.0.1" not in str(line) for line in warnings)
    assert set(traffic.statuses) <= {200, 503}  # 503: SQLite's budget failing closed, if ever


def test_a_replaced_sqlite_file_is_unavailable_then_a_reset(
    app_client: AppClient, guards_log: LogLines, tmp_path: Path
) -> None:
    """A SQLite file replaced by an empty one: each worker notices the replacement (within a
    second, as an unavailable store), then opens the new file and finds the marker gone."""
    path = tmp_path / "guards.db"
    stores = [SQLiteStore(path, timeout_s=STORE_TIMEOUT_S) for _ in range(2)]
    workers = [app_client(cap_app(store)) for store in stores]
    for worker in workers:
        assert worker.post("/label", headers={"x-user-id": "ada"}).status_code == 200
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    sqlite3.connect(path).close()  # an empty database at the path
    traffic = Traffic(workers)
    try:
        wait_until(lambda: len(guards_log.events("store_reset")) >= 2, 10)
    finally:
        traffic.stop()
    assert [store.epoch.resets for store in stores] == [1, 1]
    assert set(traffic.statuses) <= {200, 503}  # 503: the budget fails closed in between


def test_a_worker_that_starts_on_a_new_store_does_not_warn(
    app_client: AppClient, guards_log: LogLines, private_redis: Callable[..., RedisServer]
) -> None:
    server = private_redis()
    worker = app_client(cap_app(RedisStore(server.url, timeout_s=STORE_TIMEOUT_S)))
    assert worker.post("/label", headers={"x-user-id": "ada"}).status_code == 200
    late = RedisStore(server.url, timeout_s=STORE_TIMEOUT_S)
    assert app_client(cap_app(late)).post("/label", headers={"x-user-id": "bob"}).status_code == 200
    assert guards_log.events("store_reset") == []
    assert late.epoch.known
    assert late.epoch.resets == 0


def store_settings(guards_log: LogLines) -> dict[str, str]:
    return {line["setting"]: line["value"] for line in guards_log.events("store_setting")}


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "volatile-ttl", "allkeys-random"])
def test_a_policy_that_can_evict_guards_keys_is_warned_at_connect(
    policy: str, app_client: AppClient, guards_log: LogLines, private_redis: Callable[..., RedisServer]
) -> None:
    """Every guards key has a TTL, so `volatile-*` policies evict them as `allkeys-*` do."""
    server = private_redis("--maxmemory", "64mb", "--maxmemory-policy", policy, "--appendonly", "yes")
    worker = app_client(cap_app(RedisStore(server.url, timeout_s=STORE_TIMEOUT_S)))
    for _ in range(3):
        assert worker.post("/label", headers={"x-user-id": "ada"}).status_code == 200
    assert guards_log.wait_for(lambda: store_settings(guards_log))
    assert store_settings(guards_log) == {"maxmemory-policy": policy}  # once, and nothing else
    (line,) = guards_log.events("store_setting")
    assert "noeviction" in line["detail"]
    assert line["store"] == "redis"


def test_no_persistence_is_warned_and_noeviction_with_aof_is_not(
    app_client: AppClient, guards_log: LogLines, private_redis: Callable[..., RedisServer]
) -> None:
    volatile = private_redis("--maxmemory", "64mb", "--maxmemory-policy", "noeviction")  # no AOF, no save
    durable = private_redis("--maxmemory", "64mb", "--maxmemory-policy", "noeviction", "--appendonly", "yes")
    app_client(cap_app(RedisStore(durable.url, timeout_s=STORE_TIMEOUT_S))).post(
        "/label", headers={"x-user-id": "ada"}
    )
    app_client(cap_app(RedisStore(volatile.url, timeout_s=STORE_TIMEOUT_S))).post(
        "/label", headers={"x-user-id": "ada"}
    )
    assert guards_log.wait_for(lambda: store_settings(guards_log))
    assert store_settings(guards_log) == {"appendonly": "no"}  # the volatile server's alone
    (line,) = guards_log.events("store_setting")
    assert "appendonly yes" in line["detail"]


def test_a_server_that_refuses_config_is_said_once_and_used(
    app_client: AppClient, guards_log: LogLines, private_redis: Callable[..., RedisServer]
) -> None:
    server = private_redis("--rename-command", "CONFIG", "")  # as managed Redis often does
    worker = app_client(cap_app(RedisStore(server.url, timeout_s=STORE_TIMEOUT_S)))
    for _ in range(3):
        assert worker.post("/label", headers={"x-user-id": "ada"}).status_code == 200
    assert guards_log.wait_for(lambda: guards_log.events("store_settings_unchecked"))
    assert len(guards_log.events("store_settings_unchecked")) == 1
    assert guards_log.events("store_setting") == []


def test_a_write_refused_for_memory_is_named(
    app_client: AppClient, guards_log: LogLines, private_redis: Callable[..., RedisServer]
) -> None:
    server = private_redis("--maxmemory-policy", "noeviction", "--appendonly", "yes")
    worker = app_client(cap_app(RedisStore(server.url, timeout_s=STORE_TIMEOUT_S)))
    assert worker.post("/label", headers={"x-user-id": "ada"}).status_code == 200
    with redis.Redis(port=server.port) as admin:
        admin.config_set("maxmemory", "1")  # every write is now over the limit
    refused = [worker.post("/label", headers={"x-user-id": f"u{n}"}) for n in range(5)]
    # The budget cannot be charged: its failure mode (closed) applies, as for any outage.
    assert [r.status_code for r in refused] == [503] * 5
    assert {r.json()["error"] for r in refused} == {"circuit_open"}
    lines = guards_log.events("store_out_of_memory")
    assert len(lines) == 1  # at most one a second, counting the others
    assert lines[0]["setting"] == "maxmemory"
    assert lines[0]["count"] == 1
    # Each request's guards still say the store failed, and what each did (as in any outage).
    assert {line["guard"] for line in guards_log.events("store_unavailable")} == {
        "budget",
        "breaker",
        "cooldown",
    }


def test_the_status_page_shows_the_resets_a_worker_noticed(
    app_client: AppClient, private_redis: Callable[..., RedisServer]
) -> None:
    server = private_redis()
    store = RedisStore(server.url, timeout_s=STORE_TIMEOUT_S)
    app = cap_app(store)
    app.include_router(Guards.of(app).status_router())
    worker = app_client(app)
    assert worker.post("/label", headers={"x-user-id": "ada"}).status_code == 200
    first = worker.get("/status", headers={"accept": "application/json"}).json()["store_resets"]
    assert first["count"] == 0
    assert first["last"] is None
    with redis.Redis(port=server.port) as admin:
        admin.flushall()
    assert worker.post("/label", headers={"x-user-id": "ada"}).status_code == 200
    after = worker.get("/status", headers={"accept": "application/json"}).json()["store_resets"]
    assert after["count"] == 1
    assert after["last"] is not None
    assert "store forgot its state 1 time" in worker.get("/status", headers={"accept": "text/html"}).text


@pytest.mark.parametrize("kind", ["redis", "redis-cluster", "sqlite"])
def test_a_task_claimed_again_after_a_flush_is_said_so(
    kind: str,
    guards_log: LogLines,
    private_redis: Callable[..., RedisServer],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """A completed task's answer lost with the store: the claim of its `Idempotency-Key` runs it
    again (charged again): the claim itself finds the marker gone and the worker warns."""
    if kind == "redis":
        server = private_redis()
        store: RedisStore | SQLiteStore = RedisStore(server.url, timeout_s=STORE_TIMEOUT_S)

        def flush() -> None:
            with redis.Redis(port=server.port) as admin:
                admin.flushall()
    elif kind == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        store = RedisStore(cluster.url, timeout_s=STORE_TIMEOUT_S)

        def flush() -> None:
            for host, port in cluster.primaries:
                with redis.Redis(host=host, port=port) as primary:
                    primary.flushall()
    else:
        path = tmp_path / "guards.db"
        store = SQLiteStore(path, timeout_s=STORE_TIMEOUT_S)

        def flush() -> None:
            empty_sqlite(path)

    async def claim() -> TaskClaim:
        return await store.task_claim("report:ada:key-1", fingerprint="fp", lease_s=30, ttl_s=3600)

    async def scenario() -> list[TaskStatus]:
        first = await claim()
        assert first.lease is not None
        assert await store.task_complete("report:ada:key-1", first.lease, '{"reply": "done"}')
        replayed = await claim()
        flush()
        again = await claim()
        await store.aclose()
        return [first.status, replayed.status, again.status]

    assert asyncio.run(scenario()) == [TaskStatus.claimed, TaskStatus.done, TaskStatus.claimed]
    assert len(guards_log.events("store_reset")) == 1
    assert store.epoch.resets == 1


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
def test_keys_evicted_under_memory_pressure_are_reported_as_a_reset(
    policy: str, app_client: AppClient, guards_log: LogLines, private_redis: Callable[..., RedisServer]
) -> None:
    """The epoch marker is read by every step (LRU keeps it) and has no TTL (`volatile-*` never
    picks it), so eviction never takes it: the store asks the server how many keys it evicted
    (`INFO stats`, behind its health reads) and reports a rise as a reset."""
    server = private_redis("--maxmemory", "2mb", "--maxmemory-policy", policy)
    app = cap_app(RedisStore(server.url, timeout_s=STORE_TIMEOUT_S))
    app.include_router(Guards.of(app).status_router())
    worker = app_client(app, socket=True)
    counted = resets_counted("redis")
    assert [worker.post("/label", headers={"x-user-id": "ada"}).status_code for _ in range(CAP + 1)] == [
        *[200] * CAP,
        429,
    ]
    with redis.Redis(port=server.port) as admin:
        # Another program's keys, each with a TTL, until Redis evicts (bounded: 2 MB is full
        # long before the end); then removed, so nothing more is evicted.
        fillers = [f"filler:{n}" for n in range(8_000)]
        chunks = [fillers[i : i + 500] for i in range(0, len(fillers), 500)]
        for chunk in chunks:
            with admin.pipeline(transaction=False) as pipe:
                for name in chunk:
                    pipe.set(name, b"x" * 512, ex=3600)
                pipe.execute()
            if int(admin.info("stats")["evicted_keys"]) > 0:
                break
        evicted = int(admin.info("stats")["evicted_keys"])
        assert evicted > 0
        filled = time.monotonic()
        for chunk in chunks:
            admin.delete(*chunk)
    assert guards_log.events("store_reset") == []

    def noticed() -> bool:
        worker.post("/label", headers={"x-user-id": "bob"})  # traffic: the health reads ride on it
        return bool(guards_log.events("store_reset"))

    wait_until(noticed, timeout_s=5)
    latency = time.monotonic() - filled
    (line,) = guards_log.events("store_reset")
    if line["cause"] == "marker":  # `allkeys-lru` may evict the marker too, idle during the fill:
        assert policy == "allkeys-lru"  # the next step found it gone; the rise is that reset
    else:
        assert line["cause"] == "evicted"
        assert line["evicted"] >= evicted  # (Redis may go on evicting a little after a full write)
        assert "noeviction" in line["detail"]
    assert resets_counted("redis") == counted + 1
    status = worker.get("/status", headers={"accept": "application/json"}).json()["store_resets"]
    assert status["count"] == 1
    assert latency < 2.5, latency  # a health read a second, each asking at most once a second
