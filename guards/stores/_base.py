"""The store interface: the few atomic operations the guards need.

Each operation is one atomic step with respect to every other caller of the same store (other
tasks, other workers, other machines, depending on the implementation): a check and its charge
never interleave with another check. Every key a store writes expires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .._breaker import Breaker, BreakerDecision, BreakerState, Outcome

__all__ = ["Admission", "BreakerDecision", "BreakerState", "Outcome", "Store"]


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer of a limit check. When refused, `retry_after_s` says when to try again, if
    that is known."""

    allowed: bool
    retry_after_s: float | None = None


@runtime_checkable
class Store(Protocol):
    async def now(self) -> float:
        """Seconds since the Unix epoch as the store sees it: all workers sharing the store
        agree on days and timeouts even when their own clocks drift."""
        ...

    async def take(self, key: str, *, limit: int, ttl_s: float) -> Admission:
        """Charge one unit to the counter `key` if it is below `limit`. A new counter expires
        `ttl_s` after its first unit."""
        ...

    async def throttle(self, key: str, *, limit: int, period_s: float) -> Admission:
        """Sliding-window rate limit: admit if fewer than `limit` calls were admitted under `key`
        in the last `period_s` seconds, and count this one. Exact: never more than `limit` in any
        window of `period_s`. When refused, `retry_after_s` is when the oldest one leaves."""
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
