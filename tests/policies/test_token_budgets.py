"""Budgets in tokens, over calendar months and at several scopes, through guarded routes over
HTTP, on every store: a request holds its estimated input tokens plus `max_tokens` before the
call and settles to the usage reported; a route's budgets are admitted together; a monthly
count starts again on the 1st (UTC)."""

from __future__ import annotations

import calendar
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from fixtures import FakeBinding, ManualClock, Reply
from guards import AI, Budget, ConfigurationError, Guards, header_key, render_metrics
from guards.stores import MemoryStore, Store

from ..conftest import LogLines, asgi_client, no_sleep

MODEL = "@cf/test/model"
#: 80 characters: an estimate of 20 input tokens (characters / 4); with max_tokens 20, a
#: request holds 40 tokens.
PROMPT = "x" * 80
HOLD = 40


def token_app(
    store: Store, fake: FakeBinding, budget: Budget | Sequence[Budget], *, strict: bool = False
) -> FastAPI:
    guards = Guards(fake, store=store, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    fallback: dict[str, Any] = {} if strict else {"fallback": "fallback"}

    @app.post("/label")
    @guards.route(model=MODEL, max_tokens=20, budget=budget, **fallback)
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": PROMPT})

    return app


async def post(app: FastAPI, count: int, **headers: str) -> list[Any]:
    async with asgi_client(app, timeout=30) as client:
        if count == 1:
            return [await client.post("/label", headers=headers)]
        async with anyio.create_task_group() as group:
            answers: list[Any] = []

            async def one() -> None:
                answers.append(await client.post("/label", headers=headers))

            for _ in range(count):
                group.start_soon(one)
        return answers


def user(**limits: Any) -> Budget:
    return Budget(key=header_key("x-user-id"), **limits)


def test_a_token_window_admits_exactly_the_tokens_it_allows_under_a_burst(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    """200 concurrent requests of one user, each holding 40 tokens (and using them: the
    settlement frees nothing) against 810 tokens a minute: exactly 20 calls; a minute later,
    20 more."""
    fake = FakeBinding(Reply("ok", usage={"prompt_tokens": 20, "completion_tokens": 20}, delay_s=0.01))
    app = token_app(make_store(manual_clock), fake, user(tokens_per_minute=20 * HOLD + 10))

    async def scenario() -> tuple[list[Any], list[Any]]:
        first = await post(app, 200, **{"x-user-id": "u"})
        manual_clock.advance(60)
        return first, await post(app, 200, **{"x-user-id": "u"})

    first, second = anyio.run(scenario)
    for answers in (first, second):
        bodies = [answer.json() for answer in answers]
        assert sum(body["fallback"] is None for body in bodies) == 20
        assert {body["fallback"]["reason"] for body in bodies if body["fallback"]} == {"rate_limited"}
    assert len(fake.calls) == 40
    assert all(call.inputs["max_tokens"] == 20 for call in fake.calls)


def test_holds_settle_to_the_usage_reported(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    """Each call holds 40 and uses 15 (the fake's usage): 100 tokens a minute admit five calls
    one after the other (4 x 15 + 40 = 100), not two (2 x 40)."""
    fake = FakeBinding(Reply("ok"))  # usage: 10 prompt + 5 completion tokens
    app = token_app(make_store(manual_clock), fake, user(tokens_per_minute=100))

    async def scenario() -> list[dict[str, Any]]:
        return [(await post(app, 1, **{"x-user-id": "u"}))[0].json() for _ in range(6)]

    bodies = anyio.run(scenario)
    assert [body["fallback"] is None for body in bodies] == [True] * 5 + [False]
    refused = bodies[-1]["fallback"]
    assert refused["reason"] == "rate_limited"
    assert refused["detail"] == "label: at most 100 tokens per minute"


def test_a_strict_route_answers_429_with_retry_after_and_a_hold_too_large_never_fits(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    fake = FakeBinding(Reply("ok", usage={"prompt_tokens": 20, "completion_tokens": 20}))
    app = token_app(make_store(manual_clock), fake, user(tokens_per_day=HOLD), strict=True)
    small = token_app(
        make_store(manual_clock), fake, user(tokens_per_day=HOLD - 1, scope="small"), strict=True
    )

    async def scenario() -> list[Any]:
        manual_clock.set(float(calendar.timegm((2026, 3, 10, 20, 0, 0))))  # 4 hours before midnight
        answers = [(await post(app, 1, **{"x-user-id": "u"}))[0] for _ in range(2)]
        return [*answers, (await post(small, 1, **{"x-user-id": "u"}))[0]]

    ok, refused, never = anyio.run(scenario)
    assert ok.status_code == 200
    assert refused.status_code == 429
    assert refused.json()["error"] == "budget_exceeded"
    assert refused.headers["retry-after"] == str(4 * 3_600)
    assert never.status_code == 429  # 40 tokens held, a limit of 39: no wait helps
    assert "retry-after" not in never.headers
    assert len(fake.calls) == 1


def test_a_tenant_cap_binds_across_users_and_its_refusal_charges_no_user(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock, guards_log: LogLines
) -> None:
    fake = FakeBinding(Reply("ok"))
    budgets = [
        user(per_day=2),
        Budget(per_day=3, key=header_key("x-tenant-id"), scope="tenant"),
    ]
    app = token_app(make_store(manual_clock), fake, budgets)

    def call(who: str, tenant: str) -> dict[str, Any]:
        answers = anyio.run(lambda: post(app, 1, **{"x-user-id": who, "x-tenant-id": tenant}))
        body: dict[str, Any] = answers[0].json()
        return body

    assert call("ann", "acme")["fallback"] is None
    assert call("ann", "acme")["fallback"] is None
    assert call("bob", "acme")["fallback"] is None
    refused = call("bob", "acme")["fallback"]  # the tenant's third call was bob's first
    assert refused["reason"] == "budget_exceeded"
    assert refused["detail"] == "tenant: daily cap of 3 calls reached"
    # The tenant's refusal charged nothing on bob's own scope: one call left, in another tenant.
    assert call("bob", "other")["fallback"] is None
    assert call("bob", "other")["fallback"]["detail"] == "label: daily cap of 2 calls reached"
    assert len(fake.calls) == 4
    scopes = [line.get("scope") for line in guards_log.events("request") if line["outcome"] == "fallback"]
    assert scopes == ["tenant", "label"]
    assert all("acme" not in str(line) and "bob" not in str(line) for line in guards_log.events("request"))


def test_a_monthly_cap_starts_again_on_the_first_of_the_month(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    manual_clock.set(float(calendar.timegm((2026, 4, 30, 23, 59, 58))))  # 30 April, 2 s to May
    fake = FakeBinding(Reply("ok"))
    app = token_app(make_store(manual_clock), fake, user(per_month=2), strict=True)

    async def scenario() -> list[Any]:
        answers = [(await post(app, 1, **{"x-user-id": "u"}))[0] for _ in range(3)]
        manual_clock.advance(2)  # 1 May, 00:00:00 UTC
        return [*answers, *[(await post(app, 1, **{"x-user-id": "u"}))[0] for _ in range(3)]]

    statuses = [answer.status_code for answer in anyio.run(scenario)]
    assert statuses == [200, 200, 429, 200, 200, 429]
    assert len(fake.calls) == 4


def test_budget_settings_are_checked_at_start_up() -> None:
    guards = Guards(FakeBinding(Reply("ok")))

    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": PROMPT})

    with pytest.raises(ConfigurationError, match="token limit: declare max_tokens"):
        guards.route(model=MODEL, budget=Budget(tokens_per_minute=100))(label)
    with pytest.raises(ConfigurationError, match="scope 'label'"):
        guards.route(model=MODEL, budget=[Budget(per_day=1), Budget(per_day=2)])(label)
    with pytest.raises(ValueError, match="tokens_per_day must be a whole number, at least 1"):
        Budget(tokens_per_day=0)
    with pytest.raises(ValueError, match="spend_per_month must be a positive"):
        Budget(spend_per_month=0)


def budget_samples() -> dict[tuple[str, str, str], float]:
    """`guards_budget_held_total` and `guards_budget_settled_total` by (name, scope, unit)."""
    body, _ = render_metrics()
    return {
        (sample.name, sample.labels["scope"], sample.labels["unit"]): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name in ("guards_budget_held_total", "guards_budget_settled_total")
    }


def test_holds_and_settlements_are_counted_per_scope_never_per_key(manual_clock: ManualClock) -> None:
    fake = FakeBinding(Reply("ok"))  # 15 tokens used per call
    budgets = [
        user(tokens_per_minute=10_000, scope="metered"),
        Budget(tokens_per_day=100_000, key=header_key("x-tenant-id"), scope="metered-tenant"),
    ]
    app = token_app(MemoryStore(clock=manual_clock), fake, budgets)
    before = budget_samples()

    async def scenario() -> None:
        for who in ("ann", "bob", "cy"):
            await post(app, 1, **{"x-user-id": who, "x-tenant-id": "acme"})

    anyio.run(scenario)
    after = budget_samples()
    grown = {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key)}
    assert grown == {
        ("guards_budget_held_total", "metered", "tokens"): 3 * HOLD,
        ("guards_budget_settled_total", "metered", "tokens"): 3 * 15,
        ("guards_budget_held_total", "metered-tenant", "tokens"): 3 * HOLD,
        ("guards_budget_settled_total", "metered-tenant", "tokens"): 3 * 15,
    }
