"""The store steps of a walk: one store operation between calls (`Store.step`) reports the last
call's outcome and admits the next leg, charging the request's budget on its first admission;
and what a guard does when its store does not answer (the store-down policy).

Each guard its own failure mode when the store is down: cooldowns only spare a provider that
asked for a pause (the models are tried), the breaker and the budget as configured
(`on_store_failure`: open admits, closed refuses with `circuit_open`, local charges the
worker's share of the budget in its own memory). A report the store did
not take is lost, and said so: a lost probe's slot is reclaimed after the reset timeout, a lost
spend hold lapses by itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..contracts._errors import GuardTripped, ProviderError
from ..contracts._vocabulary import Reason
from ..policies._budget import budget_refusal
from ..stores import Charge, Passage, Report, Step, StoreUnavailable
from ..stores._breaker import CircuitState, Outcome
from ._events import BreakerMoved, BudgetNear, CooldownStarted, StoreFailed
from ._holds import holding, settled
from ._known import forget, passed_over, remember
from ._verdicts import COOLDOWN_KINDS, LIMIT_REASONS, failed

if TYPE_CHECKING:
    from ..policies._call import CallFailed
    from ..spec._route_spec import GuardedRoute, Leg
    from ._state import RequestState

__all__ = [
    "FIRST_ADMITTED",
    "STORE_RETRY_AFTER_S",
    "admitted",
    "cool_down",
    "cooldown",
    "finish_leg",
    "gave_up",
    "leg_down",
    "next_step",
    "record",
    "send",
    "settle",
    "walk_step",
]

#: Retry-After when a guard refuses calls because its store is unavailable.
STORE_RETRY_AFTER_S = 5.0
#: `admitted`'s usual answer: the first leg, no probe, no success to record.
FIRST_ADMITTED: tuple[int, float | None, bool] = (0, None, False)


def walk_step(route: GuardedRoute, start: int, report: Report | None, charge: Charge | None) -> Step:
    """A store step of `route`'s walk (see `Store.step`): `report` first, then the admission of
    the first leg from `start` that may be called, paying `charge` if any. Each step about a
    model carries how long ago this process's last success on it ended (`SuccessAges`), so a
    success that was not reported (a closed breaker's, admitted with no failure counted) still
    ends the failures counted while it ran: exactly within this process, at its next step for
    others."""
    ages = route.success_ages if route.breaker is not None else ()
    if start:
        return Step(report, route.step_legs[start:], route.breaker, charge, ages[start:])
    return Step(report, route.step_legs, route.breaker, charge, ages)


def next_step(state: RequestState, start: int, report: Report | None, inputs: Mapping[str, Any]) -> Step:
    """The walk's next store operation: apply `report` (the last call's outcome), then admit
    the first leg from `start` that is not cooling down and whose breaker lets it through,
    charging the request's budget on its first admission."""
    route, first = state._route, state._first
    charge = None
    if first is not None and not state._charged:
        if not start and report is None and first.legs is route.step_legs and not route.holds:
            return first  # the route's own, the same every request (of this caller)
        # What the request's first admission pays: rate, counts, its worst-case spend and
        # its tokens.
        charge = first.charge
        if charge is not None and route.holds:
            charge = holding(state, charge, inputs)
    return walk_step(route, start, report, charge)


def admitted(
    state: RequestState, start: int, step: Step, passage: Passage | None
) -> tuple[int, float | None, bool] | None:
    """What the store answered to `step` (None: the store was unavailable). Notes each leg
    skipped. Returns (the admitted leg's index, its probe ticket, whether its success must be
    recorded), or None when no leg is admitted; raises `GuardTripped` when the budget
    refuses, or a guard whose store is down fails closed."""
    route = state._route
    legs = route.legs
    report, charge = step.report, step.charge
    if passage is None:
        store_down(state, step)
        return start, None, False
    if passage.plain:  # the usual answer (`Passage.plain`): the first leg from `start`
        if charge is not None:
            state._charged = True
            if route.downgrade is not None:
                route.downgrade.saw(charge, route.scopes, ())
        if state._waits is not None:
            state._waits[start:] = passage.waits
        if route.breaker is not None and legs[start].last_state[0] is not CircuitState.closed:
            legs[start].saw(CircuitState.closed)
        return (start, None, False) if start else FIRST_ADMITTED
    if passage.recorded is not None and report is not None:
        saw_report(state, report, passage.recorded.state)
    if passage.transitions:
        saw_transitions(state, passage.transitions, report)
    if len(legs) > 1:  # only a leg with later legs reads the waits (`_retries.leg_limit`)
        if state._waits is None:
            state._waits = [0.0] * len(legs)
        state._waits[start:] = passage.waits
    passed_over(state, start, passage)
    if (refusal := passage.refusal) is not None:
        assert route.budget is not None
        refused = refusal.charge if refusal.charge < len(route.budgets) else 0
        raise budget_refusal(route.budgets[refused], refusal, route.scopes[refused])
    if charge is not None:
        state._charged = True
        state._hold = passage.reservation
        if passage.near:
            near(state, passage.near)
        if route.downgrade is not None:
            route.downgrade.saw(charge, route.scopes, passage.near)
    index, decisions = passage.admitted, passage.decisions
    if index is None:
        return None
    decision = decisions[index] if index < len(decisions) else None
    if decision is None:
        return start + index, None, False
    return start + index, decision.probe, decision.record_success


def near(state: RequestState, indices: Sequence[int]) -> None:
    """The request was admitted past the soft limits of its budgets `indices` (`Passage.near`):
    its answer says so (`x-ai-budget`), and the observers are told."""
    route = state._route
    scopes = tuple(route.scopes[index] for index in indices if index < len(route.scopes))
    if not scopes:
        return
    state._near = near_header(scopes)
    state._observe.budget_near(BudgetNear(route, state.trace_id, scopes))


def near_header(scopes: Sequence[str]) -> bytes:
    """`x-ai-budget`'s value for `scopes`: `near; scope=<scope>[,<scope>...]`, each scope a
    printable ASCII token (any other character as `?`), at most 200 characters in all."""
    clean = ",".join(
        "".join(c if c.isascii() and c.isprintable() and c not in ' ,;"' else "?" for c in scope)
        for scope in scopes
    )
    return f"near; scope={clean[:200]}".encode("ascii")


async def leg_down(
    state: RequestState, leg: Leg, call: CallFailed, probe: float | None
) -> tuple[Report | None, GuardTripped]:
    """A leg gave up: what the next store step reports of it, and its failure."""
    shared = state._shared
    tripped = gave_up(state, leg, call)
    await shared.credential_warnings.failed(shared.store, leg.ref.key, call.error)
    # JSON mode not met: the model answered, just not in shape. A context window or a content
    # filter: it answered, to this request (the request's limit, not the model's health).
    answered = getattr(call.error, "json_mode_failed", False) or call.verdict.kind in LIMIT_REASONS
    outcome = Outcome.success if answered else Outcome.failure
    if getattr(call.error, "queued", False):  # its first-output limit passed in our own queue
        outcome = Outcome.released
    cool_s, until = cooldown(state, leg, call.error) if call.verdict.kind in COOLDOWN_KINDS else (0.0, None)
    return report(state, leg, outcome, probe, cool_s, until, settle=False), tripped


def cooldown(state: RequestState, leg: Leg, error: Exception) -> tuple[float, float | None]:
    """The cooldown `error` starts on `leg`'s model: (seconds, the latest it may end on the
    store's clock: a provider's date ends it by the store's clock, not this worker's)."""
    return state._shared.cooldown_for(leg.ref.key).seconds(error), getattr(error, "retry_at", None)


async def cool_down(state: RequestState, leg: Leg, error: Exception) -> None:
    """Start the cooldown a rate limit calls for before its wait is waited out (`_retries`):
    every other request skips the model meanwhile, while this one retries it after the wait
    (a retry is not admitted by the store: the cooldown does not skip it). No breaker outcome
    yet: the call is not over."""
    cool_s, until = cooldown(state, leg, error)
    await send(state, report(state, leg, Outcome.released, None, cool_s, until, settle=False))


def gave_up(state: RequestState, leg: Leg, call: CallFailed) -> GuardTripped:
    """A leg gave up after its retries: noted, and its verdict. A model that answered, just
    not in the shape asked for (JSON mode), served the request all the same."""
    times = f" x{call.attempts}" if call.attempts > 1 else ""
    state._note(leg, call.verdict.kind.value + times, None)
    error = call.error
    if isinstance(error, ProviderError) and error.json_mode_failed:
        state._served(leg, None)
    return failed(state, leg, call, state._shared.cooldown_for(leg.ref.key))


async def finish_leg(
    state: RequestState, leg: Leg, outcome: Outcome, probe: float | None, record_success: bool
) -> None:
    """Record the serving leg's outcome and settle the request's spend."""
    if outcome is Outcome.success:
        leg.last_success[0] = state._shared.success_clock()
    if outcome is not Outcome.success or record_success or probe is not None:
        if record_success and outcome is Outcome.success and state._route.slow_call_s is not None:
            outcome = Outcome.slow if state._slow else outcome  # (set by the walk: `_state`)
        await record(state, leg, outcome, probe)
    if state._hold is not None:
        await settle(state)


async def settle(state: RequestState) -> None:
    """Replace the spend hold by what the calls cost (`_accounting`)."""
    await send(state, report_end(state, None))


async def record(state: RequestState, leg: Leg, outcome: Outcome, probe: float | None) -> None:
    """Report the end of a call to `leg` (and settle the spend) in one store operation."""
    await send(state, report(state, leg, outcome, probe, settle=True))


def report(
    state: RequestState,
    leg: Leg,
    outcome: Outcome,
    probe: float | None,
    cool_s: float = 0.0,
    cool_until: float | None = None,
    *,
    settle: bool,
) -> Report | None:
    """What the next store step reports of a call to `leg`: its breaker outcome (a released
    call without a probe changes nothing), its cooldown, and (`settle`, at the walk's end) the
    spend. None when there is nothing to report."""
    breaker = state._route.breaker
    recorded = breaker is not None and (probe is not None or outcome is not Outcome.released)
    ended = leg.last_success[0] if recorded else None
    made: Report | None = Report(
        breaker_key=leg.breaker_key if recorded else None,
        breaker=breaker if recorded else None,
        outcome=outcome,
        probe=probe,
        success_age=None if ended is None else state._shared.success_clock() - ended,
        cooldown_key=leg.cooldown_key if cool_s > 0 else None,
        cooldown_s=cool_s,
        cooldown_until=cool_until if cool_s > 0 else None,
    )
    made = report_end(state, made) if settle else made
    if made is None or (
        made.breaker_key is made.cooldown_key is made.spend_key is None and made.charge is None
    ):
        return None  # nothing to report
    return made


def report_end(state: RequestState, made: Report | None) -> Report | None:
    """`made` with the holds settled too (the walk is over), if the request holds spend or
    tokens: the spend to what the calls cost, the tokens to the usage they reported (a billed
    call that reported none: its whole hold)."""
    charge = state._first.charge if state._first is not None else None
    if state._hold is None or charge is None:
        return made
    reservation, state._hold = state._hold, None
    settled(state)
    if charge.more is not None:  # months, tokens, scopes: the charge as held settles itself
        held, tokens = state._charge, state._used_tokens if state._route.token_capped else 0
        if made is None:
            return Report(charge=held, reservation=reservation, actual=state._cost, tokens=tokens)
        return dataclasses.replace(
            made, charge=held, reservation=reservation, actual=state._cost, tokens=tokens
        )
    key = charge.key
    if made is None:
        return Report(spend_key=key, reservation=reservation, actual=state._cost)
    return dataclasses.replace(made, spend_key=key, reservation=reservation, actual=state._cost)


async def send(state: RequestState, made: Report | None) -> None:
    """A step that only reports (nothing to report: no store operation)."""
    if made is None:
        return
    try:
        passage = await state._shared.store.step(Step(report=made))
    except StoreUnavailable:
        report_lost(state, made)
        return
    if passage.recorded is not None:
        saw_report(state, made, passage.recorded.state)
    if passage.transitions:
        saw_transitions(state, passage.transitions, made)


def saw_transitions(
    state: RequestState, transitions: Sequence[tuple[str, CircuitState]], report: Report | None
) -> None:
    """The breaker state changes a store step made (the store tells exactly one caller of
    each, so every worker together counts each once). A breaker this step's `report` opened is
    open for the reporting route's `reset_timeout_s` from now, or its probe interval
    (`Breaker.reopen_after_probe_s`) when the report was a failed probe (`_known`)."""
    for key, moved in transitions:
        for leg in state._route.legs:
            if leg.breaker_key == key:
                state._observe.breaker_moved(BreakerMoved(leg, moved))
                if moved is CircuitState.open:
                    breaker = state._route.breaker
                    wait = None
                    if breaker is not None:
                        after_probe = report is not None and report.probe is not None
                        wait = (
                            breaker.reopen_after_probe_s if after_probe else None
                        ) or breaker.reset_timeout_s
                    remember(state, leg, "circuit_open", wait)
                elif moved is CircuitState.closed:
                    forget(leg)
                break


def saw_report(state: RequestState, made: Report, recorded: CircuitState) -> None:
    """After a step's report: the breaker state it recorded, and the cooldown it started."""
    route = state._route
    for leg in route.legs:
        if leg.breaker_key == made.breaker_key:
            leg.saw(recorded)
            break
    if made.cooldown_key is not None:
        cooled = next(leg for leg in route.legs if leg.cooldown_key == made.cooldown_key)
        state._observe.cooldown_started(
            CooldownStarted(route, state.trace_id, cooled.ref.key, made.cooldown_s)
        )
        if made.cooldown_until is None:  # (a provider's date ends it by the store's clock)
            remember(state, cooled, "cooldown", made.cooldown_s)


def report_lost(state: RequestState, made: Report | None) -> None:
    """The store did not take a report: each part is lost, and said so."""
    if made is None:
        return
    observe, route, trace_id = state._observe, state._route, state.trace_id
    if made.breaker_key is not None:
        observe.store_failed(StoreFailed(route, trace_id, "breaker", op="breaker_record"))
    if made.cooldown_key is not None:
        observe.store_failed(StoreFailed(route, trace_id, "cooldown", op="start_cooldown"))
    if made.spend_key is not None or made.charge is not None:
        observe.store_failed(StoreFailed(route, trace_id, "budget", op="settle_spend"))


def store_down(state: RequestState, step: Step) -> None:
    """The store did not answer `step`: its report is lost, and each guard does as it does
    when its store is down (cooldowns fail open; the breaker and the budget as configured, a
    local share charged in this worker's memory: `guards.policies._local_budget`)."""
    route, charge = state._route, step.charge
    report_lost(state, step.report)
    state._observe.store_failed(StoreFailed(route, state.trace_id, "cooldown", mode="open"))
    if route.breaker is not None:
        store_failed(state, "breaker", route.breaker.on_store_failure)
    if charge is None or route.budget is None:
        return
    local = route.local_share
    if local is None:
        closed = any(budget.on_store_failure == "closed" for budget in route.budgets)
        store_failed(state, "budget", "closed" if closed else "open")
    else:
        state._observe.store_failed(StoreFailed(route, state.trace_id, "budget", mode="local"))
        refusal = local.charge(charge)
        if refusal is not None:
            state._charged = True
            refused = refusal.charge if refusal.charge < len(route.budgets) else 0
            raise budget_refusal(route.budgets[refused], refusal, route.scopes[refused])
    state._charged = True


def store_failed(state: RequestState, guard: str, mode: str) -> None:
    """The store did not answer a guard's check: admit (fail open) or refuse (fail closed)."""
    state._observe.store_failed(StoreFailed(state._route, state.trace_id, guard, mode=mode))
    if mode == "closed":
        raise GuardTripped(
            Reason.circuit_open,
            f"the {guard} guard's store is unavailable: calls are paused",
            retry_after_s=STORE_RETRY_AFTER_S,
            model=state._route.model,
        )
