"""`MemoryStore`: counters (`take`), the sliding-window rate limit (`throttle`), atomicity under
concurrent tasks, and bounded memory. Time moves only through the `ManualClock`."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref

import pytest

from fixtures import ManualClock
from guards import Breaker, Outcome
from guards.stores import Admission, MemoryStore, Store

T0 = ManualClock().time()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> MemoryStore:
    return MemoryStore(clock=clock)


def test_memory_store_is_a_store(store: MemoryStore) -> None:
    assert isinstance(store, Store)


# --- take ---------------------------------------------------------------------------------------


def test_take_admits_exactly_limit_then_refuses_with_time_left(
    store: MemoryStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        assert await store.take("day:alice", limit=3, ttl_s=100) == Admission(True)
        clock.advance(10)
        assert (await store.take("day:alice", limit=3, ttl_s=100)).allowed
        assert (await store.take("day:alice", limit=3, ttl_s=100)).allowed
        refused = await store.take("day:alice", limit=3, ttl_s=100)
        assert not refused.allowed
        assert refused.retry_after_s == pytest.approx(90)
        clock.advance(40)
        refused = await store.take("day:alice", limit=3, ttl_s=100)
        assert not refused.allowed
        assert refused.retry_after_s == pytest.approx(50)

    asyncio.run(scenario())


def test_take_refusals_do_not_charge(store: MemoryStore) -> None:
    """Refused calls are not counted: once the limit is reached, the counter stays there."""

    async def scenario() -> None:
        results = [await store.take("k", limit=2, ttl_s=100) for _ in range(10)]
        assert [r.allowed for r in results] == [True, True] + [False] * 8

    asyncio.run(scenario())


def test_take_keys_are_independent(store: MemoryStore) -> None:
    async def scenario() -> None:
        assert (await store.take("a", limit=1, ttl_s=100)).allowed
        assert not (await store.take("a", limit=1, ttl_s=100)).allowed
        assert (await store.take("b", limit=1, ttl_s=100)).allowed

    asyncio.run(scenario())


def test_take_key_expires_ttl_after_its_first_unit(store: MemoryStore, clock: ManualClock) -> None:
    """Later units do not push the expiry back: the counter lives `ttl_s` from its first unit."""

    async def scenario() -> None:
        assert (await store.take("k", limit=2, ttl_s=100)).allowed  # t=0: first unit
        clock.advance(60)
        assert (await store.take("k", limit=2, ttl_s=100)).allowed  # t=60
        clock.advance(39.5)
        refused = await store.take("k", limit=2, ttl_s=100)  # t=99.5
        assert not refused.allowed
        assert refused.retry_after_s == pytest.approx(0.5)
        clock.advance(0.5)
        # t=100: a new counter, with its own full limit and its own TTL.
        assert (await store.take("k", limit=2, ttl_s=100)).allowed
        assert (await store.take("k", limit=2, ttl_s=100)).allowed
        refused = await store.take("k", limit=2, ttl_s=100)
        assert not refused.allowed
        assert refused.retry_after_s == pytest.approx(100)

    asyncio.run(scenario())


def test_take_concurrent_calls_admit_exactly_the_limit(store: MemoryStore) -> None:
    async def scenario() -> None:
        results = await asyncio.gather(*(store.take("burst", limit=20, ttl_s=100) for _ in range(200)))
        assert sum(r.allowed for r in results) == 20
        assert not (await store.take("burst", limit=20, ttl_s=100)).allowed

    asyncio.run(scenario())


# --- throttle -----------------------------------------------------------------------------------


def test_throttle_sliding_window(store: MemoryStore, clock: ManualClock) -> None:
    async def throttle() -> Admission:
        return await store.throttle("rate:alice", limit=3, period_s=10)

    async def scenario() -> None:
        for _ in range(3):  # t=0, 1, 2
            assert (await throttle()).allowed
            clock.advance(1)
        clock.set(T0 + 2)
        refused = await throttle()
        assert not refused.allowed
        assert refused.retry_after_s == pytest.approx(8)  # the one at t=0 leaves at t=10
        clock.set(T0 + 9.5)
        refused = await throttle()
        assert not refused.allowed
        assert refused.retry_after_s == pytest.approx(0.5)
        clock.set(T0 + 10)  # the oldest has left: one more fits
        assert (await throttle()).allowed
        refused = await throttle()
        assert not refused.allowed
        assert refused.retry_after_s == pytest.approx(1)  # next to leave: the one at t=1
        clock.set(T0 + 11)
        assert (await throttle()).allowed

    asyncio.run(scenario())


def scripted_times() -> list[float]:
    """A fixed, reproducible sequence of call times (seconds from T0): bursts, steady trickles,
    gaps, calls exactly on window edges. Quarter seconds keep the float sums exact."""
    rng = random.Random(20260101)
    times, t = [], 0.0
    for _ in range(600):
        t += rng.choice([0.0, 0.0, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0])
        times.append(t)
    return [0.0, 0.0, 0.0, 0.0, 9.75, 10.0, 10.0, *(20.0 + x for x in times)]


def test_throttle_is_exact_over_a_scripted_sequence(store: MemoryStore, clock: ManualClock) -> None:
    """Each call is admitted exactly when fewer than `limit` calls were admitted in the last
    `period_s` seconds (no more, no fewer), and refusals name when the oldest leaves."""
    limit, period = 4, 10.0

    async def scenario() -> tuple[list[float], int]:
        admitted: list[float] = []
        refusals = 0
        for t in scripted_times():
            clock.set(T0 + t)
            answer = await store.throttle("rate:bob", limit=limit, period_s=period)
            in_window = [a for a in admitted if a > t - period]
            if len(in_window) < limit:
                assert answer == Admission(True), f"refused at t={t} with {len(in_window)} in the window"
                admitted.append(t)
            else:
                assert not answer.allowed, f"admitted at t={t} with {len(in_window)} in the window"
                refusals += 1
                assert answer.retry_after_s == pytest.approx(in_window[0] + period - t)
        return admitted, refusals

    admitted, refusals = asyncio.run(scenario())
    assert len(admitted) > 100  # the sequence exercised both admits...
    assert refusals > 100  # ...and refusals
    for start in admitted:
        assert sum(1 for a in admitted if start <= a < start + period) <= limit


def test_throttle_admits_once_retry_after_has_passed(store: MemoryStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        for _ in range(5):
            assert (await store.throttle("k", limit=5, period_s=60)).allowed
            clock.advance(3.25)
        refused = await store.throttle("k", limit=5, period_s=60)
        assert not refused.allowed
        assert refused.retry_after_s is not None
        clock.advance(refused.retry_after_s)
        assert (await store.throttle("k", limit=5, period_s=60)).allowed

    asyncio.run(scenario())


def test_throttle_concurrent_calls_admit_exactly_the_limit(store: MemoryStore) -> None:
    async def scenario() -> None:
        results = await asyncio.gather(*(store.throttle("burst", limit=20, period_s=60) for _ in range(200)))
        assert sum(r.allowed for r in results) == 20

    asyncio.run(scenario())


# --- bounded memory -----------------------------------------------------------------------------


class Key(str):
    """A key the test can hold a weak reference to, to see whether the store still keeps it."""


async def fill_with_keys(store: MemoryStore, breaker: Breaker) -> list[weakref.ref[Key]]:
    """30 keys of every kind the store writes; returns weak references to them."""
    keys = [Key(f"key-{i}") for i in range(30)]
    for k in keys[:10]:
        await store.take(k, limit=5, ttl_s=86_400 + 3_600)  # a daily counter
    for k in keys[10:20]:
        await store.throttle(k, limit=5, period_s=60)
    for k in keys[20:]:
        await store.breaker_record(k, breaker, Outcome.failure, probe=None)  # an open breaker
    return [weakref.ref(k) for k in keys]


def test_memory_is_bounded(clock: ManualClock) -> None:
    """`len(store)` counts live keys; the weak references show the expired ones really leave
    memory with the next operation after the sweep interval (no private attribute read)."""
    store = MemoryStore(clock=clock, sweep_interval_s=60)
    breaker = Breaker(failure_threshold=1, reset_timeout_s=30)
    refs = asyncio.run(fill_with_keys(store, breaker))
    assert len(store) == 30
    gc.collect()
    assert all(r() is not None for r in refs)  # only the store holds them now

    clock.advance(86_400 + 3_600 + breaker.ttl_s + 60 + 1)  # past every TTL and the sweep interval
    assert len(store) == 0

    # The next operation sweeps the expired keys out of memory, not just out of the count.
    asyncio.run(store.take("after", limit=1, ttl_s=10))
    assert len(store) == 1
    gc.collect()
    assert all(r() is None for r in refs), "expired keys are still held after the sweep"


def test_expired_key_is_not_counted_before_the_sweep(clock: ManualClock) -> None:
    store = MemoryStore(clock=clock, sweep_interval_s=3_600)

    async def scenario() -> None:
        await store.take("short", limit=1, ttl_s=10)
        await store.take("long", limit=1, ttl_s=1_000)
        assert len(store) == 2
        clock.advance(10)
        assert len(store) == 1
        # Expired but not yet swept: reads treat it as gone.
        assert (await store.take("short", limit=1, ttl_s=10)).allowed

    asyncio.run(scenario())


def test_closed_breakers_keep_no_key(store: MemoryStore) -> None:
    """A healthy breaker costs no memory, however many models are called."""
    breaker = Breaker(failure_threshold=3, reset_timeout_s=30)

    async def scenario() -> None:
        for i in range(20):
            await store.breaker_admit(f"breaker:{i}", breaker)
            await store.breaker_record(f"breaker:{i}", breaker, Outcome.success, probe=None)
        assert len(store) == 0

    asyncio.run(scenario())
