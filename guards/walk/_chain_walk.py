"""The chain walk: a request's calls along its route's fallback chain, under one deadline.

Between calls, one store step (`_store_steps`) reports the last call and admits the next leg
(cooldowns and open breakers skip a model without a call; the budget is charged once, before
the first call). Each call's failure is classified: retried on the same model while the
policy, the leg's share of the attempt budget and the retry budget allow (`_retries`), else the
walk moves to the next leg. Every call is accounted for (`_accounting`); a walk that ends
without an answer raises its verdict (`_verdicts`).

One deadline covers every leg, attempt and wait: the request's first walk's runs from the
request's arrival at the app (`guards.waits._arrival`), so the time to take the request in counts, and
a request whose deadline passed before its first call ends then, with nothing called or charged;
each later walk of the request has its own, from its start. When it passes, the task is
cancelled where it awaits: the provider request is aborted, its connection closed, and no
further leg is tried (cancellation never moves on). A walk that outlasts `MARK_AFTER_S` starts
watching for the client leaving, which ends it at once the same way; quick walks never pay for
the watcher.
A leg with a first-output limit (`guards.Model`) has each of its attempts cancelled the same
way when it produced no first output in time (`guards.waits._first_output`): that attempt fails, and
the walk goes on; legs without one are called as they are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import anyio

from ..contracts._binding import AIResult, Binding
from ..contracts._errors import GuardTripped
from ..policies._call import CallFailed
from ..policies._chain import DEFAULT_PROVIDER
from ..policies._deployments import counted
from ..stores import Passage, StoreUnavailable
from ..stores._breaker import Outcome
from ..waits._admission import never_admitted, waited_for_admission
from ..waits._client import watch_client
from ..waits._deadline import Deadline
from ..waits._first_output import limited
from ._accounting import answered, on_attempt
from ._known import deployment_refused, known_refused, tokens_settled
from ._retries import Hedged, hedge_won, retried
from ._store_steps import admitted, leg_down, next_step, record, send, settle
from ._store_steps import report as report_call
from ._store_steps import report_end as settled
from ._verdicts import exhausted, gone, timed_out
from ._windows import LIMIT_KINDS, Limits, moved_by_filter

if TYPE_CHECKING:
    from ..spec._route_spec import GuardedRoute, Leg
    from ..stores import Report
    from ._state import RequestState

__all__ = ["Call", "Check", "binding", "by_effort", "client_gone", "first_output_limited", "traced", "walk"]

R = TypeVar("R")
#: One attempt on a leg: `call(model, inputs)`; what makes it for a leg: `CallFor`.
Call = Callable[[str, Mapping[str, Any]], Awaitable[R]]
CallFor = Callable[["Leg"], Call[Any]]


class Check(Protocol):
    """A check of each answer inside the walk (`_rejected.Check`): a rejected answer moves
    the walk on instead of ending it."""

    async def moved_on(
        self,
        state: RequestState,
        leg: Leg,
        index: int,
        result: AIResult,
        started: float,
        probe: float | None,
        record_success: bool,
    ) -> tuple[Report | None, GuardTripped, int, Mapping[str, Any]] | None:
        """None: the answer is accepted. Else it was accounted for and the model reported:
        (the report of the call, the rejection, the leg to call next, its inputs)."""
        ...


@overload
async def walk(
    state: RequestState, inputs: Mapping[str, Any], call_for: None = None, check: Check | None = None
) -> tuple[Leg, AIResult, float | None, bool]: ...


@overload
async def walk(
    state: RequestState,
    inputs: Mapping[str, Any],
    call_for: Callable[[Leg], Call[R]],
    check: Check | None = None,
) -> tuple[Leg, R, float | None, bool]: ...


async def walk(
    state: RequestState,
    inputs: Mapping[str, Any],
    call_for: Callable[[Leg], Call[Any]] | None = None,
    check: Check | None = None,
) -> tuple[Leg, Any, float | None, bool]:
    """Walk the chain until a call succeeds: (its leg, its result, the leg's breaker probe
    ticket, whether its success must be recorded). `call_for(leg)` is what makes one attempt
    on a leg: `call(model, inputs)` (default: the leg's binding's `run`). `check` checks each
    answer (of `run` calls, or a held stream's start: `_streaming.HoldCheck`) under the walk's
    deadline: a rejected one moves the walk on to the leg and inputs it says, its call
    already reported. The caller records the outcome and settles the spend; on failure this
    settles and raises `GuardTripped`."""
    route, start = state._route, _first_start(state)
    inflight: Leg | None = None  # the leg being called (its probe ticket: `probe`)
    probe: float | None = None
    last: GuardTripped | None = None
    spent = False  # the request's attempt budget ran out before a leg
    limits = Limits(state, inputs) if route.windowed or route.content_filter_fallback else None  # or on a hit
    try:
        scope = state._scope = _deadline(state)
        with scope:
            try:
                legs, report, count = route.legs, None, len(route.legs)
                while True:
                    if limits is not None and start < count:
                        start = limits.skip(start)  # the legs this request cannot be sent to
                    if start < count and state.attempts >= state.attempt_budget:
                        spent, start = True, count  # no further call: report only
                    if start >= count or (state.attempts > 0 and await client_gone(state)):
                        await _over(state, report, legs[start] if start < count else None)
                        break
                    if state.attempts and (known := known_refused(state, start)) != start:
                        start = known  # after a call, skipped as the store would (`_known`)
                        continue
                    step = next_step(state, start, report, inputs)
                    try:  # one store operation: the last call's report, then the next admission
                        passage: Passage | None = await state._shared.store.step(step)
                    except StoreUnavailable:
                        passage = None
                    if (let_in := admitted(state, start, step, passage)) is None:
                        break
                    index, probe, record_success = let_in
                    leg = legs[index]
                    unfit = limits is not None and index > start and limits.unfit(leg) is not None
                    if unfit or (leg.limited and await deployment_refused(state, leg, inputs)):  # (`_known`)
                        start, report = index + leg.limited, _unfit(state, leg, probe)
                        continue
                    inflight = state._leg = leg
                    call = _call(state, leg, call_for, index if probe is None else None)
                    made, started = state.attempts, perf_counter()  # the calls before this leg's
                    try:
                        result = await call(leg.ref.model, inputs)  # retried by `retried`
                    except Exception as exc:
                        on_attempt(state, exc, started)
                        try:  # an answer on a retry is judged below, as a first call's
                            result, started = await retried(state, leg, index, call, inputs, exc, made, probe)
                        except CallFailed as failure:
                            inflight, (report, last) = None, await leg_down(state, leg, failure, probe)
                            start, limits = _after_failure(state, inputs, limits, index, failure)
                            continue
                    except BaseException as cancelled:  # it may still be billed
                        on_attempt(state, cancelled, started)
                        raise
                    if state._leg is not leg:  # a hedge answered first (`_retries`)
                        inflight, probe, (leg, index, started) = state._leg, None, hedge_won(call)
                    moved = moved_by_filter(
                        state, leg, index, result, started, probe, record_success, limits, inputs
                    )
                    if moved is None and check is not None:
                        moved = await check.moved_on(
                            state, leg, index, result, started, probe, record_success
                        )
                    if moved is not None:
                        inflight, (report, last, start, inputs) = None, moved
                        continue
                    answered(state, leg, result, started)
                    if route.slow_call_s is not None:
                        record_success = _timed(state, started, result)
                    return leg, result, probe, record_success
            finally:
                if state._watch is not None:
                    _stop_watch(state)
    except BaseException as stopped:
        await _stopped(state, inflight, probe, stopped)  # raises a timeout's verdict
        raise
    raise await _no_answer(state, limits, last, spent)


def _first_start(state: RequestState) -> int:
    """Ready `state` for a walk, and the leg it starts from: the request's first walk skips a
    first model known refused (`_known`) as the store would. When every model is, the walk
    ends (`exhausted`) as when the store refuses them all, with nothing to report, charge or
    settle, and no deadline to keep."""
    if state._notes:
        state._notes = []  # the notes of this walk only
    state._hedge = None
    state._waits = None
    legs = state._route.legs
    if not legs[0].known.until or state.attempts:
        return 0
    start = known_refused(state, 0)
    if start == len(legs):
        raise exhausted(state, None, False, state._shared.attribution == "detailed")
    return start


def _deadline(state: RequestState) -> Deadline:
    """The walk's deadline: the request's first walk's from the request's arrival (the time to
    take it in counts), each later walk's from its start. A request being served watches its
    client from the deadline's mark (`MARK_AFTER_S`). The walk keeps it before entering it: a
    deadline already passed raises there, and the request's later walks are still later walks."""
    timeout_s = state._route.timeout_s
    if state._scope is None:  # the request's first walk
        timeout_s -= perf_counter() - state._started
    return Deadline(timeout_s, _start_watch if state._request is not None else None, state)


async def _over(state: RequestState, report: Report | None, left: Leg | None) -> None:
    """The walk is over before another call: the last call's `report`, which settles the spend
    too, sent. `left`: the client left before the walk got to that leg (raises `gone`)."""
    if (ending := settled(state, report)) is not None:
        await send(state, ending)
    if left is not None:
        raise gone(state, left)


def _unfit(state: RequestState, leg: Leg, probe: float | None) -> Report | None:
    """What the next step reports of an admitted leg the request cannot be sent to: the probe
    slot it took, freed (None: it took none)."""
    if probe is None:
        return None
    return report_call(state, leg, Outcome.released, probe, settle=False)


def _call(state: RequestState, leg: Leg, call_for: CallFor | None, hedge_at: int | None = None) -> Call[Any]:
    """What makes one attempt on `leg`: `call_for(leg)`, by default its binding's `run`
    (`binding`, inline), each attempt limited to the leg's first-output time and traced when
    the leg and the request ask for it; its first hedged when the route hedges (`_retries`;
    `hedge_at`: the leg's index, None for a probe or a hedge: never hedged)."""
    call: Call[Any]
    if call_for is None:
        provider = leg.ref.provider
        shared = state._shared
        call = (shared.binding if provider is None else shared.providers[provider]).run
    else:
        call = call_for(leg)
    if (group := leg.ref.group) is not None and group.strategy == "least_busy":  # a deployment's
        call = counted(state._shared.balance, leg.ref.key, call)  # calls in flight counted
    if leg.limited and leg.ref.deployment is not None and leg.ref.deployment.tpm is not None:
        call = tokens_settled(state, call)  # a deployment's tokens per minute settled to usage
    if leg.first_output_s is not None:
        # A binding's `run` may say when its answer's first byte came; a stream's hold says when
        # its first output came (`guards.streams._hold`): the limit is not the hold's.
        call = first_output_limited(state, leg, call, signalled=True)
    if state._observe.trace is not None:
        call = traced(state, call, leg)
    if hedge_at is None or state._route.hedge is None or state._route.task is not None:
        return call
    return Hedged(state, hedge_at, call, lambda other: _call(state, other, call_for))


def _after_failure(
    state: RequestState, inputs: Mapping[str, Any], limits: Limits | None, index: int, failure: CallFailed
) -> tuple[int, Limits | None]:
    """Where the walk goes on after the leg at `index` gave up (the next leg), and the request's
    limits: a failure that is the request's own limit (a context window, a content filter:
    `_windows`) starts them, and may leave no later leg to try (the walk ends)."""
    if (kind := failure.verdict.kind) not in LIMIT_KINDS:
        return index + 1, limits
    if limits is None:
        limits = Limits(state, inputs)
    legs = state._route.legs
    return (index + 1 if limits.failed(legs[index], kind) else len(legs)), limits


def _timed(state: RequestState, started: float, result: Any) -> bool:
    """A breaker counting slow calls hears of every call: whether the leg's time from its
    first attempt to its answer (a stream's first output, the start of its hold when it has
    one) was slow is kept for its record (`finish_leg`). Returns True: the success must be
    recorded."""
    slow_call_s = state._route.slow_call_s
    assert slow_call_s is not None
    answered = getattr(result, "first_output_at", None) or perf_counter()
    state._slow = answered - started > slow_call_s
    return True


def _stop_watch(state: RequestState) -> None:
    """The walk is over: stop watching the client."""
    assert state._watch is not None
    state._watch.cancel()
    state._watch = None


async def _stopped(
    state: RequestState, inflight: Leg | None, probe: float | None, stopped: BaseException
) -> None:
    """The walk stopped by `stopped`: the call in flight (`inflight`, its probe ticket `probe`)
    recorded and the spend settled. A budget refusal (before any call), the client gone (the
    watcher, or a check between models) and a cancellation from outside (the server stopping,
    shielded from it) say nothing of the model. Its deadline passing fails the call in flight,
    unless it spent the deadline waiting for a connection, and raises `timed_out` instead."""
    if isinstance(stopped, GuardTripped):
        await _released(state, inflight, probe)
    elif not isinstance(stopped, TimeoutError):
        with anyio.CancelScope(shield=True):
            await _released(state, inflight, probe)
    elif state._gone:  # the watcher ended the walk
        await _released(state, inflight, probe)
        raise gone(state, inflight if inflight is not None else state._leg) from None
    else:
        queued = waited_for_admission(stopped)
        if inflight is not None:
            await record(state, inflight, Outcome.released if queued else Outcome.failure, probe)
        await settle(state)
        leg = inflight if inflight is not None else state._leg
        raise timed_out(state, leg, never_admitted(stopped)) from None


async def _released(state: RequestState, inflight: Leg | None, probe: float | None) -> None:
    """No verdict on the model: the call in flight (its probe slot) released, the spend settled."""
    if inflight is not None:
        await record(state, inflight, Outcome.released, probe)
    await settle(state)


async def _no_answer(
    state: RequestState, limits: Limits | None, last: GuardTripped | None, spent: bool
) -> GuardTripped:
    """The walk ended with no answer (`last`: the last model's failure; `spent`: the attempt
    budget ran out first): the spend settled, and the verdict to raise (a request's own
    limit's, when one kept it from every model: `_windows`)."""
    if state._hold is not None:
        await settle(state)
    if limits is not None and (limited := limits.verdict(last)) is not None:
        return limited
    return exhausted(state, last, spent, state._shared.attribution == "detailed")


def first_output_limited(state: RequestState, leg: Leg, call: Call[R], *, signalled: bool) -> Call[R]:
    """`call`, each attempt cancelled without its first output within the leg's
    `first_output_s` (`guards.waits._first_output`); `signalled`: `call` is a binding's `run`, which
    may say when its answer's first byte came."""
    assert leg.first_output_s is not None
    return limited(
        call,
        leg.first_output_s,
        leg.ref.provider or DEFAULT_PROVIDER,
        moves_on=len(state._route.legs) > 1,
        signalled=signalled,
    )


def binding(state: RequestState, leg: Leg) -> Binding:
    """The binding that serves `leg` (its provider's, else the app's main binding)."""
    provider = leg.ref.provider
    return state._shared.binding if provider is None else state._shared.providers[provider]


def traced(state: RequestState, call: Call[R], leg: Leg, *, retry: bool = False) -> Call[R]:
    """`call`, each attempt in a span of its own (the request is traced; a hedge's is marked)."""
    return state._observe.traced(
        call,
        leg,
        binding(state, leg),
        fallback=not leg.leads,
        attempts=lambda: state.attempts,
        retry=retry,
        hedge=state._hedge is leg,
    )


def by_effort(state: RequestState, inputs: Mapping[str, Any]) -> GuardedRoute:
    """Effort routing (`guards.routes._effort`): the request's first call picks its tier's chain,
    which every later call of the request keeps."""
    assert state._route.effort is not None
    route = state._route = state._route.effort.choose(inputs, state._request, state.trace_id)
    state._leg, state.attempt_budget = route.legs[0], route.attempt_budget
    return route


def _start_watch(state: RequestState) -> None:
    """`MARK_AFTER_S` into a walk: watch the client (`guards.waits._client`)."""
    assert state._request is not None
    state._watch = watch_client(state._request, _client_left, state)


def _client_left(state: RequestState) -> None:
    """The client left: end the walk now."""
    assert state._scope is not None
    state._watch = None
    state._gone = True
    state._scope.expire()


async def client_gone(state: RequestState) -> bool:
    """Whether the client disconnected (checked before a further model, without waiting)."""
    if not state._gone and state._request is not None:
        state._gone = await state._request.is_disconnected()
    return state._gone
