"""`LocalShare`: a budget's share per worker while its store is down
(`Budget(on_store_failure="local")`).

While a request's store step fails, the budget charges this worker's share of each limit in
the worker's own memory instead (one `MemoryStore` per process, keyed as the shared store is, so
routes of one scope share their share): `per_minute // workers` and `per_day // workers`
admissions, and `spend_per_day / workers` of spend, counted at each request's worst case. A
refusal is the usual `rate_limited` / `budget_exceeded`. Each request that falls back says so
(`store_unavailable`, `mode` `local`, and `guards_store_unavailable_total{guard="budget",
action="local"}`). The store answering again ends it at the next request: the shared counts
apply again, and what was admitted locally is not added to them.

Bound: while the store is down, every worker together admits at most each limit (the shares
sum to no more), on top of what the shared store had already counted, which no worker can
read; so within one UTC day a key can reach at most twice its daily cap (the local counts
last the day: a second outage the same day continues them; a worker restarted meanwhile starts
afresh), and at most twice its per-minute limit in any minute around an outage.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._budget import Budget
from .stores import Admission, Charge, MemoryStore

__all__ = ["LocalShare"]

#: This process's counts while its store is down (every key expires, as in any MemoryStore).
_COUNTS = MemoryStore()


@dataclass(frozen=True, slots=True)
class LocalShare:
    """A worker's share of a budget's limits (see the module)."""

    per_minute: int | None
    per_day: int | None
    spend_cap: float | None

    @classmethod
    def of(cls, budget: Budget | None) -> LocalShare | None:
        """The share of `budget` when it falls back to one (`on_store_failure="local"`)."""
        if budget is None or budget.on_store_failure != "local" or budget.workers is None:
            return None
        workers = budget.workers
        return cls(
            None if budget.per_minute is None else budget.per_minute // workers,
            None if budget.per_day is None else budget.per_day // workers,
            None if budget.spend_per_day is None else budget.spend_per_day / workers,
        )

    def charge(self, charge: Charge) -> Admission | None:
        """Charge this worker's share for the request that would have paid `charge`: the
        refusal, or None when admitted."""
        spend = charge.spend if self.spend_cap is not None else None
        share = Charge(charge.key, self.per_minute, self.per_day, spend, self.spend_cap or 0.0)
        return _COUNTS.charge_now(share)
