"""Soft limits (`Budget(soft_limit=...)`), through guarded routes on every store: a request
admitted past the fraction of a limit, its own charge included, carries `x-ai-budget`, logs
`budget_near` and counts `guards_budget_near_total`, told by the same store step that admits
it; a route with no soft limit carries nothing."""

from __future__ import annotations

import calendar
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from fixtures import FakeBinding, ManualClock, Reply, Stream, Text
from guards import (
    AI,
    Attempt,
    Budget,
    ConfigurationError,
    EventStream,
    Guards,
    Ledger,
    Price,
    header_key,
    render_metrics,
)
from guards.stores import MemoryStore, Store

from ..conftest import LogLines, asgi_client, no_sleep

MODEL = "@cf/test/model"
PROMPT = "x" * 80  # 20 input tokens estimated; with max_tokens 20, a request holds 40


def app_of(store: Store, fake: FakeBinding, budget: Budget | Sequence[Budget], **route: Any) -> FastAPI:
    guards = Guards(fake, store=store, sleep=no_sleep, prices={MODEL: Price(call=1.0)})
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, max_tokens=20, budget=budget, fallback="fallback", **route)
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": PROMPT})

    return app


def near_headers(app: FastAPI, count: int, **headers: str) -> list[str | None]:
    """`x-ai-budget` of `count` requests in turn (`refused` for a budget fallback)."""

    async def scenario() -> list[str | None]:
        seen: list[str | None] = []
        async with asgi_client(app, timeout=30) as client:
            for _ in range(count):
                answer = await client.post("/label", headers=headers)
                assert answer.status_code == 200
                refused = answer.json()["fallback"] is not None
                seen.append("refused" if refused else answer.headers.get("x-ai-budget"))
        return seen

    return anyio.run(scenario)


def user(**limits: Any) -> Budget:
    return Budget(key=header_key("x-user-id"), **limits)


NEAR = "near; scope=label"


def test_past_the_soft_limit_of_a_daily_cap_the_answers_say_so(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock, guards_log: LogLines
) -> None:
    """80 % of 10 a day: the 9th and 10th requests are past it (9 > 8), the 11th refused."""
    fake = FakeBinding(Reply("ok"))
    app = app_of(make_store(manual_clock), fake, user(per_day=10, soft_limit=0.8))
    assert near_headers(app, 11, **{"x-user-id": "u"}) == [None] * 8 + [NEAR, NEAR, "refused"]
    near = [json.loads(line) for line in guards_log.lines if '"budget_near"' in line]
    assert len(near) == 2
    assert {(line["route"], line["scope"]) for line in near} == {("label", "label")}
    assert all("u" not in line.values() for line in near)  # never the key


def test_a_rate_a_spend_cap_and_a_monthly_count_each_reach_their_soft_limit(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    """60 % of 5 a minute: past it from the 4th (4 > 3); a minute later, not again until the
    4th. Spend: each request holds its worst case (2 calls x 1.0, `Price(call=1.0)` and one
    retry) and settles to 1.0; 50 % of 10 is past once settled plus held passes 5: from the
    5th (4 settled + 2 held; the 4th is at 5, not past it). A month of 20 at 10 %: past from the 3rd."""
    fake = FakeBinding(Reply("ok"))
    rate = app_of(make_store(manual_clock), fake, user(per_minute=5, soft_limit=0.6, scope="rate"))
    rate_near = "near; scope=rate"
    assert near_headers(rate, 5, **{"x-user-id": "u"}) == [None] * 3 + [rate_near] * 2
    manual_clock.advance(61)
    assert near_headers(rate, 4, **{"x-user-id": "u"}) == [None] * 3 + [rate_near]
    spend = app_of(make_store(manual_clock), fake, user(spend_per_day=10.0, soft_limit=0.5, scope="spend"))
    assert near_headers(spend, 6, **{"x-user-id": "u"}) == [None] * 4 + ["near; scope=spend"] * 2
    month = app_of(make_store(manual_clock), fake, user(per_month=20, soft_limit=0.1, scope="month"))
    assert near_headers(month, 3, **{"x-user-id": "u"}) == [None] * 2 + ["near; scope=month"]


def test_only_the_scopes_past_their_soft_limits_are_named(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    """A tenant's tokens at 50 % of 100 a day (each request holds 40 and settles to the 15 the
    fake reports): past it at the 2nd request (15 + 40 > 50); its users' daily counts (no soft
    limit) are never named, and another tenant's count is its own."""
    fake = FakeBinding(Reply("ok"))
    budgets = [
        user(per_day=100),
        Budget(tokens_per_day=100, soft_limit=0.5, key=header_key("x-tenant-id"), scope="tenant"),
    ]
    app = app_of(make_store(manual_clock), fake, budgets)
    tenant = "near; scope=tenant"
    assert near_headers(app, 3, **{"x-user-id": "ann", "x-tenant-id": "acme"}) == [None, tenant, tenant]
    assert near_headers(app, 1, **{"x-user-id": "bob", "x-tenant-id": "acme"}) == [tenant]
    assert near_headers(app, 1, **{"x-user-id": "bob", "x-tenant-id": "other"}) == [None]
    both = [
        user(per_day=3, soft_limit=0.5, scope="user"),
        Budget(per_day=3, soft_limit=0.5, key=header_key("x-tenant-id"), scope="team"),
    ]
    app = app_of(make_store(manual_clock), fake, both)
    assert near_headers(app, 2, **{"x-user-id": "cy", "x-tenant-id": "t"}) == [None, "near; scope=user,team"]


def test_near_requests_are_counted_per_scope(manual_clock: ManualClock) -> None:
    def near_total() -> float:
        body, _ = render_metrics()
        return sum(
            sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
            if sample.name == "guards_budget_near_total" and sample.labels["scope"] == "counted"
        )

    before = near_total()
    app = app_of(
        MemoryStore(clock=manual_clock),
        FakeBinding(Reply("ok")),
        user(per_day=4, soft_limit=0.5, scope="counted"),
    )
    for who in ("ann", "bob"):
        near_headers(app, 4, **{"x-user-id": who})
    assert near_total() - before == 4  # the 3rd and 4th of each user


def test_a_route_without_a_soft_limit_says_nothing(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock
) -> None:
    app = app_of(make_store(manual_clock), FakeBinding(Reply("ok")), user(per_day=2, per_month=100))
    assert near_headers(app, 3, **{"x-user-id": "u"}) == [None, None, "refused"]


@pytest.mark.parametrize("soft_limit", [0, 1, 1.5, -0.2, "0.8"])
def test_a_soft_limit_is_a_fraction_between_0_and_1(soft_limit: Any) -> None:
    with pytest.raises(ConfigurationError, match="soft_limit"):
        Budget(per_day=10, soft_limit=soft_limit)


CHEAP = "@cf/test/cheap"


def downgrade_app(
    store: Store, fake: FakeBinding, budget: Budget | Sequence[Budget], ledger: Ledger | None = None
) -> FastAPI:
    guards = Guards(fake, store=store, sleep=no_sleep, ledger=ledger)
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router())

    @app.post("/label")
    @guards.route(model=MODEL, downgrade_to=CHEAP, max_tokens=20, budget=budget, fallback="fallback")
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": PROMPT})

    return app


def test_past_the_soft_limit_the_next_requests_run_the_downgrade_chain(
    make_store: Callable[[ManualClock], Store], manual_clock: ManualClock, guards_log: LogLines
) -> None:
    """50 % of 4 a day: the 3rd request is admitted past it on the route's own model (the store
    says so as it admits it); the 4th runs the cheaper model and says so. The next UTC day the
    first request still runs downgraded (its admission says the key is no longer near), the
    second runs the route's own model again. Another user is never downgraded."""
    fake = FakeBinding(Reply("ok"))
    records: list[Attempt] = []
    ledger = type("Kept", (), {"record": staticmethod(records.append)})()
    app = downgrade_app(make_store(manual_clock), fake, user(per_day=4, soft_limit=0.5), ledger)
    manual_clock.set(float(calendar.timegm((2026, 3, 10, 12, 0, 0))))

    def run(count: int, who: str) -> list[tuple[str | None, str | None]]:
        async def scenario() -> list[tuple[str | None, str | None]]:
            seen = []
            async with asgi_client(app, timeout=30) as client:
                for _ in range(count):
                    answer = await client.post("/label", headers={"x-user-id": who})
                    assert answer.json()["fallback"] is None
                    seen.append((answer.headers.get("x-ai-downgraded"), answer.headers.get("x-ai-budget")))
            return seen

        return anyio.run(scenario)

    assert run(4, "u") == [(None, None), (None, None), (None, NEAR), ("label", NEAR)]
    assert [call.model for call in fake.calls] == [MODEL, MODEL, MODEL, CHEAP]
    # The ledger says which calls ran the downgrade chain.
    assert [(a.requested_model, a.downgraded) for a in records] == [(MODEL, False)] * 3 + [(CHEAP, True)]
    assert run(1, "v") == [(None, None)]
    manual_clock.advance(86_400)
    assert run(2, "u") == [("label", None), (None, None)]
    assert [call.model for call in fake.calls[-3:]] == [MODEL, CHEAP, MODEL]
    lines = [json.loads(line) for line in guards_log.lines]
    downgraded = [line for line in lines if line.get("event") == "request" and "downgraded" in line]
    assert [line["downgraded"] for line in downgraded] == ["label", "label"]
    assert [line["model"] for line in downgraded] == [CHEAP, CHEAP]

    async def models() -> list[str]:
        async with asgi_client(app, timeout=30) as client:
            report = (await client.get("/status", headers={"accept": "application/json"})).json()
        return [model["model"] for model in report["models"]]

    assert anyio.run(models) == [MODEL, CHEAP]  # the downgrade chain counts in the service level


def test_a_downgraded_stream_says_so_on_its_request_line(guards_log: LogLines) -> None:
    """A streamed answer of the downgrade chain: its header, and its request line (written when
    the stream ends), name the scopes, as a whole answer's do."""
    fake = FakeBinding(Stream(parts=(Text("o"), Text("k"))))
    guards = Guards(fake, store=MemoryStore(), sleep=no_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, downgrade_to=CHEAP, max_tokens=20, budget=user(per_day=4, soft_limit=0.5))
    async def label(ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": PROMPT})

    async def scenario() -> list[str | None]:
        seen = []
        async with asgi_client(app, timeout=30) as client:
            for _ in range(4):
                answer = await client.post("/label", headers={"x-user-id": "u"})
                assert answer.status_code == 200
                seen.append(answer.headers.get("x-ai-downgraded"))
        return seen

    assert anyio.run(scenario) == [None, None, None, "label"]
    assert [call.model for call in fake.calls] == [MODEL, MODEL, MODEL, CHEAP]
    lines = [json.loads(line) for line in guards_log.lines]
    requests = [line for line in lines if line.get("event") == "request"]
    assert [line.get("downgraded") for line in requests] == [None, None, None, "label"]
    assert requests[-1]["model"] == CHEAP


def test_downgrade_to_needs_a_soft_limit() -> None:
    guards = Guards(FakeBinding(Reply("ok")), sleep=no_sleep)
    with pytest.raises(ConfigurationError, match="downgrade_to needs a budget with a soft limit"):

        @guards.route(model=MODEL, downgrade_to=CHEAP, budget=user(per_day=4))
        async def label(ai: AI[str]) -> str:
            return await ai.run({"prompt": PROMPT})


def test_the_headers_are_in_the_openapi_schema_of_the_routes_that_send_them() -> None:
    fake = FakeBinding(Reply("ok"))
    soft = downgrade_app(MemoryStore(), fake, user(per_day=4, soft_limit=0.5)).openapi()
    plain = app_of(MemoryStore(), fake, user(per_day=4)).openapi()
    headers = soft["paths"]["/label"]["post"]["responses"]["200"]["headers"]
    assert re.fullmatch(headers["x-ai-budget"]["schema"]["pattern"], "near; scope=user,team")
    assert "x-ai-downgraded" in headers
    plain_headers = plain["paths"]["/label"]["post"]["responses"]["200"]["headers"]
    assert "x-ai-budget" not in plain_headers
    assert "x-ai-downgraded" not in plain_headers
