"""Fair shares of a shared upstream limit across two workers on Redis, over real HTTP: two apps,
each served by uvicorn with its own `RedisStore` on one Redis (the store's clock a manual one,
so the burst lands in one minute), tenants A and B active (one request each), then A sending
200 requests and B 20 at once: each gets at least its share of 20 a minute, and together never
more than 20. (A share is kept for a tenant from its first request of the minute on: what
another took before that is not given back, so the tenants' first requests come first here,
where the order of a burst's arrivals is the network's.) (The store's own test,
tests/stores/test_store_share.py, sends 600 and 60 against 60 on every store.)"""

from __future__ import annotations

import asyncio
import calendar
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from fastapi import FastAPI

from fixtures import FakeBinding, ManualClock, Reply
from guards import AI, Budget, Guards, SharedLimit, header_key
from guards.stores import Store

from ..conftest import LiveServer, no_sleep

MODEL = "@cf/test/model"
#: 2026-01-31 23:00:20 UTC: 40 s before the minute's end.
T0 = float(calendar.timegm((2026, 1, 31, 23, 0, 20)))


def worker(store: Store, fake: FakeBinding) -> FastAPI:
    guards = Guards(fake, store=store, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(
        model=MODEL,
        budget=Budget(key=header_key("x-tenant"), scope="upstream", shared=SharedLimit(per_minute=20)),
    )
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label this"})

    return app


async def burst(urls: list[str], tenants: list[str]) -> list[httpx.Response]:
    """One POST per entry of `tenants` (its `x-tenant`), all at once, spread over `urls`."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post(f"{urls[i % len(urls)]}/label", headers={"x-tenant": tenant})
                for i, tenant in enumerate(tenants)
            )
        )


@pytest.mark.parametrize("store_kind", ["redis"])
def test_two_tenants_at_10x_and_1x_demand_each_get_their_share_across_two_workers(
    make_store: Callable[[ManualClock], Store],
) -> None:
    clock = ManualClock(T0)
    fake = FakeBinding(Reply("ok"))
    tenants = ["b" if i % 11 == 10 else "a" for i in range(220)]  # 200 of A's, 20 of B's
    with (
        LiveServer(worker(make_store(clock), fake)) as one,
        LiveServer(worker(make_store(clock), fake)) as two,
    ):
        # Both active first (one request each, one per worker), then the burst.
        first = [asyncio.run(burst([url], [tenant]))[0] for url, tenant in ((one.url, "a"), (two.url, "b"))]
        answers = [*first, *asyncio.run(burst([one.url, two.url], tenants))]
    tenants = ["a", "b", *tenants]
    admitted = Counter(t for t, a in zip(tenants, answers, strict=True) if a.status_code == 200)
    assert admitted["a"] >= 10
    assert admitted["b"] >= 10
    assert admitted["a"] + admitted["b"] == 20
    assert len(fake.calls) == 20
    refused = [a for a in answers if a.status_code != 200]
    assert {a.status_code for a in refused} == {429}
    assert {a.json()["error"] for a in refused} == {"rate_limited"}
    assert {a.headers["retry-after"] for a in refused} == {"40"}  # the minute's end
