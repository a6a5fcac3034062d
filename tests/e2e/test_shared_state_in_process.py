"""Shared state in one process, for each store with a controllable clock: exact budgets and
breakers under bursts of concurrent requests, the daily cap's UTC midnight, and a store that
cannot be reached. (Across processes and machines: `test_shared_state`, run alone.)

Here the stores' timeout is the tests' (`STORE_TIMEOUT_S`): a loaded machine slows a step,
never makes it fail, so these tests run beside others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY

from fixtures import Fail, FakeBinding, ManualClock, Reply
from fixtures.redis_server import free_port
from guards import AI, Breaker, Budget, Guards, Price, Retry, header_key
from guards.stores import RedisStore, Store

from ..conftest import asgi_client, no_sleep
from .test_shared_state import MODEL


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
