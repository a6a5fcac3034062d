"""The retry budget: a model's retries stay a share of its requests in each worker. Its rule as
a table, then the retry storm over real HTTP (200 concurrent requests to the example app, one
worker, against a model that fails every call with 3040: at most 200 + 40 provider calls, not
400), a chain that moves to its next model instead of retrying, and the log and metric."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.service import create_app
from fixtures import Fail, FakeWorkersAI, ManualClock, Reply
from guards import AI, Guards, Retry, RetryBudget
from guards.providers import WorkersAI
from guards.stores import Store

from ..conftest import LogLines, Serve, assert_error, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
BACKUP = "@cf/test/backup"
REQUESTS = 200


@pytest.mark.parametrize(
    ("budget", "retries", "requests", "allowed"),
    [
        (RetryBudget(), 0, 0, True),  # the floor: a quiet model may retry
        (RetryBudget(), 2, 0, True),
        (RetryBudget(), 3, 0, False),
        (RetryBudget(), 3, 10, False),  # 20 % of 10 is 2: the floor (3) still rules
        (RetryBudget(), 39, 200, True),  # 20 % of 200 is 40
        (RetryBudget(), 40, 200, False),
        (RetryBudget(share=0.5, min_retries=0), 4, 10, True),
        (RetryBudget(share=0.5, min_retries=0), 5, 10, False),
        (RetryBudget(share=0.0, min_retries=0), 0, 1_000, False),  # never retry
    ],
)
def test_budget_rule(budget: RetryBudget, retries: int, requests: int, allowed: bool) -> None:
    assert budget.allows(retries, requests) is allowed


@pytest.mark.parametrize(
    "kwargs", [{"share": -0.1}, {"min_retries": -1}, {"window_s": 0}, {"share": float("nan")}]
)
def test_bad_budgets_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="RetryBudget"):
        RetryBudget(**kwargs)


async def storm(
    base_url: str, path: str, body: dict[str, Any], count: int = REQUESTS
) -> list[httpx.Response]:
    """`count` requests at once, each on a connection of its own."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as client:
        return await asyncio.gather(*(client.post(path, json=body) for _ in range(count)))


def retry_budget_exhausted(client: httpx.Client, model: str) -> float:
    series = f'guards_retry_budget_exhausted_total{{model="{model}"}}'
    found = re.search(re.escape(series) + r" (\S+)", client.get("/metrics").text)
    return float(found.group(1)) if found else 0.0


def test_a_retry_storm_is_bounded_by_the_budget(
    fake_workers_ai: FakeWorkersAI, serve: Serve, store: Store, clock: ManualClock, guards_log: LogLines
) -> None:
    settings = workers_ai_settings(
        fake_workers_ai,
        ai_timeout_s=60.0,  # no deadline interferes: only the budget decides
        breaker_failure_threshold=10_000,  # nor the breaker
    )
    client = serve(create_app(settings, store=store, clock=clock, sleep=no_sleep))
    fake_workers_ai.default = Fail(code=3040, status=429)  # out of capacity: retryable
    skipped_before = retry_budget_exhausted(client, MODEL)
    responses = asyncio.run(storm(str(client.base_url), "/draft-reply", {"message": "Where is my parcel?"}))
    for response in responses:
        assert_error(response, 503, "model_temporarily_unavailable", True)
    calls = len(fake_workers_ai.calls)
    retries = calls - REQUESTS
    assert REQUESTS <= calls <= REQUESTS + REQUESTS // 5, calls  # at most 240, not 400
    skipped = [e for e in guards_log.events("retry") if e.get("skipped") == "retry_budget"]
    assert len(skipped) == REQUESTS - retries  # every request either retried or was refused
    assert {(e["model"], e["kind"], e["attempt"]) for e in skipped} == {
        (MODEL, "model_temporarily_unavailable", 1)
    }
    assert retry_budget_exhausted(client, MODEL) == skipped_before + len(skipped)
    print(f"retry storm: {calls} provider calls for {REQUESTS} requests ({retries} retries)")


def test_without_a_budget_the_storm_doubles_the_calls(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    """What the budget prevents: every request retries, 400 calls to a model that is down."""
    client = serve(guarded_app(fake_workers_ai, Retry(budget=None)))
    fake_workers_ai.default = Fail(code=3040, status=429)
    responses = asyncio.run(storm(str(client.base_url), "/reply", {}))
    assert {response.status_code for response in responses} == {503}
    assert len(fake_workers_ai.calls) == 2 * REQUESTS


def test_over_the_budget_the_walk_moves_to_the_next_model(
    fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    client = serve(guarded_app(fake_workers_ai, Retry(), fallbacks=[BACKUP]))
    fake_workers_ai.script(MODEL, *[Fail(code=3040, status=429)] * 100)
    fake_workers_ai.script(BACKUP, *[Reply("From the backup.")] * 100)
    responses = [client.post("/reply", json={}) for _ in range(20)]
    assert all(r.status_code == 200 and r.headers["x-ai-fallback"] == BACKUP for r in responses)
    primary = [call for call in fake_workers_ai.calls if call.model == MODEL]
    # 20 requests, sequential: the floor's 3 retries, then 20 % of the requests.
    assert 20 + 3 <= len(primary) <= 20 + 4
    skipped = [e for e in guards_log.events("retry") if e.get("skipped") == "retry_budget"]
    assert len(skipped) == 20 - (len(primary) - 20)
    assert len([c for c in fake_workers_ai.calls if c.model == BACKUP]) == 20


def guarded_app(server: FakeWorkersAI, retry: Retry, fallbacks: list[str] | None = None) -> FastAPI:
    guards = Guards(
        WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url),
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/reply")
    @guards.route(model=MODEL, fallbacks=fallbacks or [], retry=retry, timeout_s=60, breaker=None)
    async def reply(ai: AI[str]) -> str:
        return await ai.run({"prompt": "Where is my parcel?"})

    return app
