"""`/summary`'s budgets in the example app (issue 29): TENANT_DAILY_CALL_LIMIT (a second budget
keyed by `x-tenant-id`, admitted with the user's), MONTHLY_CALL_LIMIT (per user, UTC calendar
months) and TOKENS_PER_MINUTE / TOKENS_PER_DAY (per user, /summary then sends max_tokens)."""

from __future__ import annotations

import calendar
import functools
import itertools

import httpx
import pytest

from fixtures import FakeWorkersAI, ManualClock, Reply

from ..conftest import ExampleClient, estimated_tokens

ANSWER = {"label": "billing", "confidence": 0.9}


@pytest.fixture
def make_client(example_client: ExampleClient, manual_clock: ManualClock) -> ExampleClient:
    return functools.partial(example_client, clock=manual_clock)


#: A new text per call: no last good answer (of the same text) stands in for a refusal.
TEXTS = (f"refund number {n}" for n in itertools.count())


def summarize(client: httpx.Client, user: str, tenant: str | None = None) -> httpx.Response:
    headers = {"x-user-id": user} | ({"x-tenant-id": tenant} if tenant else {})
    return client.post("/summary", json={"text": next(TEXTS)}, headers=headers)


def test_the_tenant_cap_binds_across_its_users(
    make_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = Reply(ANSWER)
    client = make_client(daily_call_limit=2, tenant_daily_call_limit=3)
    assert [summarize(client, "ann", "acme").json()["fallback"] for _ in range(2)] == [None, None]
    assert summarize(client, "bob", "acme").json()["fallback"] is None
    refused = summarize(client, "bob", "acme").json()["fallback"]
    assert refused["reason"] == "budget_exceeded"
    assert refused["detail"] == "tenant: daily cap of 3 calls reached"
    # Bob's own scope was not charged by the refusal: his second call, in another tenant.
    assert summarize(client, "bob", "globex").json()["fallback"] is None
    assert (
        summarize(client, "bob", "globex").json()["fallback"]["detail"]
        == "summary: daily cap of 2 calls reached"
    )
    assert len(fake_workers_ai.calls) == 4


def test_a_malformed_tenant_id_is_refused_before_any_charge(
    make_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    client = make_client(tenant_daily_call_limit=1)
    answer = summarize(client, "ann", "bad\x01tenant")
    assert answer.status_code == 400
    assert answer.json()["problems"] == [
        {"field": "header.x-tenant-id", "problem": "string_pattern_mismatch"}
    ]
    assert fake_workers_ai.calls == []


def test_the_monthly_cap_counts_a_users_calls_per_utc_month(
    make_client: ExampleClient, fake_workers_ai: FakeWorkersAI, manual_clock: ManualClock
) -> None:
    fake_workers_ai.default = Reply(ANSWER)
    manual_clock.set(float(calendar.timegm((2026, 12, 31, 23, 0, 0))))
    client = make_client(daily_call_limit=100, monthly_call_limit=2)
    assert [summarize(client, "ann").json()["fallback"] for _ in range(2)] == [None, None]
    refused = summarize(client, "ann").json()["fallback"]
    assert refused == {
        "guard": "budget",
        "reason": "budget_exceeded",
        "detail": "summary: monthly cap of 2 calls reached",
    }
    manual_clock.advance(3_600)  # 1 January 2027
    assert summarize(client, "ann").json()["fallback"] is None


def test_token_limits_hold_max_tokens_and_refuse_as_rate_limited(
    make_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    """Each call holds its estimate plus 200 output tokens, and settles to 10 + 5 (the fake's
    usage): 700 tokens a minute admit calls one after the other until the next hold no longer
    fits beside the 15 tokens each earlier call used."""
    fake_workers_ai.default = Reply(ANSWER)
    client = make_client(tokens_per_minute=700, daily_call_limit=100)
    bodies = [summarize(client, "ann").json() for _ in range(40)]
    assert all(call.inputs["max_tokens"] == 200 for call in fake_workers_ai.calls)
    answered = sum(body["fallback"] is None for body in bodies)
    hold = estimated_tokens(fake_workers_ai.calls[0].inputs) + 200
    assert answered == (700 - hold) // 15 + 1
    refused = bodies[answered]["fallback"]
    assert refused["reason"] == "rate_limited"
    assert refused["detail"] == "summary: at most 700 tokens per minute"
    assert len(fake_workers_ai.calls) == answered


def test_a_fair_share_keeps_a_tenants_share_of_the_upstream_limit(
    make_client: ExampleClient, fake_workers_ai: FakeWorkersAI, manual_clock: ManualClock
) -> None:
    """FAIR_SHARE_PER_MINUTE=4: acme alone may take all 4; in the next minute, with globex
    active too, acme past its share (2) waits while globex's share is unused."""
    fake_workers_ai.default = Reply(ANSWER)
    manual_clock.set(float(calendar.timegm((2026, 12, 31, 23, 0, 0))))
    client = make_client(daily_call_limit=100, fair_share_per_minute=4)
    assert [summarize(client, f"u{n}", "acme").json()["fallback"] for n in range(4)] == [None] * 4
    refused = summarize(client, "u5", "acme").json()["fallback"]
    assert refused["reason"] == "rate_limited"
    assert refused["detail"] == "upstream: shared limit of 4 requests per minute reached for this tenant"
    manual_clock.advance(60)
    assert summarize(client, "ann", "globex").json()["fallback"] is None
    assert [summarize(client, "bob", "acme").json()["fallback"] is None for _ in range(3)] == [
        True,
        True,
        False,
    ]
    assert summarize(client, "ann", "globex").json()["fallback"] is None
    assert len(fake_workers_ai.calls) == 4 + 4
