"""Prices from `genai-prices`' table (`Guards(price_table=GenAIPrices())`), over real HTTP: a
spend-capped route on a model the app did not price is declared and charged the table's
rates; an explicit price wins over the table; a model the table does not know is still refused
at start-up, by name; a long-context tier becomes `long_context_above` / `long_context`."""

from __future__ import annotations

import math
import uuid
from decimal import Decimal

import pytest
from fastapi import FastAPI
from genai_prices import data_snapshot
from prometheus_client.parser import text_string_to_metric_families

from fixtures import FakeOpenAI, Reply
from guards import AI, AIResult, Budget, ConfigurationError, GenAIPrices, Guards, Price, render_metrics
from guards.providers import OpenAICompatible

from ..conftest import AppClient

MODEL = "gpt-4o-mini"


def table_rates(provider: str, model: str) -> tuple[Decimal, Decimal]:
    """The input and output dollars per million tokens the bundled table lists for `model`."""
    _, info = data_snapshot.get_snapshot().find_provider_model(model, None, provider, None)
    prices = info.prices if not isinstance(info.prices, list) else info.prices[-1].prices
    return Decimal(prices.input_mtok), Decimal(prices.output_mtok)


def settled_spend(scope: str) -> float:
    """What the spend caps of `scope` were settled to (`guards_budget_settled_total`)."""
    body, _ = render_metrics()
    return sum(
        sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name == "guards_budget_settled_total"
        and sample.labels["scope"] == scope
        and sample.labels["unit"] == "spend"
    )


def spend_capped(guards: Guards, model: str = MODEL, scope: str = "ask") -> FastAPI:
    app = FastAPI()
    guards.install(app)

    @app.post("/ask")
    @guards.route(model=model, max_tokens=100, budget=Budget(spend_per_day=1.0, scope=scope))
    async def ask(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    return app


def openai(server: FakeOpenAI) -> OpenAICompatible:
    return OpenAICompatible(api_key=server.api_key, base_url=server.base_url)


USAGE = {"prompt_tokens": 1_000, "completion_tokens": 200, "total_tokens": 1_200}


def test_a_model_the_app_did_not_price_is_charged_the_tables_rates(
    fake_openai: FakeOpenAI, app_client: AppClient
) -> None:
    fake_openai.script(MODEL, Reply("hi", usage=USAGE))
    scope = f"table-{uuid.uuid4().hex[:8]}"
    guards = Guards(openai(fake_openai), price_table=GenAIPrices())
    client = app_client(spend_capped(guards, scope=scope), socket=True)
    assert client.post("/ask").status_code == 200
    rate_in, rate_out = table_rates("openai", MODEL)
    expected = float((1_000 * rate_in + 200 * rate_out) / 1_000_000)
    assert math.isclose(settled_spend(scope), expected, rel_tol=1e-9)


def test_an_explicit_price_wins_over_the_table(fake_openai: FakeOpenAI, app_client: AppClient) -> None:
    fake_openai.script(MODEL, Reply("hi", usage=USAGE))
    scope = f"own-{uuid.uuid4().hex[:8]}"
    own = Price(input_token=1e-4, output_token=0.0)
    guards = Guards(openai(fake_openai), prices={MODEL: own}, price_table=GenAIPrices())
    client = app_client(spend_capped(guards, scope=scope), socket=True)
    assert client.post("/ask").status_code == 200
    assert math.isclose(settled_spend(scope), 0.1)


def test_a_model_the_table_does_not_know_is_still_refused_at_start_up(fake_openai: FakeOpenAI) -> None:
    guards = Guards(openai(fake_openai), price_table=GenAIPrices())
    with pytest.raises(ConfigurationError, match="no price for no-such-model-anywhere"):
        spend_capped(guards, model="no-such-model-anywhere")


def test_a_long_context_tier_and_cache_rates_become_a_price() -> None:
    class Claude:
        async def run(self, model: str, inputs: object) -> AIResult:
            raise AssertionError("not called")

        async def aclose(self) -> None:
            return None

    table = GenAIPrices(providers={"anthropic": "anthropic"})
    price = table.price("anthropic", Claude(), "claude-sonnet-4-5", 1.0)
    assert price is not None
    assert price.long_context_above == 200_000
    assert price.long_context is not None
    assert math.isclose(price.input_token, 3e-6)
    assert math.isclose(price.long_context.input_token, 6e-6)
    assert price.cached_input_token is not None
    assert math.isclose(price.cached_input_token, 0.3e-6)
    cents = table.price("anthropic", Claude(), "claude-sonnet-4-5", 0.01)
    assert cents is not None
    assert math.isclose(cents.input_token, 3e-4)


def test_a_price_table_must_be_one() -> None:
    with pytest.raises(ConfigurationError, match="price_table"):
        Guards(OpenAICompatible(api_key="k"), price_table="genai-prices")  # type: ignore[arg-type]
