"""The store operations of service levels (`Store.health`) and of multi-step tasks
(`task_claim`, `task_save`, `task_complete`, `task_release`), on every store (memory, SQLite,
Redis), with the semantics the guards rely on: one atomic operation each, every key expiring."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from fixtures import ManualClock
from fixtures.stores import PiecewiseStore
from guards import Breaker, CircuitState, Outcome
from guards.stores import Store, TaskClaim, TaskStatus

T0 = 1_728_000_000.0
LEGS = [("guards:cooldown:a", "guards:breaker:a"), ("guards:cooldown:b", "guards:breaker:b")]
POLICY = Breaker(failure_threshold=1, reset_timeout_s=30)
KEY = "guards:task:report:k1"
LEASE_S = 76.0
TTL_S = 86_400.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def claim(store: Store, fingerprint: str = "fp-1", key: str = KEY) -> TaskClaim:
    return asyncio.run(store.task_claim(key, fingerprint=fingerprint, lease_s=LEASE_S, ttl_s=TTL_S))


# --- health ------------------------------------------------------------------------------------


def test_health_reads_breakers_and_cooldowns_together_and_writes_nothing(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        healthy = await store.health(LEGS)
        assert healthy.now == T0
        assert healthy.cooldowns == (0.0, 0.0)
        assert [b.state for b in healthy.breakers] == [CircuitState.closed, CircuitState.closed]
        await store.start_cooldown("guards:cooldown:a", 12)
        await store.breaker_record("guards:breaker:b", POLICY, Outcome.failure, probe=None)
        clock.advance(2)
        seen = await store.health(LEGS)
        assert seen.now == T0 + 2
        assert seen.cooldowns == (10.0, 0.0)
        assert seen.breakers[0].state is CircuitState.closed
        assert seen.breakers[1].state is CircuitState.open
        assert seen.breakers[1].opened_at == T0
        # Read only: the open breaker is still open past its reset (no probe was taken).
        clock.advance(40)
        again = await store.health(LEGS)
        assert again.cooldowns == (0.0, 0.0)
        assert again.breakers[1].state is CircuitState.open
        assert again.breakers[1].probes == 0
        assert await store.health([]) == type(again)(T0 + 42, (), ())

    asyncio.run(scenario())


# --- tasks -------------------------------------------------------------------------------------


def test_a_task_is_claimed_saved_and_resumed_after_a_release(store: Store) -> None:
    first = claim(store)
    assert first.status is TaskStatus.claimed
    assert first.lease
    assert dict(first.steps) == {}
    assert first.lease is not None

    async def save() -> None:
        assert first.lease is not None
        assert await store.task_save(KEY, first.lease, "summarize", '"a summary"', lease_s=LEASE_S)
        assert await store.task_save(KEY, first.lease, "classify", '{"label":"x"}', lease_s=LEASE_S)
        assert await store.task_save(KEY, first.lease, "classify", '{"label":"y"}', lease_s=LEASE_S)
        await store.task_release(KEY, first.lease)

    asyncio.run(save())
    second = claim(store)
    assert second.status is TaskStatus.claimed
    assert second.lease not in (None, first.lease)
    assert dict(second.steps) == {"summarize": '"a summary"', "classify": '{"label":"y"}'}


def test_a_held_task_is_busy_until_its_lease_lapses(store: Store, clock: ManualClock) -> None:
    first = claim(store)
    assert first.lease is not None
    clock.advance(10)
    busy = claim(store)
    assert busy.status is TaskStatus.busy
    assert busy.lease is None
    assert busy.retry_after_s == pytest.approx(LEASE_S - 10)
    # Saving a step renews the lease from now.
    assert asyncio.run(store.task_save(KEY, first.lease, "summarize", '"s"', lease_s=LEASE_S))
    clock.advance(LEASE_S - 1)
    assert claim(store).status is TaskStatus.busy
    clock.advance(2)  # the holder crashed: its lease lapsed
    taken = claim(store)
    assert taken.status is TaskStatus.claimed
    assert dict(taken.steps) == {"summarize": '"s"'}

    async def late_holder() -> None:
        # The first holder's late writes are refused: another request holds the task now.
        assert first.lease is not None
        assert not await store.task_save(KEY, first.lease, "classify", '"late"', lease_s=LEASE_S)
        assert not await store.task_complete(KEY, first.lease, '{"late":true}')
        await store.task_release(KEY, first.lease)  # not the holder: changes nothing

    asyncio.run(late_holder())
    assert claim(store).status is TaskStatus.busy


def test_a_completed_task_replays_and_forgets_its_steps(store: Store) -> None:
    held = claim(store)
    assert held.lease is not None

    async def run() -> None:
        assert held.lease is not None
        assert await store.task_save(KEY, held.lease, "summarize", '"s"', lease_s=LEASE_S)
        assert await store.task_complete(KEY, held.lease, '{"status":200}')
        assert not await store.task_complete(KEY, held.lease, '{"status":201}')
        assert not await store.task_save(KEY, held.lease, "draft", '"d"', lease_s=LEASE_S)

    asyncio.run(run())
    done = claim(store)
    assert done == TaskClaim(TaskStatus.done, response='{"status":200}')


def test_a_key_with_another_fingerprint_is_reused_in_every_state(store: Store) -> None:
    held = claim(store)
    assert held.lease is not None
    assert claim(store, "fp-2").status is TaskStatus.reused  # held
    asyncio.run(store.task_release(KEY, held.lease))
    assert claim(store, "fp-2").status is TaskStatus.reused  # released
    again = claim(store)
    assert again.lease is not None
    asyncio.run(store.task_complete(KEY, again.lease, "{}"))
    assert claim(store, "fp-2").status is TaskStatus.reused  # completed
    assert claim(store, "fp-1", key=KEY + "-other").status is TaskStatus.claimed


def test_a_task_is_gone_after_its_ttl(store: Store, clock: ManualClock) -> None:
    held = claim(store)
    assert held.lease is not None
    asyncio.run(store.task_save(KEY, held.lease, "summarize", '"s"', lease_s=LEASE_S))
    asyncio.run(store.task_complete(KEY, held.lease, "{}"))
    clock.advance(TTL_S)
    fresh = claim(store, "fp-2")  # another body may use the key now: a new task, with nothing saved
    assert fresh.status is TaskStatus.claimed
    assert dict(fresh.steps) == {}


def test_concurrent_claims_give_the_lease_to_exactly_one(
    make_store: Callable[[ManualClock], Store], clock: ManualClock, store_kind: str
) -> None:
    """Twenty claims of one key at once, from two store instances on SQLite and Redis (two
    workers sharing the file or the server); a memory store is one process's."""
    first = make_store(clock)
    stores = [first, first if store_kind == "memory" else make_store(clock)]

    async def race() -> list[TaskClaim]:
        return await asyncio.gather(
            *(
                stores[i % 2].task_claim(KEY, fingerprint="fp-1", lease_s=LEASE_S, ttl_s=TTL_S)
                for i in range(20)
            )
        )

    claims = asyncio.run(race())
    assert sorted(c.status for c in claims) == [TaskStatus.busy] * 19 + [TaskStatus.claimed]


def test_long_task_keys_and_values_are_kept_whole(store: Store) -> None:
    key = "guards:task:" + "k" * 5_000
    held = claim(store, key=key)
    assert held.lease is not None
    value = '"' + "\u00e9\u4e2d\U0001f600" * 50_000 + '"'
    asyncio.run(store.task_save(key, held.lease, "s" * 100, value, lease_s=LEASE_S))
    asyncio.run(store.task_release(key, held.lease))
    assert dict(claim(store, key=key).steps) == {"s" * 100: value}


def test_dropping_a_task_that_saved_nothing_leaves_nothing_and_frees_its_owners_slot(
    store: Store, clock: ManualClock
) -> None:
    owner = "guards:tasks:report:ada"

    async def claim_owned(key: str, fingerprint: str) -> TaskClaim:
        return await store.task_claim(
            key, fingerprint=fingerprint, lease_s=LEASE_S, ttl_s=TTL_S, owner=owner, max_live=1
        )

    async def scenario() -> None:
        first = await claim_owned(KEY, "fp-1")
        assert first.status is TaskStatus.claimed
        assert first.lease is not None
        other = await claim_owned(KEY + "-2", "fp-1")
        assert other.status is TaskStatus.full
        assert other.retry_after_s == pytest.approx(TTL_S)
        await store.task_drop(KEY, "not-the-lease")  # not the holder: nothing happens
        assert (await claim_owned(KEY, "fp-1")).status is TaskStatus.busy
        await store.task_drop(KEY, first.lease)
        # Gone, as if never claimed: another body may use the key, in the owner's free slot.
        again = await claim_owned(KEY, "fp-2")
        assert again.status is TaskStatus.claimed
        assert again.lease is not None
        # A task that holds a saved step is only released by a drop: its steps are kept.
        assert await store.task_save(KEY, again.lease, "summarize", '"s"', lease_s=LEASE_S)
        await store.task_drop(KEY, again.lease)
        kept = await claim_owned(KEY, "fp-2")
        assert kept.status is TaskStatus.claimed
        assert dict(kept.steps) == {"summarize": '"s"'}
        assert (await claim_owned(KEY + "-2", "fp-1")).status is TaskStatus.full
        # The owner's slot frees up when its task expires.
        clock.advance(TTL_S)
        assert (await claim_owned(KEY + "-2", "fp-1")).status is TaskStatus.claimed

    asyncio.run(scenario())
