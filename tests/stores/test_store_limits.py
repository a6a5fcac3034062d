"""A charge's `MoreLimits` in `Store.step`, on every store (memory, SQLite, Redis): token
windows held and settled to the usage, monthly periods of the UTC calendar, and several scopes
admitted together, all or nothing."""

from __future__ import annotations

import asyncio
import calendar

import pytest

from fixtures import ManualClock
from fixtures.stores import PiecewiseStore
from guards.stores import Charge, MoreLimits, Passage, Report, Step

#: 2026-01-31 23:00 UTC: an hour before a new day and a new month.
T0 = float(calendar.timegm((2026, 1, 31, 23, 0, 0)))
LEGS = [("guards:cooldown:a", "guards:breaker:a")]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def charge(
    key: str = "u", *, also: tuple[Charge, ...] = (), hold_s: float = 60.0, **limits: object
) -> Charge:
    """A charge under `key` with `limits` (`MoreLimits` fields; `per_minute`/`per_day` too)."""
    per_minute = limits.pop("per_minute", None)
    per_day = limits.pop("per_day", None)
    more = MoreLimits(also=also, **limits)  # type: ignore[arg-type]
    return Charge(key, per_minute, per_day, None, 0.0, hold_s, more)  # type: ignore[arg-type]


async def admit(store: PiecewiseStore, paid: Charge) -> Passage:
    return await store.step(Step(legs=LEGS, charge=paid))


async def settle(store: PiecewiseStore, paid: Charge, reservation: str | None, *, tokens: int) -> None:
    assert reservation is not None
    await store.step(Step(report=Report(charge=paid, reservation=reservation, tokens=tokens)))


def test_tokens_per_minute_holds_settle_to_the_usage_and_leave_after_a_minute(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        hold = charge(tokens=400, tokens_per_minute=1_000)
        first = await admit(store, hold)
        assert first.admitted == 0
        clock.advance(10)
        second = await admit(store, hold)
        assert second.admitted == 0
        refused = await admit(store, hold)  # 800 held: 400 more would make 1,200
        assert refused.admitted is None
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "tokens_per_minute"
        assert refused.refusal.retry_after_s == pytest.approx(50)  # when the first hold leaves
        # The first call used 150 tokens: its hold takes that in its place.
        await settle(store, hold, first.reservation, tokens=150)
        assert (await admit(store, hold)).admitted == 0  # 150 + 400 + 400 = 950
        assert (await admit(store, charge(tokens=51, tokens_per_minute=1_000))).admitted is None
        assert (await admit(store, charge(tokens=50, tokens_per_minute=1_000))).admitted == 0
        clock.advance(60)  # every hold has left the window
        assert (await admit(store, charge(tokens=1_000, tokens_per_minute=1_000))).admitted == 0

    asyncio.run(scenario())


def test_a_hold_larger_than_the_limit_never_fits(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        refused = await admit(store, charge(tokens=1_001, tokens_per_day=1_000))
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "tokens_per_day"
        assert refused.refusal.retry_after_s is None
        assert (await admit(store, charge(tokens=1_000, tokens_per_day=1_000))).admitted == 0

    asyncio.run(scenario())


def test_tokens_per_day_settle_to_the_usage_and_a_lapsed_hold_frees_its_room(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        hold = charge(tokens=600, tokens_per_day=1_000, hold_s=30)
        first = await admit(store, hold)
        assert first.admitted == 0
        refused = await admit(store, hold)
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "tokens_per_day"
        assert refused.refusal.retry_after_s == pytest.approx(3_600)  # until UTC midnight
        await settle(store, hold, first.reservation, tokens=300)
        crashed = await admit(store, hold)  # 300 settled + 600 held; its worker dies
        assert crashed.admitted == 0
        assert (await admit(store, charge(tokens=101, tokens_per_day=1_000))).admitted is None
        clock.advance(31)  # the hold lapsed: 300 settled
        assert (await admit(store, charge(tokens=700, tokens_per_day=1_000))).admitted == 0

    asyncio.run(scenario())


def test_a_monthly_cap_is_per_utc_calendar_month(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        monthly = charge(per_month=2)
        assert (await admit(store, monthly)).admitted == 0
        assert (await admit(store, monthly)).admitted == 0
        refused = await admit(store, monthly)
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "per_month"
        assert refused.refusal.retry_after_s == pytest.approx(3_600)  # until 1 February, 00:00
        clock.advance(3_600 - 0.5)  # 23:59:59.5 on 31 January: still January
        assert (await admit(store, monthly)).admitted is None
        clock.advance(0.5)  # 1 February: a new month's count
        assert (await admit(store, monthly)).admitted == 0
        assert (await admit(store, monthly)).admitted == 0
        late = await admit(store, monthly)
        assert late.refusal is not None
        assert late.refusal.retry_after_s == pytest.approx(28 * 86_400)  # until 1 March (2026: 28 days)

    asyncio.run(scenario())


def test_a_monthly_spend_cap_holds_and_settles(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        spend = charge(spend=4.0, spend_per_month=10.0)
        first = await admit(store, spend)
        assert (await admit(store, spend)).admitted == 0
        refused = await admit(store, spend)
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "spend_per_month"
        assert first.reservation is not None
        await store.step(Step(report=Report(charge=spend, reservation=first.reservation, actual=1.0)))
        assert (await admit(store, spend)).admitted == 0  # 1 settled + 4 + 4 held

    asyncio.run(scenario())


def test_scopes_are_admitted_together_and_a_refusal_by_one_charges_none(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        def request(user: str) -> Charge:
            tenant = charge("tenant:acme", per_day=3, tokens=100, tokens_per_day=10_000)
            return charge(f"user:{user}", per_day=2, tokens=100, tokens_per_minute=10_000, also=(tenant,))

        # The tenant's cap binds across two users: 2 + 1, then the tenant refuses.
        assert (await admit(store, request("ann"))).admitted == 0
        assert (await admit(store, request("ann"))).admitted == 0
        assert (await admit(store, request("ann"))).refusal.refused_by == "per_day"  # type: ignore[union-attr]
        assert (await admit(store, request("bob"))).admitted == 0
        refused = await admit(store, request("bob"))
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "per_day"
        assert refused.refusal.charge == 1  # the tenant's scope refused
        # ... and charged nothing on bob's scope: he still has one call of his own.
        alone = charge("user:bob", per_day=2, tokens=100, tokens_per_minute=10_000)
        assert (await admit(store, alone)).admitted == 0
        assert (await admit(store, alone)).refusal is not None

    asyncio.run(scenario())


def test_holds_of_several_scopes_settle_together(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        tenant = charge("tenant:acme", tokens=500, tokens_per_day=1_000)
        paid = charge("user:ann", tokens=500, tokens_per_day=1_000, also=(tenant,))
        first = await admit(store, paid)
        assert first.reservation is not None
        await settle(store, paid, first.reservation, tokens=100)
        # 100 settled on each scope: the tenant has 900 left, the user too.
        assert (await admit(store, charge("tenant:acme", tokens=900, tokens_per_day=1_000))).admitted == 0
        assert (await admit(store, charge("user:ann", tokens=900, tokens_per_day=1_000))).admitted == 0
        assert (await admit(store, charge("user:ann", tokens=1, tokens_per_day=1_000))).admitted is None

    asyncio.run(scenario())


def every_limit(key: str, also: tuple[Charge, ...] = ()) -> Charge:
    """A charge under `key` with one unit of every limit a store keeps: a minute's, a day's and a
    month's count, a day's and a month's spend, and tokens in the minute, the day and the month."""
    more = MoreLimits(
        per_month=1,
        spend=1.0,
        spend_per_month=1.0,
        tokens=100,
        tokens_per_minute=100,
        tokens_per_day=100,
        tokens_per_month=100,
        also=also,
    )
    return Charge(key, 1, 1, 1.0, 1.0, 60.0, more)


def test_a_scope_that_refuses_charges_no_limit_of_the_others(store: PiecewiseStore) -> None:
    """On Redis Cluster the scopes live in different slots, each charged in its own: a scope
    that passed is given back when another refuses, every limit of it."""

    async def scenario() -> None:
        tenant = charge("tenant:full", per_day=1)
        assert (await admit(store, tenant)).admitted == 0  # the tenant's one call
        refused = await admit(store, every_limit("user:ann", also=(tenant,)))
        assert refused.admitted is None
        assert refused.refusal is not None
        assert (refused.refusal.refused_by, refused.refusal.charge) == ("per_day", 1)
        # Every limit of ann's is whole: the same charge, alone, is admitted once.
        assert (await admit(store, every_limit("user:ann"))).admitted == 0
        assert (await admit(store, every_limit("user:ann"))).admitted is None

    asyncio.run(scenario())


def test_a_step_that_admits_no_leg_charges_no_limit(store: PiecewiseStore, clock: ManualClock) -> None:
    """Every leg cooling down: nothing admitted, nothing charged (on Redis Cluster the charge,
    paid beside the legs' decision, is given back)."""

    async def scenario() -> None:
        await store.start_cooldown(LEGS[0][0], 30)
        skipped = await admit(store, every_limit("user:bo"))
        assert skipped.admitted is None
        assert skipped.refusal is None
        assert skipped.waits[0] > 0
        clock.advance(31)  # the cooldown is over: the charge's every unit is still there
        assert (await admit(store, every_limit("user:bo"))).admitted == 0
        assert (await admit(store, every_limit("user:bo"))).admitted is None

    asyncio.run(scenario())
