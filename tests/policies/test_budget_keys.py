"""Budget keys: a client-chosen id cannot grow the store without bound, and the
example app refuses a malformed or oversized `x-user-id` before any budget is charged."""

from __future__ import annotations

import sqlite3
import tracemalloc
from pathlib import Path

import pytest
from fastapi import FastAPI

from app.service import create_app
from fixtures import FakeBinding, FakeWorkersAI, Reply
from guards import AI, Budget, Guards, header_key
from guards.stores import MemoryStore, RedisStore, SQLiteStore

from ..conftest import AppClient, guards_memory, no_sleep, workers_ai_settings


@pytest.mark.parametrize("user", ["u" * 129, "bad\x01id", "tab\tinside", "x" * 15_000])
def test_the_app_refuses_a_malformed_user_id_before_any_charge(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, user: str
) -> None:
    fake_workers_ai.default = Reply({"label": "billing", "confidence": 0.9})
    client = app_client(create_app(workers_ai_settings(fake_workers_ai, daily_call_limit=1), sleep=no_sleep))
    response = client.post("/summary", json={"text": "refund"}, headers={"x-user-id": user})
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_request"
    assert fake_workers_ai.calls == []
    # Nothing was charged: the one call of the day is still there for a valid id.
    ok = client.post("/summary", json={"text": "refund"}, headers={"x-user-id": "u" * 128})
    assert ok.json()["fallback"] is None


def test_the_openapi_document_states_the_user_id_constraint(fake_workers_ai: FakeWorkersAI) -> None:
    app = create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep)
    parameters = app.openapi()["paths"]["/summary"]["post"]["parameters"]
    (user_id,) = [p for p in parameters if p["name"] == "x-user-id"]
    schema = user_id["schema"]["anyOf"][0]
    assert schema["maxLength"] == 128
    assert "pattern" in schema


def label_app(guards: Guards) -> FastAPI:
    """A degrading route whose budget is keyed by `x-user-id`."""
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(
        model="@cf/test/model",
        fallback="fallback",
        budget=Budget(per_minute=10, per_day=10, key=header_key("x-user-id")),
    )
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label"})

    return app


def test_long_client_keys_do_not_grow_the_store_without_bound(tmp_path: Path, app_client: AppClient) -> None:
    """400 requests with distinct 15 KB ids: the SQLite file stays small (each key is stored
    hashed, at most 201 characters), where it grew by 15 KB a request before."""
    path = tmp_path / "guards.db"
    guards = Guards(FakeBinding(Reply("ok")), store=SQLiteStore(path, timeout_s=2))
    client = app_client(label_app(guards))
    for i in range(400):
        user = f"{i:05d}" + "k" * 15_000
        assert client.post("/label", headers={"x-user-id": user}).json()["fallback"] is None
    with sqlite3.connect(path) as conn:  # the WAL's pages into the file, to measure the file alone
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert path.stat().st_size < 3 * 1024 * 1024  # unbounded, 15 KB ids made over 12 MB


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_long_client_keys_do_not_grow_a_routes_memory_without_bound(
    kind: str, app_client: AppClient, request: pytest.FixtureRequest
) -> None:
    """200 requests with distinct 15 KB ids: what guards holds grows by far less than the ids
    (a route keeps each caller's prepared store step for short keys only; the memory store
    keeps long keys hashed; the Redis store keeps the arguments of short keys' steps only).
    Kept, they would hold 6 MB."""
    store = (
        MemoryStore() if kind == "memory" else RedisStore(request.getfixturevalue("redis_url"), timeout_s=2)
    )
    guards = Guards(FakeBinding(Reply("ok")), store=store)
    client = app_client(label_app(guards))
    assert client.post("/label", headers={"x-user-id": "warm-up"}).json()["fallback"] is None
    tracemalloc.start()
    try:
        before = guards_memory()
        for i in range(200):
            user = f"{i:05d}" + "k" * 15_000
            assert client.post("/label", headers={"x-user-id": user}).json()["fallback"] is None
        grown = guards_memory() - before
    finally:
        tracemalloc.stop()
    assert grown < 1024 * 1024, f"{grown} bytes kept for 200 callers"
