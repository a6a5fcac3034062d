"""The store interface: the few atomic operations the guards need.

Each operation is one atomic step with respect to every other caller of the same store (other
tasks, other workers, other machines, depending on the implementation): a check and its charge
never interleave with another check. Every key a store writes expires. An operation that cannot
reach its store raises `StoreUnavailable`, never anything else and never after hanging: each
store bounds its operations by its own short timeout.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .._breaker import Breaker, BreakerDecision, BreakerState, Outcome
from .._errors import GuardsError


class StoreUnavailable(GuardsError):
    """The store did not answer (down, unreachable, or slower than its own timeout).

    Raised by every store operation in that case, and only then. Guards answer it with their
    configured failure mode (`fail_open` or `fail_closed`). The message never carries the
    store's URL or password.
    """


__all__ = [
    "ADMITTED",
    "DAILY_TTL_S",
    "DAY_S",
    "MINUTE_S",
    "Admission",
    "BreakerDecision",
    "BreakerState",
    "Outcome",
    "SpendReservation",
    "Store",
    "StoreUnavailable",
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


@dataclass(frozen=True, slots=True)
class SpendReservation:
    """The answer of `reserve_spend`. When allowed, `reservation` identifies the hold to settle;
    when refused, `retry_after_s` is the time until the next UTC day."""

    allowed: bool
    reservation: str | None = None
    retry_after_s: float | None = None


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

    async def reserve_spend(self, key: str, *, amount: float, cap: float, hold_s: float) -> SpendReservation:
        """Hold `amount` cost units of the UTC day's spend under `key`, in one atomic step, if
        settled spend plus live holds plus `amount` stays within `cap`. A hold not settled
        within `hold_s` seconds (its worker crashed) lapses and frees its room."""
        ...

    async def settle_spend(self, key: str, reservation: str, *, actual: float) -> None:
        """Replace the hold `reservation` (made on the same UTC day) by the `actual` cost. The
        cost is added even if the hold already lapsed: the call happened."""
        ...

    async def spent(self, key: str) -> float:
        """Settled spend of the current UTC day under `key`."""
        ...

    async def breaker_admit(self, key: str, policy: Breaker) -> BreakerDecision:
        """Ask the breaker `key` whether a call may go through (see `guards.Breaker`)."""
        ...

    async def breaker_record(
        self, key: str, policy: Breaker, outcome: Outcome, *, probe: float | None
    ) -> BreakerState:
        """Record one guarded call's outcome; `probe` is the ticket `breaker_admit` returned."""
        ...

    async def cooldowns(self, keys: Sequence[str]) -> tuple[float, ...]:
        """Seconds left on each key's cooldown (0.0 for a key not cooling down), read in one
        step: a fallback chain reads all its models' cooldowns at once."""
        ...

    async def start_cooldown(self, key: str, seconds: float) -> None:
        """Cool `key` down for `seconds` from now (the store's clock), in one atomic step.
        Never shortens a cooldown already running; the key expires when its cooldown ends."""
        ...

    async def aclose(self) -> None: ...
