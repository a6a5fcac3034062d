"""Two apps on one store, calling the same model with different breaker policies: they share the
model's breaker, and the open period is the one of the app whose failure opened it, stored with
the breaker's state, so both answer the same reopen time (`Retry-After`). A Redis key prefix of
their own keeps two apps apart. Both apps in process (ASGI), the fake Workers AI server over
real HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from app.service import create_app
from fixtures import Fail, FakeWorkersAI, Reply
from guards.stores import MemoryStore, RedisStore, SQLiteStore, Store

from ..conftest import STORE_TIMEOUT_S, AppClient, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
INCOMPATIBLE = Fail(code=5007, status=400)


def post(client: httpx.Client) -> httpx.Response:
    return client.post("/draft-reply", json={"message": "Where is my parcel?"})


def two_stores(kind: str, tmp_path: Path, prefix: str, request: pytest.FixtureRequest) -> tuple[Store, Store]:
    """Two apps' stores on the same state: one memory store for both (one process), two
    SQLite stores on one file, two Redis stores on one server under one prefix."""
    if kind == "memory":
        shared = MemoryStore()
        return shared, shared
    if kind == "sqlite":
        path = tmp_path / "guards.db"
        return SQLiteStore(path, timeout_s=STORE_TIMEOUT_S), SQLiteStore(path, timeout_s=STORE_TIMEOUT_S)
    url = request.getfixturevalue("redis_url")
    return (
        RedisStore(url, prefix=prefix, timeout_s=STORE_TIMEOUT_S),
        RedisStore(url, prefix=prefix, timeout_s=STORE_TIMEOUT_S),
    )


def retry_after(response: httpx.Response) -> int:
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "circuit_open"
    return int(response.headers["retry-after"])


@pytest.mark.parametrize("opener_reset_s", [300.0, 30.0])
def test_two_apps_sharing_a_breaker_agree_on_when_it_reopens(
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
    store_kind: str,
    tmp_path: Path,
    prefix: str,
    request: pytest.FixtureRequest,
    opener_reset_s: float,
) -> None:
    """App A's policy holds the breaker open 300 s or 30 s, app B's the other: whichever A's is,
    A's failure opens it, and both answer A's period."""
    other_s = 330.0 - opener_reset_s
    store_a, store_b = two_stores(store_kind, tmp_path, prefix, request)
    opener = workers_ai_settings(fake_workers_ai, breaker_failure_threshold=1, breaker_reset_s=opener_reset_s)
    other = workers_ai_settings(fake_workers_ai, breaker_failure_threshold=1, breaker_reset_s=other_s)
    app_a = app_client(create_app(opener, store=store_a, sleep=no_sleep))
    app_b = app_client(create_app(other, store=store_b, sleep=no_sleep))
    fake_workers_ai.script(MODEL, INCOMPATIBLE)
    assert post(app_a).status_code == 502  # app A's failure opens the shared breaker
    seen = [retry_after(post(app_b)), retry_after(post(app_a)), retry_after(post(app_b))]
    assert all(opener_reset_s - 3 <= wait <= opener_reset_s for wait in seen), seen
    assert len(fake_workers_ai.calls) == 1


def test_a_redis_prefix_of_its_own_keeps_an_apps_breaker_apart(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, redis_url: str, prefix: str
) -> None:
    settings = workers_ai_settings(fake_workers_ai, breaker_failure_threshold=1, breaker_reset_s=300.0)
    app_a = app_client(
        create_app(settings, store=RedisStore(redis_url, prefix=f"{prefix}a:"), sleep=no_sleep)
    )
    app_b = app_client(
        create_app(settings, store=RedisStore(f"{redis_url}?prefix={prefix}b:"), sleep=no_sleep)
    )
    fake_workers_ai.script(MODEL, INCOMPATIBLE, Reply("Still here."))
    assert post(app_a).status_code == 502
    assert retry_after(post(app_a)) >= 298
    assert post(app_b).status_code == 200  # its own breaker, closed
