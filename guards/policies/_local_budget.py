"""`LocalShare`: a route's budgets' share per worker while its store is down
(`Budget(on_store_failure="local")`).

While a request's store step fails, each budget of the route that says `"local"` charges this
worker's share of each of its limits in the worker's own memory instead (one `MemoryStore` per
process, keyed as the shared store is, so routes of one scope share their share): every count
and token limit divided by the budget's `workers` (rounded down), every spend cap divided by it,
holds counted at each request's worst case for their whole period (never settled). The budgets are charged together,
all or nothing, as in the store. A refusal is the usual `rate_limited` / `budget_exceeded`.
Each request that falls back says so (`store_unavailable`, `mode` `local`, and
`guards_store_unavailable_total{guard="budget", action="local"}`). The store answering again
ends it at the next request: the shared counts apply again, and what was admitted locally is
not added to them. A route with a budget that says `"closed"` refuses instead (`circuit_open`);
budgets that say `"open"` are not charged while the store is down.

Bound: while the store is down, every worker together admits at most each limit (the shares
sum to no more), on top of what the shared store had already counted, which no worker can
read; so within one period a key can reach at most twice its cap (the local counts last the
period: a second outage in it continues them; a worker restarted meanwhile starts afresh), and
at most twice its per-minute limit in any minute around an outage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..stores import Admission, Charge, MemoryStore, MoreLimits
from ..stores._base import MONTHLY_TTL_S
from ._budget import Budget

__all__ = ["LocalShare"]

#: This process's counts while its store is down (every key expires, as in any MemoryStore).
_COUNTS = MemoryStore()


def _part(value: int | None, workers: int) -> int | None:
    return None if value is None else value // workers


def _portion(value: float | None, workers: int) -> float | None:
    return None if value is None else value / workers


@dataclass(frozen=True, slots=True)
class LocalShare:
    """This worker's share of the limits of a route's budgets (see the module): for each
    budget, in the route's order, its `workers`, or None for a budget that does not fall
    back to a share."""

    workers: tuple[int | None, ...]

    @classmethod
    def of(cls, budgets: Sequence[Budget]) -> LocalShare | None:
        """The share of `budgets` when one of them falls back to one and none fails closed."""
        shared = tuple(budget.workers if budget.on_store_failure == "local" else None for budget in budgets)
        if all(workers is None for workers in shared):
            return None
        if any(budget.on_store_failure == "closed" for budget in budgets):
            return None  # the route refuses while its store is down
        return cls(shared)

    def charge(self, charge: Charge) -> Admission | None:
        """Charge this worker's share for the request that would have paid `charge` (the
        route's budgets' charges: `charge`, then its `MoreLimits.also`): the refusal, or None
        when admitted. The refusal's `charge` is the index of the refusing budget."""
        charges = (charge, *(charge.more.also if charge.more is not None else ()))
        shares: list[tuple[int, Charge]] = []
        for index, (each, workers) in enumerate(zip(charges, self.workers, strict=True)):
            if workers is not None:
                shares.append((index, _share(each, workers)))
        first = shares[0][1]
        more = first.more or MoreLimits()
        together = dataclasses.replace(
            first, more=dataclasses.replace(more, also=tuple(c for _, c in shares[1:]))
        )
        refusal = _COUNTS.charge_now(together)
        if refusal is None:
            return None
        # The store names the refusing charge among those it was given: the route's index.
        return dataclasses.replace(refusal, charge=shares[refusal.charge][0])


def _share(charge: Charge, workers: int) -> Charge:
    """`charge` with each limit divided among `workers`, its holds (spend, tokens) kept for
    their whole period: nothing settles them (they count at the worst case)."""
    more = charge.more
    return Charge(
        charge.key,
        _part(charge.per_minute, workers),
        _part(charge.per_day, workers),
        charge.spend,
        charge.spend_cap / workers,
        MONTHLY_TTL_S,
        None
        if more is None
        else MoreLimits(
            per_month=_part(more.per_month, workers),
            spend=more.spend,
            spend_per_month=_portion(more.spend_per_month, workers),
            tokens=more.tokens,
            tokens_per_minute=_part(more.tokens_per_minute, workers),
            tokens_per_day=_part(more.tokens_per_day, workers),
            tokens_per_month=_part(more.tokens_per_month, workers),
        ),
    )
