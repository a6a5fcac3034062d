"""Spend reservations, for every store: holds are atomic against the cap, settle to the actual
cost, lapse when their worker never settles, and days are UTC days of the store's clock."""

from __future__ import annotations

import asyncio

import pytest

from fixtures import ManualClock
from fixtures.stores import PiecewiseStore

MIDNIGHT = 86_400.0 * 20_000
T0 = MIDNIGHT + 3_600  # 01:00 UTC


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def test_holds_count_against_the_cap_until_settled(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        first = await store.reserve_spend("team", amount=4, cap=10, hold_s=60)
        second = await store.reserve_spend("team", amount=4, cap=10, hold_s=60)
        third = await store.reserve_spend("team", amount=4, cap=10, hold_s=60)
        assert first.allowed
        assert second.allowed
        assert not third.allowed
        assert third.retry_after_s == pytest.approx(23 * 3_600)  # until UTC midnight
        assert first.reservation is not None
        assert second.reservation is not None
        assert first.reservation != second.reservation
        await store.settle_spend("team", first.reservation, actual=1.5)
        assert await store.spent("team") == pytest.approx(1.5)
        # 1.5 settled + 4 held: room for 4.5 more.
        assert (await store.reserve_spend("team", amount=4.5, cap=10, hold_s=60)).allowed
        assert not (await store.reserve_spend("team", amount=0.01, cap=10, hold_s=60)).allowed

    asyncio.run(scenario())


def test_a_hold_that_is_never_settled_lapses(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        assert (await store.reserve_spend("team", amount=10, cap=10, hold_s=30)).allowed
        assert not (await store.reserve_spend("team", amount=1, cap=10, hold_s=30)).allowed
        clock.advance(31)  # its worker crashed
        late = await store.reserve_spend("team", amount=10, cap=10, hold_s=30)
        assert late.allowed
        assert late.reservation is not None
        await store.settle_spend("team", late.reservation, actual=10)
        assert await store.spent("team") == pytest.approx(10)

    asyncio.run(scenario())


def test_settling_a_lapsed_hold_still_counts_the_cost(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        hold = await store.reserve_spend("team", amount=2, cap=10, hold_s=5)
        assert hold.reservation is not None
        clock.advance(6)
        await store.settle_spend("team", hold.reservation, actual=2)
        assert await store.spent("team") == pytest.approx(2)

    asyncio.run(scenario())


def test_a_new_utc_day_starts_from_zero(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        hold = await store.reserve_spend("team", amount=10, cap=10, hold_s=60)
        assert hold.reservation is not None
        await store.settle_spend("team", hold.reservation, actual=10)
        assert not (await store.reserve_spend("team", amount=1, cap=10, hold_s=60)).allowed
        clock.set(MIDNIGHT + 86_400)
        assert await store.spent("team") == 0
        assert (await store.reserve_spend("team", amount=10, cap=10, hold_s=60)).allowed

    asyncio.run(scenario())


def test_keys_are_independent(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        assert (await store.reserve_spend("a", amount=10, cap=10, hold_s=60)).allowed
        assert (await store.reserve_spend("b", amount=10, cap=10, hold_s=60)).allowed
        assert await store.spent("c") == 0

    asyncio.run(scenario())


def test_concurrent_holds_never_exceed_the_cap(store: PiecewiseStore) -> None:
    """10 concurrent holds of 3 against a cap of 7: exactly two fit."""

    async def scenario() -> None:
        answers = await asyncio.gather(
            *(store.reserve_spend("team", amount=3, cap=7, hold_s=60) for _ in range(10))
        )
        granted = [a.reservation for a in answers if a.allowed]
        assert len(granted) == 2
        for reservation in granted:
            assert reservation is not None
            await store.settle_spend("team", reservation, actual=3)
        assert await store.spent("team") == pytest.approx(6)

    asyncio.run(scenario())
