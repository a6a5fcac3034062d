"""The last good answer: `/summary` of the example app against the fake Workers
AI server, on every store: a validated success stored, served when the model fails (same text,
whitespace and case normalized; `fallback.detail` says how old), then expired to the keyword
label; keys hashed before they reach the store; answers never logged. Time moves only through
`ManualClock`. The store operations themselves: test_store_answer.py."""

from __future__ import annotations

import functools
import re
import sqlite3
import uuid
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from fixtures import Fail, FakeWorkersAI, ManualClock, Reply
from guards import AI, ConfigurationError, Guards, LastGood
from guards.providers import WorkersAI
from guards.stores import RedisStore, SQLiteStore, Store

from ..conftest import AppClient, ExampleClient, LogLines, assert_fallback, no_sleep, redis_admins

T0 = 86_400.0 * 20_000 + 3_600
MODEL = "@cf/test/model"
TEXT = "I was charged twice and need a refund for the second invoice."
LABEL_CANARY = "LASTGOOD-CANARY-9b1e"
ANSWER = {"label": LABEL_CANARY, "confidence": 0.92}
KEYWORD = {"label": "billing", "confidence": 0.3}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


# --- /summary over HTTP ----------------------------------------------------------------------


@pytest.fixture
def make_client(example_client: ExampleClient, store: Store, clock: ManualClock) -> ExampleClient:
    return functools.partial(example_client, store=store, clock=clock)


def summarize(client: httpx.Client, text: str = TEXT) -> httpx.Response:
    return client.post("/summary", json={"text": text}, headers={"x-user-id": "user-1"})


def test_summary_serves_the_last_good_answer_then_expires_to_the_keyword_label(
    make_client: Callable[..., httpx.Client],
    fake_workers_ai: FakeWorkersAI,
    clock: ManualClock,
    guards_log: LogLines,
) -> None:
    client = make_client()  # LAST_GOOD_MAX_AGE_S: 600 by default
    fake_workers_ai.script(MODEL, Reply(ANSWER))
    fake_workers_ai.default = Fail(code=5007, status=400)  # then the model fails
    assert summarize(client).json() == {"ok": True, "data": ANSWER, "fallback": None}

    clock.advance(120)
    # The same text, with other whitespace and case: the last good answer, and how old it is.
    body = assert_fallback(summarize(client, f"  {TEXT.upper()}\n\n"), "call", "provider_error", ANSWER)
    assert body["fallback"]["detail"].startswith("the last good answer, 120 s old (")
    # Another text has no answer of its own: the keyword label.
    assert_fallback(summarize(client, "Please refund my invoice."), "call", "provider_error", KEYWORD)

    clock.advance(480)  # 600 s after the answer: expired
    assert_fallback(summarize(client), "call", "provider_error", KEYWORD)
    assert len(fake_workers_ai.calls) == 4
    assert all(LABEL_CANARY not in line for line in guards_log.lines)  # user data: never logged


def test_last_good_max_age_is_a_setting(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, clock: ManualClock
) -> None:
    client = make_client(last_good_max_age_s=30)
    fake_workers_ai.script(MODEL, Reply(ANSWER))
    fake_workers_ai.default = Fail(code=3040, status=429)
    assert summarize(client).json()["fallback"] is None
    clock.advance(29)
    assert summarize(client).json()["data"] == ANSWER
    clock.advance(1)
    assert summarize(client).json()["data"] == KEYWORD


def test_only_validated_successes_are_stored(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI
) -> None:
    """A fallback is not a good answer, nor is an answer the output guard rejected."""
    client = make_client()
    fake_workers_ai.script(
        MODEL,
        Fail(code=5007, status=400),  # the keyword label: not stored
        Reply({"label": "mail ada@example.com", "confidence": 0.9}),  # blocked by moderation
        Fail(code=5007, status=400),
    )
    assert summarize(client).json()["data"] == KEYWORD
    assert summarize(client).json()["fallback"]["reason"] == "moderation_blocked"
    assert summarize(client).json()["data"] == KEYWORD


@pytest.mark.parametrize("store_kind", ["sqlite", "redis", "redis-cluster"], indirect=True)
def test_keys_are_hashed_before_they_reach_the_store(
    make_client: Callable[..., httpx.Client],
    fake_workers_ai: FakeWorkersAI,
    store: Store,
    store_kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    # This test's own answer (letters only: a run of digits reads as a phone number to moderation).
    secret, label = (
        "PARCEL-CANARY-77ac",
        "label-" + uuid.uuid4().hex.translate(str.maketrans("0123456789", "ghijklmnop")),
    )
    client = make_client()
    fake_workers_ai.script(MODEL, Reply({"label": label, "confidence": 0.5}))
    assert summarize(client, f"Where is parcel {secret}?").json()["fallback"] is None
    if store_kind == "sqlite":
        assert isinstance(store, SQLiteStore)
        with closing(sqlite3.connect(tmp_path / "guards.db")) as conn:
            [(key, value)] = conn.execute("SELECT key, value FROM guards_answer").fetchall()
        assert re.fullmatch(r"guards:last_good:[0-9a-f]{64}", key)
    else:
        assert isinstance(store, RedisStore)
        found = []
        for admin in redis_admins(store_kind, request):
            with admin:
                keys = admin.scan_iter(match="*{guards:last_good:*}:answer")
                found += [(k, v, admin.pttl(k)) for k in keys if label in (v := admin.get(k) or "")]
        [(key, value, ttl)] = found
        assert 0 < ttl <= 600_000
        assert re.search(r"\{guards:last_good:[0-9a-f]{64}\}:answer$", key)
    assert secret.lower() not in key.lower()
    assert label in value  # the answer is what is stored, under the hash


class Label(BaseModel):
    label: str


def test_last_good_declaration_errors() -> None:
    with pytest.raises(ConfigurationError, match="positive"):
        LastGood(key=lambda arguments: "k", max_age_s=0, otherwise=None)
    guards = Guards(WorkersAI(account_id="a", api_token="t"))
    with pytest.raises(ConfigurationError, match="does not validate"):

        @guards.route(model=MODEL, fallback=LastGood(key=lambda a: "k", max_age_s=60, otherwise={"bad": 1}))
        async def labelled(ai: AI[Label]) -> Label:
            return await ai.run({"prompt": "hi"})


def test_a_response_the_handler_builds_itself_is_not_stored(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store
) -> None:
    guards = Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        ),
        store=store,
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(
        model=MODEL, fallback=LastGood(key=lambda a: "same", max_age_s=60, otherwise={"label": "none"})
    )
    async def label(ai: AI[Label]) -> dict[str, str]:
        answer = await ai.run({"prompt": "Label this."})
        return JSONResponse({"label": answer.label.upper()})  # type: ignore[return-value]

    client = app_client(app)
    fake_workers_ai.script(MODEL, Reply({"label": "billing"}), Fail(code=5007, status=400))
    assert client.post("/label").json() == {"label": "BILLING"}
    assert client.post("/label").json()["data"] == {"label": "none"}  # nothing was stored
