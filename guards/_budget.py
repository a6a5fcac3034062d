"""Budget guard: per-key rate limit, daily call cap and daily spend cap, checked and charged
before any model call.

The daily cap charges one unit per request (its retries included) before the first call, so a
failed call still spends. Its key is scoped to the UTC day as the store sees it, and lives
longer than a day so a late request cannot find its day's counter gone.

The spend cap holds the request's worst-case cost before the first call (every attempt at
`max_tokens` of output, and at most one token per byte of input) and settles it to the actual
cost afterwards, so concurrent requests can never push settled spend past the cap.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request

from ._errors import ConfigurationError, GuardTripped
from ._vocabulary import Reason
from .stores import Admission

__all__ = ["Budget", "Price", "StoreFailureMode", "client_key", "header_key"]


def client_key(request: Request) -> str:
    """The client's address (the budget key when nothing better identifies the caller)."""
    client = request.client
    return client.host if client else "unknown"


def header_key(name: str) -> Callable[[Request], str]:
    """Key budgets by a request header (a user or tenant id), falling back to the client address."""
    wanted = name.lower().encode("latin-1")

    def key(request: Request) -> str:
        # The raw ASGI headers (lower-case names): what `request.headers.get(name)` reads,
        # without building `Headers` on every request. The first one counts; empty is absent.
        for header, value in request.scope["headers"]:
            if header == wanted:
                if value:
                    found: str = value.decode("latin-1")
                    return found
                break
        return client_key(request)

    return key


#: What a budget does when its store is down or too slow: `"open"` admits the call (and logs a
#: warning), `"closed"` refuses it (`circuit_open`: the envelope's budget fallback, or 503),
#: `"local"` enforces the worker's share of each limit in its own memory (see `Budget`).
StoreFailureMode = Literal["open", "closed", "local"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Price:
    """What a model costs, in the cost units of spend caps (say, US cents)."""

    input_token: float = 0.0
    output_token: float = 0.0
    call: float = 0.0

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return self.call + input_tokens * self.input_token + output_tokens * self.output_token


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """Per-key limits checked before any model call.

    `per_minute`: at most this many requests per key in any sliding 60-second window.
    `per_day`: at most this many requests per key per UTC day (retries included in one).
    `spend_per_day`: at most this much cost per key per UTC day, priced by `Guards(prices=...)`;
    the route must declare `max_tokens`.
    `key`: derives the key from the request (default: the client address).
    `scope`: counters are shared by routes with the same scope (default: the route's name).
    `on_store_failure`: `"closed"` (default) refuses calls while the store is unreachable:
    a budget that cannot be checked cannot be enforced, and an outage of the store must not
    become unbounded spend. `"open"` admits them, with a warning in the log. `"local"`: each
    worker enforces its share of each limit (the limit divided by `workers`, rounded down) in
    its own memory until the store answers again, with a warning per request meanwhile (see
    docs/guards/budget.md for the bound on overshoot).
    `workers`: how many workers (processes) share the store, across every machine; required
    with `"local"` (and only then), and at most each limit, so every worker's share is at
    least one.
    """

    per_minute: int | None = None
    per_day: int | None = None
    spend_per_day: float | None = None
    key: Callable[[Request], str] = client_key
    scope: str | None = None
    on_store_failure: StoreFailureMode = "closed"
    workers: int | None = None

    def __post_init__(self) -> None:
        for name in ("per_minute", "per_day"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"Budget.{name} must be at least 1 (or None for no limit)")
        if self.spend_per_day is not None and self.spend_per_day <= 0:
            raise ValueError("Budget.spend_per_day must be positive (or None for no cap)")
        if self.on_store_failure not in ("open", "closed", "local"):
            raise ValueError('Budget.on_store_failure must be "open", "closed" or "local"')
        local = self.on_store_failure == "local"
        if local and (self.workers is None or self.workers < 1):
            raise ConfigurationError(
                'Budget(on_store_failure="local") needs workers=N: how many workers share the '
                "store (each enforces 1/N of each limit while the store is down)"
            )
        if not local and self.workers is not None:
            raise ConfigurationError('Budget.workers is read only with on_store_failure="local"')
        if local:
            assert self.workers is not None
            for name in ("per_minute", "per_day"):
                value = getattr(self, name)
                if value is not None and value < self.workers:
                    raise ConfigurationError(
                        f"Budget.{name}={value} split among workers={self.workers} leaves a worker "
                        f'no share while the store is down: use on_store_failure="closed", or '
                        f"{name} of at least {self.workers}"
                    )


def input_tokens_bound(inputs: Mapping[str, Any]) -> int:
    """An upper bound of the input tokens `inputs` can cost: tokenizers spend at least one byte
    of text per token, and the JSON of the inputs holds every byte the model will read (the
    messages, and the schema of JSON mode)."""
    return len(json.dumps(inputs, separators=(",", ":"), default=str).encode())


def budget_refusal(budget: Budget, admission: Admission) -> GuardTripped:
    """What a guarded call raises when the store refused to charge `budget`."""
    if admission.refused_by == "spend_per_day":
        return GuardTripped(
            Reason.budget_exceeded,
            f"daily spend cap of {budget.spend_per_day:g} reached",
            retry_after_s=admission.retry_after_s,
        )
    if admission.refused_by == "per_minute":
        return GuardTripped(
            Reason.rate_limited,
            f"at most {budget.per_minute} requests per minute",
            retry_after_s=admission.retry_after_s,
        )
    return GuardTripped(
        Reason.budget_exceeded,
        f"daily cap of {budget.per_day} calls reached",
        retry_after_s=admission.retry_after_s,
    )
