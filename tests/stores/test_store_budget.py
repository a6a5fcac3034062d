"""`MemoryStore`: the budget (`charge_budget`: a daily cap per UTC day and an exact sliding-minute
rate limit, charged together or not at all), atomicity under concurrent tasks, bounded memory,
and breakers that keep no key while closed. Time moves only through the `ManualClock`."""

from __future__ import annotations

import asyncio
import gc
import random
import tracemalloc
import weakref

import pytest

from fixtures import ManualClock
from fixtures.stores import PiecewiseStore
from guards import Breaker, Outcome
from guards.stores import DAILY_TTL_S, Admission, MemoryStore, Store

from ..conftest import guards_memory

MIDNIGHT = 86_400.0 * 20_000  # 2024-10-04T00:00:00Z
T0 = MIDNIGHT + 3_600  # 01:00 UTC: every test starts here
NEXT_MIDNIGHT = MIDNIGHT + 86_400


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def memory_store(clock: ManualClock) -> MemoryStore:
    return MemoryStore(clock=clock)


def assert_refused(answer: Admission, by: str, retry_after_s: float) -> None:
    assert not answer.allowed, f"admitted, expected a refusal by {by}"
    assert answer.refused_by == by
    assert answer.retry_after_s == pytest.approx(retry_after_s)


def test_memory_store_is_a_store(memory_store: Store) -> None:
    assert isinstance(memory_store, Store)


# --- per_day ------------------------------------------------------------------------------------


def test_per_day_admits_exactly_the_limit_then_refuses_until_utc_midnight(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """A cap per calendar day, not a window: calls hours apart share it, and refusals name the
    time left until the next UTC midnight."""

    async def charge() -> Admission:
        return await store.charge_budget("alice", per_minute=None, per_day=3)

    async def scenario() -> None:
        assert await charge() == Admission(True)  # 01:00
        clock.set(MIDNIGHT + 5 * 3_600)
        assert await charge() == Admission(True)  # 05:00
        clock.set(MIDNIGHT + 12 * 3_600)
        assert await charge() == Admission(True)  # 12:00
        assert_refused(await charge(), "per_day", 12 * 3_600)
        clock.set(MIDNIGHT + 20 * 3_600 + 0.5)
        assert_refused(await charge(), "per_day", 4 * 3_600 - 0.5)
        clock.set(NEXT_MIDNIGHT - 0.25)
        assert_refused(await charge(), "per_day", 0.25)

    asyncio.run(scenario())


def test_per_day_refuses_from_the_first_call_after_the_limit(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """Exactly `per_day` admitted at one instant, at 01:00: the refusal waits 23 hours."""

    async def scenario() -> list[Admission]:
        return [await store.charge_budget("k", per_minute=None, per_day=5) for _ in range(12)]

    answers = asyncio.run(scenario())
    assert answers[:5] == [Admission(True)] * 5
    for answer in answers[5:]:
        assert_refused(answer, "per_day", 23 * 3_600)


def test_per_day_starts_from_zero_at_utc_midnight(store: PiecewiseStore, clock: ManualClock) -> None:
    """The day is the UTC calendar day, not 24 hours from the first call (01:00 to 00:00 is 23 h),
    and a new day owes nothing to the previous one: neither its charges nor its refusals."""

    async def charge() -> Admission:
        return await store.charge_budget("alice", per_minute=None, per_day=2)

    async def scenario() -> None:
        assert (await charge()).allowed  # 01:00
        assert (await charge()).allowed
        for hour in range(2, 24):  # refused all day long
            clock.set(MIDNIGHT + hour * 3_600)
            assert_refused(await charge(), "per_day", (24 - hour) * 3_600)
        clock.set(NEXT_MIDNIGHT - 0.25)
        assert_refused(await charge(), "per_day", 0.25)

        clock.set(NEXT_MIDNIGHT)  # 00:00 the next day: a fresh counter with the full limit
        assert await charge() == Admission(True)
        assert await charge() == Admission(True)
        assert_refused(await charge(), "per_day", 86_400)
        clock.set(NEXT_MIDNIGHT + 60)
        assert_refused(await charge(), "per_day", 86_400 - 60)

        clock.set(NEXT_MIDNIGHT + 86_400 + 10 * 3_600)  # the day after, at 10:00
        assert (await charge()).allowed
        assert (await charge()).allowed
        assert_refused(await charge(), "per_day", 14 * 3_600)

    asyncio.run(scenario())


def test_per_day_counts_a_day_that_began_just_before_midnight_separately(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """Calls seconds apart across midnight fall in different days."""

    async def charge() -> Admission:
        return await store.charge_budget("k", per_minute=None, per_day=1)

    async def scenario() -> None:
        clock.set(NEXT_MIDNIGHT - 1)
        assert (await charge()).allowed
        assert_refused(await charge(), "per_day", 1)
        clock.set(NEXT_MIDNIGHT)
        assert (await charge()).allowed
        assert_refused(await charge(), "per_day", 86_400)

    asyncio.run(scenario())


# --- per_minute ---------------------------------------------------------------------------------


def test_per_minute_sliding_window(store: PiecewiseStore, clock: ManualClock) -> None:
    async def charge() -> Admission:
        return await store.charge_budget("alice", per_minute=3, per_day=None)

    async def scenario() -> None:
        for _ in range(3):  # admitted at T0+0, +10, +20
            assert await charge() == Admission(True)
            clock.advance(10)
        clock.set(T0 + 20)
        assert_refused(await charge(), "per_minute", 40)  # the one at +0 leaves at +60
        clock.set(T0 + 59.75)
        assert_refused(await charge(), "per_minute", 0.25)
        clock.set(T0 + 60)  # the oldest has left: exactly one more fits
        assert await charge() == Admission(True)
        assert_refused(await charge(), "per_minute", 10)  # next to leave: the one at +10
        clock.set(T0 + 70)
        assert (await charge()).allowed
        assert_refused(await charge(), "per_minute", 10)  # then the one at +20

    asyncio.run(scenario())


def test_per_minute_admits_once_retry_after_has_passed(store: PiecewiseStore, clock: ManualClock) -> None:
    async def charge() -> Admission:
        return await store.charge_budget("k", per_minute=5, per_day=None)

    async def scenario() -> None:
        for _ in range(5):
            assert (await charge()).allowed
            clock.advance(3.25)
        for _ in range(3):
            refused = await charge()
            assert not refused.allowed
            assert refused.retry_after_s is not None
            assert refused.retry_after_s > 0
            clock.advance(refused.retry_after_s)
            assert (await charge()).allowed

    asyncio.run(scenario())


def scripted_times() -> list[float]:
    """A fixed, reproducible sequence of call times (seconds from T0): bursts, steady trickles,
    gaps, calls exactly on window edges. Quarter seconds keep the float sums exact."""
    rng = random.Random(20260101)
    times, t = [], 0.0
    for _ in range(600):
        t += rng.choice([0.0, 0.0, 0.25, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0])
        times.append(t)
    return [0.0, 0.0, 0.0, 0.0, 59.75, 60.0, 60.0, *(120.0 + x for x in times)]


def test_per_minute_is_exact_over_a_scripted_sequence(store: PiecewiseStore, clock: ManualClock) -> None:
    """Each call is admitted exactly when fewer than `per_minute` calls were admitted in the last
    60 seconds (no more, no fewer), and refusals name when the oldest leaves the window."""
    limit = 4

    async def scenario() -> tuple[list[float], int]:
        admitted: list[float] = []
        refusals = 0
        for t in scripted_times():
            clock.set(T0 + t)
            answer = await store.charge_budget("bob", per_minute=limit, per_day=None)
            in_window = [a for a in admitted if a > t - 60]
            if len(in_window) < limit:
                assert answer == Admission(True), f"refused at t={t} with {len(in_window)} in the window"
                admitted.append(t)
            else:
                assert not answer.allowed, f"admitted at t={t} with {len(in_window)} in the window"
                refusals += 1
                assert_refused(answer, "per_minute", in_window[0] + 60 - t)
        return admitted, refusals

    admitted, refusals = asyncio.run(scenario())
    assert len(admitted) > 100  # the sequence exercised both admissions...
    assert refusals > 100  # ...and refusals
    assert 3_600 < admitted[-1] < 22 * 3_600  # over hours, all within one UTC day
    for start in admitted:
        assert sum(1 for a in admitted if start <= a < start + 60) <= limit


# --- both limits: all or nothing ----------------------------------------------------------------


def test_a_per_day_refusal_leaves_the_minute_window_unchanged(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def charge() -> Admission:
        return await store.charge_budget("alice", per_minute=3, per_day=2)

    async def scenario() -> None:
        clock.set(NEXT_MIDNIGHT - 30)
        assert (await charge()).allowed  # 23:59:30, the day's cap is reached
        assert (await charge()).allowed
        clock.set(NEXT_MIDNIGHT - 20)
        assert_refused(await charge(), "per_day", 20)
        clock.set(NEXT_MIDNIGHT - 10)
        # Had the refusal at 23:59:40 taken a place in the window, this would be `per_minute`.
        assert_refused(await charge(), "per_day", 10)
        assert_refused(await charge(), "per_day", 10)
        clock.set(NEXT_MIDNIGHT)  # a new day: the window holds only the two admitted at 23:59:30
        assert await charge() == Admission(True)
        assert_refused(await charge(), "per_minute", 30)
        clock.set(NEXT_MIDNIGHT + 30)  # both 23:59:30 ones leave; one more fits today's cap
        assert (await charge()).allowed
        assert_refused(await charge(), "per_day", 86_400 - 30)

    asyncio.run(scenario())


def test_a_per_minute_refusal_leaves_the_daily_counter_unchanged(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def charge() -> Admission:
        return await store.charge_budget("alice", per_minute=2, per_day=4)

    async def scenario() -> None:
        assert (await charge()).allowed  # 01:00:00
        assert (await charge()).allowed
        for second in range(1, 11):  # ten refusals, which must not count against the day
            clock.set(T0 + second)
            assert_refused(await charge(), "per_minute", 60 - second)
        clock.set(T0 + 60)
        assert (await charge()).allowed  # the day's 3rd and 4th
        assert (await charge()).allowed
        # Both limits spent: the answer names the one that frees up last.
        assert_refused(await charge(), "per_day", 23 * 3_600 - 60)
        clock.set(T0 + 120)  # the window is free again, the day's cap of 4 is reached
        assert_refused(await charge(), "per_day", 23 * 3_600 - 120)

    asyncio.run(scenario())


def test_both_limits_match_a_reference_model_across_midnight(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """A scripted sequence over two UTC midnights, each answer checked against a plain model:
    admitted only if both limits allow, and then charged to both."""
    per_minute, per_day = 2, 40
    rng = random.Random(4242)
    times, t = [], NEXT_MIDNIGHT - 2 * 3_600
    while t < NEXT_MIDNIGHT + 86_400 + 2 * 3_600:
        times.append(t)
        t += rng.choice([0.0, 0.0, 0.0, 0.25, 5.0, 20.0, 60.0, 300.0, 900.0])

    async def scenario() -> tuple[int, int, int]:
        admitted: list[float] = []
        counts = [0, 0, 0]  # admissions, per_minute refusals, per_day refusals
        for t in times:
            clock.set(t)
            answer = await store.charge_budget("carol", per_minute=per_minute, per_day=per_day)
            in_window = [a for a in admitted if a > t - 60]
            today = [a for a in admitted if a // 86_400 == t // 86_400]
            minute_full, day_full = len(in_window) >= per_minute, len(today) >= per_day
            expected_retry = {
                "per_minute": in_window[0] + 60 - t if minute_full else None,
                "per_day": 86_400 - t % 86_400 if day_full else None,
            }
            if not (minute_full or day_full):
                assert answer == Admission(True), f"refused at {t - MIDNIGHT}"
                admitted.append(t)
                counts[0] += 1
                continue
            assert not answer.allowed, f"admitted at {t - MIDNIGHT}"
            assert answer.refused_by in [
                limit for limit, retry in expected_retry.items() if retry is not None
            ]
            assert answer.retry_after_s == pytest.approx(expected_retry[answer.refused_by])
            counts[1 if answer.refused_by == "per_minute" else 2] += 1
        return counts[0], counts[1], counts[2]

    admissions, minute_refusals, day_refusals = asyncio.run(scenario())
    # All three answers happened, many times:
    assert admissions > 80
    assert minute_refusals > 40
    assert day_refusals > 400


def test_keys_are_independent(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        assert (await store.charge_budget("a", per_minute=None, per_day=1)).allowed
        assert_refused(await store.charge_budget("a", per_minute=None, per_day=1), "per_day", 23 * 3_600)
        assert (await store.charge_budget("b", per_minute=None, per_day=1)).allowed
        assert (await store.charge_budget("a:day", per_minute=None, per_day=1)).allowed

        assert (await store.charge_budget("c", per_minute=1, per_day=None)).allowed
        assert_refused(await store.charge_budget("c", per_minute=1, per_day=None), "per_minute", 60)
        assert (await store.charge_budget("d", per_minute=1, per_day=None)).allowed
        assert (await store.charge_budget("c:rate", per_minute=1, per_day=None)).allowed

        # Every refused key is still refused: the others' admissions charged nothing to it.
        assert not (await store.charge_budget("a", per_minute=None, per_day=1)).allowed
        assert not (await store.charge_budget("c", per_minute=1, per_day=None)).allowed

    asyncio.run(scenario())


def test_none_disables_a_limit(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        # Neither: no limit at all.
        answers = [await store.charge_budget("free", per_minute=None, per_day=None) for _ in range(5_000)]
        assert answers == [Admission(True)] * 5_000

        # No per_minute: 300 at one instant, up to the daily cap.
        answers = [await store.charge_budget("daily", per_minute=None, per_day=300) for _ in range(301)]
        assert answers[:300] == [Admission(True)] * 300
        assert answers[300].refused_by == "per_day"

        # No per_day: 100 a minute for 50 minutes, 5,000 in one UTC day.
        for minute in range(50):
            clock.set(T0 + 60 * minute)
            for _ in range(100):
                assert await store.charge_budget("minutely", per_minute=100, per_day=None) == Admission(True)
            assert_refused(
                await store.charge_budget("minutely", per_minute=100, per_day=None), "per_minute", 60
            )

    asyncio.run(scenario())


# --- atomicity ----------------------------------------------------------------------------------


def test_concurrent_calls_admit_exactly_per_day(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        answers = await asyncio.gather(
            *(store.charge_budget("burst", per_minute=None, per_day=20) for _ in range(200))
        )
        assert sum(a.allowed for a in answers) == 20
        assert {a.refused_by for a in answers if not a.allowed} == {"per_day"}
        assert not (await store.charge_budget("burst", per_minute=None, per_day=20)).allowed

    asyncio.run(scenario())


def test_concurrent_calls_admit_exactly_per_minute(store: PiecewiseStore, clock: ManualClock) -> None:
    async def burst() -> list[Admission]:
        return await asyncio.gather(
            *(store.charge_budget("burst", per_minute=20, per_day=None) for _ in range(200))
        )

    async def scenario() -> None:
        answers = await burst()
        assert sum(a.allowed for a in answers) == 20
        assert {a.refused_by for a in answers if not a.allowed} == {"per_minute"}
        clock.advance(60)  # the window empties: again exactly 20, the refusals took no place in it
        answers = await burst()
        assert sum(a.allowed for a in answers) == 20

    asyncio.run(scenario())


def test_concurrent_calls_with_both_limits_admit_the_smaller(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def burst() -> list[Admission]:
        return await asyncio.gather(
            *(store.charge_budget("burst", per_minute=20, per_day=30) for _ in range(200))
        )

    async def scenario() -> None:
        assert sum(a.allowed for a in await burst()) == 20
        clock.advance(60)
        assert sum(a.allowed for a in await burst()) == 10  # the day's remaining 10
        clock.advance(60)
        assert sum(a.allowed for a in await burst()) == 0

    asyncio.run(scenario())


# --- bounded memory -----------------------------------------------------------------------------


def test_rate_key_expires_a_minute_after_its_last_admission(
    memory_store: MemoryStore, clock: ManualClock
) -> None:
    async def charge() -> Admission:
        return await memory_store.charge_budget("k", per_minute=2, per_day=None)

    async def scenario() -> None:
        assert (await charge()).allowed  # T0
        clock.set(T0 + 30)
        assert (await charge()).allowed  # the last admission
        clock.set(T0 + 50)
        assert not (await charge()).allowed  # a refusal does not extend the key
        assert len(memory_store) == 1
        clock.set(T0 + 89.75)
        assert len(memory_store) == 1
        clock.set(T0 + 90)
        assert len(memory_store) == 0

    asyncio.run(scenario())


def test_daily_key_expires_daily_ttl_after_its_first_unit(
    memory_store: MemoryStore, clock: ManualClock
) -> None:
    async def charge() -> Admission:
        return await memory_store.charge_budget("k", per_minute=None, per_day=3)

    async def scenario() -> None:
        assert (await charge()).allowed  # T0: the first unit
        clock.set(T0 + 12 * 3_600)
        assert (await charge()).allowed  # later units do not push the expiry back
        assert len(memory_store) == 1
        clock.set(T0 + DAILY_TTL_S - 0.25)
        assert len(memory_store) == 1
        clock.set(T0 + DAILY_TTL_S)
        assert len(memory_store) == 0

    asyncio.run(scenario())


class Key(str):
    """A key the test can hold a weak reference to, to see whether the store still keeps it."""


async def fill(memory_store: MemoryStore, breaker: Breaker, n: int) -> list[weakref.ref[Key]]:
    """`n` budgets of each kind (daily only, per-minute only, both) and `n` open breakers;
    returns weak references to the breaker keys."""
    for i in range(n):
        assert (await memory_store.charge_budget(f"day-{i}", per_minute=None, per_day=5)).allowed
        assert (await memory_store.charge_budget(f"rate-{i}", per_minute=5, per_day=None)).allowed
        assert (await memory_store.charge_budget(f"both-{i}", per_minute=5, per_day=5)).allowed
    keys = [Key(f"breaker-{i}") for i in range(n)]
    for k in keys:
        await memory_store.breaker_record(k, breaker, Outcome.failure, probe=None)  # an open breaker
    return [weakref.ref(k) for k in keys]


def test_memory_is_bounded(clock: ManualClock) -> None:
    """`len(store)` counts live keys; the memory the store holds and the weak references to the
    breaker keys show the expired ones really leave memory with the next operation after the
    sweep interval (no private attribute read)."""
    n = 500
    store = MemoryStore(clock=clock, sweep_interval_s=60)
    breaker = Breaker(failure_threshold=1, reset_timeout_s=30)
    tracemalloc.start()
    try:
        empty = guards_memory()
        refs = asyncio.run(fill(store, breaker, n))
        assert len(store) == 5 * n  # daily, rate, daily + rate, breaker
        full = guards_memory()
        assert full - empty > 5 * n * 50  # the measure sees what the store holds
        gc.collect()
        assert all(r() is not None for r in refs)  # only the store holds them now

        clock.advance(DAILY_TTL_S + breaker.ttl_s + 60 + 1)  # past every TTL and the sweep interval
        assert len(store) == 0

        # The next operation sweeps the expired keys out of memory, not just out of the count.
        assert asyncio.run(store.charge_budget("after", per_minute=1, per_day=1)).allowed
        assert len(store) == 2
        gc.collect()
        assert all(r() is None for r in refs), "expired breaker keys are still held after the sweep"
        swept = guards_memory()
        assert swept - empty < (full - empty) / 50, f"{swept - empty} bytes still held of {full - empty}"
    finally:
        tracemalloc.stop()


def test_expired_key_is_not_counted_before_the_sweep(clock: ManualClock) -> None:
    store = MemoryStore(clock=clock, sweep_interval_s=10 * DAILY_TTL_S)  # no sweep during the test
    breaker = Breaker(failure_threshold=1, reset_timeout_s=30)

    async def scenario() -> None:
        assert (await store.charge_budget("short", per_minute=1, per_day=None)).allowed
        assert (await store.charge_budget("long", per_minute=None, per_day=1)).allowed
        await store.breaker_record("breaker", breaker, Outcome.failure, probe=None)  # open
        assert len(store) == 3
        clock.advance(60)
        assert len(store) == 2
        assert (await store.charge_budget("short", per_minute=1, per_day=None)).allowed
        assert len(store) == 3
        clock.set(T0 + breaker.ttl_s)
        assert len(store) == 1
        # Expired but not yet swept: reads treat it as gone. An open breaker read after its key
        # expired would half-open and hand out a probe; a forgotten one is closed.
        decision = await store.breaker_admit("breaker", breaker)
        assert decision.allowed
        assert decision.probe is None
        assert decision.state == "closed"
        clock.set(T0 + DAILY_TTL_S)
        assert len(store) == 0

    asyncio.run(scenario())


# --- breakers -----------------------------------------------------------------------------------


def test_closed_breakers_keep_no_key(memory_store: MemoryStore) -> None:
    """A healthy breaker costs no memory, however many models are called."""
    breaker = Breaker(failure_threshold=3, reset_timeout_s=30)

    async def scenario() -> None:
        for i in range(20):
            await memory_store.breaker_admit(f"breaker:{i}", breaker)
            await memory_store.breaker_record(f"breaker:{i}", breaker, Outcome.success, probe=None)
        assert len(memory_store) == 0

    asyncio.run(scenario())
