"""Slow calls count (`Breaker(slow_call_s=...)`), and recovery is seen sooner
(`Breaker(probe_interval_s=...)`): through guarded routes, on every store.

The stores' time is a `ManualClock`; a call's duration is real (a scripted delay of the fake,
well above or below `slow_call_s`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import httpx
from fastapi import FastAPI

from fixtures import Fail, FakeBinding, ManualClock, Reply, Stream, Text
from fixtures.stores import PiecewiseStore
from guards import AI, Breaker, EventStream, Guards, Retry
from guards.stores import Passage, Step, Store

from ..conftest import asgi_client, no_sleep

MODEL = "@cf/test/model"
SECOND = "@cf/test/second"
BROKEN = Fail(code=5035, status=403)  # not retried, counted by the breaker
#: Slow and fast, far enough apart that a loaded machine does not blur them.
SLOW_S, SLOW_DELAY_S = 0.15, 0.3
SLOW = Breaker(failure_threshold=2, window_s=60, slow_call_s=SLOW_S, minimum_calls=4, reset_timeout_s=30)


class Counting:
    """`store`, with each `step` it is asked kept."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.steps: list[Step] = []

    async def step(self, step: Step) -> Passage:
        self.steps.append(step)
        return await self.store.step(step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def worker(store: Store, fake: FakeBinding, breaker: Breaker, **route: Any) -> tuple[FastAPI, Counting]:
    """One worker: an app on `store` (counted) with a degrading route and a degrading stream."""
    counting = Counting(store)
    guards = Guards(fake, store=counting, sleep=no_sleep)  # type: ignore[arg-type]
    app = FastAPI()
    guards.install(app)
    options: dict[str, Any] = {"model": MODEL, "breaker": breaker, "retry": Retry(attempts=1), **route}

    @app.post("/degrading")
    @guards.route(fallback="fallback", **options)
    async def degrading(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label this"})

    @app.post("/stream")
    @guards.route(**options)
    async def stream(ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": "label this"})

    return app, counting


async def post(app: FastAPI, path: str = "/degrading") -> httpx.Response:
    async with asgi_client(app, timeout=30) as client:
        return await client.post(path)


async def served(app: FastAPI) -> str:
    """The data of a degrading route's answer, or `fallback:<reason>`."""
    body = (await post(app)).json()
    return body["data"] if body["fallback"] is None else f"fallback:{body['fallback']['reason']}"


# --- slow calls ---------------------------------------------------------------------------------


def test_a_slow_model_opens_its_breaker_after_minimum_calls_and_the_threshold(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock
) -> None:
    """Every call answers, slowly. The first three (fewer than `minimum_calls` in the window)
    count as successes; the fourth and fifth count as failures, which opens the breaker: the
    sixth request is not called."""
    fake = FakeBinding(Reply("slow answer", delay_s=SLOW_DELAY_S))
    app, _ = worker(make_store(manual_clock), fake, SLOW)

    async def scenario() -> list[str]:
        return [await served(app) for _ in range(6)]

    assert anyio.run(scenario) == ["slow answer"] * 5 + ["fallback:circuit_open"]
    assert len(fake.calls) == 5


def test_below_minimum_calls_slow_calls_do_not_open_it(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock
) -> None:
    """Slow calls spread so that the window never holds `minimum_calls` of them: none counts."""
    fake = FakeBinding(Reply("slow answer", delay_s=SLOW_DELAY_S))
    app, _ = worker(make_store(manual_clock), fake, SLOW)

    async def scenario() -> list[str]:
        answers = []
        for _ in range(6):
            answers.append(await served(app))
            manual_clock.advance(25)  # three calls in any 60 s
        return answers

    assert anyio.run(scenario) == ["slow answer"] * 6


def test_fast_calls_and_a_breaker_without_slow_call_s_never_open_on_slowness(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock
) -> None:
    """Fast answers under a slow-call breaker, and slow ones under today's breaker: all served.
    A route without `slow_call_s` writes nothing for a success (one store step per request);
    one with it reports each success (two)."""
    store = make_store(manual_clock)
    fast = FakeBinding(Reply("fast answer"))
    slow = FakeBinding(Reply("slow answer", delay_s=SLOW_DELAY_S))
    counting_app, counted = worker(store, fast, SLOW)
    plain_app, plain = worker(store, slow, Breaker(failure_threshold=2, window_s=60), model=SECOND)

    async def scenario() -> tuple[list[str], list[str]]:
        return [await served(counting_app) for _ in range(8)], [await served(plain_app) for _ in range(6)]

    fast_answers, slow_answers = anyio.run(scenario)
    assert fast_answers == ["fast answer"] * 8
    assert slow_answers == ["slow answer"] * 6
    assert len(counted.steps) == 16
    assert len(plain.steps) == 6


def test_a_stream_counts_the_time_to_its_first_output(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock
) -> None:
    """A stream whose first output comes late is slow however quick the rest; one whose first
    output is quick is not, however long it then runs."""
    fake = FakeBinding()
    app, _ = worker(make_store(manual_clock), fake, SLOW)

    async def scenario() -> tuple[list[int], str]:
        fake.script(
            MODEL, *[Stream([Text("late "), Text("start")], interval_s=0.0, delay_s=SLOW_DELAY_S)] * 3
        )
        # The first output after 0.03 s, the whole stream after 0.24 s (over `SLOW_S`: the sleeps
        # between parts only ever last longer).
        fake.script(MODEL, *[Stream([Text("quick ")] * 8, interval_s=0.03)] * 6)
        statuses = [(await post(app, "/stream")).status_code for _ in range(9)]
        return statuses, await served(app)

    statuses, after = anyio.run(scenario)
    assert statuses == [200] * 9
    assert after == "Hello from the fake model."  # closed: the three late starts were too few
    fake.script(MODEL, *[Stream([Text("late")], delay_s=SLOW_DELAY_S)] * 2)

    async def two_more() -> list[str]:
        for _ in range(2):
            await post(app, "/stream")
        return [await served(app)]

    assert anyio.run(two_more) == ["fallback:circuit_open"]


# --- recovery: probe_interval_s ----------------------------------------------------------------

RECOVERING = Breaker(failure_threshold=2, reset_timeout_s=30, probe_interval_s=5, success_threshold=1)


def recovery(
    make_store: Callable[[ManualClock], PiecewiseStore],
    clock: ManualClock,
    kind: str,
    breaker: Breaker,
    back_at: float,
) -> tuple[list[tuple[float, str]], FakeBinding]:
    """Two workers on one store; the first model fails until `back_at` seconds, then answers.
    Every 5 s each worker serves one request. Returns (time, what served) per request, and
    the fake."""
    start = clock.time()
    store_a = make_store(clock)
    store_b = store_a if kind == "memory" else make_store(clock)

    def outcome(model: str, inputs: Any) -> Any:
        if model == SECOND:
            return Reply("second")
        return BROKEN if clock.time() - start < back_at else Reply("first")

    fake = FakeBinding(outcome)
    app_a, _ = worker(store_a, fake, breaker, fallbacks=[SECOND])
    app_b, _ = worker(store_b, fake, breaker, fallbacks=[SECOND])

    async def scenario() -> list[tuple[float, str]]:
        seen = []
        for _ in range(20):
            for app in (app_a, app_b):
                seen.append((clock.time() - start, await served(app)))
            clock.advance(5)
        return seen

    return anyio.run(scenario), fake


def test_a_model_back_at_61_s_serves_again_at_65_s_not_90_s(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, store_kind: str
) -> None:
    """Reset 30 s, probe interval 5 s: the breaker opens at 0 s; a probe every 5 s from 30 s,
    one across both workers, each failing until the model is back at 61 s; the probe at 65 s
    answers. A request whose probe failed is served by the next model all the same."""
    seen, fake = recovery(make_store, manual_clock, store_kind, RECOVERING, back_at=61)
    first_served = min(t for t, what in seen if what == "first")
    assert first_served == 65
    assert all(what == "first" for t, what in seen if t >= 65)
    assert all(what == "second" for t, what in seen if t < 65)  # never a fallback value
    probes = [call for call in fake.calls_to(MODEL)]
    assert len(probes) == 2 + len(range(30, 65, 5)) + sum(1 for t, _ in seen if t >= 65)


def test_without_a_probe_interval_it_waits_a_whole_reset_timeout(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, store_kind: str
) -> None:
    """The probe interval off (`probe_interval_s=None`), for comparison: the probe at 60 s
    fails, the next is at 90 s."""
    breaker = Breaker(failure_threshold=2, reset_timeout_s=30, success_threshold=1, probe_interval_s=None)
    seen, _ = recovery(make_store, manual_clock, store_kind, breaker, back_at=61)
    assert min(t for t, what in seen if what == "first") == 90


def test_by_default_a_failed_probe_reopens_for_five_seconds(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, store_kind: str
) -> None:
    """`probe_interval_s` left unset: the default interval, 5 s, as `RECOVERING` sets it."""
    breaker = Breaker(failure_threshold=2, reset_timeout_s=30, success_threshold=1)
    seen, _ = recovery(make_store, manual_clock, store_kind, breaker, back_at=61)
    assert min(t for t, what in seen if what == "first") == 65


def test_one_probe_at_a_time_across_two_workers_under_a_probe_interval(
    make_store: Callable[[ManualClock], PiecewiseStore], manual_clock: ManualClock, store_kind: str
) -> None:
    """At each probe time, bursts on both workers while the probe is in flight: exactly one call
    to the first model across both; the rest go to the second model."""
    store_a = make_store(manual_clock)
    store_b = store_a if store_kind == "memory" else make_store(manual_clock)
    fake = FakeBinding(
        lambda model, inputs: Reply("second") if model == SECOND else Fail(code=5035, status=403, delay_s=0.2)
    )
    app_a, _ = worker(store_a, fake, RECOVERING, fallbacks=[SECOND])
    app_b, _ = worker(store_b, fake, RECOVERING, fallbacks=[SECOND])

    async def burst(app: FastAPI, count: int) -> list[str]:
        async with asgi_client(app, timeout=30) as client:
            responses = await asyncio.gather(*(client.post("/degrading") for _ in range(count)))
        return [r.json()["data"] for r in responses]

    async def scenario() -> list[int]:
        for app in (app_a, app_a, app_b):  # opens it; B learns it
            await served(app)
        probes = []
        for _ in range(3):
            manual_clock.advance(30 if not probes else 5)
            before = len(fake.calls_to(MODEL))
            a, b = await asyncio.gather(burst(app_a, 10), burst(app_b, 10))
            assert a + b == ["second"] * 20
            probes.append(len(fake.calls_to(MODEL)) - before)
        return probes

    assert anyio.run(scenario) == [1, 1, 1]
