"""`Store.step`: a request's cooldown read, breaker admission and budget charge as one atomic
store operation, on every store (memory, SQLite, Redis), with the semantics the walk relies on."""

from __future__ import annotations

import asyncio

import pytest

from fixtures import ManualClock
from guards import Breaker, CircuitState, Outcome
from guards.stores import Charge, Report, Step, Store

T0 = 1_728_000_000.0
LEGS = [("guards:cooldown:a", "guards:breaker:a"), ("guards:cooldown:b", "guards:breaker:b")]
POLICY = Breaker(failure_threshold=1, reset_timeout_s=30)


def test_a_step_skips_cooling_and_open_legs_and_charges_only_an_admission(
    store: Store, clock: ManualClock
) -> None:
    async def scenario() -> None:
        await store.start_cooldown("guards:cooldown:a", 10)
        await store.breaker_record("guards:breaker:b", POLICY, Outcome.failure, probe=None)
        passage = await store.step(Step(legs=LEGS, breaker=POLICY, charge=Charge(key="u", per_day=1)))
        assert passage.admitted is None
        assert passage.refusal is None
        assert passage.waits[0] == 10.0
        assert passage.waits[1] == 0.0
        assert passage.decisions[1] is not None
        assert not passage.decisions[1].allowed
        # Nothing was charged: the one unit of the day is still there.
        assert (await store.charge_budget("u", per_minute=None, per_day=1)).allowed

    asyncio.run(scenario())


def test_a_refused_charge_takes_no_probe_and_a_report_applies_first(store: Store, clock: ManualClock) -> None:
    async def scenario() -> None:
        await store.breaker_record("guards:breaker:a", POLICY, Outcome.failure, probe=None)
        clock.advance(30)  # half-open: the next admission is the one probe
        assert (await store.charge_budget("u", per_minute=None, per_day=1)).allowed
        refused = await store.step(Step(legs=LEGS[:1], breaker=POLICY, charge=Charge(key="u", per_day=1)))
        assert refused.admitted is None
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "per_day"
        probe = await store.step(Step(legs=LEGS[:1], breaker=POLICY))
        assert probe.admitted == 0
        assert probe.decisions[0] is not None
        assert probe.decisions[0].probe == T0 + 30
        # The probe fails: reported, and the next leg admitted, in one step.
        report = Report(
            breaker_key="guards:breaker:a",
            breaker=POLICY,
            outcome=Outcome.failure,
            probe=probe.decisions[0].probe,
            cooldown_key="guards:cooldown:a",
            cooldown_s=5,
        )
        after = await store.step(Step(report=report, legs=LEGS[1:], breaker=POLICY))
        assert after.recorded is not None
        assert after.recorded.state is CircuitState.open
        assert after.admitted == 0
        assert await store.cooldowns(["guards:cooldown:a"]) == (5.0,)

    asyncio.run(scenario())


def test_a_spend_refusal_charges_no_other_limit(store: Store) -> None:
    async def scenario() -> None:
        charge = Charge(key="u", per_day=5, spend=3.0, spend_cap=5.0, hold_s=60)
        first = await store.step(Step(legs=LEGS[:1], charge=charge))
        assert first.admitted == 0
        assert first.reservation is not None
        second = await store.step(Step(legs=LEGS[:1], charge=charge))
        assert second.refusal is not None
        assert second.refusal.refused_by == "spend_per_day"
        settled = await store.step(
            Step(report=Report(spend_key="u", reservation=first.reservation, actual=1.0))
        )
        assert settled.admitted is None
        assert await store.spent("u") == 1.0
        for _ in range(4):  # one unit of five was charged: four left
            assert (await store.charge_budget("u", per_minute=None, per_day=5)).allowed
        assert not (await store.charge_budget("u", per_minute=None, per_day=5)).allowed

    asyncio.run(scenario())


def test_the_window_is_exact_for_any_per_minute(store: Store, clock: ManualClock) -> None:
    """Never more than `per_minute` in any 60 s, with bounded work per check, for a small limit
    and for a huge one (the window never fills)."""

    async def scenario() -> None:
        for _ in range(3):
            assert (await store.charge_budget("w", per_minute=3, per_day=None)).allowed
            clock.advance(10)
        refused = await store.charge_budget("w", per_minute=3, per_day=None)
        assert not refused.allowed
        assert refused.retry_after_s == 30.0
        clock.advance(30)
        assert (await store.charge_budget("w", per_minute=3, per_day=None)).allowed
        assert not (await store.charge_budget("w", per_minute=3, per_day=None)).allowed
        for _ in range(500):
            assert (await store.charge_budget("huge", per_minute=10**9, per_day=None)).allowed

    asyncio.run(scenario())


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)
