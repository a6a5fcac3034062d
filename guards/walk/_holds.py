"""A request's holds: what its first admission holds against budgets with spend caps or token
limits (its worst-case spend, its estimated tokens), set on the route's charge per request, and
what the holds settle to (`_store_steps.report_end` sends the settlement), both told to the
observers (`guards_budget_held_total`, `guards_budget_settled_total`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..contracts._tokens import binding_estimate, max_tokens_of
from ..policies._budget import input_tokens_bound
from ._accounting import worst
from ._events import BudgetCounted

if TYPE_CHECKING:
    from ..stores import Charge
    from ._state import RequestState

__all__ = ["holding", "settled"]


def holding(state: RequestState, charge: Charge, inputs: Mapping[str, Any]) -> Charge:
    """`charge` (every scope's) with the request's holds: its worst-case spend (every attempt
    at `max_tokens` of output, one token per byte of input) where a scope caps spend, and its
    tokens (the estimated input tokens, the largest of the chain's bindings' estimates, plus
    `max_tokens`) where a scope limits tokens; `max_tokens` is the call's, as sent
    (`guards.contracts._tokens.max_tokens_of`: the inputs', at most `MAX_TOKENS`, else the route's).
    Kept for the settlement (`state._charge`)."""
    route = state._route
    # What the call is sent (`AI.run` set it by the same rule): the holds are priced by it.
    state._max_tokens = most = max_tokens_of(inputs.get("max_tokens"), route.max_tokens) or 0
    spend = None
    if route.spend_capped:
        state._tokens = bound = input_tokens_bound(inputs)
        spend = max(worst(leg, bound, most) for leg in route.legs) * state.attempt_budget
    hold_s = 2 * route.timeout_s + 60
    if charge.more is None:  # one budget with only the first three limits: as ever
        state._charge = charge = dataclasses.replace(charge, spend=spend, hold_s=hold_s)
    else:
        tokens = None
        if route.token_capped:
            shared = state._shared
            tokens = max(
                binding_estimate(shared.binding if (p := leg.ref.provider) is None else shared.providers[p])(
                    leg.ref.model, inputs
                )
                for leg in route.legs
            )
            tokens += most
            state._token_hold, state._used_tokens = tokens, 0
        scoped = []
        for each in (charge, *charge.more.also):
            more = each.more
            assert more is not None
            limited = (
                more.tokens_per_minute
                or more.tokens_per_day
                or more.tokens_per_month
                or (more.share is not None and more.share.tokens_per_minute)
            )
            more = dataclasses.replace(
                more,
                spend=spend if more.spend_per_month is not None else None,
                tokens=tokens if limited else None,
            )
            scoped.append(
                dataclasses.replace(
                    each, spend=spend if each.spend_cap > 0 else None, hold_s=hold_s, more=more
                )
            )
        first = scoped[0].more
        assert first is not None
        state._charge = charge = dataclasses.replace(
            scoped[0], more=dataclasses.replace(first, also=tuple(scoped[1:]))
        )
    for scope, held_tokens, held_spend in _holds(state, charge):
        if held_tokens is not None:
            state._observe.budget_counted(BudgetCounted("held", scope, "tokens", held_tokens))
        if held_spend is not None:
            state._observe.budget_counted(BudgetCounted("held", scope, "spend", held_spend))
    return charge


def settled(state: RequestState) -> None:
    """Tell the observers what the request's holds settle to: the tokens the calls reported
    (`_accounting`), the spend they cost."""
    used = state._used_tokens if state._route.token_capped else 0
    for scope, held_tokens, held_spend in _holds(state, state._charge):
        if held_tokens is not None:
            state._observe.budget_counted(BudgetCounted("settled", scope, "tokens", used))
        if held_spend is not None:
            state._observe.budget_counted(BudgetCounted("settled", scope, "spend", state._cost))


def _holds(state: RequestState, charge: Charge) -> Iterator[tuple[str, int | None, float | None]]:
    """Each scope of `charge` as held: (its scope, the tokens it holds, the spend it holds)."""
    more = charge.more
    scoped = (charge, *more.also) if more is not None else (charge,)
    for each, scope in zip(scoped, state._route.scopes, strict=False):
        extra = each.more
        tokens = extra.tokens if extra is not None else None
        spend = each.spend if each.spend is not None else extra.spend if extra is not None else None
        yield scope, tokens, spend
