"""The circuit breaker through the store API (`breaker_admit` / `breaker_record`), for every store.

Time only moves when the test moves the `ManualClock`; nothing sleeps.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fixtures import ManualClock
from fixtures.stores import PiecewiseStore
from guards import Breaker, CircuitState, Outcome

KEY = "breaker:@cf/test/model"


async def fail_closed_calls(store: PiecewiseStore, policy: Breaker, n: int) -> None:
    """`n` closed-phase calls that are admitted and fail."""
    for _ in range(n):
        decision = await store.breaker_admit(KEY, policy)
        assert decision.allowed
        assert decision.probe is None
        await store.breaker_record(KEY, policy, Outcome.failure, probe=None)


async def open_breaker(store: PiecewiseStore, policy: Breaker) -> None:
    await fail_closed_calls(store, policy, policy.failure_threshold)
    decision = await store.breaker_admit(KEY, policy)
    assert not decision.allowed
    assert decision.state is CircuitState.open


async def half_open(store: PiecewiseStore, clock: ManualClock, policy: Breaker) -> None:
    """Open the breaker and let its reset timeout pass (the next admit half-opens it)."""
    await open_breaker(store, policy)
    clock.advance(policy.reset_timeout_s)


# --- closed → open ------------------------------------------------------------------------------


def test_opens_after_n_consecutive_failures(store: PiecewiseStore) -> None:
    policy = Breaker(failure_threshold=3, reset_timeout_s=30)

    async def scenario() -> None:
        await fail_closed_calls(store, policy, 2)
        assert (await store.breaker_admit(KEY, policy)).allowed  # two failures: still closed
        state = await store.breaker_record(KEY, policy, Outcome.failure, probe=None)
        assert state.state is CircuitState.open
        decision = await store.breaker_admit(KEY, policy)
        assert not decision.allowed
        assert decision.state is CircuitState.open

    asyncio.run(scenario())


def test_success_resets_the_consecutive_count(store: PiecewiseStore) -> None:
    policy = Breaker(failure_threshold=3, reset_timeout_s=30)

    async def scenario() -> None:
        await fail_closed_calls(store, policy, 2)
        assert (await store.breaker_admit(KEY, policy)).allowed
        await store.breaker_record(KEY, policy, Outcome.success, probe=None)
        await fail_closed_calls(store, policy, 2)  # 2 + success + 2: never 3 in a row
        decision = await store.breaker_admit(KEY, policy)
        assert decision.allowed
        assert decision.state is CircuitState.closed
        await store.breaker_record(KEY, policy, Outcome.failure, probe=None)  # third in a row
        assert not (await store.breaker_admit(KEY, policy)).allowed

    asyncio.run(scenario())


def test_breakers_are_per_key(store: PiecewiseStore) -> None:
    policy = Breaker(failure_threshold=1, reset_timeout_s=30)

    async def scenario() -> None:
        await open_breaker(store, policy)
        assert (await store.breaker_admit("breaker:other-model", policy)).allowed

    asyncio.run(scenario())


def test_windowed_opens_only_when_n_failures_fall_within_the_window(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    policy = Breaker(failure_threshold=3, window_s=10, reset_timeout_s=30)

    async def scenario() -> None:
        # Failures at t=0, 6, 12: never three within 10 s (the one at 0 has left by 12).
        for step in (0, 6, 6):
            clock.advance(step)
            await fail_closed_calls(store, policy, 1)
        assert (await store.breaker_admit(KEY, policy)).allowed
        # t=14: 6, 12 and 14 are within 10 s.
        clock.advance(2)
        await fail_closed_calls(store, policy, 1)
        decision = await store.breaker_admit(KEY, policy)
        assert not decision.allowed
        assert decision.state is CircuitState.open

    asyncio.run(scenario())


def test_windowed_success_does_not_reset_the_count(store: PiecewiseStore, clock: ManualClock) -> None:
    """In windowed mode failures count within the window, successes in between or not."""
    policy = Breaker(failure_threshold=3, window_s=10, reset_timeout_s=30)

    async def scenario() -> None:
        for _ in range(2):
            await fail_closed_calls(store, policy, 1)
            assert (await store.breaker_admit(KEY, policy)).allowed
            await store.breaker_record(KEY, policy, Outcome.success, probe=None)
            clock.advance(1)
        await fail_closed_calls(store, policy, 1)  # failure, success, failure, success, failure
        assert not (await store.breaker_admit(KEY, policy)).allowed

    asyncio.run(scenario())


# --- open ---------------------------------------------------------------------------------------


def test_open_denies_with_the_remaining_time(store: PiecewiseStore, clock: ManualClock) -> None:
    policy = Breaker(failure_threshold=2, reset_timeout_s=30)

    async def scenario() -> None:
        await fail_closed_calls(store, policy, 2)
        decision = await store.breaker_admit(KEY, policy)
        assert (decision.allowed, decision.state) == (False, CircuitState.open)
        assert decision.retry_after_s == pytest.approx(30)
        clock.advance(12.5)
        decision = await store.breaker_admit(KEY, policy)
        assert not decision.allowed
        assert decision.retry_after_s == pytest.approx(17.5)
        clock.advance(17.4)
        decision = await store.breaker_admit(KEY, policy)
        assert not decision.allowed
        assert decision.retry_after_s == pytest.approx(0.1)

    asyncio.run(scenario())


# --- half-open ----------------------------------------------------------------------------------


def test_half_opens_after_reset_timeout_and_limits_probes(store: PiecewiseStore, clock: ManualClock) -> None:
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=2)

    async def scenario() -> None:
        await half_open(store, clock, policy)
        first = await store.breaker_admit(KEY, policy)
        second = await store.breaker_admit(KEY, policy)
        third = await store.breaker_admit(KEY, policy)
        assert (first.allowed, first.state) == (True, CircuitState.half_open)
        assert first.probe is not None
        assert second.allowed
        assert second.probe == first.probe  # same generation of probes
        assert not third.allowed
        assert third.state is CircuitState.half_open

    asyncio.run(scenario())


def test_two_probe_successes_close_it(store: PiecewiseStore, clock: ManualClock) -> None:
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1, success_threshold=2)

    async def scenario() -> None:
        await half_open(store, clock, policy)
        ticket = (await store.breaker_admit(KEY, policy)).probe
        assert ticket is not None
        state = await store.breaker_record(KEY, policy, Outcome.success, probe=ticket)
        assert state.state is CircuitState.half_open  # one success is not enough
        decision = await store.breaker_admit(KEY, policy)
        assert decision.allowed
        assert decision.probe is not None
        state = await store.breaker_record(KEY, policy, Outcome.success, probe=decision.probe)
        assert state.state is CircuitState.closed
        # Closed again: calls flow freely, not as probes.
        for _ in range(5):
            decision = await store.breaker_admit(KEY, policy)
            assert (decision.allowed, decision.probe, decision.state) == (True, None, CircuitState.closed)

    asyncio.run(scenario())


def test_one_probe_failure_reopens_with_a_fresh_timeout(store: PiecewiseStore, clock: ManualClock) -> None:
    """With the probe interval off (None), a failed probe reopens for a whole reset timeout."""
    policy = Breaker(
        failure_threshold=1,
        reset_timeout_s=30,
        half_open_probes=1,
        success_threshold=2,
        probe_interval_s=None,
    )

    async def scenario() -> None:
        await half_open(store, clock, policy)
        ticket = (await store.breaker_admit(KEY, policy)).probe
        await store.breaker_record(KEY, policy, Outcome.success, probe=ticket)
        ticket = (await store.breaker_admit(KEY, policy)).probe
        assert ticket is not None
        clock.advance(5)
        state = await store.breaker_record(KEY, policy, Outcome.failure, probe=ticket)
        assert state.state is CircuitState.open
        decision = await store.breaker_admit(KEY, policy)
        assert not decision.allowed
        assert decision.state is CircuitState.open
        assert decision.retry_after_s == pytest.approx(30)  # counted from the probe failure
        clock.advance(29)
        assert not (await store.breaker_admit(KEY, policy)).allowed
        clock.advance(1)
        decision = await store.breaker_admit(KEY, policy)
        assert decision.allowed
        assert decision.probe is not None
        # The earlier probe success does not carry over into the new half-open phase.
        state = await store.breaker_record(KEY, policy, Outcome.success, probe=decision.probe)
        assert state.state is CircuitState.half_open

    asyncio.run(scenario())


def test_released_probe_frees_its_slot(store: PiecewiseStore, clock: ManualClock) -> None:
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1)

    async def scenario() -> None:
        await half_open(store, clock, policy)
        ticket = (await store.breaker_admit(KEY, policy)).probe
        assert ticket is not None
        assert not (await store.breaker_admit(KEY, policy)).allowed
        state = await store.breaker_record(KEY, policy, Outcome.released, probe=ticket)
        assert state.state is CircuitState.half_open  # no verdict either way
        decision = await store.breaker_admit(KEY, policy)
        assert decision.allowed
        assert decision.probe is not None

    asyncio.run(scenario())


def test_probe_slot_held_past_reset_timeout_is_reclaimed(store: PiecewiseStore, clock: ManualClock) -> None:
    """A probe whose caller never reports (its worker died) must not keep the breaker half-open
    and shut forever."""
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1)

    async def scenario() -> None:
        await half_open(store, clock, policy)
        assert (await store.breaker_admit(KEY, policy)).probe is not None  # never reported
        clock.advance(29)
        refused = await store.breaker_admit(KEY, policy)
        assert not refused.allowed
        assert refused.retry_after_s == pytest.approx(1)  # when the slot can be reclaimed
        clock.advance(1)
        decision = await store.breaker_admit(KEY, policy)
        assert decision.allowed
        assert decision.probe is not None
        assert not (await store.breaker_admit(KEY, policy)).allowed  # and the slot is held again

    asyncio.run(scenario())


def test_reclaimed_probe_reporting_late_does_not_free_the_new_probes_slot(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """At most `half_open_probes` calls in flight, even when a probe whose slot was reclaimed
    reports after all: its report must not hand the new probe's slot to a third call."""
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1)

    async def scenario() -> None:
        await half_open(store, clock, policy)
        probe_a = (await store.breaker_admit(KEY, policy)).probe  # silent for too long
        clock.advance(30)
        probe_b = (await store.breaker_admit(KEY, policy)).probe  # takes the reclaimed slot
        assert probe_a is not None
        assert probe_b is not None
        state = await store.breaker_record(KEY, policy, Outcome.success, probe=probe_a)  # A at last
        assert state.successes == 0  # a stale report counts for nothing
        decision = await store.breaker_admit(KEY, policy)  # B is still in flight
        assert not decision.allowed

    asyncio.run(scenario())


def test_late_closed_phase_outcome_changes_nothing(store: PiecewiseStore, clock: ManualClock) -> None:
    """A call admitted while closed that finishes after the breaker opened is not a probe: its
    success must not close the breaker, its failure must not restart the timeout."""
    policy = Breaker(failure_threshold=2, reset_timeout_s=30)

    async def scenario() -> None:
        straggler = await store.breaker_admit(KEY, policy)
        assert (straggler.allowed, straggler.probe) == (True, None)
        await fail_closed_calls(store, policy, 2)
        clock.advance(10)
        state = await store.breaker_record(KEY, policy, Outcome.success, probe=None)
        assert state.state is CircuitState.open
        state = await store.breaker_record(KEY, policy, Outcome.failure, probe=None)
        assert state.state is CircuitState.open
        decision = await store.breaker_admit(KEY, policy)
        assert not decision.allowed
        assert decision.retry_after_s == pytest.approx(20)  # still timed from the original opening

    asyncio.run(scenario())


def test_late_closed_phase_outcome_does_not_use_a_probe_slot(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1, success_threshold=1)

    async def scenario() -> None:
        straggler = await store.breaker_admit(KEY, policy)
        assert straggler.probe is None
        await half_open(store, clock, policy)
        probe = await store.breaker_admit(KEY, policy)
        assert probe.probe is not None
        state = await store.breaker_record(KEY, policy, Outcome.success, probe=None)
        assert state.state is CircuitState.half_open  # the straggler's success does not close it
        assert not (await store.breaker_admit(KEY, policy)).allowed  # nor free the probe's slot

    asyncio.run(scenario())


def test_stale_probe_outcome_after_reopening_changes_nothing(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """A probe whose slot was reclaimed reports after the breaker reopened: its success must
    not close the breaker."""
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1, success_threshold=1)

    async def scenario() -> None:
        await half_open(store, clock, policy)
        stale = (await store.breaker_admit(KEY, policy)).probe
        clock.advance(30)
        fresh = (await store.breaker_admit(KEY, policy)).probe  # its slot, reclaimed
        assert stale is not None
        assert fresh is not None
        await store.breaker_record(KEY, policy, Outcome.failure, probe=fresh)  # reopens
        clock.advance(1)
        state = await store.breaker_record(KEY, policy, Outcome.success, probe=stale)
        assert state.state is CircuitState.open
        decision = await store.breaker_admit(KEY, policy)
        assert not decision.allowed
        assert decision.retry_after_s == pytest.approx(4)  # reopened for the default probe interval, 5 s

    asyncio.run(scenario())


# --- concurrency --------------------------------------------------------------------------------


def test_concurrent_admits_on_half_open_allow_exactly_one_probe(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1)

    async def scenario() -> None:
        await half_open(store, clock, policy)
        decisions = await asyncio.gather(*(store.breaker_admit(KEY, policy) for _ in range(50)))
        allowed = [d for d in decisions if d.allowed]
        assert len(allowed) == 1
        assert allowed[0].probe is not None

    asyncio.run(scenario())


def test_concurrent_failures_open_once(store: PiecewiseStore) -> None:
    """50 closed-phase failures recorded concurrently open the breaker exactly as 50 in a row do."""
    policy = Breaker(failure_threshold=5, reset_timeout_s=30)

    async def scenario() -> None:
        await asyncio.gather(
            *(store.breaker_record(KEY, policy, Outcome.failure, probe=None) for _ in range(50))
        )
        decision = await store.breaker_admit(KEY, policy)
        assert not decision.allowed
        assert decision.retry_after_s == pytest.approx(30)

    asyncio.run(scenario())


# --- slow calls (`slow_call_s`, `minimum_calls`) ------------------------------------------------

SLOW = Breaker(failure_threshold=2, window_s=60, slow_call_s=5, minimum_calls=4, reset_timeout_s=30)


async def calls(store: PiecewiseStore, policy: Breaker, *outcomes: Outcome) -> CircuitState:
    """Closed-phase calls admitted and ended as `outcomes`, in order: the state after the last."""
    state = CircuitState.closed
    for outcome in outcomes:
        decision = await store.breaker_admit(KEY, policy)
        assert (decision.allowed, decision.probe) == (True, None)
        state = (await store.breaker_record(KEY, policy, outcome, probe=None)).state
    return state


S, F, OK = Outcome.slow, Outcome.failure, Outcome.success


@pytest.mark.parametrize(
    ("outcomes", "opened"),
    [
        # Fewer than minimum_calls (4) calls in the window: a slow call is a success.
        ((S, S, S), False),
        # The fourth call is slow with four calls in the window: it counts; a second opens it.
        ((S, S, S, S), False),
        ((S, S, S, S, S), True),
        ((OK, OK, OK, S, S), True),
        # Failures count toward minimum_calls, and a failure is a failure whatever the count.
        ((F, OK, OK, S), True),
        ((F, F), True),
        # A slow call before the fourth is a success; the fourth and fifth count (a window:
        # successes between them reset nothing).
        ((OK, S, OK, S, OK), False),
        ((OK, S, OK, S, OK, S), True),
    ],
)
def test_slow_calls_count_as_failures_once_the_window_holds_minimum_calls(
    store: PiecewiseStore, outcomes: tuple[Outcome, ...], opened: bool
) -> None:
    state = asyncio.run(calls(store, SLOW, *outcomes))
    assert state is (CircuitState.open if opened else CircuitState.closed)


def test_slow_calls_need_the_minimum_within_the_window(store: PiecewiseStore, clock: ManualClock) -> None:
    """Calls that left the window no longer count toward `minimum_calls`."""

    async def scenario() -> None:
        assert await calls(store, SLOW, OK, OK, OK) is CircuitState.closed
        clock.advance(61)  # those three have left the 60 s window
        assert await calls(store, SLOW, S, S, S) is CircuitState.closed  # 3 calls within it
        clock.advance(1)
        assert await calls(store, SLOW, S) is CircuitState.closed  # the 4th: one slow counted
        assert await calls(store, SLOW, S) is CircuitState.open  # the 2nd counted: open
        decision = await store.breaker_admit(KEY, SLOW)
        assert (decision.allowed, decision.retry_after_s) == (False, pytest.approx(30))

    asyncio.run(scenario())


def test_a_slow_probe_is_a_failed_probe(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        assert await calls(store, SLOW, F, F) is CircuitState.open
        clock.advance(30)
        ticket = (await store.breaker_admit(KEY, SLOW)).probe
        assert ticket is not None
        state = await store.breaker_record(KEY, SLOW, Outcome.slow, probe=ticket)
        assert state.state is CircuitState.open  # reopened, for the default probe interval
        assert (await store.breaker_admit(KEY, SLOW)).retry_after_s == pytest.approx(5)

    asyncio.run(scenario())


def test_a_policy_without_slow_call_s_takes_a_slow_call_as_a_success(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    policy = Breaker(failure_threshold=2, reset_timeout_s=30, success_threshold=1)

    async def scenario() -> None:
        assert await calls(store, policy, F, S, F, S, F) is CircuitState.closed  # never two in a row
        assert await calls(store, policy, F) is CircuitState.open
        clock.advance(30)
        ticket = (await store.breaker_admit(KEY, policy)).probe
        state = await store.breaker_record(KEY, policy, Outcome.slow, probe=ticket)
        assert state.state is CircuitState.closed

    asyncio.run(scenario())


def test_counted_calls_are_kept_and_forgotten_when_the_breaker_opens(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """The calls counted survive in the store between calls (a closed breaker with calls but no
    failure is kept), and a breaker that opened and closed again starts counting afresh."""
    policy = Breaker(
        failure_threshold=1,
        window_s=60,
        slow_call_s=5,
        minimum_calls=3,
        reset_timeout_s=30,
        success_threshold=1,
    )

    async def scenario() -> None:
        assert await calls(store, policy, OK, OK) is CircuitState.closed
        assert await calls(store, policy, S) is CircuitState.open  # the third call, slow
        clock.advance(30)
        ticket = (await store.breaker_admit(KEY, policy)).probe
        assert (
            await store.breaker_record(KEY, policy, Outcome.success, probe=ticket)
        ).state is CircuitState.closed
        assert await calls(store, policy, S, S) is CircuitState.closed  # two calls since it closed
        assert await calls(store, policy, S) is CircuitState.open

    asyncio.run(scenario())


# --- probe interval (`probe_interval_s`) --------------------------------------------------------

PROBING = Breaker(failure_threshold=1, reset_timeout_s=30, probe_interval_s=5, success_threshold=2)


def test_a_failed_probe_reopens_for_the_probe_interval(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        await open_breaker(store, PROBING)
        assert (await store.breaker_admit(KEY, PROBING)).retry_after_s == pytest.approx(30)  # the first: full
        clock.advance(30)
        ticket = (await store.breaker_admit(KEY, PROBING)).probe
        assert ticket is not None
        clock.advance(2)  # the probe took 2 s and failed
        state = await store.breaker_record(KEY, PROBING, Outcome.failure, probe=ticket)
        assert state.state is CircuitState.open
        refused = await store.breaker_admit(KEY, PROBING)
        assert (refused.allowed, refused.state, refused.retry_after_s) == (
            False,
            CircuitState.open,
            pytest.approx(5),
        )
        clock.advance(4.9)
        assert not (await store.breaker_admit(KEY, PROBING)).allowed
        clock.advance(0.1)
        probe = await store.breaker_admit(KEY, PROBING)
        assert (probe.allowed, probe.state) == (True, CircuitState.half_open)
        assert probe.probe is not None
        assert not (await store.breaker_admit(KEY, PROBING)).allowed  # still one probe at a time
        # It answers: two successes close it.
        await store.breaker_record(KEY, PROBING, Outcome.success, probe=probe.probe)
        second = await store.breaker_admit(KEY, PROBING)
        state = await store.breaker_record(KEY, PROBING, Outcome.success, probe=second.probe)
        assert state.state is CircuitState.closed

    asyncio.run(scenario())


def test_a_probe_slot_is_still_reclaimed_after_the_reset_timeout(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """A probe in flight longer than the probe interval keeps its slot: only one probe at a time;
    a slot whose caller never reports is reclaimed after `reset_timeout_s`, as without one."""

    async def scenario() -> None:
        await open_breaker(store, PROBING)
        clock.advance(30)
        ticket = (await store.breaker_admit(KEY, PROBING)).probe
        await store.breaker_record(KEY, PROBING, Outcome.failure, probe=ticket)
        clock.advance(5)
        assert (await store.breaker_admit(KEY, PROBING)).probe is not None  # never reported
        clock.advance(29)
        refused = await store.breaker_admit(KEY, PROBING)
        assert (refused.allowed, refused.state) == (False, CircuitState.half_open)
        assert refused.retry_after_s == pytest.approx(1)
        clock.advance(1)
        assert (await store.breaker_admit(KEY, PROBING)).probe is not None

    asyncio.run(scenario())


def test_a_closed_phase_failure_opens_for_the_reset_timeout_even_with_a_probe_interval(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        await open_breaker(store, PROBING)
        clock.advance(30)
        ticket = (await store.breaker_admit(KEY, PROBING)).probe
        await store.breaker_record(KEY, PROBING, Outcome.success, probe=ticket)
        ticket = (await store.breaker_admit(KEY, PROBING)).probe
        await store.breaker_record(KEY, PROBING, Outcome.success, probe=ticket)  # closed
        await fail_closed_calls(store, PROBING, 1)
        assert (await store.breaker_admit(KEY, PROBING)).retry_after_s == pytest.approx(30)

    asyncio.run(scenario())


def test_a_reader_without_a_probe_interval_keeps_the_openers_next_probe(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    """The next probe's time is stored with the state: a policy of its own (no interval) reads
    the same `Retry-After` and half-opens it at the same moment."""
    other = Breaker(failure_threshold=1, reset_timeout_s=300)

    async def scenario() -> None:
        await open_breaker(store, PROBING)
        clock.advance(30)
        ticket = (await store.breaker_admit(KEY, other)).probe
        await store.breaker_record(KEY, PROBING, Outcome.failure, probe=ticket)
        assert (await store.breaker_admit(KEY, other)).retry_after_s == pytest.approx(5)
        clock.advance(5)
        assert (await store.breaker_admit(KEY, other)).probe is not None

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"slow_call_s": 5}, "needs window_s"),
        ({"slow_call_s": 0, "window_s": 60}, "slow_call_s must be a positive"),
        ({"slow_call_s": float("nan"), "window_s": 60}, "slow_call_s must be a positive"),
        ({"slow_call_s": float("inf"), "window_s": 60}, "slow_call_s must be a positive"),
        ({"minimum_calls": 0}, "minimum_calls must be a whole number from 1 to 1,000"),
        ({"minimum_calls": 1001}, "minimum_calls"),
        ({"minimum_calls": 2.5}, "minimum_calls"),
        ({"probe_interval_s": 0}, "probe_interval_s must be a positive"),
        ({"probe_interval_s": float("nan")}, "probe_interval_s"),
        ({"probe_interval_s": 31}, r"at most reset_timeout_s \(30\)"),
        ({"probe_interval_s": True}, "probe_interval_s must be a positive"),
        ({"probe_interval_s": "5"}, "probe_interval_s must be a positive"),
    ],
)
def test_bad_slow_call_and_probe_settings_say_what_to_fix(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Breaker(**options)


def test_slow_calls_are_off_and_probes_every_five_seconds_by_default() -> None:
    policy = Breaker()
    assert (policy.slow_call_s, policy.minimum_calls, policy.reopen_after_probe_s) == (None, 10, 5.0)
    assert Breaker(reset_timeout_s=2).reopen_after_probe_s == 2  # at most the reset timeout
    assert Breaker(probe_interval_s=None).reopen_after_probe_s is None  # a whole reset timeout
    assert Breaker(probe_interval_s=12).reopen_after_probe_s == 12
    Breaker(window_s=60, slow_call_s=0.5, minimum_calls=1000, probe_interval_s=30)  # the limits
