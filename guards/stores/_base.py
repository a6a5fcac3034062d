"""The store interface: the few atomic operations the guards need.

Each operation is one atomic step with respect to every other caller of the same store (other
tasks, other workers, other machines, depending on the implementation): a check and its charge
never interleave with another check. Every key a store writes expires.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .._breaker import Breaker, BreakerDecision, BreakerState, Outcome

__all__ = [
    "ADMITTED",
    "DAILY_TTL_S",
    "DAY_S",
    "MINUTE_S",
    "Admission",
    "BreakerDecision",
    "BreakerState",
    "Outcome",
    "Store",
    "utc_day",
]


DAY_S = 86_400.0
#: Daily counters outlive their day by this much, so none expires while its day is current.
DAILY_TTL_S = DAY_S + 3_600.0
#: The window of `per_minute` limits.
MINUTE_S = 60.0


@functools.lru_cache(maxsize=4)
def _day_name(day_number: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(day_number * DAY_S))


def utc_day(now: float) -> str:
    """The UTC day of `now` (seconds since the epoch) as `YYYY-MM-DD`: part of daily keys."""
    return _day_name(int(now // DAY_S))


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer of a budget check. When refused, `refused_by` names the limit
    (`"per_minute"` or `"per_day"`) and `retry_after_s` says when it frees up."""

    allowed: bool
    refused_by: str | None = None
    retry_after_s: float | None = None


ADMITTED = Admission(True)


@runtime_checkable
class Store(Protocol):
    async def now(self) -> float:
        """Seconds since the Unix epoch as the store sees it: all workers sharing the store
        agree on days and timeouts even when their own clocks drift."""
        ...

    async def charge_budget(self, key: str, *, per_minute: int | None, per_day: int | None) -> Admission:
        """Charge one request to the budget `key`, in one atomic step, if both limits allow it:

        - `per_minute`: fewer than this many requests were admitted under `key` in the last
          60 seconds (a sliding window: never more than `per_minute` in any 60 seconds);
        - `per_day`: fewer than this many were admitted during the current UTC day, as the
          store's clock tells it (counter `{key}:day:{YYYY-MM-DD}`, kept `DAILY_TTL_S`).

        A refused request charges neither; when both limits are spent, the refusal names the
        one that frees up last. `None` disables a limit.
        """
        ...

    async def breaker_admit(self, key: str, policy: Breaker) -> BreakerDecision:
        """Ask the breaker `key` whether a call may go through (see `guards.Breaker`)."""
        ...

    async def breaker_record(
        self, key: str, policy: Breaker, outcome: Outcome, *, probe: float | None
    ) -> BreakerState:
        """Record one guarded call's outcome; `probe` is the ticket `breaker_admit` returned."""
        ...

    async def aclose(self) -> None: ...
