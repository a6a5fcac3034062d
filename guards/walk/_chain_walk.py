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

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import anyio

from ..contracts._binding import AIResult, Binding
from ..contracts._errors import GuardTripped
from ..policies._call import CallFailed, call_model
from ..policies._chain import DEFAULT_PROVIDER
from ..stores import Passage, StoreUnavailable
from ..stores._breaker import Outcome
from ..waits._admission import never_admitted, waited_for_admission
from ..waits._deadline import Deadline
from ..waits._first_output import limited
from ._accounting import on_attempt
from ._checkpoints import resumed
from ._known import known_refused
from ._retries import alone, before_retry, leg_limit
from ._store_steps import admitted, cool_down, leg_down, next_step, record, send, settle
from ._store_steps import report as report_call
from ._store_steps import report_end as settled
from ._verdicts import exhausted, gone, timed_out
from ._windows import LIMIT_KINDS, Limits, flagged

if TYPE_CHECKING:
    from ..spec._route_spec import GuardedRoute, Leg
    from ..stores import Report
    from ._state import RequestState

__all__ = ["Call", "Check", "binding", "by_effort", "client_gone", "first_output_limited", "traced", "walk"]

R = TypeVar("R")
#: One attempt on a leg: `call(model, inputs)`.
Call = Callable[[str, Mapping[str, Any]], Awaitable[R]]


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
    state: RequestState, inputs: Mapping[str, Any], call_for: Callable[[Leg], Call[R]]
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
    answer (of `run` calls) under the walk's deadline: a rejected one moves the walk on to the
    leg and inputs it says, its call already reported. The caller records the outcome and
    settles the spend; on failure this settles and raises `GuardTripped`."""
    route, observe = state._route, state._observe
    if state._notes:
        state._notes = []  # the notes of this walk only
    state._waits = None
    start = 0
    if route.legs[0].known.until and not state.attempts:
        # The request's first walk, its first model known refused (`_known`): skipped as the
        # store would. When every model is, the walk ends as when the store refuses them all,
        # with nothing to report, charge or settle, and no deadline to keep.
        start = known_refused(state, 0)
        if start == len(route.legs):
            raise exhausted(state, None, False, state._shared.attribution == "detailed")
    inflight: Leg | None = None  # the leg being called (its probe ticket: `probe`)
    probe: float | None = None
    last: GuardTripped | None = None
    spent = False  # the request's attempt budget ran out before a leg
    # Context windows and content filters (`_windows`): made now only when a leg declares a
    # window, else at a call that hits such a limit.
    limits = Limits(state, inputs) if route.windowed else None
    timeout_s = route.timeout_s
    if state._scope is None:  # the request's first walk: from the request's arrival
        timeout_s -= perf_counter() - state._started
    try:
        on_mark = _start_watch if state._request is not None else None
        # Kept before it is entered: a deadline already passed raises there, and the request's
        # later walks are still later walks.
        scope = state._scope = Deadline(timeout_s, on_mark, state)
        with scope:
            deadline = scope.when
            try:
                legs, report = route.legs, None
                count = len(legs)
                while True:
                    if limits is not None and start < count:
                        start = limits.skip(start)  # the legs this request cannot be sent to
                    # One store operation: the last call's report, then the next admission.
                    if start < count and state.attempts >= state.attempt_budget:
                        spent, start = True, count  # no further call: report only
                    left = start < count and state.attempts > 0 and await client_gone(state)
                    if left or start >= count:
                        # The walk is over: the report settles the spend too.
                        if (ending := settled(state, report)) is not None:
                            await send(state, ending)
                        if left:
                            raise gone(state, legs[start])
                        break
                    if state.attempts and legs[start].known.until:
                        # After a call, a model known refused (`_known`, as above): skipped
                        # as the store would, with no store operation.
                        known = known_refused(state, start)
                        if known != start:
                            start = known
                            continue
                    first = state._first
                    if (
                        first is not None
                        and not start
                        and report is None
                        and not state._charged
                        and first.legs is route.step_legs
                        and not route.holds
                    ):
                        step = first  # `next_step`'s usual answer, inline: every request's path
                    else:
                        step = next_step(state, start, report, inputs)
                    try:
                        passage: Passage | None = await state._shared.store.step(step)
                    except StoreUnavailable:
                        passage = None
                    let_in = admitted(state, start, step, passage)
                    if let_in is None:
                        break
                    index, probe, record_success = let_in
                    leg = legs[index]
                    if limits is not None and index > start and limits.unfit(leg) is not None:
                        # The store admitted a leg past `start` (those before it resting) that
                        # this request cannot be sent to: the next step frees its probe slot,
                        # and the walk goes on after it (the loop's first check skips it).
                        start, report = index, None
                        if probe is not None:
                            report = report_call(state, leg, Outcome.released, probe, settle=False)
                        continue
                    inflight = leg
                    state._leg = leg
                    call: Call[Any]
                    if call_for is None:  # the leg's binding's `run` (`binding`, inline)
                        provider = leg.ref.provider
                        shared = state._shared
                        call = (shared.binding if provider is None else shared.providers[provider]).run
                    else:
                        call = call_for(leg)
                    if leg.first_output_s is not None:
                        call = first_output_limited(state, leg, call, signalled=call_for is None)
                    if observe.trace is not None:
                        call = traced(state, call, leg)
                    made = state.attempts  # the request's calls before this leg's
                    started = perf_counter()
                    try:
                        # The leg's first call, made here; `call_model` only retries a
                        # failure (one coroutine less on every request's path).
                        result = await call(leg.ref.model, inputs)
                    except Exception as error:
                        on_attempt(state, error, started)
                        try:
                            # A half-open probe is one call: it tells whether the model is
                            # back, and its failure moves on at once.
                            probing = probe is not None
                            result, _ = await call_model(
                                call,
                                leg.ref.model,
                                inputs,
                                policy=route.retry,
                                deadline=deadline,
                                limit=(
                                    1
                                    if probing
                                    else leg_limit(state, index, made)
                                    if index + 1 < count
                                    else state.attempt_budget - made  # the last leg's
                                ),
                                sleep=state._shared.sleep,
                                on_attempt=lambda _, outcome, began: on_attempt(state, outcome, began),
                                on_retry=functools.partial(before_retry, state),
                                failed=error,
                                wait_out=(
                                    None
                                    if probing or not alone(state, index)
                                    else functools.partial(cool_down, state, leg)
                                ),
                            )
                        except CallFailed as failure:
                            inflight = None
                            report, last = await leg_down(state, leg, failure, probe)
                            start = index + 1
                            if (kind := failure.verdict.kind) in LIMIT_KINDS:
                                if limits is None:
                                    limits = Limits(state, inputs)
                                if not limits.failed(leg, kind):
                                    start = count  # the walk ends here
                            continue
                    except BaseException as stopped:  # cancelled: it may still be billed
                        on_attempt(state, stopped, started)
                        raise
                    else:
                        if route.content_filter_fallback and type(result) is AIResult and result.moderated:
                            # Its provider flagged the answer: its content filter (`_windows`).
                            inflight, start, limits = None, index + 1, limits or Limits(state, inputs)
                            report, last = flagged(state, leg, result, started, probe, record_success, limits)
                            continue
                        if check is not None:  # the route moves rejected answers on (`_rejected`)
                            moved = await check.moved_on(
                                state, leg, index, result, started, probe, record_success
                            )
                            if moved is not None:
                                inflight = None
                                report, last, start, inputs = moved
                                continue
                        if type(result) is AIResult and leg.price is None and not route.token_capped:
                            # `on_attempt`'s usual case, inline (every request's path): a
                            # success with no price, so no cost to add.
                            state.attempts += 1
                            if (usage := result.usage) is not None:
                                state.usage = usage if state.usage is None else state.usage + usage
                            state._held = observe.attempt_ended(
                                (
                                    route,
                                    state.trace_id,
                                    leg,
                                    state.attempts,
                                    "ok",
                                    usage,
                                    result.model or leg.ref.model,
                                    perf_counter() - started,
                                    None,
                                    None,
                                    None,
                                    None,
                                    resumed(state._request) if route.task is not None else (),
                                    None,
                                ),
                                state._held,
                            )
                        else:
                            on_attempt(state, result, started)
                    if route.slow_call_s is not None:
                        # A breaker counting slow calls hears of every call: the leg's time
                        # from its first attempt to its answer (a stream's first output).
                        state._slow = perf_counter() - started > route.slow_call_s
                        record_success = True
                    return leg, result, probe, record_success
            finally:
                if state._watch is not None:
                    state._watch.cancel()
                    state._watch = None
    except TimeoutError as expired:
        leg = inflight if inflight is not None else state._leg
        if state._gone:  # the watcher ended the walk: no verdict on the model
            if inflight is not None:
                await record(state, leg, Outcome.released, probe)
            await settle(state)
            raise gone(state, leg) from None
        # A call that spent its deadline waiting for a connection: no verdict on the model.
        queued = waited_for_admission(expired)
        if inflight is not None:
            await record(state, leg, Outcome.released if queued else Outcome.failure, probe)
        await settle(state)
        raise timed_out(state, leg, never_admitted(expired)) from None
    except GuardTripped:
        # A budget refusal (before any call) or the client gone: no verdict on the model.
        if inflight is not None:
            await record(state, inflight, Outcome.released, probe)
        await settle(state)
        raise
    except BaseException:
        # Cancelled from outside (server stopping): no verdict on the model, but a probe
        # slot must be freed and the spend settled, shielded from the cancellation.
        with anyio.CancelScope(shield=True):
            if inflight is not None:
                await record(state, inflight, Outcome.released, probe)
            await settle(state)
        raise
    if state._hold is not None:
        await settle(state)
    if limits is not None and (limited := limits.verdict(last)) is not None:
        raise limited
    raise exhausted(state, last, spent, state._shared.attribution == "detailed")


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
    """`call`, each attempt in a span of its own (the request is traced)."""
    return state._observe.traced(
        call,
        leg,
        binding(state, leg),
        fallback=state._route.legs[0] is not leg,
        attempts=lambda: state.attempts,
        retry=retry,
    )


def by_effort(state: RequestState, inputs: Mapping[str, Any]) -> GuardedRoute:
    """Effort routing (`guards.routes._effort`): the request's first call picks its tier's chain,
    which every later call of the request keeps."""
    assert state._route.effort is not None
    route = state._route = state._route.effort.choose(inputs, state._request, state.trace_id)
    state._leg, state.attempt_budget = route.legs[0], route.attempt_budget
    return route


def _start_watch(state: RequestState) -> None:
    """`MARK_AFTER_S` into a walk: watch the client."""
    assert state._scope is not None
    state._watch = asyncio.get_running_loop().create_task(_watch_client(state, state._scope))


async def _watch_client(state: RequestState, scope: Deadline) -> None:
    """Wait for the client to disconnect, then end the walk now."""
    assert state._request is not None
    receive = state._request.receive
    while (await receive())["type"] != "http.disconnect":
        pass
    state._gone = True
    scope.expire()


async def client_gone(state: RequestState) -> bool:
    """Whether the client disconnected (checked before a further model, without waiting)."""
    if not state._gone and state._request is not None:
        state._gone = await state._request.is_disconnected()
    return state._gone
