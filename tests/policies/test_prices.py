"""Prices and what a call is charged, through guarded routes over real HTTP: cached input read
and written at their own rates, a long-context tier, usage normalized on both wires (OpenAI's
`prompt_tokens` includes its cached tokens), a spend-capped route with an unpriced model
refused at start-up unless `"*"` prices it, and a stream that ends early (its client gone, or
cut) charged its estimated input plus the characters delivered over four, on every store,
unless its binding bills such streams in full."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from fixtures import FakeOpenAI, FakeWorkersAI, ManualClock, Reply, Stream, Text
from guards import AI, Attempt, Budget, ConfigurationError, EventStream, Guards, Price, render_metrics
from guards.providers import OpenAICompatible, WorkersAI
from guards.stores import MemoryStore, Store

from ..conftest import AppClient, LogLines, no_sleep

MODEL = "@cf/test/model"
OPENAI_MODEL = "gpt-4o-mini"
#: 80 characters: an estimate of 20 input tokens (characters / 4).
PROMPT = "x" * 80
INPUT_ESTIMATE = 20
MAX_TOKENS = 100
#: Cost units per input, cached input and output token.
PRICE = Price(input_token=1.0, cached_input_token=0.1, output_token=10.0)
#: 50 parts of four characters: one output token each, by the estimate.
PARTS = tuple(Text("abcd") for _ in range(50))


class Recorder:
    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)


def budget_samples(scope: str) -> dict[tuple[str, str], float]:
    """`guards_budget_held_total` and `guards_budget_settled_total` of `scope`, by (name, unit)."""
    body, _ = render_metrics()
    return {
        (sample.name, sample.labels["unit"]): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name in ("guards_budget_held_total", "guards_budget_settled_total")
        and sample.labels["scope"] == scope
    }


def workers_ai(server: FakeWorkersAI) -> WorkersAI:
    return WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url)


class BillsInFull(WorkersAI):
    """A Workers AI binding whose provider bills a stream cut short in full."""

    bills_cancelled_streams_in_full = True


def streaming_app(guards: Guards, budget: Budget) -> FastAPI:
    app = FastAPI()
    guards.install(app)

    @app.post("/stream")
    @guards.route(model=MODEL, max_tokens=MAX_TOKENS, budget=budget, timeout_s=10)
    async def stream(ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": PROMPT})

    return app


def leave_after(client: httpx.Client, deltas: int) -> None:
    """Read `deltas` delta events of `POST /stream` over a connection of its own, then leave."""
    own = httpx.Client(base_url=client.base_url, timeout=10)
    with own, own.stream("POST", "/stream") as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            if line.startswith("event: delta"):
                seen += 1
                if seen == deltas:
                    break


def request_lines(log: LogLines, count: int) -> None:
    assert log.wait_for(lambda: len(log.events("request")) >= count, timeout=5), "no request line"


# --- a stream that ends early ------------------------------------------------------------------


@pytest.mark.parametrize("bills_in_full", [False, True], ids=["estimate", "in-full"])
def test_a_client_that_leaves_mid_stream_is_charged_by_the_rule_on_every_store(
    make_store: Callable[[ManualClock], Store],
    manual_clock: ManualClock,
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
    guards_log: LogLines,
    bills_in_full: bool,
) -> None:
    """The client leaves after three deltas: no usage came, so the stream is charged its
    estimated input tokens (20) plus the characters delivered over four, in tokens and in
    spend; the store settled it, so a second request fits in what the hold alone would have
    filled. A binding that bills such streams in full settles to the hold instead."""
    fake_workers_ai.script(MODEL, Stream(parts=PARTS, interval_s=0.05))
    scope = f"cut-{uuid.uuid4().hex[:8]}"
    hold = INPUT_ESTIMATE + MAX_TOKENS
    # Room for the hold twice over only if the first request settled well below its hold.
    budget = Budget(spend_per_day=1e9, tokens_per_day=hold + 60, scope=scope)
    binding = (BillsInFull if bills_in_full else WorkersAI)(
        account_id=fake_workers_ai.account_id,
        api_token=fake_workers_ai.api_token,
        base_url=fake_workers_ai.base_url,
    )
    ledger = Recorder()
    guards = Guards(
        binding, store=make_store(manual_clock), prices={MODEL: PRICE}, sleep=no_sleep, ledger=ledger
    )
    client = app_client(streaming_app(guards, budget), socket=True)

    leave_after(client, 3)
    request_lines(guards_log, 1)
    (attempt,) = ledger.attempts
    assert attempt.outcome == "cancelled"
    assert attempt.usage is None  # an estimate is charged, never told as the provider's usage
    delivered = attempt.delivered_chars
    assert delivered is not None
    assert 12 <= delivered < 4 * len(PARTS)
    samples = budget_samples(scope)
    assert samples[("guards_budget_held_total", "tokens")] == hold
    held_spend = samples[("guards_budget_held_total", "spend")]
    if bills_in_full:
        assert samples[("guards_budget_settled_total", "tokens")] == hold
        # The spend hold covers the route's attempt budget (two calls): one call, at its worst.
        assert samples[("guards_budget_settled_total", "spend")] == held_spend / 2
    else:
        output = math.ceil(delivered / 4)
        assert samples[("guards_budget_settled_total", "tokens")] == INPUT_ESTIMATE + output
        assert samples[("guards_budget_settled_total", "spend")] == pytest.approx(
            INPUT_ESTIMATE * 1.0 + output * 10.0
        )
        assert held_spend > INPUT_ESTIMATE + output * 10.0

    # The store holds what was settled: a second request (holding 120 tokens) fits in the
    # 60 tokens left beside the estimate, never beside the hold.
    fake_workers_ai.script(MODEL, Stream(parts=(Text("ok"),)))
    second = client.post("/stream")
    request_lines(guards_log, 2)
    assert second.status_code == (429 if bills_in_full else 200)


def test_a_stream_cut_after_output_is_charged_the_estimate_on_every_store(
    make_store: Callable[[ManualClock], Store],
    manual_clock: ManualClock,
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
    guards_log: LogLines,
) -> None:
    """The provider's connection drops after three parts (12 characters delivered): 20 input
    tokens plus 3 output tokens, 50 cost units."""
    fake_workers_ai.script(MODEL, Stream(parts=PARTS, cut_after=3))
    scope = f"cut-{uuid.uuid4().hex[:8]}"
    guards = Guards(
        workers_ai(fake_workers_ai), store=make_store(manual_clock), prices={MODEL: PRICE}, sleep=no_sleep
    )
    client = app_client(
        streaming_app(guards, Budget(spend_per_day=1e9, tokens_per_day=10_000, scope=scope)), socket=True
    )
    body = client.post("/stream").text
    assert "event: error" in body
    request_lines(guards_log, 1)
    samples = budget_samples(scope)
    assert samples[("guards_budget_settled_total", "tokens")] == INPUT_ESTIMATE + 3
    assert samples[("guards_budget_settled_total", "spend")] == pytest.approx(INPUT_ESTIMATE * 1.0 + 3 * 10.0)


def test_a_stream_that_completes_is_charged_its_usage_not_the_estimate(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, guards_log: LogLines
) -> None:
    fake_workers_ai.script(
        MODEL,
        Stream(parts=PARTS[:3], usage={"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37}),
    )
    scope = f"done-{uuid.uuid4().hex[:8]}"
    guards = Guards(workers_ai(fake_workers_ai), store=MemoryStore(), prices={MODEL: PRICE}, sleep=no_sleep)
    client = app_client(
        streaming_app(guards, Budget(spend_per_day=1e9, tokens_per_day=10_000, scope=scope)), socket=True
    )
    assert "event: done" in client.post("/stream").text
    request_lines(guards_log, 1)
    samples = budget_samples(scope)
    assert samples[("guards_budget_settled_total", "tokens")] == 37
    assert samples[("guards_budget_settled_total", "spend")] == pytest.approx(30 * 1.0 + 7 * 10.0)


# --- cached input on both wires ------------------------------------------------------------------

CACHED_USAGE = {
    "prompt_tokens": 1000,
    "completion_tokens": 10,
    "total_tokens": 1010,
    "prompt_tokens_details": {"cached_tokens": 800},
}
#: 200 input tokens at 1, 800 cached at 0.1, 10 output at 10: not 1000 + 100.
CACHED_COST = 200 * 1.0 + 800 * 0.1 + 10 * 10.0


@pytest.mark.parametrize("wire", ["openai", "workers-ai"])
@pytest.mark.parametrize("streamed", [False, True], ids=["answer", "stream"])
def test_cached_input_tokens_are_billed_at_their_rate_and_once(
    wire: str,
    streamed: bool,
    fake_openai: FakeOpenAI,
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
    guards_log: LogLines,
) -> None:
    """`prompt_tokens` includes `prompt_tokens_details.cached_tokens`: 800 of the 1000 input
    tokens are billed at the cached rate, the other 200 at the input rate."""
    model = OPENAI_MODEL if wire == "openai" else MODEL
    binding = (
        OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)
        if wire == "openai"
        else workers_ai(fake_workers_ai)
    )
    server: FakeOpenAI | FakeWorkersAI = fake_openai if wire == "openai" else fake_workers_ai
    outcome = Stream(parts=(Text("ok"),), usage=CACHED_USAGE) if streamed else Reply("ok", usage=CACHED_USAGE)
    server.script(model, outcome)
    scope = f"cached-{uuid.uuid4().hex[:8]}"
    ledger = Recorder()
    guards = Guards(binding, store=MemoryStore(), prices={model: PRICE}, sleep=no_sleep, ledger=ledger)
    app = FastAPI()
    guards.install(app)

    @app.post("/ask")
    @guards.route(model=model, max_tokens=MAX_TOKENS, budget=Budget(spend_per_day=1e9, scope=scope))
    async def ask(ai: AI[str]) -> Any:
        if streamed:
            return await ai.stream({"prompt": PROMPT})
        return {"text": await ai.run({"prompt": PROMPT})}

    response = app_client(app, socket=True).post("/ask")
    assert response.status_code == 200
    request_lines(guards_log, 1)
    (attempt,) = ledger.attempts
    assert attempt.usage is not None
    assert (attempt.usage.prompt_tokens, attempt.usage.cached_input_tokens) == (1000, 800)
    assert budget_samples(scope)[("guards_budget_settled_total", "spend")] == pytest.approx(CACHED_COST)


# --- the price itself ----------------------------------------------------------------------------


def test_a_price_bills_each_input_token_once_at_its_own_rate() -> None:
    price = Price(
        input_token=3.0, cached_input_token=0.3, cache_write_token=3.75, output_token=15.0, call=1.0
    )
    assert price.cost(1000, 10) == 1.0 + 3000 + 150
    assert price.cost(1000, 10, cached_input_tokens=600, cache_write_tokens=300) == pytest.approx(
        1.0 + 100 * 3.0 + 600 * 0.3 + 300 * 3.75 + 150
    )
    # More cached tokens than input tokens (a provider's slip) never bills a token twice.
    assert price.cost(100, 0, cached_input_tokens=500, cache_write_tokens=500) == pytest.approx(
        1.0 + 100 * 0.3
    )
    # Without their own rates, cached tokens are billed as input.
    assert Price(input_token=2.0).cost(100, 0, cached_input_tokens=50, cache_write_tokens=50) == 200


def test_a_long_prompt_is_billed_whole_at_the_tier_and_the_hold_stays_an_upper_bound() -> None:
    tier = Price(input_token=6.0, cached_input_token=0.6, output_token=22.5)
    price = Price(
        input_token=3.0, cached_input_token=0.3, cache_write_token=3.75, output_token=15.0,
        long_context_above=200_000, long_context=tier,
    )  # fmt: skip
    assert price.cost(200_000, 100) == 200_000 * 3.0 + 100 * 15.0
    assert price.cost(200_001, 100) == 200_001 * 6.0 + 100 * 22.5
    assert price.cost(250_000, 0, cached_input_tokens=50_000) == pytest.approx(200_000 * 6.0 + 50_000 * 0.6)
    for bound in (10, 200_000, 200_001, 400_000):
        most = price.most(bound, 1000)
        for used in (0, bound // 2, bound):
            for cached, written in ((0, 0), (used, 0), (0, used), (used // 3, used // 3)):
                assert price.cost(used, 1000, cached, written) <= most + 1e-6


def test_prices_are_checked_when_made() -> None:
    with pytest.raises(ConfigurationError, match="go together"):
        Price(input_token=1.0, long_context_above=1000)
    with pytest.raises(ConfigurationError, match="go together"):
        Price(input_token=1.0, long_context=Price(input_token=2.0))
    with pytest.raises(ConfigurationError, match="long_context_above must be a whole number, at least 1"):
        Price(long_context_above=0, long_context=Price())
    nested = Price(long_context_above=10, long_context=Price())
    with pytest.raises(ConfigurationError, match="no long_context tier of its own"):
        Price(long_context_above=5, long_context=nested)
    with pytest.raises(ConfigurationError, match="cached_input_token must be a finite number"):
        Price(cached_input_token=-0.1)
    with pytest.raises(ConfigurationError, match="input_token must be a finite number"):
        Price(input_token=float("nan"))


# --- a model without a price ---------------------------------------------------------------------


def test_a_spend_capped_route_refuses_an_unpriced_model_unless_star_prices_it(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, guards_log: LogLines
) -> None:
    def app_with(prices: dict[str, Price], scope: str) -> FastAPI:
        guards = Guards(workers_ai(fake_workers_ai), store=MemoryStore(), prices=prices, sleep=no_sleep)
        app = FastAPI()
        guards.install(app)

        @app.post("/ask")
        @guards.route(model=MODEL, max_tokens=MAX_TOKENS, budget=Budget(spend_per_day=1e9, scope=scope))
        async def ask(ai: AI[str]) -> dict[str, str]:
            return {"text": await ai.run({"prompt": PROMPT})}

        return app

    with pytest.raises(ConfigurationError) as refused:
        app_with({"@cf/other/model": PRICE}, "unpriced")
    assert str(refused.value) == (
        "test_a_spend_capped_route_refuses_an_unpriced_model_unless_star_prices_it.<locals>.app_with"
        ".<locals>.ask has a spend cap: Guards(prices=...) has no price for @cf/test/model: add one "
        'under its key, or a price for every model without one under "*"'
    )

    scope = f"star-{uuid.uuid4().hex[:8]}"
    fake_workers_ai.script(MODEL, Reply("ok"))  # 10 input and 5 output tokens
    app = app_with({"@cf/other/model": PRICE, "*": Price(input_token=2.0, output_token=4.0)}, scope)
    assert app_client(app, socket=True).post("/ask").status_code == 200
    request_lines(guards_log, 1)
    assert budget_samples(scope)[("guards_budget_settled_total", "spend")] == 10 * 2.0 + 5 * 4.0
