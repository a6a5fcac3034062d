"""Fair shares of a shared upstream limit (`Budget(shared=SharedLimit(...))`), through guarded
routes on every store: a lone tenant uses the whole limit, a refusal is `429 rate_limited` with
the minute's end as `Retry-After`, logged and counted with closed labels (never the tenant);
token shares hold each request's estimate and settle to the usage; what a shared limit may not
be combined with fails at start-up."""

from __future__ import annotations

import calendar
import json
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from fixtures import FakeBinding, ManualClock, Reply
from guards import AI, Budget, ConfigurationError, Guards, SharedLimit, header_key, render_metrics
from guards.stores import MemoryStore, Store

from ..conftest import LogLines, asgi_client, no_sleep

MODEL = "@cf/test/model"
PROMPT = "x" * 80  # 20 input tokens estimated; with max_tokens 20, a request holds 40
#: 2026-01-31 23:00:00 UTC: the start of a minute.
T0 = float(calendar.timegm((2026, 1, 31, 23, 0, 0)))


def tenants(limit: SharedLimit) -> Budget:
    return Budget(key=header_key("x-tenant"), scope="upstream", shared=limit)


def app_of(store: Store, fake: FakeBinding, budget: Budget, **route: Any) -> FastAPI:
    guards = Guards(fake, store=store, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, budget=budget, **route)
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": PROMPT})

    return app


def posts(app: FastAPI, tenant: str, count: int) -> list[httpx.Response]:
    async def scenario() -> list[httpx.Response]:
        async with asgi_client(app, timeout=30) as client:
            return [await client.post("/label", headers={"x-tenant": tenant}) for _ in range(count)]

    return anyio.run(scenario)


def test_a_lone_tenant_uses_the_whole_limit_then_waits_for_the_minutes_end(
    make_store: Callable[[ManualClock], Store], guards_log: LogLines
) -> None:
    clock = ManualClock(T0 + 15)
    fake = FakeBinding(Reply("ok"))
    app = app_of(make_store(clock), fake, tenants(SharedLimit(per_minute=10, weights={"acme": 3})))
    answers = posts(app, "acme", 11)
    assert [a.status_code for a in answers] == [200] * 10 + [429]
    refused = answers[-1]
    assert refused.json()["error"] == "rate_limited"
    assert refused.headers["retry-after"] == "45"
    assert len(fake.calls) == 10
    lines = [json.loads(line) for line in guards_log.lines if '"rate_limited"' in line]
    assert [(line["guard"], line["scope"]) for line in lines if line.get("event") == "request"] == [
        ("budget", "upstream")
    ]
    assert not any("acme" in line for line in guards_log.lines)  # never the tenant
    metrics = render_metrics()[0].decode()
    counted = [
        m for m in metrics.splitlines() if m.startswith("guards_fallbacks_total{") and "rate_limited" in m
    ]
    assert counted
    assert all("acme" not in m for m in metrics.splitlines())


def test_token_shares_hold_the_estimate_and_settle_to_the_usage(
    make_store: Callable[[ManualClock], Store],
) -> None:
    """100 tokens a minute; each request holds 40 and settles to the 15 the fake reports: the
    5th request still fits (60 + 40), the 6th does not (75 + 40)."""
    fake = FakeBinding(Reply("ok"))
    app = app_of(
        make_store(ManualClock(T0)),
        fake,
        tenants(SharedLimit(tokens_per_minute=100)),
        max_tokens=20,
        fallback="fallback",
    )
    answers = posts(app, "acme", 6)
    assert [a.json()["fallback"] for a in answers[:5]] == [None] * 5
    assert answers[5].json()["fallback"]["reason"] == "rate_limited"


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: SharedLimit(), "per_minute, tokens_per_minute or both"),
        (lambda: SharedLimit(per_minute=0), "SharedLimit.per_minute"),
        (lambda: SharedLimit(per_minute=5, weights={"gold": 0}), "SharedLimit.weights['gold']"),
        (lambda: SharedLimit(per_minute=5, weights=[("gold", 3)]), "SharedLimit.weights"),
        (lambda: Budget(per_day=5, shared=SharedLimit(per_minute=5)), "another Budget"),
        (lambda: Budget(shared=SharedLimit(per_minute=5), on_store_failure="local", workers=2), '"local"'),
        (lambda: Budget(shared=5), "Budget.shared must be a SharedLimit"),  # type: ignore[arg-type]
    ],
)
def test_what_a_shared_limit_cannot_be_fails_at_start_up(make: Callable[[], object], says: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        make()
    assert says in str(raised.value)


def test_a_token_share_needs_max_tokens() -> None:
    with pytest.raises(ConfigurationError, match="declare max_tokens"):
        app_of(MemoryStore(), FakeBinding(Reply("ok")), tenants(SharedLimit(tokens_per_minute=100)))


def test_a_strict_routes_openapi_says_a_shared_limit_may_answer_429() -> None:
    app = app_of(MemoryStore(), FakeBinding(Reply("ok")), tenants(SharedLimit(per_minute=5)))
    responses = app.openapi()["paths"]["/label"]["post"]["responses"]
    assert "429" in responses
