"""What this worker knows its store would refuse: a refusal cheaper than a call.

A store step's answer that refuses a model says until when: its breaker is open until it
half-opens (`BreakerDecision.retry_after_s`: the next probe's time), its cooldown runs for `wait`
more seconds. Neither can end sooner for any worker: an open breaker half-opens only at the time
it was opened for (`BreakerState.open_s`, or `probe_s` after a failed probe under
`Breaker.probe_interval_s`), and a cooldown is never shortened. So each worker remembers, per model
(`Leg.known`, shared by every route of the instance that calls it), the last such answer until
that time, on the clock the success ages use (`Shared.success_clock`: the store's own when a
test gives it one, else `time.monotonic`; read when the answer arrives, so a memory ends at
most one store round trip after the store's time). A walk skips a leg known refused without
asking the store, noted and told to the observers as a store skip (same reason, the wait
left); when every leg left is known refused, the walk ends as when the store refuses them all,
with no store operation: no charge, nothing written. After that time the store is asked again,
and it alone decides the half-open probe (one across every worker). An answer admitting the
model replaces what was known; so does a breaker this worker's report opened or closed.

A deployment with its own `rpm` or `tpm` (`guards.Deployment`) is asked once more, after its
admission (`deployment_refused`): at a limit, it is skipped and known refused (`rate_limited`)
until the sliding minute frees room, which cannot come sooner for any worker either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..contracts._tokens import binding_estimate, max_tokens_of
from ..policies._deployments import limit_charge
from ..stores import Report, Step, StoreUnavailable
from ..stores._breaker import CircuitState
from ._events import StoreFailed

if TYPE_CHECKING:
    from ..spec._route_spec import Leg
    from ..stores import Passage
    from ._state import RequestState

__all__ = [
    "deployment_refused",
    "forget",
    "known_refused",
    "passed_over",
    "remember",
    "skip",
    "tokens_settled",
]

R = TypeVar("R")
Call = Callable[[str, Mapping[str, Any]], Awaitable[R]]

#: A skip's note, by reason (the text built once).
_SKIPPED = {why: f"skipped ({why})" for why in ("cooldown", "circuit_open", "rate_limited")}


def known_refused(state: RequestState, start: int) -> int:
    """The first leg from `start` this worker does not know refused (the walk's next store
    step starts there; `len(legs)`: every leg left is known refused). Each leg before it is
    skipped as the store would skip it: `skip`'s note and event, with the wait left."""
    route = state._route
    legs = route.legs
    if start < len(legs) and not legs[start].known.until:
        return start  # nothing known of it: the store decides
    now = state._shared.success_clock()
    while start < len(legs):
        leg = legs[start]
        known = leg.known
        left = known.until - now
        if left <= 0:
            known.until = 0.0  # lapsed: ask the store
            break
        if known.why == "circuit_open" and route.breaker is None:
            break  # a route without a breaker does not read it
        skip(state, leg, known.why, left)
        start += 1
    return start


def remember(state: RequestState, leg: Leg, why: str, seconds: float | None) -> None:
    """The store refused `leg` for `why` (`circuit_open`, `cooldown`) for `seconds` more."""
    if seconds is None or seconds <= 0:
        return
    known, now = leg.known, state._shared.success_clock()
    if why == "circuit_open" and known.why == "cooldown" and known.until > now:
        return  # the store answers a running cooldown first
    known.until = now + seconds
    known.why = why


def forget(leg: Leg) -> None:
    """The store admitted `leg`, or closed its breaker: nothing known."""
    leg.known.until = 0.0


def skip(state: RequestState, leg: Leg, why: str, wait_s: float | None) -> None:
    """`leg` is skipped without a call (`why`: `cooldown`, `circuit_open`): noted, and told to
    the observers."""
    state._note(leg, _SKIPPED.get(why) or f"skipped ({why})", wait_s)
    state._observe.skipped((state._route, state.trace_id, leg, why, wait_s))


def passed_over(state: RequestState, start: int, passage: Passage) -> None:
    """The legs from `start` the store passed over (cooling down, or refused by their breaker),
    each noted and remembered (`_known`), and each breaker state it read seen, up to the one
    it admitted (or whose charge it refused), which is no longer known refused."""
    legs, decisions = state._route.legs, passage.decisions
    for offset, wait in enumerate(passage.waits):
        leg = legs[start + offset]
        if wait > 0:
            skip(state, leg, "cooldown", wait)
            remember(state, leg, "cooldown", wait)
            continue
        decision = decisions[offset] if offset < len(decisions) else None
        if decision is not None:
            if decision.state is not leg.last_state[0]:
                leg.saw(decision.state)
            if not decision.allowed:
                skip(state, leg, "circuit_open", decision.retry_after_s)
                if decision.state is CircuitState.open:  # (half-open: a probe may close it sooner)
                    remember(state, leg, "circuit_open", decision.retry_after_s)
                continue
        if leg.known.until:
            forget(leg)  # admitted (or its charge refused): the store let it through
        break  # the leg admitted, or the one whose charge was refused


async def deployment_refused(state: RequestState, leg: Leg, inputs: Mapping[str, Any]) -> bool:
    """Whether `leg`, a deployment with `rpm` or `tpm` the store just admitted, is at one of
    them: its own store step charges one request of its `rpm` and the call's estimated tokens
    (its input's estimate plus its `max_tokens`) of its `tpm`, in sliding minutes, exactly
    across workers. At a limit, the deployment is skipped (`rate_limited`, the wait until the
    minute frees room) and remembered refused for that wait (`_known`), as an open breaker
    is; the request's charge is not refunded. A store that does not answer admits the call
    (its limits fail open) and says so."""
    deployment = leg.ref.deployment
    assert deployment is not None
    tokens = 0
    if deployment.tpm is not None:
        route, shared = state._route, state._shared
        estimate = binding_estimate(
            shared.binding if (p := leg.ref.provider) is None else shared.providers[p]
        )
        tokens = estimate(leg.ref.model, inputs) + (
            max_tokens_of(inputs.get("max_tokens"), route.max_tokens) or 0
        )
    # The deployment alone, its breaker not asked again: a charge is paid with an admission.
    charge = limit_charge(leg.ref.key, deployment, tokens)
    step = Step(None, ((leg.cooldown_key, leg.breaker_key),), None, charge)
    try:
        passage = await state._shared.store.step(step)
    except StoreUnavailable:
        state._observe.store_failed(StoreFailed(state._route, state.trace_id, "budget", mode="open"))
        return False
    if passage.admitted is not None:
        if passage.reservation is not None:  # (the tokens it holds: `tokens_settled`)
            state._deployment_hold = (charge, passage.reservation)
        return False
    refusal = passage.refusal
    why, wait = (
        ("rate_limited", refusal.retry_after_s)
        if refusal is not None
        else ("cooldown", passage.waits[0] if passage.waits else None)
    )
    skip(state, leg, why, wait)
    remember(state, leg, why, wait)
    return True


def tokens_settled(state: RequestState, call: Call[R]) -> Call[R]:
    """`call` (an attempt on a deployment with `tpm`), whose whole answer settles the tokens
    its admission held to the usage it reported (`Report.charge`: in the minute window, the
    hold takes the reported tokens in its place). A failed call, a stream (its usage comes at
    its end) and an answer that reports no usage leave the hold as it is: the estimate."""

    async def settling(model: str, inputs: Mapping[str, Any]) -> R:
        result = await call(model, inputs)
        hold = getattr(state, "_deployment_hold", None)
        usage = getattr(result, "usage", None)
        if hold is not None:
            state._deployment_hold = None
            used = None if usage is None else usage.total_tokens
            if used is not None:
                charge, reservation = hold
                report = Report(charge=charge, reservation=reservation, tokens=used)
                try:
                    await state._shared.store.step(Step(report=report))
                except StoreUnavailable:
                    state._observe.store_failed(
                        StoreFailed(state._route, state.trace_id, "budget", op="settle_spend")
                    )
        return result

    return settling
