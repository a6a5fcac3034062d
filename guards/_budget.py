"""Budget guard: per-key rate limit and daily call cap, checked and charged before any model
call.

The daily cap charges one unit per request (its retries included) before the first call, so a
failed call still spends. Its key is scoped to the UTC day as the store sees it, and lives
longer than a day so a late request cannot find its day's counter gone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from ._envelope import Reason
from ._errors import GuardTripped
from .stores import Store

__all__ = ["Budget", "client_key", "header_key"]

DAY_S = 86_400.0
#: Daily counters outlive their day by this much (never expire while their day is current).
DAILY_TTL_S = DAY_S + 3_600.0


def client_key(request: Request) -> str:
    """The client's address (the budget key when nothing better identifies the caller)."""
    return request.client.host if request.client else "unknown"


def header_key(name: str) -> Callable[[Request], str]:
    """Key budgets by a request header (a user or tenant id), falling back to the client address."""

    def key(request: Request) -> str:
        return request.headers.get(name) or client_key(request)

    return key


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """Per-key limits checked before any model call.

    `per_minute`: at most this many requests per key in any sliding 60-second window.
    `per_day`: at most this many requests per key per UTC day (retries included in one).
    `key`: derives the key from the request (default: the client address).
    `scope`: counters are shared by routes with the same scope (default: the route's name).
    """

    per_minute: int | None = None
    per_day: int | None = None
    key: Callable[[Request], str] = client_key
    scope: str | None = None

    def __post_init__(self) -> None:
        for name in ("per_minute", "per_day"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"Budget.{name} must be at least 1 (or None for no limit)")


@functools.lru_cache(maxsize=4)
def _utc_day(day_number: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(day_number * DAY_S))


async def check_rate(store: Store, budget: Budget, scope: str, key: str) -> None:
    """Raise `GuardTripped(rate_limited)` when the key's per-minute rate is spent."""
    if budget.per_minute is None:
        return
    admission = await store.throttle(f"guards:{scope}:rate:{key}", limit=budget.per_minute, period_s=60.0)
    if not admission.allowed:
        raise GuardTripped(
            Reason.rate_limited,
            f"at most {budget.per_minute} requests per minute",
            retry_after_s=admission.retry_after_s,
        )


async def charge_daily(store: Store, budget: Budget, scope: str, key: str) -> None:
    """Charge one unit of the key's daily cap, or raise `GuardTripped(budget_exceeded)`."""
    if budget.per_day is None:
        return
    now = await store.now()
    day = _utc_day(int(now // DAY_S))
    admission = await store.take(f"guards:{scope}:day:{day}:{key}", limit=budget.per_day, ttl_s=DAILY_TTL_S)
    if not admission.allowed:
        raise GuardTripped(
            Reason.budget_exceeded,
            f"daily cap of {budget.per_day} calls reached",
            retry_after_s=DAY_S - now % DAY_S,  # until the next UTC midnight
        )
