"""What multi-step tasks leave in the store, through HTTP requests on every store (memory, SQLite,
Redis): a request refused before any model call (budget, breaker, invalid input) leaves no
task state at all, however many fresh `Idempotency-Key`s a refused client sends; a caller's
live tasks are capped per route (`Task.max_live`: 429 `rate_limited` past it, with the wait
until its oldest task expires); and a task keeps at most `Task.max_bytes` of answers."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import Fail, FakeBinding, ManualClock, Reply
from guards import AI, Breaker, Budget, Guards, Task, header_key
from guards.stores import MemoryStore, Store

from ..conftest import AppClient, no_sleep, redis_admins, wait_until

MODEL = "@cf/test/model"
T0 = 1_728_000_000.0


class Ask(BaseModel):
    text: str


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def state_count(store: Store, store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> int:
    """Every piece of state the store holds: live keys (memory), rows (SQLite), keys under the
    store's prefix (Redis)."""
    if store_kind == "memory":
        assert isinstance(store, MemoryStore)
        return len(store)
    if store_kind == "sqlite":
        with sqlite3.connect(tmp_path / "guards.db") as conn:
            tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            return sum(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in tables)
    prefix = repr(store).split("'")[1]
    count = 0
    for admin in redis_admins(store_kind, request):
        with admin:
            # (Redis Cluster's per-slot epoch markers are the store's, at most one per slot.)
            keys = admin.scan_iter(match=f"{prefix}*", count=1000)
            count += sum(1 for key in keys if not key.endswith("}:epoch"))
    return count


def task_app(store: Store, fake_ai: FakeBinding, task: Task) -> FastAPI:
    guards = Guards(fake_ai, store=store, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    user = header_key("x-user-id")

    @app.post("/budgeted")
    @guards.route(model=MODEL, task=task, budget=Budget(per_day=1, key=user))
    async def budgeted(body: Ask, ai: AI[str]) -> dict[str, str]:
        return {"first": await ai.step("first", {"prompt": body.text})}

    @app.post("/breakered")
    @guards.route(
        model="@cf/test/other", task=task, breaker=Breaker(failure_threshold=1, reset_timeout_s=600)
    )
    async def breakered(body: Ask, ai: AI[str]) -> dict[str, str]:
        return {"first": await ai.step("first", {"prompt": body.text})}

    @app.post("/shed")
    @guards.route(model=MODEL, task=task, shed_at="degraded")
    async def shed(body: Ask, ai: AI[str]) -> dict[str, str]:
        return {"first": await ai.step("first", {"prompt": body.text})}

    @app.post("/open")
    @guards.route(model=MODEL, task=task, budget=Budget(per_day=1000, key=user))
    async def open_(body: Ask, ai: AI[str]) -> dict[str, str]:
        return {
            "first": await ai.step("first", {"prompt": body.text}),
            "second": await ai.run({"prompt": "2"}),
        }

    return app


def post(client: httpx.Client, path: str, key: str, user: str = "ada", text: str = "hi") -> httpx.Response:
    return client.post(path, json={"text": text}, headers={"Idempotency-Key": key, "x-user-id": user})


async def refused_requests(url: str, count: int) -> dict[int, int]:
    """`count` requests, each with a fresh key, 50 at a time: an eighth to the open breaker's
    route and an eighth to a route shed while a model is down (503 circuit_open), a quarter
    with an invalid body (400), half from the user at their daily cap (429 budget_exceeded).
    The number of answers by status."""

    async def send(client: httpx.AsyncClient, i: int) -> int:
        headers = {"Idempotency-Key": f"refused-{i}-{uuid.uuid4().hex}", "x-user-id": "ada"}
        path = ("/breakered" if i % 8 == 0 else "/shed") if i % 4 == 0 else "/budgeted"
        body = {} if i % 4 == 1 else {"text": "hi"}
        return (await client.post(f"{url}{path}", json=body, headers=headers)).status_code

    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        for start in range(0, count, 50):
            for status in await asyncio.gather(
                *(send(client, i) for i in range(start, min(count, start + 50)))
            ):
                statuses[status] = statuses.get(status, 0) + 1
    return statuses


#: Refused requests, each with a fresh key: 50 to the open breaker's route, 50 to the shed
#: route, 100 with an invalid body and 200 at the daily cap. The store is counted exactly
#: before and after, so one task left behind shows (each of the stores drops its own); 2,000
#: found nothing more and took 10 to 20 s a store.
REFUSED = 400


def test_refused_requests_with_fresh_keys_leave_no_task_state(
    make_store: Callable[[ManualClock], Store],
    clock: ManualClock,
    store_kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    fake_ai: FakeBinding,
    app_client: AppClient,
) -> None:
    store = make_store(clock)
    client = app_client(task_app(store, fake_ai, Task()), socket=True)  # raw requests at its URL
    fake_ai.default = Reply("answered")
    fake_ai.script("@cf/test/other", Fail(code=5007, status=400))
    assert post(client, "/budgeted", "first").status_code == 200  # the day's one unit
    assert post(client, "/breakered", "opens").status_code == 502  # opens the breaker
    # A model down: the service level is degraded, and /shed is shed (once the worker's view
    # of the level is refreshed, within a second).
    wait_until(lambda: post(client, "/shed", uuid.uuid4().hex).status_code == 503)
    calls = len(fake_ai.calls)
    before = state_count(store, store_kind, tmp_path, request)
    assert before > 0
    statuses = asyncio.run(refused_requests(str(client.base_url), REFUSED))
    assert statuses == {503: REFUSED // 4, 400: REFUSED // 4, 429: REFUSED // 2}
    assert len(fake_ai.calls) == calls
    assert state_count(store, store_kind, tmp_path, request) == before
    # The task contract holds: the first key replays, with no call and no charge.
    replayed = post(client, "/budgeted", "first")
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.json() == {"first": "answered"}


def test_a_callers_live_tasks_are_capped_per_route(
    make_store: Callable[[ManualClock], Store],
    clock: ManualClock,
    fake_ai: FakeBinding,
    app_client: AppClient,
) -> None:
    store = make_store(clock)
    client = app_client(task_app(store, fake_ai, Task(max_live=3, ttl_s=3_600)))
    fake_ai.default = Reply("said")
    for i in range(3):
        assert post(client, "/open", f"k{i}").status_code == 200
        clock.advance(60)
    over = post(client, "/open", "k3")
    assert over.status_code == 429
    assert over.json() == {
        "error": "rate_limited",
        "retryable": False,
        "trace_id": over.headers["x-trace-id"],
    }
    assert over.headers["retry-after"] == str(3_600 - 180)  # until the oldest task expires
    assert len(fake_ai.calls) == 6  # nothing called for it
    # Its live tasks still answer; another caller has room of their own.
    assert post(client, "/open", "k0").headers["idempotent-replayed"] == "true"
    assert post(client, "/open", "k3", user="bob").status_code == 200
    # A retry after the wait has room again (the oldest task expired).
    clock.advance(3_600 - 180)
    assert post(client, "/open", "k3").status_code == 200
    assert post(client, "/open", "k4").status_code == 429


def test_a_task_keeps_at_most_max_bytes_of_answers(
    make_store: Callable[[ManualClock], Store],
    clock: ManualClock,
    fake_ai: FakeBinding,
    app_client: AppClient,
) -> None:
    """Past `max_bytes`, a step is not saved and a response not kept: the request still
    answers; its retry runs again."""
    store = make_store(clock)
    client = app_client(task_app(store, fake_ai, Task(max_bytes=1_000)))
    fake_ai.default = Reply("x" * 2_000)
    first = post(client, "/open", "big")
    assert first.status_code == 200
    assert first.json() == {"first": "x" * 2_000, "second": "x" * 2_000}
    again = post(client, "/open", "big")
    assert again.status_code == 200
    assert "idempotent-replayed" not in again.headers
    assert len(fake_ai.calls) == 4
