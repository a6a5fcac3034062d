"""Retries within a walk: a leg's retries after its first call failed (`retried`), how many
calls a leg may make (so a retry never starves the fallbacks), whether a retry the policy allows
is admitted by the model's retry budget, and whether a leg is alone (no other model left to
answer: a short provider wait is then waited out, `Retry.wait_out_s`)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..policies._call import call_model
from ..policies._retry_budget import admit_retry
from ._accounting import on_attempt
from ._events import Retried
from ._store_steps import cool_down

if TYPE_CHECKING:
    from ..contracts._classify import Classification
    from ..spec._route_spec import Leg
    from ._state import RequestState

__all__ = ["alone", "before_retry", "leg_limit", "retried"]

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
