"""The service's routes against the fake provider of `guards.testing` (its pytest plugin comes
with route-guards: no `-p` flag). Each test gets a fresh store from `use_fake_ai`, so a test that
trips a guard (a rate limit puts the model in a cooldown) never reaches the next one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from app.main import app
from guards.testing import Fail, FakeBinding, Reply, UseFakeAI

BILLING = {"label": "billing", "urgent": False}

pytestmark = pytest.mark.anyio  # async tests on asyncio (anyio's pytest plugin)


@pytest.fixture
def fake(use_fake_ai: UseFakeAI) -> FakeBinding:
    return use_fake_ai(app)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def test_triage_answers_with_the_model(fake: FakeBinding, client: httpx.AsyncClient) -> None:
    fake.script("*", Reply(BILLING))
    answer = await client.post("/triage", json={"text": "I was charged twice"})
    assert answer.status_code == 200
    assert answer.json() == {"ok": True, "data": BILLING, "fallback": None}


async def test_triage_degrades_when_the_model_is_rate_limited(
    fake: FakeBinding, client: httpx.AsyncClient
) -> None:
    fake.script("*", Fail(code=3036, status=429))  # and the model cools down
    for _ in range(2):
        answer = await client.post("/triage", json={"text": "The site is down"})
        assert answer.status_code == 200
        assert answer.json()["data"] == {"label": "outage", "urgent": True}
    assert len(fake.calls) == 1  # the second request skipped the cooling model


async def test_draft_is_strict_when_the_model_fails(fake: FakeBinding, client: httpx.AsyncClient) -> None:
    fake.script("*", Fail(code=3036, status=429))
    answer = await client.post("/draft", json={"text": "Where is my order?"})
    assert answer.status_code == 503
    assert answer.json()["error"] == "model_quota_exhausted"
    assert int(answer.headers["retry-after"]) > 0


async def test_draft_answers_with_the_model(fake: FakeBinding, client: httpx.AsyncClient) -> None:
    fake.script("*", Reply("Your order ships today."))
    answer = await client.post("/draft", json={"text": "Where is my order?"})
    assert answer.json() == {"message": "Your order ships today."}


async def test_the_budget_counts_per_user(fake: FakeBinding, client: httpx.AsyncClient) -> None:
    fake.default = Reply(BILLING)
    ada, eve = {"x-user-id": "ada"}, {"x-user-id": "eve"}
    answers = [await client.post("/triage", json={"text": "hi"}, headers=ada) for _ in range(4)]
    assert [a.json()["fallback"] for a in answers[:3]] == [None, None, None]
    assert answers[3].json()["fallback"]["reason"] == "rate_limited"
    assert (await client.post("/triage", json={"text": "hi"}, headers=eve)).json()["fallback"] is None
    assert len(fake.calls) == 4
