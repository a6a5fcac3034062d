"""`Store.step`: a request's cooldown read, breaker admission and budget charge as one atomic
store operation, on every store (memory, SQLite, Redis), with the semantics the walk relies on."""

from __future__ import annotations

import asyncio

import pytest

from fixtures import ManualClock
from fixtures.stores import PiecewiseStore
from guards import Breaker, CircuitState, Outcome
from guards.stores import Charge, Report, Step, Store

T0 = 1_728_000_000.0
LEGS = [("guards:cooldown:a", "guards:breaker:a"), ("guards:cooldown:b", "guards:breaker:b")]
POLICY = Breaker(failure_threshold=1, reset_timeout_s=30)


def test_a_step_skips_cooling_and_open_legs_and_charges_only_an_admission(
    store: PiecewiseStore, clock: ManualClock
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


def test_a_refused_charge_takes_no_probe_and_a_report_applies_first(
    store: PiecewiseStore, clock: ManualClock
) -> None:
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


def test_each_breaker_transition_is_told_to_the_one_step_that_made_it(
    store: Store, clock: ManualClock
) -> None:
    """closed -> open (a report), open -> half_open (an admission), half_open -> closed (two
    probe successes) and half_open -> open (a failed probe): each reported once, by the step
    that made it; a step that changes no state reports none (a refusal, a second failure of an
    open breaker, a healthy success)."""
    policy = Breaker(failure_threshold=2, reset_timeout_s=30, success_threshold=2, half_open_probes=2)
    key = LEGS[0][1]

    def failure(probe: float | None = None) -> Report:
        return Report(breaker_key=key, breaker=policy, outcome=Outcome.failure, probe=probe)

    def success(probe: float | None = None) -> Report:
        return Report(breaker_key=key, breaker=policy, outcome=Outcome.success, probe=probe)

    async def scenario() -> None:
        step = Step(legs=LEGS[:1], breaker=policy)
        first = await store.step(step)
        assert first.transitions == ()  # a closed breaker's admission
        assert (await store.step(Step(report=failure()))).transitions == ()  # 1 of 2 failures
        opened = await store.step(Step(report=failure(), legs=LEGS[:1], breaker=policy))
        assert opened.transitions == ((key, CircuitState.open),)
        assert opened.admitted is None  # the admission after the report is refused: no change
        assert (await store.step(Step(report=failure()))).transitions == ()  # already open
        clock.advance(30)
        probe = await store.step(step)
        assert probe.transitions == ((key, CircuitState.half_open),)
        second_probe = await store.step(step)  # a second slot of the same generation
        assert second_probe.transitions == ()
        assert probe.decisions[0] is not None
        ticket = probe.decisions[0].probe
        assert (await store.step(Step(report=success(ticket)))).transitions == ()  # 1 of 2
        closed = await store.step(Step(report=success(ticket)))
        assert closed.transitions == ((key, CircuitState.closed),)
        assert (await store.step(Step(report=success()))).transitions == ()  # healthy
        # Open again, half-open, and a failed probe reopens it.
        await store.step(Step(report=failure()))
        assert (await store.step(Step(report=failure()))).transitions == ((key, CircuitState.open),)
        clock.advance(30)
        probe = await store.step(step)
        assert probe.decisions[0] is not None
        reopened = await store.step(
            Step(report=failure(probe.decisions[0].probe), legs=LEGS[1:], breaker=policy)
        )
        assert reopened.transitions == ((key, CircuitState.open),)
        assert reopened.admitted == 0  # the next leg, closed: no transition of its own

    asyncio.run(scenario())


def test_a_spend_refusal_charges_no_other_limit(store: PiecewiseStore) -> None:
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


def test_the_window_is_exact_for_any_per_minute(store: PiecewiseStore, clock: ManualClock) -> None:
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


def test_a_success_that_ended_between_failures_ends_their_run(store: Store, clock: ManualClock) -> None:
    """Consecutive failures are failures with no success ending between them. A success
    admitted while its breaker counted no failure is not reported (a closed breaker's success
    writes nothing); the caller's next step about that model carries how long ago it ended
    (`Step.success_ages`, `Report.success_age`), and the store forgets the failures counted
    before that, keeping the ones after it."""
    policy = Breaker(failure_threshold=3, reset_timeout_s=30)
    key = LEGS[0][1]

    def failure(age: float | None) -> Report:
        return Report(breaker_key=key, breaker=policy, outcome=Outcome.failure, success_age=age)

    async def failures() -> tuple[float, ...]:
        return (await store.health(LEGS[:1])).breakers[0].failures

    async def scenario() -> None:
        running = await store.step(Step(legs=LEGS[:1], breaker=policy))  # a success's admission
        assert running.decisions[0] is not None
        assert not running.decisions[0].record_success  # nothing counted: not to be reported
        await store.step(Step(report=failure(None)))  # T0: a failure, while the success runs
        clock.advance(1)
        await store.step(Step(report=failure(None)))  # T0 + 1
        clock.advance(1)  # T0 + 2: the success ends, unreported
        clock.advance(1)
        # T0 + 3: the next admission carries the success's age: both failures are forgotten.
        after = await store.step(Step(legs=LEGS[:1], breaker=policy, success_ages=[1.0]))
        assert after.admitted == 0
        assert after.decisions[0] is not None
        assert not after.decisions[0].record_success
        assert await failures() == ()
        recorded = (await store.step(Step(report=failure(1.0)))).recorded  # T0 + 3
        assert recorded is not None
        assert recorded.failures == (T0 + 3,)
        clock.advance(1)
        # A failure report carries it too; failures after the success stay counted.
        await store.step(Step(report=failure(None)))  # T0 + 4
        clock.advance(1)  # T0 + 5: a second success ends, unreported
        clock.advance(1)
        recorded = (await store.step(Step(report=failure(1.0)))).recorded  # T0 + 6
        assert recorded is not None
        assert recorded.failures == (T0 + 6,)
        assert recorded.state is CircuitState.closed
        # An older success, or one that ended as the failure landed, forgets nothing: three
        # failures with no success ending between them open the breaker.
        clock.advance(1)
        await store.step(Step(report=failure(5.0)))  # T0 + 7, the success of T0 + 2
        clock.advance(1)
        # T0 + 8: a success that ended at T0 + 6, as that failure landed (a tie is no proof
        # the success ended after it).
        opened = await store.step(
            Step(report=failure(2.0), legs=LEGS[:1], breaker=policy, success_ages=[2.0])
        )
        assert opened.transitions == ((key, CircuitState.open),)
        assert opened.admitted is None
        # An open breaker is not closed by a closed-phase success.
        refused = await store.step(Step(legs=LEGS[:1], breaker=policy, success_ages=[0.0]))
        assert refused.admitted is None

    asyncio.run(scenario())


def test_a_success_age_does_not_touch_a_windowed_breaker(store: Store, clock: ManualClock) -> None:
    """With `window_s` a success never resets the count: neither does its age."""
    policy = Breaker(failure_threshold=3, window_s=60, reset_timeout_s=30)
    key = LEGS[0][1]
    report = Report(breaker_key=key, breaker=policy, outcome=Outcome.failure, success_age=0.5)

    async def scenario() -> None:
        await store.step(Step(report=report))
        clock.advance(1)
        await store.step(Step(report=report, legs=LEGS[:1], breaker=policy, success_ages=[0.5]))
        assert (await store.health(LEGS[:1])).breakers[0].failures == (T0, T0 + 1)

    asyncio.run(scenario())
