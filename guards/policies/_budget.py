"""Budget guard: per-key rate limits, daily and monthly call caps, spend caps and token
limits, checked and charged before any model call, for each of a route's budgets (scopes)
together, all or nothing.

The daily cap charges one unit per request (its retries included) before the first call, so a
failed call still spends. Its key is scoped to the UTC day as the store sees it, and lives
longer than a day so a late request cannot find its day's counter gone.

The spend cap holds the request's worst-case cost before the first call (every attempt at
`max_tokens` of output, and at most one token per byte of input) and settles it to the actual
cost afterwards, so concurrent requests can never push settled spend past the cap. Token
limits hold a request's estimated input tokens plus its `max_tokens`, settled to the usage the
provider reports (see docs/guards/budget.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.requests import Request

from ..contracts._errors import ConfigurationError, GuardTripped
from ..contracts._settings import choice, number, settings, whole
from ..contracts._vocabulary import Reason
from ..stores import Admission, Charge, MoreLimits, Share

__all__ = ["Budget", "Price", "SharedLimit", "StoreFailureMode", "client_key", "header_key"]


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


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class Price:
    """What a model costs, in the cost units of spend caps (say, US cents), per token and per
    call (see docs/guards/budget.md, "Prices").

    `input_token` and `output_token`: each input and output token. `cached_input_token`: each
    input token read from the provider's prompt cache, `cache_write_token`: each input token
    written to it (None: billed as `input_token`). `long_context_above` and `long_context`,
    together: a request with more input tokens than `long_context_above` is billed whole at
    `long_context`'s rates (as Anthropic and Gemini bill long prompts); `long_context` has no
    tier of its own.
    """

    input_token: float = 0.0
    output_token: float = 0.0
    call: float = 0.0
    cached_input_token: float | None = None
    cache_write_token: float | None = None
    long_context_above: int | None = None
    long_context: Price | None = None

    def __post_init__(self) -> None:
        for name in ("input_token", "output_token", "call"):
            number(f"Price.{name}", getattr(self, name), least=0)
        for name in ("cached_input_token", "cache_write_token"):
            number(f"Price.{name}", getattr(self, name), least=0, none="billed as input_token")
        whole("Price.long_context_above", self.long_context_above, none="no long-context tier")
        if self.long_context is not None and not isinstance(self.long_context, Price):
            raise ConfigurationError(f"Price.long_context must be a Price; got {self.long_context!r}")
        if (self.long_context_above is None) != (self.long_context is None):
            raise ConfigurationError(
                "Price.long_context_above and Price.long_context go together: the input tokens "
                "above which a request is billed at long_context's rates, and those rates"
            )
        if self.long_context is not None and self.long_context.long_context is not None:
            raise ConfigurationError("Price.long_context has no long_context tier of its own")

    def cost(
        self, input_tokens: int, output_tokens: int, cached_input_tokens: int = 0, cache_write_tokens: int = 0
    ) -> float:
        """The cost of a call: `input_tokens` counts every input token, those read from the
        cache (`cached_input_tokens`) and written to it (`cache_write_tokens`) included (each
        token is billed once, at its own rate; cached tokens past `input_tokens` are not
        counted); with a tier, above `long_context_above` input tokens, at its rates."""
        rates = self
        if self.long_context is not None and input_tokens > (self.long_context_above or 0):
            rates = self.long_context
        cost = rates.call + input_tokens * rates.input_token + output_tokens * rates.output_token
        if cached_input_tokens or cache_write_tokens:
            read = min(max(cached_input_tokens, 0), input_tokens)
            written = min(max(cache_write_tokens, 0), input_tokens - read)
            if rates.cached_input_token is not None:
                cost += read * (rates.cached_input_token - rates.input_token)
            if rates.cache_write_token is not None:
                cost += written * (rates.cache_write_token - rates.input_token)
        return cost

    def most(self, input_tokens: int, output_tokens: int) -> float:
        """The most a call of at most `input_tokens` input and `output_tokens` output tokens
        can cost: every input token at the highest of its rates, and at the tier's rates too
        once `input_tokens` passes its threshold (the higher of the two costs)."""
        cost = self.call + input_tokens * self._input_most() + output_tokens * self.output_token
        tier = self.long_context
        if tier is not None and input_tokens > (self.long_context_above or 0):
            cost = max(
                cost, tier.call + input_tokens * tier._input_most() + output_tokens * tier.output_token
            )
        return cost

    def _input_most(self) -> float:
        return max(self.input_token, self.cached_input_token or 0.0, self.cache_write_token or 0.0)


def price_of(prices: Mapping[str, Price], key: str) -> Price | None:
    """The price of the model `key` (`model` or `provider:model`) in `Guards(prices=...)`: its
    own, else the one under `"*"` (every model without a price of its own), else None."""
    found = prices.get(key)
    return found if found is not None else prices.get("*")


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class SharedLimit:
    """An upstream limit shared fairly by the tenants of a budget (its `key`), per UTC minute
    (see docs/guards/budget.md, "Fair shares of a shared limit").

    `per_minute`: requests, `tokens_per_minute`: tokens (the route must declare `max_tokens`),
    in each UTC minute, for every tenant together (at least one of the two). While the minute
    is under a limit every request is admitted; once contended, each tenant active in the
    minute (admitted or refused) is guaranteed its share, `limit x weight / (the weights of the
    minute's active tenants)`, and a tenant past its share is refused first (`rate_limited`).
    `weights`: a tenant's weight by its key (a number above 0; others weigh 1).
    """

    per_minute: int | None = None
    tokens_per_minute: int | None = None
    weights: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        whole("SharedLimit.per_minute", self.per_minute, none="no limit")
        whole("SharedLimit.tokens_per_minute", self.tokens_per_minute, none="no limit")
        if self.per_minute is None and self.tokens_per_minute is None:
            raise ConfigurationError("SharedLimit needs per_minute, tokens_per_minute or both")
        if not isinstance(self.weights, Mapping) or not all(isinstance(k, str) for k in self.weights):
            raise ConfigurationError(
                f"SharedLimit.weights must map tenant keys to weights; got {self.weights!r}"
            )
        for tenant, weight in self.weights.items():
            number(f"SharedLimit.weights[{tenant!r}]", weight, above=0)
        object.__setattr__(self, "weights", dict(self.weights))  # the caller's dict may change

    def share(self, tenant: str) -> Share:
        """The store's `Share` of `tenant`'s request."""
        return Share(tenant, float(self.weights.get(tenant, 1)), self.per_minute, self.tokens_per_minute)


#: A budget's limits in whole units (requests, tokens).
_COUNTED = ("per_minute", "per_day", "per_month", "tokens_per_minute", "tokens_per_day", "tokens_per_month")


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """Per-key limits checked before any model call (see docs/guards/budget.md).

    `per_minute`: at most this many requests per key in any sliding 60-second window.
    `per_day`: at most this many requests per key per UTC day (retries included in one).
    `per_month`: at most this many requests per key per UTC calendar month.
    `spend_per_day`, `spend_per_month`: at most this much cost per key per UTC day / month,
    priced by `Guards(prices=...)`; the route must declare `max_tokens`.
    `tokens_per_minute`: at most this many tokens per key in any sliding 60-second window;
    `tokens_per_day`, `tokens_per_month`: per UTC day / month. A request holds its estimated
    input tokens plus its `max_tokens` (the route must declare `max_tokens`), settled to the
    usage the provider reports.
    `key`: derives the key from the request (default: the client address).
    `scope`: counters are shared by routes with the same scope (default: the route's name);
    a route's budgets (`route(budget=[...])`) each need their own.
    `on_store_failure`: `"closed"` (default) refuses calls while the store is unreachable:
    a budget that cannot be checked cannot be enforced, and an outage of the store must not
    become unbounded spend. `"open"` admits them, with a warning in the log. `"local"`: each
    worker enforces its share of each limit (the limit divided by `workers`, rounded down) in
    its own memory until the store answers again, with a warning per request meanwhile (see
    docs/guards/budget.md for the bound on overshoot).
    `workers`: how many workers (processes) share the store, across every machine; required
    with `"local"` (and only then), and at most each limit, so every worker's share is at
    least one.
    `soft_limit`: a fraction between 0 and 1 (say 0.8); a request admitted while any of the
    budget's limits is past that fraction of itself, this request's charge included, is near
    the cap: its answer says so (`x-ai-budget`), and it is logged (`budget_near`) and counted
    (`guards_budget_near_total`). None (the default): no soft limit.
    `shared`: an upstream limit that the budget's keys (its tenants) share fairly
    (`SharedLimit`), counted under the budget's `scope`; a budget with `shared` has no other
    limit (give the tenants' own limits another budget of the route) and no `"local"` mode.
    """

    per_minute: int | None = None
    per_day: int | None = None
    spend_per_day: float | None = None
    key: Callable[[Request], str] = client_key
    scope: str | None = None
    on_store_failure: StoreFailureMode = "closed"
    per_month: int | None = None
    spend_per_month: float | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    workers: int | None = None
    soft_limit: float | None = None
    shared: SharedLimit | None = None

    def __post_init__(self) -> None:
        if self.shared is not None:
            self._check_shared()
        soft = self.soft_limit
        if soft is not None and not (
            not isinstance(soft, bool) and isinstance(soft, int | float) and 0 < soft < 1
        ):
            raise ConfigurationError(
                f"Budget.soft_limit={soft!r}: a fraction of each limit strictly between 0 and 1 "
                "(0.8: past 80 %), or None for no soft limit"
            )
        for name in _COUNTED:
            whole(f"Budget.{name}", getattr(self, name), none="no limit")
        for name in ("spend_per_day", "spend_per_month"):
            number(f"Budget.{name}", getattr(self, name), above=0, none="no cap")
        if not callable(self.key):
            raise ConfigurationError(
                f"Budget.key must be a function of the request returning its key (header_key(...), "
                f"bearer_token, client_key); got {self.key!r}"
            )
        if self.scope is not None and not (isinstance(self.scope, str) and self.scope):
            raise ConfigurationError(
                f"Budget.scope must be a name (or None: the route's name); got {self.scope!r}"
            )
        choice("Budget.on_store_failure", self.on_store_failure, ("closed", "open", "local"))
        local = self.on_store_failure == "local"
        if local and (
            isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1
        ):
            raise ConfigurationError(
                'Budget(on_store_failure="local") needs workers=N: how many workers share the '
                f"store (each enforces 1/N of each limit while the store is down); got {self.workers!r}"
            )
        if not local and self.workers is not None:
            raise ConfigurationError('Budget.workers is read only with on_store_failure="local"')
        if local:
            assert self.workers is not None
            for name in _COUNTED:
                value = getattr(self, name)
                if value is not None and value < self.workers:
                    raise ConfigurationError(
                        f"Budget.{name}={value} split among workers={self.workers} leaves a worker "
                        f'no share while the store is down: use on_store_failure="closed", or '
                        f"{name} of at least {self.workers}"
                    )

    def _check_shared(self) -> None:
        if not isinstance(self.shared, SharedLimit):
            raise ConfigurationError(f"Budget.shared must be a SharedLimit; got {self.shared!r}")
        own = (*_COUNTED, "spend_per_day", "spend_per_month", "soft_limit")
        if any(getattr(self, name) is not None for name in own):
            raise ConfigurationError(
                "a Budget with shared=SharedLimit(...) holds only the shared limit: give the "
                "tenants' own limits another Budget of the route (with its own scope)"
            )
        if self.on_store_failure == "local":
            raise ConfigurationError(
                'Budget(shared=...) has no on_store_failure="local": a share needs every '
                'tenant\'s count ("closed" or "open")'
            )

    @property
    def spend_capped(self) -> bool:
        """Whether the budget caps spend (daily or monthly)."""
        return self.spend_per_day is not None or self.spend_per_month is not None

    @property
    def token_capped(self) -> bool:
        """Whether the budget limits tokens."""
        return (
            self.tokens_per_minute is not None
            or self.tokens_per_day is not None
            or self.tokens_per_month is not None
            or (self.shared is not None and self.shared.tokens_per_minute is not None)
        )

    @property
    def plain(self) -> bool:
        """Whether the budget has only the first three limits and no soft limit (a `Charge` with
        no `MoreLimits`)."""
        return (
            self.per_month is None
            and self.spend_per_month is None
            and not self.token_capped
            and self.soft_limit is None
            and self.shared is None
        )


def scoped_keys(budgets: Sequence[Budget]) -> Callable[[Request], tuple[str, ...]]:
    """The caller's key for each of a route's `budgets`, together."""
    keys = tuple(budget.key for budget in budgets)

    def key(request: Request) -> tuple[str, ...]:
        return tuple(each(request) for each in keys)

    return key


def scoped_charge(
    budgets: Sequence[Budget], scopes: Sequence[str], callers: Sequence[str], hold_s: float
) -> Charge:
    """The charge of a route's `budgets` for `callers` (one key each): the first budget's, with
    the others in its `MoreLimits.also`, each under `guards:{scope}:{caller}`."""
    charges = []
    for budget, scope, caller in zip(budgets, scopes, callers, strict=True):
        if budget.shared is not None:  # one key for every tenant: the limit's
            share = budget.shared.share(caller)
            charges.append(Charge(f"guards:{scope}", None, None, None, 0.0, hold_s, MoreLimits(share=share)))
            continue
        key = f"guards:{scope}:{caller}"
        more = MoreLimits(
            per_month=budget.per_month,
            spend_per_month=budget.spend_per_month,
            tokens_per_minute=budget.tokens_per_minute,
            tokens_per_day=budget.tokens_per_day,
            tokens_per_month=budget.tokens_per_month,
            soft=None if budget.soft_limit is None else soft_charge(budget, key),
        )
        charges.append(
            Charge(key, budget.per_minute, budget.per_day, None, budget.spend_per_day or 0.0, hold_s, more)
        )
    first = charges[0]
    assert first.more is not None
    watched = any(budget.soft_limit is not None for budget in budgets)
    return dataclasses.replace(
        first, more=dataclasses.replace(first.more, also=tuple(charges[1:]), watched=watched)
    )


def soft_charge(budget: Budget, key: str) -> Charge:
    """`budget`'s soft limit as a charge under `key` (see `MoreLimits.soft`): refused, with
    nothing written, exactly when a limit is past `soft_limit` of itself. A count past the
    fraction `f` of its limit `n` is one above `floor(f x n)`: the dry check refuses a count
    that is already `floor(f x n) + 1`; a held amount is past it when above `f x limit` (for
    tokens, a whole number: above its floor), what a hold of 0 against that cap refuses."""
    fraction = budget.soft_limit
    assert fraction is not None

    def count(limit: int | None) -> int | None:
        return None if limit is None else math.floor(fraction * limit) + 1

    def held(limit: float | None) -> float | None:
        return None if limit is None else fraction * limit

    def whole(limit: int | None) -> int | None:  # tokens are whole: past f x n is past its floor
        return None if limit is None else math.floor(fraction * limit)

    more = MoreLimits(
        per_month=count(budget.per_month),
        spend=0.0 if budget.spend_per_month is not None else None,
        spend_per_month=held(budget.spend_per_month),
        tokens=0 if budget.token_capped else None,
        tokens_per_minute=whole(budget.tokens_per_minute),
        tokens_per_day=whole(budget.tokens_per_day),
        tokens_per_month=whole(budget.tokens_per_month),
    )
    spend_cap = held(budget.spend_per_day)
    return Charge(
        key,
        count(budget.per_minute),
        count(budget.per_day),
        None if spend_cap is None else 0.0,
        spend_cap or 0.0,
        0.0,
        more,
    )


def input_tokens_bound(inputs: Mapping[str, Any]) -> int:
    """An upper bound of the input tokens `inputs` can cost: tokenizers spend at least one byte
    of text per token, and the JSON of the inputs holds every byte the model will read (the
    messages, and the schema of JSON mode)."""
    return len(json.dumps(inputs, separators=(",", ":"), default=str).encode())


#: What each limit refuses with, and how its detail reads (`{}`: the limit's value).
_REFUSALS: dict[str, tuple[Reason, str]] = {
    "per_minute": (Reason.rate_limited, "at most {} requests per minute"),
    "per_day": (Reason.budget_exceeded, "daily cap of {} calls reached"),
    "per_month": (Reason.budget_exceeded, "monthly cap of {} calls reached"),
    "spend_per_day": (Reason.budget_exceeded, "daily spend cap of {:g} reached"),
    "spend_per_month": (Reason.budget_exceeded, "monthly spend cap of {:g} reached"),
    "tokens_per_minute": (Reason.rate_limited, "at most {} tokens per minute"),
    "tokens_per_day": (Reason.budget_exceeded, "daily cap of {} tokens reached"),
    "tokens_per_month": (Reason.budget_exceeded, "monthly cap of {} tokens reached"),
    "shared_per_minute": (
        Reason.rate_limited,
        "shared limit of {} requests per minute reached for this tenant",
    ),
    "shared_tokens_per_minute": (
        Reason.rate_limited,
        "shared limit of {} tokens per minute reached for this tenant",
    ),
}


def budget_refusal(budget: Budget, admission: Admission, scope: str) -> GuardTripped:
    """What a guarded call raises when the store refused to charge `budget` (of `scope`): the
    detail names the scope and the limit; a hold larger than a token limit itself says so,
    with no Retry-After (it never fits)."""
    limit = admission.refused_by or "per_day"
    reason, text = _REFUSALS.get(limit, _REFUSALS["per_day"])
    value = getattr(budget, limit, None)
    if limit.startswith("shared_") and budget.shared is not None:
        value = getattr(budget.shared, limit.removeprefix("shared_"))
    detail = text.format(value)
    if admission.retry_after_s is None and "tokens_" in limit:
        detail = f"the request holds more tokens than {limit}={value} allows"
    return GuardTripped(reason, f"{scope}: {detail}", retry_after_s=admission.retry_after_s, scope=scope)
