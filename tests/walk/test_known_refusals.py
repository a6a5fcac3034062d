"""A refusal cheaper than a call: a worker that heard from its store that a model's breaker is
open, or that it cools down, until some time, refuses it without a store operation until then,
and answers exactly what the store's refusal answers. Two apps on one store (one `MemoryStore`,
two SQLite stores on one file, two Redis stores under one prefix) are two workers; the store's
clock is a `ManualClock`; each worker's store operations are counted by a wrapper."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import httpx
from fastapi import FastAPI

from fixtures import Fail, FakeBinding, ManualClock, Reply
from fixtures.stores import PiecewiseStore
from guards import AI, Breaker, Budget, Guards, Price, Retry, header_key
from guards.stores import Passage, Step, Store

from ..conftest import LogLines, asgi_client, no_sleep

MODEL = "@cf/test/model"
SECOND = "@cf/test/second"
BREAKER = Breaker(failure_threshold=2, reset_timeout_s=30.0, success_threshold=1)
BROKEN = Fail(code=5035, status=403)  # not retried, counted by the breaker


class Counting:
    """`store`, with each `step` it is asked kept (every guard's operation is one step)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.steps: list[Step] = []

    async def step(self, step: Step) -> Passage:
        self.steps.append(step)
        return await self.store.step(step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def worker(store: Store, fake: FakeBinding, **route: Any) -> tuple[FastAPI, Counting]:
    """One worker: an app on `store` (counted) with a strict and a degrading route calling the
    same model (`route`: their other options)."""
    counting = Counting(store)
    guards = Guards(
        fake,
        store=counting,  # type: ignore[arg-type]
        sleep=no_sleep,
        prices={MODEL: Price(input_token=0.001, output_token=0.01)},
    )
    app = FastAPI()
    guards.install(app)
    options: dict[str, Any] = {"model": MODEL, "breaker": BREAKER, "retry": Retry(attempts=1), **route}

    @app.post("/strict")
    @guards.route(**options)
    async def strict(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label this"})

    @app.post("/degrading")
    @guards.route(fallback="fallback", **options)
    async def degrading(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label this"})

    return app, counting


def two_stores(
    make_store: Callable[[ManualClock], PiecewiseStore], clock: ManualClock, kind: str
) -> tuple[Store, Store]:
    first = make_store(clock)
    return first, first if kind == "memory" else make_store(clock)


async def post(app: FastAPI, path: str, user: str = "u") -> httpx.Response:
    async with asgi_client(app) as client:
        return await client.post(path, headers={"x-user-id": user})


def answer(response: httpx.Response) -> tuple[int, str | None, Any]:
    """What a client is told: status, Retry-After, the body (its trace id left out)."""
    body = response.json()
    if isinstance(body, dict):
        body.pop("trace_id", None)
    return response.status_code, response.headers.get("retry-after"), body


def test_an_open_breaker_refuses_without_a_store_operation_until_it_half_opens(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, store_kind: str
) -> None:
    """Worker A's failures open the breaker: A refuses on both routes with no store operation,
    and answers what worker B (which knows nothing yet, so asks the store) answers."""
    store_a, store_b = two_stores(make_store, manual_clock, store_kind)
    fake = FakeBinding()
    app_a, counted_a = worker(store_a, fake)
    app_b, counted_b = worker(store_b, fake)

    async def scenario() -> None:
        fake.script(MODEL, BROKEN, BROKEN)
        for _ in range(2):
            assert (await post(app_a, "/degrading")).json()["fallback"]["reason"] == "provider_error"
        manual_clock.advance(10)
        counted_a.steps.clear()
        for path in ("/strict", "/degrading", "/strict", "/degrading"):
            told_b = answer(await post(app_b, path))  # B asks the store
            steps_b = len(counted_b.steps)
            told_a = answer(await post(app_a, path))
            assert told_a == told_b
            assert len(counted_b.steps) == steps_b  # B now knows too
        assert counted_a.steps == []
        assert len(counted_b.steps) == 1  # B's first refusal, one step for both routes
        strict = await post(app_a, "/strict")
        assert strict.status_code == 503
        assert strict.json()["error"] == "circuit_open"
        assert strict.headers["retry-after"] == "20"
        degrading = (await post(app_a, "/degrading")).json()
        assert degrading["data"] == "fallback"
        assert degrading["fallback"]["reason"] == "circuit_open"
        assert counted_a.steps == []
        manual_clock.advance(20)  # half-open: the store decides the probe
        fake.default = Reply("answered")
        served = await post(app_a, "/degrading")
        assert served.json() == {"ok": True, "data": "answered", "fallback": None}
        assert len(counted_a.steps) >= 1

    anyio.run(scenario)
    assert len(fake.calls) == 3


def test_a_cooldown_refuses_without_a_store_operation_until_it_ends(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, store_kind: str
) -> None:
    """A 429 with `Retry-After: 20` cools the model down: refused with no store operation, the
    same answer as a worker that asks the store, until the 20 s are over."""
    store_a, store_b = two_stores(make_store, manual_clock, store_kind)
    fake = FakeBinding()
    app_a, counted_a = worker(store_a, fake)
    app_b, _ = worker(store_b, fake)

    async def scenario() -> None:
        fake.script(MODEL, Fail(status=429, retry_after="20"))
        first = await post(app_a, "/strict")
        assert (first.status_code, first.json()["error"]) == (503, "model_rate_limited")
        counted_a.steps.clear()
        manual_clock.advance(5)
        for path in ("/strict", "/degrading"):
            assert answer(await post(app_a, path)) == answer(await post(app_b, path))
        strict = await post(app_a, "/strict")
        assert (strict.status_code, strict.headers["retry-after"]) == (503, "15")
        assert strict.json()["error"] == "circuit_open"
        assert counted_a.steps == []
        manual_clock.advance(15)
        fake.default = Reply("answered")
        assert (await post(app_a, "/degrading")).json()["data"] == "answered"
        # The admission, and the success that ends the failure the breaker counted.
        assert len(counted_a.steps) == 2

    anyio.run(scenario)
    assert len(fake.calls) == 2


def test_after_the_reset_exactly_one_probe_across_two_workers(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, store_kind: str
) -> None:
    """Both workers know the breaker open; past its reset time both ask the store again, which
    lets one probe through, across both."""
    store_a, store_b = two_stores(make_store, manual_clock, store_kind)
    fake = FakeBinding()
    app_a, counted_a = worker(store_a, fake)
    app_b, counted_b = worker(store_b, fake)

    async def burst(app: FastAPI, count: int) -> list[dict[str, Any]]:
        async with asgi_client(app, timeout=30) as client:
            responses = await asyncio.gather(
                *(client.post("/degrading", headers={"x-user-id": "u"}) for _ in range(count))
            )
        return [r.json() for r in responses]

    async def scenario() -> list[dict[str, Any]]:
        fake.script(MODEL, BROKEN, BROKEN)
        await burst(app_a, 1)
        await burst(app_a, 1)
        await burst(app_b, 1)  # B learns it from the store
        counted_a.steps.clear()
        counted_b.steps.clear()
        await burst(app_a, 5)
        await burst(app_b, 5)
        assert counted_a.steps == counted_b.steps == []
        manual_clock.advance(30)  # half-open now
        fake.default = Reply("answered", delay_s=0.2)  # the probe is in flight while the rest arrive
        a, b = await asyncio.gather(burst(app_a, 25), burst(app_b, 25))
        return a + b

    bodies = anyio.run(scenario)
    assert len(fake.calls) == 3  # two failures, then exactly one probe
    assert sum(b["fallback"] is None for b in bodies) == 1
    assert {b["fallback"]["reason"] for b in bodies if b["fallback"]} == {"circuit_open"}


def test_a_chain_whose_first_model_is_known_open_asks_the_store_from_the_second(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, guards_log: LogLines
) -> None:
    """The first model is known open: it is skipped (and said so, as the store's skip is), and
    the one store step starts at the second model, which answers."""
    fake = FakeBinding()
    app, counted = worker(make_store(manual_clock), fake, fallbacks=[SECOND])

    async def scenario() -> None:
        fake.script(MODEL, BROKEN, BROKEN)
        fake.script(SECOND, *[Reply("second")] * 3)
        for _ in range(2):  # the first fails, the second answers
            assert (await post(app, "/degrading")).json()["data"] == "second"
        manual_clock.advance(10)
        counted.steps.clear()
        guards_log.lines.clear()
        served = await post(app, "/degrading")
        assert served.json() == {"ok": True, "data": "second", "fallback": None}
        assert served.headers["x-ai-fallback"] == SECOND

    anyio.run(scenario)
    assert len(counted.steps) == 1
    assert counted.steps[0].legs == ((f"guards:cooldown:{SECOND}", f"guards:breaker:{SECOND}"),)
    assert [call.model for call in fake.calls].count(MODEL) == 2
    skips = guards_log.events("skip")
    assert [(s["model"], s["reason"], s["retry_after_s"]) for s in skips] == [(MODEL, "circuit_open", 20.0)]


def test_a_breaker_another_worker_closed_is_noticed_at_the_first_request_after_the_reset(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, store_kind: str
) -> None:
    """B knows the breaker open; after the reset time A's probe closes it: B's next request asks
    the store and calls the model."""
    store_a, store_b = two_stores(make_store, manual_clock, store_kind)
    fake = FakeBinding()
    app_a, _ = worker(store_a, fake)
    app_b, counted_b = worker(store_b, fake)

    async def scenario() -> None:
        fake.script(MODEL, BROKEN, BROKEN)
        for _ in range(2):
            await post(app_a, "/degrading")
        assert (await post(app_b, "/degrading")).json()["fallback"]["reason"] == "circuit_open"
        manual_clock.advance(30)
        fake.default = Reply("answered")
        assert (await post(app_a, "/degrading")).json()["data"] == "answered"  # the probe closes it
        counted_b.steps.clear()
        assert (await post(app_b, "/degrading")).json()["data"] == "answered"
        assert len(counted_b.steps) == 1

    anyio.run(scenario)
    assert len(fake.calls) == 4


def test_requests_refused_from_memory_charge_no_budget(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock
) -> None:
    """Refused on every leg, from the store or from memory: no rate, daily cap or spend
    charged."""
    store = make_store(manual_clock)
    fake = FakeBinding()
    budget = Budget(per_minute=4, per_day=4, spend_per_day=100.0, key=header_key("x-user-id"))
    app, counted = worker(store, fake, budget=budget, max_tokens=50)

    async def scenario() -> float:
        fake.script(MODEL, Reply("answered"), BROKEN, BROKEN)
        for _ in range(3):  # three of the four calls a minute and a day
            await post(app, "/degrading")
        spent = await store.spent("guards:degrading:u")
        counted.steps.clear()
        for _ in range(10):
            assert (await post(app, "/degrading")).json()["fallback"]["reason"] == "circuit_open"
        assert counted.steps == []
        assert await store.spent("guards:degrading:u") == spent
        manual_clock.advance(30)
        fake.default = Reply("answered")
        told = [(await post(app, "/degrading")).json() for _ in range(2)]
        assert [body["data"] for body in told] == ["answered", "fallback"]
        assert told[1]["fallback"]["reason"] == "budget_exceeded"
        return spent

    spent = anyio.run(scenario)
    assert spent > 0
    assert len(fake.calls) == 4
