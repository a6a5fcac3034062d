"""Budget guard: per-key rate limit and daily call cap, checked and charged before any model
call.

The daily cap charges one unit per request (its retries included) before the first call, so a
failed call still spends. Its key is scoped to the UTC day as the store sees it, and lives
longer than a day so a late request cannot find its day's counter gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from ._envelope import Reason
from ._errors import GuardTripped
from .stores import Store

__all__ = ["Budget", "client_key", "header_key"]


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


async def charge_budget(store: Store, budget: Budget, key: str) -> None:
    """Charge one request to `key`'s budget, or raise `GuardTripped` (`rate_limited` or
    `budget_exceeded`) without charging anything."""
    admission = await store.charge_budget(key, per_minute=budget.per_minute, per_day=budget.per_day)
    if admission.allowed:
        return
    if admission.refused_by == "per_minute":
        raise GuardTripped(
            Reason.rate_limited,
            f"at most {budget.per_minute} requests per minute",
            retry_after_s=admission.retry_after_s,
        )
    raise GuardTripped(
        Reason.budget_exceeded,
        f"daily cap of {budget.per_day} calls reached",
        retry_after_s=admission.retry_after_s,
    )
