"""`Store.step` in Python, shared by `MemoryStore` and `SQLiteStore` (RedisStore runs the same
rules in its Lua script).

A store provides the few primitives of `StepState`, each reading or writing one piece of state
at the store's time `now`; `run_step` composes them into one step of a request's walk. The
caller makes the whole of `run_step` atomic (no `await` in memory, one write transaction on
SQLite), so the step reads and writes as one operation, and a refused charge leaves nothing
of the admission behind: nothing of it is written before the charge is known to pass (what
the step reports, its `report` and its `success_ages`, is written either way).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

from ._base import Admission, Passage, Report, Step
from ._breaker import ADMIT_CLOSED, Breaker, BreakerDecision, BreakerState, CircuitState, forget_before
from ._breaker import admit as breaker_admit
from ._breaker import record as breaker_record
from ._limits import LimitState, near_scopes, settle_charge

__all__ = ["StepState", "first_admitted", "plainly_admitted", "run_step"]


class StepState(LimitState, Protocol):
    """The state a step reads and writes, inside the store's atomic operation (with the
    charge's primitives of `LimitState`)."""

    def cooldowns(self, keys: Sequence[str], now: float) -> tuple[float, ...]:
        """Seconds of cooldown left on each key (0.0: none)."""
        ...

    def start_cooldown(self, key: str, seconds: float, now: float) -> None:
        """Cool `key` down for `seconds` from `now`, never shortening a running cooldown (see
        `Report.cooldown_key`)."""
        ...

    def breaker(self, key: str, now: float) -> BreakerState:
        """The breaker's state (a missing or expired key: closed)."""
        ...

    def put_breaker(self, key: str, state: BreakerState, policy: Breaker, now: float) -> None:
        """Keep `state`, `policy.ttl_s` from now (a closed, healthy breaker: no key at all)."""
        ...


def run_step(state: StepState, step: Step, now: float) -> Passage:
    """One step of a walk (see `guards.stores.Step`), on `state`, at the store's time `now`."""
    recorded: BreakerState | None = None
    #: The breaker state changes this step makes (see `Passage.transitions`; rare: no list
    #: until there is one).
    transitions: list[tuple[str, CircuitState]] | None = None
    if step.report is not None:
        recorded, transitions = _apply_report(state, step.report, now)
    legs = step.legs
    if not legs:
        return Passage(recorded=recorded, transitions=tuple(transitions or ()))
    waits = state.cooldowns([cooldown_key for cooldown_key, _ in legs], now)
    decisions: list[BreakerDecision | None] = []
    admitted: int | None = None
    policy = step.breaker
    opened: tuple[str, BreakerState, BreakerState] | None = None  # (key, before, after)
    ages = step.success_ages
    for index, (_, breaker_key) in enumerate(legs):
        if waits[index] > 0:
            decisions.append(None)
            continue
        if policy is None:
            admitted = index
            decisions.append(None)
            break
        before = state.breaker(breaker_key, now)
        if before.failures and index < len(ages) and (age := ages[index]) is not None:
            # An earlier success the caller did not report: written whatever the admission
            # becomes (it is a report, not part of the admission).
            forgotten = forget_before(before, policy, now - age)
            if forgotten is not before:
                state.put_breaker(breaker_key, forgotten, policy, now)
                before = forgotten
        after, decision = breaker_admit(before, policy, now)
        decisions.append(decision)
        if decision.allowed:
            admitted = index
            if after is not before:  # a probe taken; a closed breaker's admission writes nothing
                opened = (breaker_key, before, after)
            break
    refusal: Admission | None = None
    reservation: str | None = None
    near: tuple[int, ...] = ()
    if admitted is not None and step.charge is not None:
        refusal, reservation = state.charge(step.charge, now)
        if refusal is not None:
            admitted = None  # nothing of the admission is written: no probe slot taken
        else:
            near = near_scopes(state, step.charge, now)
    if admitted is not None and opened is not None:
        assert policy is not None
        state.put_breaker(opened[0], opened[2], policy, now)
        if opened[2].state is not opened[1].state:  # open to half_open (not a new probe generation)
            transitions = [*(transitions or ()), (opened[0], opened[2].state)]
    return Passage(
        waits,  # a tuple already (`StepState.cooldowns`)
        tuple(decisions),
        admitted,
        refusal,
        reservation,
        recorded,
        tuple(transitions) if transitions else (),
        near=near,
    )


def _apply_report(
    state: StepState, report: Report, now: float
) -> tuple[BreakerState | None, list[tuple[str, CircuitState]] | None]:
    """Write what a step reports: the breaker's outcome (the state it recorded, and its
    transition when it moved), the cooldown it starts, the spend or charge it settles."""
    recorded: BreakerState | None = None
    transitions: list[tuple[str, CircuitState]] | None = None
    if report.breaker_key is not None and report.breaker is not None:
        before = stored = state.breaker(report.breaker_key, now)
        if report.success_age is not None:
            before = forget_before(before, report.breaker, now - report.success_age)
        recorded = breaker_record(before, report.breaker, now, report.outcome, probe=report.probe)
        if recorded is not stored:  # unchanged (a stale probe, a healthy success): no write
            state.put_breaker(report.breaker_key, recorded, report.breaker, now)
            if recorded.state is not before.state:
                transitions = [(report.breaker_key, recorded.state)]
    if report.cooldown_key is not None and report.cooldown_s > 0:
        seconds = report.cooldown_s
        if report.cooldown_until is not None:  # a provider's date, read on the store's clock
            seconds = min(seconds, report.cooldown_until - now)
        if seconds > 0:
            state.start_cooldown(report.cooldown_key, seconds, now)
    if report.spend_key is not None and report.reservation is not None:
        state.settle(report.spend_key, report.reservation, report.actual, now)
    if report.charge is not None and report.reservation is not None:
        settle_charge(state, report.charge, report.reservation, report.actual, report.tokens, now)
    return recorded, transitions


def first_admitted(
    legs: int, breaker: bool, refusal: Admission | None, reservation: str | None, near: tuple[int, ...] = ()
) -> Passage:
    """What `run_step` answers when the first of `legs` legs, none cooling down, is admitted by
    a closed breaker counting no failure (`breaker`: the step has one) or has none, and the
    charge is refused (`refusal`) or passes (with `reservation` when it held spend, `near` the
    scopes past their soft limits). The stores that decide this usual step without
    `run_step`'s general walk answer with it."""
    if refusal is None and reservation is None and not near:
        return plainly_admitted(legs, breaker)
    decisions = (ADMIT_CLOSED if breaker else None,)
    return Passage((0.0,) * legs, decisions, None if refusal else 0, refusal, reservation, near=near)


@functools.lru_cache(maxsize=64)
def plainly_admitted(legs: int, breaker: bool) -> Passage:
    """`first_admitted` with the charge passed and no hold: the usual answer (`Passage.plain`),
    one per shape, shared by every step of the process: read-only."""
    return Passage((0.0,) * legs, (ADMIT_CLOSED if breaker else None,), 0, plain=True)
