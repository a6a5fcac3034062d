"""An app written from the README, nothing tuned, recovers on its own: a strict streaming route
served by uvicorn, a chain of two models on the fake OpenAI-compatible server, over real HTTP.

- A first model that fails every call for 60 s, then recovers, under one request every 4 s:
  every request is answered during the outage (by the second model), and the first model
  serves again within 10 s of its recovery: a failed half-open probe reopens the breaker for
  the default probe interval (5 s), not a whole `reset_timeout_s`, and a probe is one call (it
  is never retried on the same model). The outage runs on a `ManualClock` that the store (the
  breaker's time) and the fake provider (when the outage ends) share: 60 s pass in no time.
- The same, closer: a probe whose retryable failure is not retried, then 5 s open, then the
  next probe (the retry budget off, so that only the probe rule can refuse the retry).
- A one-model route whose provider answers 429 with `Retry-After: 2`: the wait is waited out
  (for real, once: 2 s) and the answer comes from the same model; while it waits, the model
  cools down, so another request is not sent to it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
from fastapi import FastAPI
from pydantic import BaseModel, Field

from fixtures import Fail, FakeOpenAI, ManualClock, Reply
from guards import AI, Breaker, EventStream, Guards, Retry
from guards.providers import OpenAICompatible
from guards.stores import Store

from ..conftest import Serve, assert_error, no_sleep, wait_until

FIRST, SECOND = "first-model", "second-model"
OUTAGE_S, EVERY_S = 60.0, 4.0


class Message(BaseModel):
    message: str = Field(min_length=1, max_length=2000)


def readme_app(
    server: FakeOpenAI,
    *,
    fallbacks: list[str],
    store: Store | None = None,
    breaker: Breaker = Breaker(failure_threshold=5, reset_timeout_s=30),
    retry: Retry = Retry(),
    **options: Any,
) -> FastAPI:
    """The README's app, its route strict and streaming: a two-model chain (or one model),
    `timeout_s=30`, `Breaker(failure_threshold=5, reset_timeout_s=30)`, the default retry."""
    guards = Guards(OpenAICompatible(base_url=server.base_url, api_key="test-key"), store=store, **options)
    app = FastAPI()
    guards.install(app)

    @app.post("/reply/stream")
    @guards.route(
        model=FIRST,
        fallbacks=fallbacks,
        timeout_s=30,
        breaker=breaker,
        retry=retry,
    )
    async def reply_stream(body: Message, ai: AI[str]) -> EventStream:
        return await ai.stream({"messages": [{"role": "user", "content": body.message}]})

    return app


def streamed(client: httpx.Client) -> tuple[int, list[tuple[str, Any]]]:
    """One request's status and its events, `(name, data)`, read to the end."""
    events: list[tuple[str, Any]] = []
    with client.stream(
        "POST", "/reply/stream", json={"message": "Where is my parcel?"}, timeout=30
    ) as response:
        name = "message"
        for line in response.iter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line.split(":", 1)[1])))
                name = "message"
        return response.status_code, events


def served_by(events: list[tuple[str, Any]]) -> str | None:
    """The model a completed stream says served it (None: it did not complete)."""
    done = [data for name, data in events if name == "done"]
    return done[0].get("model") if done else None


def test_a_model_back_from_an_outage_serves_again_within_ten_seconds(
    fake_openai: FakeOpenAI, serve: Serve, store: Store, clock: ManualClock
) -> None:
    start = clock.time()

    def answer(model: str, inputs: Any) -> Fail | Reply:
        if model == FIRST and clock.time() - start < OUTAGE_S:
            return Fail(status=503)  # down for OUTAGE_S on the shared clock, then back
        return Reply(f"From {model}.")

    fake_openai.default = answer
    client = serve(readme_app(fake_openai, fallbacks=[SECOND], store=store, sleep=no_sleep))
    serving: list[tuple[float, str | None]] = []
    probe_calls: list[int] = []
    while clock.time() - start < OUTAGE_S + 24:
        before = sum(1 for call in fake_openai.calls if call.model == FIRST)
        status, events = streamed(client)
        assert status == 200, events
        model = served_by(events)
        assert model in (FIRST, SECOND), events  # every request answered
        calls = sum(1 for call in fake_openai.calls if call.model == FIRST) - before
        serving.append((clock.time() - start, model))
        if 20 <= clock.time() - start < OUTAGE_S and calls:  # open since 16 s: a probe
            probe_calls.append(calls)
        clock.advance(EVERY_S)
    back = [at for at, model in serving if model == FIRST]
    assert back, serving
    assert OUTAGE_S <= back[0] <= OUTAGE_S + 10, serving
    # Each probe is one call to the first model (never retried on it).
    assert probe_calls == [1] * len(probe_calls), probe_calls
    assert probe_calls


def test_a_failed_probe_is_one_call_and_reopens_for_five_seconds(
    fake_openai: FakeOpenAI, serve: Serve, store: Store, clock: ManualClock
) -> None:
    """A half-open probe tells whether the model is back in one call: a retryable failure of
    the probe is not retried on the model (the second model answers at once), and the breaker
    reopens for the default probe interval, 5 s, not `reset_timeout_s`. (The retry budget is
    off here so that nothing but the probe rule can refuse the retry.)"""
    fake_openai.default = lambda model, inputs: Fail(status=503) if model == FIRST else Reply("Second.")
    app = readme_app(
        fake_openai,
        fallbacks=[SECOND],
        store=store,
        breaker=Breaker(failure_threshold=1, reset_timeout_s=30),
        retry=Retry(budget=None),
        sleep=no_sleep,
    )
    client = serve(app)

    def calls_to_first() -> int:
        """The first model's calls for one request, which the second model answers."""
        before = sum(1 for call in fake_openai.calls if call.model == FIRST)
        status, events = streamed(client)
        assert (status, served_by(events)) == (200, SECOND), events
        return sum(1 for call in fake_openai.calls if call.model == FIRST) - before

    assert calls_to_first() == 2  # closed: the failure is retried, then the breaker opens
    clock.advance(30)
    assert calls_to_first() == 1  # the probe: one call
    clock.advance(4.9)
    assert calls_to_first() == 0  # reopened...
    clock.advance(0.1)
    assert calls_to_first() == 1  # ...for 5 s: the next probe


def test_a_short_rate_limit_is_waited_out_when_no_other_model_can_answer(
    fake_openai: FakeOpenAI, serve: Serve
) -> None:
    """The real sleep, once: `Retry-After: 2` is waited out, then the same model answers. A
    request arriving meanwhile is not sent to the model: it cools down for those 2 s."""
    fake_openai.script(FIRST, Fail(status=429, retry_after="2"), Reply("After the wait."))
    client = serve(readme_app(fake_openai, fallbacks=[]))
    answered: list[tuple[int, list[tuple[str, Any]], float]] = []

    def first() -> None:
        began = time.monotonic()
        status, events = streamed(client)
        answered.append((status, events, time.monotonic() - began))

    waiting = threading.Thread(target=first)
    waiting.start()
    try:
        wait_until(lambda: len(fake_openai.calls) == 1)
        meanwhile = client.post("/reply/stream", json={"message": "Me too"}, timeout=10)
        assert_error(meanwhile, 503, "circuit_open", True)
        assert 1 <= int(meanwhile.headers["retry-after"]) <= 2
        assert len(fake_openai.calls) == 1
    finally:
        waiting.join(10)
    [(status, events, took)] = answered
    assert status == 200, events
    assert served_by(events) == FIRST
    assert "".join(data["text"] for name, data in events if name == "delta") == "After the wait."
    assert 2.0 <= took < 6.0
    assert [call.model for call in fake_openai.calls] == [FIRST, FIRST]
