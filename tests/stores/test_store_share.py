"""Fair shares of a shared upstream limit (`MoreLimits.share`) in `Store.step`, on every store
(memory, SQLite, Redis, Redis Cluster): below the limit everyone is admitted; once contended,
each tenant active in the minute keeps its weighted share and the tenant past its share is
refused first, with the minute's end as its wait."""

from __future__ import annotations

import asyncio
import calendar
from collections import Counter
from collections.abc import Callable

import pytest

from fixtures import ManualClock
from fixtures.stores import PiecewiseStore
from guards.stores import SHARE_TENANTS_CAP, Charge, MoreLimits, Passage, Report, Share, Step

#: 2026-01-31 23:00:00 UTC: the start of a minute.
T0 = float(calendar.timegm((2026, 1, 31, 23, 0, 0)))
LEGS = [("guards:cooldown:a", "guards:breaker:a")]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def shared(
    tenant: str,
    *,
    weight: float = 1.0,
    per_minute: int | None = None,
    tokens: int | None = None,
    tpm: int | None = None,
) -> Charge:
    """A request of `tenant` against the shared limit `guards:gpt` (holding `tokens`)."""
    more = MoreLimits(tokens=tokens, share=Share(tenant, weight, per_minute, tpm))
    return Charge("guards:gpt", None, None, None, 0.0, 60.0, more)


async def admit(store: PiecewiseStore, paid: Charge) -> Passage:
    return await store.step(Step(legs=LEGS, charge=paid))


def stores(
    make_store: Callable[[ManualClock], PiecewiseStore], store_kind: str, clock: ManualClock
) -> list[PiecewiseStore]:
    """Two workers' stores sharing their state (one on memory, which no worker shares)."""
    return [make_store(clock)] if store_kind == "memory" else [make_store(clock), make_store(clock)]


def test_two_tenants_at_10x_and_1x_demand_each_get_their_share_across_workers(
    make_store: Callable[[ManualClock], PiecewiseStore], store_kind: str, clock: ManualClock
) -> None:
    async def scenario() -> None:
        workers = stores(make_store, store_kind, clock)
        # A sends 600 requests, B 60, interleaved (one of B's after every ten of A's), all at
        # once, each worker taking every other one.
        tenants = [("b" if i % 11 == 10 else "a") for i in range(660)]
        passages = await asyncio.gather(
            *(admit(workers[i % len(workers)], shared(t, per_minute=60)) for i, t in enumerate(tenants))
        )
        admitted = Counter(t for t, p in zip(tenants, passages, strict=True) if p.admitted == 0)
        assert admitted["a"] >= 30
        assert admitted["b"] >= 30
        assert admitted["a"] + admitted["b"] == 60
        refused = [p.refusal for p in passages if p.admitted is None]
        assert {r.refused_by for r in refused if r is not None} == {"shared_per_minute"}
        assert all(r is not None and r.retry_after_s == pytest.approx(60) for r in refused)

    asyncio.run(scenario())


def test_a_lone_tenant_uses_the_whole_limit_and_waits_for_the_minutes_end(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        clock.advance(15)
        for _ in range(10):
            assert (await admit(store, shared("a", per_minute=10))).admitted == 0
        refused = await admit(store, shared("a", per_minute=10))
        assert refused.admitted is None
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "shared_per_minute"
        assert refused.refusal.retry_after_s == pytest.approx(45)  # the minute's end
        clock.advance(45)  # a new minute: nobody is active in it yet
        assert (await admit(store, shared("b", per_minute=10))).admitted == 0

    asyncio.run(scenario())


def test_weights_split_the_limit_3_to_1(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        admitted: Counter[str] = Counter()
        for _ in range(80):  # both want far more than 60
            for tenant, weight in (("gold", 3.0), ("iron", 1.0)):
                if (await admit(store, shared(tenant, weight=weight, per_minute=60))).admitted == 0:
                    admitted[tenant] += 1
        assert admitted == {"gold": 45, "iron": 15}

    asyncio.run(scenario())


def test_a_tenant_past_its_share_is_refused_while_another_active_tenant_has_room(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        assert (await admit(store, shared("b", per_minute=10))).admitted == 0  # b is active
        clock.advance(20)
        for _ in range(5):  # a's share: 5 of 10
            assert (await admit(store, shared("a", per_minute=10))).admitted == 0
        # 6 of 10 used, but b's unused share (4) is b's: a waits, for the minute's end.
        refused = await admit(store, shared("a", per_minute=10))
        assert refused.refusal is not None
        assert refused.refusal.retry_after_s == pytest.approx(40)
        for _ in range(4):
            assert (await admit(store, shared("b", per_minute=10))).admitted == 0
        assert (await admit(store, shared("b", per_minute=10))).admitted is None  # the limit

    asyncio.run(scenario())


def test_token_shares_hold_settle_to_the_usage_and_a_refused_tenant_keeps_its_share(
    store: PiecewiseStore,
) -> None:
    async def scenario() -> None:
        first = await admit(store, shared("a", tokens=1_000, tpm=1_000))
        assert first.admitted == 0
        assert first.reservation is not None
        refused = await admit(store, shared("b", tokens=100, tpm=1_000))  # the minute is full
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "shared_tokens_per_minute"
        # a used 200 tokens of its 1,000: 800 come back, but b, refused, is active: its share
        # (500) is kept for it, so a (at 200 of its 500) may take 300 more, not 301.
        report = Report(
            charge=shared("a", tokens=1_000, tpm=1_000), reservation=first.reservation, tokens=200
        )
        await store.step(Step(report=report))
        assert (await admit(store, shared("a", tokens=301, tpm=1_000))).admitted is None
        assert (await admit(store, shared("a", tokens=300, tpm=1_000))).admitted == 0
        assert (await admit(store, shared("b", tokens=500, tpm=1_000))).admitted == 0
        never = await admit(store, shared("c", tokens=1_001, tpm=1_000))
        assert never.refusal is not None
        assert never.refusal.retry_after_s is None  # larger than the limit: never fits

    asyncio.run(scenario())


def test_tenants_past_the_cap_share_one_overflow_bucket(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        limit = 2 * (SHARE_TENANTS_CAP + 1)
        for i in range(SHARE_TENANTS_CAP):  # the cap of tenants, one request each
            assert (await admit(store, shared(f"t{i}", per_minute=limit))).admitted == 0
        # Every later tenant counts in one bucket: its share (2) is the bucket's, together.
        late = [(await admit(store, shared(f"late{i}", per_minute=limit))).admitted for i in range(5)]
        assert late == [0, 0, None, None, None]

    asyncio.run(scenario())


def test_a_request_another_scope_refuses_takes_nothing_of_the_share(store: PiecewiseStore) -> None:
    """With a user's daily cap of 1 (another scope, another slot on Redis Cluster): the user's
    second request is refused by its cap, and charges the shared limit nothing (on a cluster,
    the share paid in its slot is given back), so the tenant's other users get the rest."""

    def request(user: str) -> Charge:
        mine = Charge(f"guards:user:{user}", None, 1, None, 0.0, 60.0, MoreLimits())
        paid = shared("a", per_minute=3)
        assert paid.more is not None
        return Charge(paid.key, None, None, None, 0.0, 60.0, MoreLimits(share=paid.more.share, also=(mine,)))

    async def scenario() -> None:
        assert (await admit(store, request("ann"))).admitted == 0
        refused = await admit(store, request("ann"))
        assert refused.refusal is not None
        assert refused.refusal.refused_by == "per_day"
        assert (await admit(store, request("bob"))).admitted == 0
        assert (await admit(store, request("cy"))).admitted == 0
        over = await admit(store, request("dan"))
        assert over.refusal is not None
        assert over.refusal.refused_by == "shared_per_minute"

    asyncio.run(scenario())
