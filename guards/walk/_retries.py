"""Retries within a walk: a leg's retries after its first call failed (`retried`), how many
calls a leg may make (so a retry never starves the fallbacks), whether a retry the policy allows
is admitted by the model's retry budget, and whether a leg is alone (no other model left to
answer: a short provider wait is then waited out, `Retry.wait_out_s`); and hedges, the other
attempt the retry budget pays for.

Hedged calls (`route(hedge=Hedge(...))`, `Hedged`): a leg's first call that has not answered
after the hedge's delay starts a second attempt, the hedge, on another model (`hedge_target`);
the first answer wins and the other attempt is cancelled at once (its connection closed).

What is hedged: a leg's first call in a walk (its retries are not), not a half-open breaker's
probe, not a call with tools, not on a route with `task=`; a stream up to its commit point (its
first output, or its hold's end: the walk's call returns there), never after. At most one
hedge per call. A hedge takes one of the request's attempts (`attempt_budget`, which the spend
hold is priced by) and one token of the hedged model's retry budget: none left, no hedge
(`skipped`). Both attempts run under the walk's deadline.

Accounting: each attempt is accounted for as any call is (`_accounting`): the loser as a
cancelled call (billed; under a spend cap at its worst case, its usage being unknown), an
attempt that failed as that failure. The breaker hears of the winner only (a hedge's success
as the leg's success, a first attempt's as today); a loser's cancellation, or a failure the
winner made up for, is no verdict on its model.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar

from ..policies._call import call_model
from ..policies._retry_budget import admit_retry
from ..streams._relay import Opened, aclose
from ._accounting import on_attempt
from ._events import Retried
from ._store_steps import cool_down

if TYPE_CHECKING:
    from ..contracts._classify import Classification
    from ..spec._route_spec import Leg
    from ._state import RequestState

__all__ = ["Hedged", "alone", "before_retry", "hedge_target", "hedge_won", "leg_limit", "retried"]

R = TypeVar("R")


def leg_limit(state: RequestState, index: int, made: int) -> int:
    """Calls the leg at `index` may make when it has later legs, the request having made
    `made` before it: what the attempt budget has left, minus one for each later leg that is
    not cooling down."""
    left = state.attempt_budget - made
    waits = state._waits
    if waits is None:
        reserved = len(state._route.legs) - index - 1
    else:
        reserved = sum(1 for wait in waits[index + 1 :] if wait <= 0)
    return max(1, left - reserved)


def alone(state: RequestState, index: int) -> bool:
    """Whether no model after the leg at `index` can answer the request, as far as this worker
    knows: the leg is the chain's last, or every later leg rests (cooling down, as the last
    store step said, or known refused by the store: `_known`)."""
    route = state._route
    legs = route.legs
    if index + 1 >= len(legs):
        return True
    waits, now = state._waits, state._shared.success_clock()
    return all(
        (waits is not None and waits[later] > 0)
        or (
            legs[later].known.until > now
            and (legs[later].known.why == "cooldown" or route.breaker is not None)
        )
        for later in range(index + 1, len(legs))
    )


def before_retry(state: RequestState, attempt: int, verdict: Classification, delay_s: float) -> bool:
    """Before a retry the policy allows: whether the model's retry budget admits it. The
    retry, or its refusal, is told to the observers."""
    route = state._route
    leg = state._leg
    admitted = admit_retry(
        state._shared.retry_windows, leg.ref.key, leg.attempts.values(), route.retry.budget
    )
    state._observe.retried(
        Retried(
            route,
            state.trace_id,
            leg,
            attempt,
            verdict.kind.value,
            delay_s if admitted else None,
            None if admitted else "retry_budget",
        )
    )
    return admitted


async def retried(
    state: RequestState,
    leg: Leg,
    index: int,
    call: Callable[[str, Mapping[str, Any]], Awaitable[R]],
    inputs: Mapping[str, Any],
    error: Exception,
    made: int,
    probe: float | None,
) -> tuple[R, float]:
    """The retries of `leg`, at `index`, after its first call failed with `error`, the request
    having made `made` calls before the leg: the answer, and when the call that gave it
    started. A half-open probe is one call: it tells whether the model is back, and its failure
    moves on at once; a leg with later legs leaves them their calls (`leg_limit`); a leg alone
    waits a short provider wait out (`cool_down`). Raises `CallFailed`.

    Each failed retry is accounted for here; the answer is not: the walk judges it as it
    judges a first call's (its content filter, the route's check of the answer) and accounts
    for it then."""
    probing = probe is not None
    last = index + 1 >= len(state._route.legs)
    assert state._scope is not None  # the walk's
    began = 0.0

    def seen(_: int, outcome: Any, at: float) -> None:
        nonlocal began
        if isinstance(outcome, BaseException):
            on_attempt(state, outcome, at)
        else:
            began = at

    result, _ = await call_model(
        call,
        leg.ref.model,
        inputs,
        policy=state._route.retry,
        deadline=state._scope.when,
        limit=1 if probing else state.attempt_budget - made if last else leg_limit(state, index, made),
        sleep=state._shared.sleep,
        on_attempt=seen,
        on_retry=functools.partial(before_retry, state),
        failed=error,
        wait_out=None if probing or not alone(state, index) else functools.partial(cool_down, state, leg),
    )
    return result, began


#: One attempt on a leg: `call(model, inputs)` (`_chain_walk.Call`).
Call = Callable[[str, Mapping[str, Any]], Awaitable[Any]]


def hedge_target(state: RequestState, index: int) -> int | None:
    """The leg a hedge of the call to the leg at `index` goes to: the next leg of the chain
    that this worker does not know refused (an open breaker, a cooldown: `_known`); None when
    there is none. (The one place that chooses it.)"""
    route = state._route
    legs = route.legs
    now = state._shared.success_clock()
    for later in range(index + 1, len(legs)):
        known = legs[later].known
        if known.until <= now or (known.why == "circuit_open" and route.breaker is None):
            return later
    return None


class Hedged:
    """The call of the leg at `index`, its first invocation hedged: `call` makes an attempt on
    the leg, `make(leg)` one on another leg (a hedge's). `won`: (the hedge's leg, its index,
    when it started) once a hedge's answer won the race."""

    __slots__ = ("_call", "_fired", "_index", "_make", "_state", "won")

    def __init__(self, state: RequestState, index: int, call: Call, make: Callable[[Leg], Call]) -> None:
        self._state = state
        self._index = index
        self._call = call
        self._make = make
        self._fired = False
        self.won: tuple[Leg, int, float] | None = None

    async def __call__(self, model: str, inputs: Mapping[str, Any]) -> Any:
        if self._fired or "tools" in inputs:
            return await self._call(model, inputs)
        self._fired = True
        state = self._state
        leg = state._route.legs[self._index]
        hedge = state._route.hedge
        assert hedge is not None
        began = perf_counter()
        first = asyncio.get_running_loop().create_task(_attempt(self._call, model, inputs))
        second: asyncio.Task[Any] | None = None
        started: tuple[asyncio.Task[Any], int, float] | None = None
        try:
            await asyncio.wait((first,), timeout=hedge.delay_s(leg.ref.key, leg.first_output))
            if not first.done() and (started := self._start(leg, inputs)) is not None:
                second, target, at = started
                return await self._race(leg, first, began, second, target, at)
            return await first
        except asyncio.CancelledError:  # stopped (the deadline, the client gone)
            await _cancelled(first)
            # What the first attempt said of its time (spent in the connection queue:
            # `guards.waits._admission`) goes up with the stop, as an unhedged call's does.
            if (queued := _queued(first)) is None:
                raise
            raise queued from None
        finally:  # neither attempt outlives the call
            await _cancelled(first)
            if second is not None and not second.done():
                assert started is not None
                await _cancelled(second)
                _account(state, state._route.legs[started[1]], asyncio.CancelledError(), started[2])

    def _start(self, leg: Leg, inputs: Mapping[str, Any]) -> tuple[asyncio.Task[Any], int, float] | None:
        """Start the hedge, when there is a leg for it, an attempt left and a retry token:
        (its task, its leg's index, when it started); else None."""
        state = self._state
        route = state._route
        target = hedge_target(state, self._index)
        if target is None or state.attempts + 2 > state.attempt_budget:
            return None  # the first attempt in flight and the hedge: within the attempt budget
        if not admit_retry(
            state._shared.retry_windows, leg.ref.key, leg.attempts.values(), route.retry.budget
        ):
            state._observe.hedged(route, leg, "skipped")
            return None
        other = state._hedge = route.legs[target]
        state._observe.hedged(route, leg, "started")
        at = perf_counter()
        task = asyncio.get_running_loop().create_task(_attempt(self._make(other), other.ref.model, inputs))
        return task, target, at

    async def _race(
        self,
        leg: Leg,
        first: asyncio.Task[Any],
        began: float,
        second: asyncio.Task[Any],
        target: int,
        at: float,
    ) -> Any:
        """The first answer of `first` (on `leg`, since `began`) and `second` (the hedge, on
        the leg at `target`, since `at`); both failed: `first`'s failure, raised."""
        state = self._state
        route = state._route
        other = route.legs[target]
        pending: set[asyncio.Task[Any]] = {first, second}
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if _answered(first):  # (the first wins a tie)
                state._observe.hedged(route, leg, "lost")
                await _lost(state, other, second, at)
                state._hedge = None
                return first.result()
            if _answered(second):
                state._observe.hedged(route, leg, "won")
                state._leg, self.won = other, (other, target, at)
                await _lost(state, leg, first, began)  # (or failed: the hedge made up for it)
                return second.result()
        _account(state, other, _outcome(second), at)  # both failed: the first's failure goes on
        state._hedge = None
        return first.result()


def hedge_won(call: Call) -> tuple[Leg, int, float]:
    """The hedge that answered the walk's call `call` (a `Hedged`): its leg, its index, when
    it started."""
    assert isinstance(call, Hedged)
    assert call.won is not None
    return call.won


async def _attempt(call: Call, model: str, inputs: Mapping[str, Any]) -> Any:
    """One attempt, as a task's coroutine."""
    return await call(model, inputs)


def _account(state: RequestState, leg: Leg, outcome: Any, started: float) -> None:
    """`on_attempt` for an attempt on `leg`, which need not be the leg being called. (Its span
    ended with it: the answered call's span waiting for its verdict is not this one's.)"""
    called, state._leg = state._leg, leg
    trace = state._observe.trace
    if trace is not None:
        waiting, trace._pending = trace._pending, None
    try:
        on_attempt(state, outcome, started)
    finally:
        state._leg = called
        if trace is not None:
            trace._pending = waiting


async def _lost(state: RequestState, leg: Leg, task: asyncio.Task[Any], started: float) -> None:
    """The attempt of `task` on `leg` (since `started`) lost the race: cancelled when it still
    runs (its connection closed), a stream that reached its commit point too late closed, and
    accounted for as it ended (cancelled, failed, or answered too late)."""
    await _cancelled(task)
    outcome = _outcome(task)
    if isinstance(outcome, Opened) and outcome.committed:
        await aclose(outcome.iter_events)
        outcome = asyncio.CancelledError()
    _account(state, leg, outcome, started)


def _outcome(task: asyncio.Task[Any]) -> Any:
    """What a finished attempt's task ended in: its result, or what it raised."""
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception() or task.result()


def _queued(task: asyncio.Task[Any]) -> asyncio.CancelledError | None:
    """The cancellation that ended `task`'s attempt, when it says where the attempt's time
    went (its argument: `guards.waits._admission`); else None."""
    if not task.cancelled():
        return None
    try:
        task.result()  # (raises the attempt's own cancellation, this once)
    except asyncio.CancelledError as cancelled:
        return cancelled if cancelled.args else None
    return None


def _answered(task: asyncio.Task[Any]) -> bool:
    """Whether the attempt of `task` ended with an answer."""
    return task.done() and not task.cancelled() and task.exception() is None


async def _cancelled(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the attempts of `tasks` still running, and wait for them to end (their
    connections closed): whatever stops the caller meanwhile waits for them too."""
    running = [task for task in tasks if task is not None and not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running)
