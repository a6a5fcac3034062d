"""Accounting: every provider call a request makes is counted once, with its tokens and cost,
and told to the observers (`AttemptEnded`: metrics, the usage ledger). The cost adds to what
the request's spend hold settles to (`_store_steps.report_end`)."""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any

from ..contracts._binding import AIResult
from ..contracts._classify import classify
from ..contracts._errors import ProviderError
from ..streams._hold import BelowMinimumRate
from ..streams._relay import Opened
from ..waits._admission import never_admitted
from ..waits._first_output import NoFirstOutput
from ._checkpoints import resumed

if TYPE_CHECKING:
    from ..contracts._binding import Usage
    from ..spec._route_spec import Leg
    from ._state import RequestState

__all__ = ["account", "answered", "on_attempt", "worst"]


def on_attempt(state: RequestState, outcome: Any, started: float) -> None:
    """Count one provider call on the leg being called, ended in `outcome` (a result, an
    `Opened` stream, or what it raised). A stream that reached its first output is accounted
    for when it ends (`_streaming`). A call cancelled while waiting for a connection never
    left: it is not one. (The walk counts its answers with `answered`.)"""
    elapsed = perf_counter() - started
    leg = state._leg
    if isinstance(outcome, BaseException) and (
        never_admitted(outcome) or (isinstance(outcome, NoFirstOutput) and outcome.never_sent)
    ):
        return
    state.attempts += 1
    if isinstance(outcome, AIResult):
        account(state, leg, "ok", outcome.usage, outcome.model or leg.ref.model, elapsed, billed=True)
    elif isinstance(outcome, Opened):
        if not outcome.committed:  # complete and empty: accounted now
            end = outcome.end
            usage = end.usage if end is not None else None
            account(state, leg, "ok", usage, outcome.model or leg.ref.model, elapsed, billed=True)
        else:  # at its first output: timed now, accounted when it ends
            state._observe.first_output(leg, elapsed)
    else:
        # Billed unless the provider refused the call: a timeout (its first output's too), a
        # cancelled call, any failure that is not a provider's error answer, JSON mode not met.
        provider_error = isinstance(outcome, ProviderError)
        billed = not provider_error or outcome.json_mode_failed or isinstance(outcome, NoFirstOutput)
        if type(outcome) is BelowMinimumRate:
            state._observe.slow_stream(state._route, leg)
        account(
            state,
            leg,
            classify(outcome).kind.value,
            None,
            None,
            elapsed,
            billed=billed,
            status=outcome.status if provider_error else None,
            code=outcome.code if provider_error else None,
        )


def answered(state: RequestState, leg: Leg, result: Any, started: float) -> None:
    """Count the call to `leg` that answered `result` (its first attempt's): `on_attempt`, with
    its usual case (an `AIResult` with no price, no token cap: no cost to add) inline, as it
    is on every request's path."""
    route = state._route
    if type(result) is not AIResult or leg.price is not None or route.token_capped:
        on_attempt(state, result, started)
        return
    state.attempts += 1
    if (usage := result.usage) is not None:
        state.usage = usage if state.usage is None else state.usage + usage
    state._held = state._observe.attempt_ended(
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
            leg is state._hedge,
        ),
        state._held,
    )


def account(
    state: RequestState,
    leg: Leg,
    kind: str,
    usage: Usage | None,
    served: str | None,
    elapsed: float,
    *,
    billed: bool,
    delivered: int | None = None,
    status: int | None = None,
    code: int | None = None,
    problems: tuple[str, ...] | None = None,
    estimate: Usage | None = None,
) -> None:
    """Account for one call to `leg` ended as `kind`: its cost (the reported usage's; else
    `estimate`'s, a stream that ended early (`_streaming`); else, under a spend cap, the worst
    case when the provider may have billed), then its record (`problems`: a rejected
    answer's)."""
    route = state._route
    cost = None
    if usage is not None:
        state.usage = usage if state.usage is None else state.usage + usage
    charged = usage if usage is not None else estimate
    if leg.price is not None:
        if charged is not None:
            cost = leg.price.cost(
                charged.prompt_tokens,
                charged.completion_tokens,
                charged.cached_input_tokens,
                charged.cache_write_tokens,
            )
            state._cost += cost
        elif billed and route.spend_capped:
            state._cost += worst(leg, state._tokens, state._max_tokens)
    if route.token_capped:  # what the token hold settles to (`_holds.settled`)
        if charged is not None:
            state._used_tokens += charged.prompt_tokens + charged.completion_tokens
        elif billed:
            state._used_tokens += state._token_hold
    state._held = state._observe.attempt_ended(
        (
            route,
            state.trace_id,
            leg,
            state.attempts,
            kind,
            usage,
            served,
            elapsed,
            cost,
            delivered,
            status,
            code,
            resumed(state._request) if route.task is not None else (),
            problems,
            leg is state._hedge,
        ),
        state._held,
    )


def worst(leg: Leg, input_tokens: int, max_tokens: int) -> float:
    """What one call to `leg` may cost at most."""
    return leg.price.most(input_tokens, max_tokens) if leg.price is not None else 0.0
