"""Token windows shared by workers and machines: one user's burst admits exactly the tokens
`tokens_per_minute` allows, through the example app, on SQLite with four uvicorn workers and on
Redis with two app processes (the pattern of `test_shared_state`, with tokens)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fixtures import FakeWorkersAI, Reply

from ..conftest import estimated_tokens
from .test_shared_state import AppProcess, _flush, app_process_env, burst

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


def hold_of(fake: FakeWorkersAI, url: str) -> int:
    """The warm-up call: what one /summary request of the burst will hold."""
    import httpx

    fake.default = Reply({"label": "billing", "confidence": 0.9})
    answer = httpx.post(
        f"{url}/summary", json={"text": "refund"}, headers={"x-user-id": "warm-up"}, timeout=30
    )
    assert answer.json()["fallback"] is None
    hold = estimated_tokens(fake.calls[0].inputs) + MAX_TOKENS
    usage = {"prompt_tokens": hold - MAX_TOKENS, "completion_tokens": MAX_TOKENS}
    fake.default = Reply({"label": "billing", "confidence": 0.9}, usage=usage, delay_s=0.02)
    return hold


#: What the app's /summary holds for {"text": "refund"}: found once (the prompt and schema are
#: the app's), then the limit of each test is set from it before its app starts.
def summary_hold(fake: FakeWorkersAI, store_url: str) -> int:
    app = AppProcess(token_env(fake, store_url, 10**9))
    try:
        app.wait_ready()
        return hold_of(fake, app.url)
    finally:
        app.stop()


def test_sqlite_token_window_is_exact_across_four_uvicorn_workers(
    tmp_path: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    hold = summary_hold(fake_workers_ai, f"sqlite:///{tmp_path}/probe.db")
    limit = ADMITTED * hold + hold // 2
    app = AppProcess(token_env(fake_workers_ai, f"sqlite:///{tmp_path}/guards.db", limit), workers=4)
    try:
        app.wait_ready()
        exact_token_window(fake_workers_ai, [app.url])
    finally:
        app.stop()


def test_redis_token_window_is_exact_across_two_app_processes(
    redis_url: str, fake_workers_ai: FakeWorkersAI
) -> None:
    url = redis_url.rsplit("/", 1)[0] + "/4"  # a database of its own
    asyncio.run(_flush(url))
    hold = summary_hold(fake_workers_ai, url)
    asyncio.run(_flush(url))
    limit = ADMITTED * hold + hold // 2
    apps = [AppProcess(token_env(fake_workers_ai, url, limit)) for _ in range(2)]
    try:
        for app in apps:
            app.wait_ready()
        exact_token_window(fake_workers_ai, [app.url for app in apps])
    finally:
        for app in apps:
            app.stop()
