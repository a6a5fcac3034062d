"""Shared test helpers: the app and client factory (`app_client`, `example_client`, `asgi_client`;
a real uvicorn server in a thread, `serve`, for what needs a socket), captured `guards` log lines,
the assertions on the two public answer shapes, bounded polling, and the store fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import socket
import subprocess
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import guards
from app.service import create_app
from app.settings import Settings
from fixtures import FakeWorkersAI, ManualClock
from fixtures.stores import PiecewiseStore
from guards import AIResult, Binding, Clock
from guards.stores import MemoryStore, RedisStore, SQLiteStore, Store
from guards.testing.pytest_plugin import immortal_keys
from guards.testing.redis_cluster import RedisCluster

#: The SQLite and Redis store timeout of tests about state, not timeouts: on a loaded machine
#: an operation can take longer than the default 0.1 s.
STORE_TIMEOUT_S = 5.0


class LiveServer:
    """`app` served by uvicorn on a free loopback port, in a background thread."""

    def __init__(self, app: FastAPI) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        # asyncio and h11 whatever is installed: uvloop's loop refuses to close while a client
        # still holds a connection (EBUSY), which a test's client may well do at the end.
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, loop="asyncio", http="h11"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> LiveServer:
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                return self
            self._thread.join(0.01)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


#: Options of a pytest that a test runs in a subprocess: not the pytest plugins of the
#: repository's own test tools (schemathesis, hypothesis), which no user's project has and no
#: such run uses; loading them is about 2 s of CPU, more than half of an empty run's start.
UNUSED_PLUGINS = ("-p", "no:schemathesis", "-p", "no:hypothesispytest")


#: `serve(app)`: a client of `app` served for real.
Serve = Callable[[FastAPI], httpx.Client]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """`client = serve(app)`: serve `app` for real and get an httpx client bound to it."""
    stack: list[tuple[LiveServer, httpx.Client]] = []

    def start(app: FastAPI) -> httpx.Client:
        server = LiveServer(app).__enter__()
        client = httpx.Client(base_url=server.url, timeout=10)
        stack.append((server, client))
        return client

    yield start
    for server, client in reversed(stack):
        client.close()
        server.__exit__()


# --- the app and its client ---------------------------------------------------------------------
#: `app_client(app)`, `app_client(app, socket=True)`: a client of `app`.
AppClient = Callable[..., httpx.Client]
#: `example_client(**settings)`: a client of the example app on those settings.
ExampleClient = Callable[..., httpx.Client]


@pytest.fixture
def app_client(serve: Serve) -> Iterator[AppClient]:
    """`client = app_client(app)`: an httpx client of `app`, the one way tests get one.

    In process by default: Starlette's `TestClient` (ASGI on an event loop of its own thread),
    entered so the app's lifespan runs; an exception of the app is its 500 answer, as under a
    server, and redirects are not followed. With `socket=True` the app is served for real by
    uvicorn on a loopback port (`serve`), for what only a socket shows: a stream read as it comes,
    a client that leaves, bodies sent piece by piece, requests in flight at once from threads.
    Everything is closed at the end of the test."""
    entered: list[TestClient] = []

    def make(app: FastAPI, *, socket: bool = False) -> httpx.Client:
        if socket:
            return serve(app)
        client = TestClient(app, raise_server_exceptions=False, follow_redirects=False)
        client.__enter__()
        entered.append(client)
        return client

    yield make
    for client in reversed(entered):
        client.__exit__(None, None, None)


@pytest.fixture
def example_client(app_client: AppClient, fake_workers_ai: FakeWorkersAI) -> ExampleClient:
    """`client = example_client(**settings)`: the example app (`app.service.create_app`) on
    `workers_ai_settings(fake_workers_ai, **settings)`, its retries not waited (`no_sleep`), and
    a client of it from `app_client`. `store`, `clock`, `binding` and `tracer_provider` go to
    `create_app`, `socket` to `app_client`. A module fixes its own defaults with
    `functools.partial(example_client, ...)`."""

    def make(
        *,
        store: Store | None = None,
        clock: Clock | None = None,
        binding: Binding | None = None,
        tracer_provider: Any = None,
        socket: bool = False,
        **settings: Any,
    ) -> httpx.Client:
        app = create_app(
            workers_ai_settings(fake_workers_ai, **settings),
            store=store,
            clock=clock,
            binding=binding,
            sleep=no_sleep,
            tracer_provider=tracer_provider,
        )
        return app_client(app, socket=socket)

    return make


def asgi_client(app: FastAPI, **options: Any) -> httpx.AsyncClient:
    """`async with asgi_client(app) as client:` an async httpx client of `app`, in process
    (`httpx.ASGITransport`; no lifespan); `options` go to `httpx.AsyncClient`."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", **options)


class LogLines(logging.Handler):
    """Every record of the `guards` logger, as text and parsed JSON. guards writes its lines
    from a thread of its own: reading `lines` first waits until every line emitted so far was
    written (`guards.flush_logs`)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._lines: list[str] = []
        self._changed = threading.Condition()

    @property
    def lines(self) -> list[str]:
        assert guards.flush_logs(5.0), "guards' log writer did not catch up"
        return self._lines

    def emit(self, record: logging.LogRecord) -> None:
        with self._changed:
            self._lines.append(record.getMessage())
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 5.0) -> bool:
        """Block until `predicate()` is true (a line arrived from a server thread) or `timeout`.
        `predicate` runs without the lock held: it may read `lines`, which waits for guards'
        writer, whose lines come through `emit`."""
        deadline = time.monotonic() + timeout
        while not predicate():
            with self._changed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.05))
        return True

    def events(self, event: str | None = None) -> list[dict[str, Any]]:
        parsed = [json.loads(line) for line in self.lines]
        return [p for p in parsed if event is None or p["event"] == event]

    def skips(self) -> dict[tuple[str, str], int]:
        """How many skips the `skip` lines count, by (models, reason): a line summarizes its
        route's skips for one reason in one second (`models`: the models skipped, comma-joined,
        when more than one)."""
        counted: dict[tuple[str, str], int] = {}
        for line in self.events("skip"):
            key = (",".join(line.get("models", [line["model"]])), line["reason"])
            counted[key] = counted.get(key, 0) + line["count"]
        return counted


_Lines = TypeVar("_Lines", bound=LogLines)


def capture_guards_log(handler: _Lines) -> Iterator[_Lines]:
    """`handler` on the `guards` logger at INFO for the test's duration (a fixture's body)."""
    logger = logging.getLogger("guards")
    previous = logger.level
    assert guards.flush_logs(5.0), "guards' log writer did not catch up"  # earlier tests' lines
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(previous)


@pytest.fixture
def guards_log() -> Iterator[LogLines]:
    yield from capture_guards_log(LogLines())


def workers_ai_settings(server: FakeWorkersAI, **overrides: Any) -> Settings:
    """Settings for the example app pointed at the fake Workers AI server."""
    values: dict[str, Any] = {
        "ai_provider": "workers-ai",
        "cloudflare_account_id": server.account_id,
        "cloudflare_api_token": server.api_token,
        "cloudflare_api_base": server.base_url,
        "ai_model": "@cf/test/model",
        "ai_timeout_s": 2.0,
    }
    values.update(overrides)
    return Settings(**values)


def estimated_tokens(inputs: Mapping[str, Any]) -> int:
    """The documented default estimate of a call's input tokens (docs/guards/budget.md), from
    the inputs a fake received: the characters of the messages' text and of the JSON of
    `response_format`, divided by four, rounded up."""
    chars = sum(len(message["content"]) for message in inputs.get("messages", ()))
    if "response_format" in inputs:
        chars += len(json.dumps(inputs["response_format"], separators=(",", ":")))
    return -(-chars // 4)


async def no_sleep(seconds: float) -> None:
    """Retry delays in tests: recorded by nobody, waited by nobody."""


def assert_error(response: httpx.Response, status: int, error: str, retryable: bool) -> None:
    """A strict route's public error, whole (a 400's `problems`: at least one, each a field and
    a problem token)."""
    assert response.status_code == status, response.text
    body = response.json()
    if status == 400:
        problems = body.pop("problems")
        assert problems
        assert all(set(p) == {"field", "problem"} for p in problems), problems
    assert body == {"error": error, "retryable": retryable, "trace_id": response.headers["x-trace-id"]}


def problems(response: httpx.Response) -> list[tuple[str, str]]:
    """A 400's `problems`, as (field, problem) pairs."""
    assert response.status_code == 400, response.text
    return [(p["field"], p["problem"]) for p in response.json()["problems"]]


def assert_fallback(response: httpx.Response, guard: str, reason: str, data: Any) -> dict[str, Any]:
    """A degrading route's fallback envelope, whole (`detail`: any non-empty text); returns it."""
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    detail = body["fallback"]["detail"]
    assert isinstance(detail, str)
    assert detail
    assert body == {
        "ok": True,
        "data": data,
        "fallback": {"guard": guard, "reason": reason, "detail": detail},
    }
    return body


def answers(url: str) -> bool:
    """Whether a server answers at `url` yet (its `/docs`), for a bounded `wait_until`."""
    try:
        httpx.get(url + "/docs", timeout=1)
    except httpx.TransportError:
        return False
    return True


def wait_until(condition: Callable[[], Any], timeout_s: float = 5.0) -> None:
    """Poll `condition` until it holds, failing after `timeout_s`: for what another process or
    thread does on its own time (a server noticing a closed connection, a key expiring on
    Redis' clock), which the test cannot be told about."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def run_binding_once(make: Callable[[], Binding], model: str, inputs: Mapping[str, Any]) -> AIResult:
    """One `run` through a fresh binding from `make()`, closed afterwards."""

    async def call() -> AIResult:
        binding = make()
        try:
            return await binding.run(model, inputs)
        finally:
            await binding.aclose()

    return asyncio.run(call())


class RedisReads:
    """`reads = RedisReads(url)`, then `reads.take()`: the reads the Redis server at `url` made
    from its clients' connections since the last `take` (`INFO stats`, less the INFO's own).
    A client's write is one read (a pipeline of commands is one; more than 16 KB takes more),
    so with one client talking this counts its round trips. Counted by the server: whichever
    client library or connection sends them. A connection closing is a read too."""

    def __init__(self, url: str) -> None:
        self._admin = redis.Redis.from_url(url)
        self._last = self._read()

    def _read(self) -> int:
        return int(self._admin.info("stats")["total_reads_processed"])

    def take(self) -> int:
        now = self._read()
        reads, self._last = now - self._last - 1, now  # the INFO just sent was one
        return reads

    def close(self) -> None:
        self._admin.close()


# --- stores -------------------------------------------------------------------------------------
#: Every store implementation; tests taking the `make_store` fixture run against each
#: (`redis-cluster`: RedisStore on a real Redis Cluster of three primaries and three replicas).
STORE_KINDS = ("memory", "sqlite", "redis", "redis-cluster")


@contextlib.contextmanager
def running_cluster(**options: Any) -> Iterator[RedisCluster]:
    """A Redis Cluster (three primaries, each with a replica) on loopback ports, for the block
    (`options`: `RedisCluster`'s, a password say).
    Skipped where no redis-server can start one, unless GUARDS_REQUIRE_REDIS_CLUSTER=1 (CI):
    then that fails."""
    cluster = RedisCluster(**options)
    try:
        cluster.__enter__()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        if os.environ.get("GUARDS_REQUIRE_REDIS_CLUSTER") == "1":
            pytest.fail(f"a Redis Cluster is required (GUARDS_REQUIRE_REDIS_CLUSTER=1): {exc}")
        pytest.skip(f"no Redis Cluster could start here (redis-server and redis-cli needed): {exc}")
    try:
        yield cluster
    finally:
        cluster.__exit__(None, None, None)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """The session's Redis Cluster (see `running_cluster`): the `redis-cluster` store kind's,
    and the e2e tests'. A test that kills its nodes starts one of its own."""
    with running_cluster() as cluster:
        yield cluster
        # As the session's Redis: every key the tests left has a TTL, but the epoch markers.
        immortal = [key for _, port in cluster.primaries for key in immortal_keys(port, databases=1)]
        assert not immortal, f"keys without a TTL after the session: {immortal[:20]}"


def redis_admins(store_kind: str, request: pytest.FixtureRequest) -> list[redis.Redis]:
    """Plain clients (text replies) to every primary holding a Redis store kind's keys: the
    session's server, or each primary of the session's cluster. The caller closes them."""
    if store_kind == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return [redis.Redis(host=host, port=port, decode_responses=True) for host, port in cluster.primaries]
    return [redis.Redis.from_url(request.getfixturevalue("redis_url"), decode_responses=True)]


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(
    store_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[ManualClock], PiecewiseStore]]:
    """`make_store(clock)`: a fresh, empty store of the kind under test, whose time is `clock`.

    SQLite stores share one file per test (like workers on one machine); Redis stores share
    the session's server, under a key prefix of their own per test.
    """
    made: list[PiecewiseStore] = []
    prefix = f"test-{uuid.uuid4().hex[:12]}:"

    def make(clock: ManualClock) -> PiecewiseStore:
        store: PiecewiseStore
        if store_kind == "memory":
            store = MemoryStore(clock=clock)
        elif store_kind == "sqlite":
            store = SQLiteStore(tmp_path / "guards.db", clock=clock, timeout_s=STORE_TIMEOUT_S)
        else:
            url = request.getfixturevalue("redis_cluster" if store_kind == "redis-cluster" else "redis_url")
            store = RedisStore(
                url if isinstance(url, str) else url.url,
                clock=clock,
                prefix=prefix,
                timeout_s=STORE_TIMEOUT_S,
            )
        made.append(store)
        return store

    yield make
    for store in made:
        asyncio.run(store.aclose())


@pytest.fixture
def clock() -> ManualClock:
    """The time of the stores under test (modules override it to start at a chosen instant)."""
    return ManualClock()


@pytest.fixture
def store(make_store: Callable[[ManualClock], PiecewiseStore], clock: ManualClock) -> PiecewiseStore:
    """A fresh store of each kind (memory, SQLite, Redis) on `clock`: the guards' state behaves
    alike in all."""
    return make_store(clock)


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own on the shared Redis."""
    return f"t-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    """A plain client to look at the Redis the stores use."""
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        yield client


GUARDS_DIR = str(Path(guards.__file__).parent)


def guards_memory() -> int:
    """Bytes currently allocated by code in the `guards` package (as `tracemalloc` traced them)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, f"{GUARDS_DIR}/*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def guards_samples(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every `guards_*` sample of the app's `/metrics` (which must answer 200), by name and
    sorted labels."""
    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name.startswith("guards_")
    }
