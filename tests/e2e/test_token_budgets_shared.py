"""Token windows shared by workers and machines: one user's burst admits exactly the tokens
`tokens_per_minute` allows, through the example app, on SQLite with four uvicorn workers and on
Redis with two app processes (the pattern of `test_shared_state`, with tokens)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.service import create_app
from fixtures import FakeWorkersAI, Reply

from ..conftest import Serve, estimated_tokens, no_sleep, workers_ai_settings
from .test_shared_state import MODEL, AppProcess, _flush, app_process_env, burst

pytestmark = pytest.mark.serial

#: /summary's max_tokens when a token limit is set (`app.service.SUMMARY_MAX_TOKENS`).
MAX_TOKENS = 200
ADMITTED = 20


def exact_token_window(fake: FakeWorkersAI, urls: list[str]) -> None:
    """One warm-up call (another user) says what a request holds; the fake then reports
    exactly that as its usage (settling frees nothing, whatever the timing); 200 concurrent
    requests of one user against room for 20.5 holds: exactly 20 calls."""
    calls = fake.calls
    assert len(calls) == 1
    hold = estimated_tokens(calls[0].inputs) + MAX_TOKENS
    assert calls[0].inputs["max_tokens"] == MAX_TOKENS
    responses = asyncio.run(burst(urls, 200))
    bodies = [r.json() for r in responses]
    assert all(r.status_code == 200 for r in responses)
    assert len(fake.calls) == 1 + ADMITTED, hold
    # The app processes sent what the warm-up in this process did: each call held `hold`.
    assert {estimated_tokens(call.inputs) + MAX_TOKENS for call in fake.calls} == {hold}
    assert sum(b["fallback"] is None for b in bodies) == ADMITTED
    # Refused by the window; on a machine other tests load, a store operation may also outlast
    # its bound, and the budget, failing closed, answers `circuit_open` (charging nothing):
    # the count of calls above is what must be exact.
    reasons = [b["fallback"]["reason"] for b in bodies if b["fallback"]]
    assert "rate_limited" in reasons
    assert set(reasons) <= {"rate_limited", "circuit_open"}


def token_env(fake: FakeWorkersAI, store_url: str, tokens_per_minute: int) -> dict[str, str]:
    return app_process_env(
        fake, store_url, DAILY_CALL_LIMIT="100000", TOKENS_PER_MINUTE=str(tokens_per_minute)
    )


def summary_hold(fake: FakeWorkersAI, serve: Serve) -> int:
    """The warm-up call: what one /summary request of the burst will hold. What the app sends
    is its own code's (the prompt, the schema), so the warm-up runs in this process, through
    the same adapter to the same fake, before the test's app processes start with the limit
    found (one process start fewer per test)."""
    fake.default = Reply({"label": "billing", "confidence": 0.9})
    settings = workers_ai_settings(fake, ai_model=MODEL, tokens_per_minute=10**9, daily_call_limit=100_000)
    client = serve(create_app(settings, sleep=no_sleep))
    answer = client.post("/summary", json={"text": "refund"}, headers={"x-user-id": "warm-up"})
    assert answer.json()["fallback"] is None
    hold = estimated_tokens(fake.calls[0].inputs) + MAX_TOKENS
    usage = {"prompt_tokens": hold - MAX_TOKENS, "completion_tokens": MAX_TOKENS}
    fake.default = Reply({"label": "billing", "confidence": 0.9}, usage=usage, delay_s=0.02)
    return hold


def test_sqlite_token_window_is_exact_across_four_uvicorn_workers(
    tmp_path: Any, fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    hold = summary_hold(fake_workers_ai, serve)
    limit = ADMITTED * hold + hold // 2
    app = AppProcess(token_env(fake_workers_ai, f"sqlite:///{tmp_path}/guards.db", limit), workers=4)
    try:
        app.wait_ready()
        exact_token_window(fake_workers_ai, [app.url])
    finally:
        app.stop()


def test_redis_token_window_is_exact_across_two_app_processes(
    redis_url: str, fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    url = redis_url.rsplit("/", 1)[0] + "/4"  # a database of its own
    asyncio.run(_flush(url))
    hold = summary_hold(fake_workers_ai, serve)
    limit = ADMITTED * hold + hold // 2
    apps = [AppProcess(token_env(fake_workers_ai, url, limit)) for _ in range(2)]
    try:
        for app in apps:
            app.wait_ready()
        exact_token_window(fake_workers_ai, [app.url for app in apps])
    finally:
        for app in apps:
            app.stop()
