"""Prices from a maintained table: `Guards(price_table=GenAIPrices())` prices every model a
spend-capped route may call that `Guards(prices=...)` does not, from pydantic's `genai-prices`
(the `prices` extra), once, when the route is declared.

Explicit prices win: the table is read only for a model with no price of its own; `"*"` then
prices what neither knows. A model the table does not know, or knows only with prices guards cannot hold (more
than one long-context tier), stays unpriced, and a spend-capped route that may call it is refused
at start-up as before, naming it.

The table is the snapshot bundled with the installed `genai-prices` (as fresh as its release;
pin the version to pin the prices). Guards never fetches prices over the network: every worker
of an app holds the same prices for its whole life, so a spend cap means the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Protocol

from ..contracts._errors import ConfigurationError
from ..contracts._extras import missing_extra
from ._budget import Price

__all__ = ["GenAIPrices", "PROVIDER_IDS", "PriceTable", "check_table", "fill_prices"]

#: The `genai-prices` provider of each adapter of `guards.providers` (by class name, so that
#: reading it imports no adapter). An OpenAI-compatible binding whose `base_url` names another
#: provider is matched by that URL instead (as `genai-prices` matches providers).
PROVIDER_IDS: Mapping[str, str] = {
    "WorkersAI": "cloudflare",
    "OpenAICompatible": "openai",
    "Anthropic": "anthropic",
    "Gemini": "google",
    "Bedrock": "aws",
    "AzureOpenAI": "azure",
}
_MILLION = Decimal(1_000_000)
#: The table's rates guards holds: (name here, `ModelPrice` field), dollars per million tokens.
_FIELDS = (
    ("input", "input_mtok"),
    ("output", "output_mtok"),
    ("cache_read", "cache_read_mtok"),
    ("cache_write", "cache_write_mtok"),
)


class PriceTable(Protocol):
    """Where `Guards(price_table=...)` finds the prices `Guards(prices=...)` lacks."""

    def price(self, provider: str, binding: Any, model: str, cost_unit_usd: float) -> Price | None: ...


def fill_prices(
    prices: dict[str, Price],
    table: PriceTable | None,
    refs: Any,
    bindings: Mapping[str | None, Any],
    cost_unit_usd: float,
) -> None:
    """Add to `prices` the table's price of each model of `refs` (`ModelRef`s) that has none
    of its own, once: a route's models, when it is declared."""
    if table is None:
        return
    for ref in refs:
        if ref.key in prices:
            continue
        found = table.price(ref.provider or "default", bindings[ref.provider], ref.model, cost_unit_usd)
        if found is not None:
            prices[ref.key] = found


class GenAIPrices:
    """The prices of `genai-prices`' bundled table (see docs/guards/budget.md, "Prices from a
    table").

    `providers` maps a provider name of the app (`"default"` for the main binding, or a key of
    `Guards(providers=...)`) to a `genai-prices` provider id, for a binding whose provider guards
    cannot tell from its adapter (a custom binding, or an OpenAI-compatible server behind a URL
    the table does not know). `at`: the date whose prices apply (default: now, when the route is
    declared), for a table that lists a scheduled price change.
    """

    def __init__(self, *, providers: Mapping[str, str] | None = None, at: datetime | None = None) -> None:
        try:
            from genai_prices import data_snapshot
        except ModuleNotFoundError as error:
            raise missing_extra(error, "prices", "guards.GenAIPrices") from error
        self._snapshot = data_snapshot.get_snapshot()
        self._providers = dict(providers or {})
        self._at = at

    def price(self, provider: str, binding: Any, model: str, cost_unit_usd: float) -> Price | None:
        """The price of `model` served by `binding` (named `provider` in the app), in the app's
        cost units (`cost_unit_usd` dollars each), or None when the table cannot price it."""
        provider_id, url = self._provider_of(provider, binding)
        if provider_id is None and url is None:
            return None
        try:
            _, info = self._snapshot.find_provider_model(model, None, provider_id, url)
        except LookupError:
            return None
        found = info.get_prices(self._at or datetime.now(tz=UTC))
        return _price(found, Decimal(repr(cost_unit_usd)))

    def _provider_of(self, provider: str, binding: Any) -> tuple[str | None, str | None]:
        if provider in self._providers:
            return self._providers[provider], None
        while hasattr(binding, "binding"):  # a `Throttled` binding: the one it paces
            binding = binding.binding
        known = PROVIDER_IDS.get(type(binding).__name__)
        url = getattr(binding, "base_url", None)
        if known == "openai" and isinstance(url, str) and "api.openai.com" not in url:
            return None, url  # another provider's OpenAI-compatible endpoint: found by its URL
        return known, None


def _price(found: Any, unit: Decimal) -> Price | None:
    """`found` (a `genai-prices` `ModelPrice`, in dollars per million tokens) as a `Price` in
    cost units per token, or None when guards cannot hold it."""
    base: dict[str, Decimal] = {}
    tier: dict[str, Decimal] = {}
    starts: set[int] = set()
    for name, field in _FIELDS:
        value = getattr(found, field, None)
        if value is None:
            continue
        if hasattr(value, "tiers"):  # `TieredPrices`: a base rate and rates above token counts
            if len(value.tiers) > 1:
                return None
            if value.tiers:
                starts.add(int(value.tiers[0].start))
                tier[name] = Decimal(value.tiers[0].price)
            value = value.base
        base[name] = Decimal(value)
    if "input" not in base or "output" not in base or len(starts) > 1:
        return None
    call = getattr(found, "requests_kcount", None)
    calls = float(Decimal(call) / 1000 / unit) if call is not None else 0.0

    def rate(rates: Mapping[str, Decimal], name: str) -> float | None:
        value = rates.get(name, base.get(name))
        return None if value is None else float(value / _MILLION / unit)

    def made(rates: Mapping[str, Decimal], **tiered: Any) -> Price:
        return Price(
            input_token=rate(rates, "input") or 0.0,
            output_token=rate(rates, "output") or 0.0,
            cached_input_token=rate(rates, "cache_read"),
            cache_write_token=rate(rates, "cache_write"),
            call=calls,
            **tiered,
        )

    if not starts:
        return made(base)
    return made(base, long_context_above=starts.pop(), long_context=made(tier))


def check_table(table: object) -> None:
    """`Guards(price_table=...)`: None, or a table with a `price` method."""
    if table is not None and not callable(getattr(table, "price", None)):
        raise ConfigurationError(
            f"Guards(price_table=...) must be a price table such as guards.GenAIPrices(); got {table!r}"
        )
