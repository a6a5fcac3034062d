"""What a request's calls cost, read by the handler from its `ai` handle after `run`, `step`
or a stream's end: the model that served, the calls made, the tokens they reported
(`ai.usage`, summed over every call) and their cost by the route's prices (`ai.cost`). Over
real HTTP: the app served by uvicorn, its models the fake Workers AI server."""

from __future__ import annotations

import queue
from typing import Any

import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.background import BackgroundTask

from fixtures import Fail, FakeWorkersAI, Reply, Stream, Text
from guards import AI, Breaker, EventStream, Guards, Price, Retry
from guards.providers import WorkersAI

from ..conftest import AppClient, no_sleep

MODEL = "@cf/test/first"
BACKUP = "@cf/test/second"
USAGE = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
#: Cost units per token (input, output), and per call.
PRICE = Price(input_token=0.01, output_token=0.1, call=1.0)


class Ask(BaseModel):
    text: str


def build(
    server: FakeWorkersAI, prices: dict[str, Price] | None, streamed: queue.SimpleQueue[Any] | None = None
) -> FastAPI:
    """`POST /ask` runs, `/steps` takes two steps, `/stream` streams and puts what it spent in
    `streamed` once the stream ended; each answers what its handle tells."""
    guards = Guards(
        WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url),
        prices=prices,
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)

    def spent(ai: AI[Any]) -> dict[str, Any]:
        usage = ai.usage
        return {
            "model": ai.model,
            "attempts": ai.attempts,
            "usage": None
            if usage is None
            else [usage.prompt_tokens, usage.completion_tokens, usage.total_tokens],
            "cost": ai.cost,
        }

    route = guards.route(
        model=MODEL, fallbacks=[BACKUP], breaker=Breaker(failure_threshold=1000), retry=Retry(attempts=1)
    )

    @app.post("/ask")
    @route
    async def ask(body: Ask, ai: AI[str]) -> dict[str, Any]:
        before = spent(ai)
        await ai.run({"prompt": body.text})
        return {"before": before, "after": spent(ai)}

    @app.post("/steps")
    @route
    async def steps(body: Ask, ai: AI[str]) -> dict[str, Any]:
        await ai.step("one", {"prompt": body.text})
        await ai.step("two", {"prompt": body.text})
        return spent(ai)

    @app.post("/stream")
    @route
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        events = await ai.stream({"prompt": body.text})
        assert streamed is not None
        events.background = BackgroundTask(lambda: streamed.put(spent(ai)))  # once it ended
        return events

    return app


@pytest.mark.parametrize("priced", [True, False], ids=["priced", "unpriced"])
def test_run_tells_the_handler_what_its_calls_used_and_cost(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, priced: bool
) -> None:
    """A failed first model (no usage reported: it costs nothing without a spend cap) and the
    second's answer: two calls, the tokens the answer reported, its cost by its price (None
    when the app prices no model)."""
    prices = {MODEL: PRICE, BACKUP: PRICE} if priced else None
    client = app_client(build(fake_workers_ai, prices), socket=True)
    fake_workers_ai.script(MODEL, Fail(code=3040, status=503))
    fake_workers_ai.script(BACKUP, Reply("hello", usage=USAGE))
    answer = client.post("/ask", json={"text": "hi"}).json()
    assert answer["before"] == {
        "model": None,
        "attempts": 0,
        "usage": None,
        "cost": None if not priced else 0.0,
    }
    expected_cost = 1.0 + 100 * 0.01 + 20 * 0.1  # the answer's call and tokens
    assert answer["after"] == {
        "model": BACKUP,
        "attempts": 2,
        "usage": [100, 20, 120],
        "cost": pytest.approx(expected_cost) if priced else None,
    }


def test_steps_add_up(fake_workers_ai: FakeWorkersAI, app_client: AppClient) -> None:
    client = app_client(build(fake_workers_ai, {MODEL: PRICE, BACKUP: PRICE}), socket=True)
    fake_workers_ai.script(MODEL, Reply("one", usage=USAGE), Reply("two", usage=USAGE))
    answer = client.post("/steps", json={"text": "hi"}).json()
    assert answer == {
        "model": MODEL,
        "attempts": 2,
        "usage": [200, 40, 240],
        "cost": pytest.approx(2 * (1.0 + 100 * 0.01 + 20 * 0.1)),
    }


def test_a_stream_is_counted_once_it_ended(fake_workers_ai: FakeWorkersAI, app_client: AppClient) -> None:
    """The handler returns before its stream is relayed: a `BackgroundTask` on the stream reads
    the `ai` handle once the stream ended, its usage counted."""
    streamed: queue.SimpleQueue[Any] = queue.SimpleQueue()
    client = app_client(build(fake_workers_ai, {MODEL: PRICE, BACKUP: PRICE}, streamed), socket=True)
    fake_workers_ai.script(MODEL, Stream(parts=(Text("Hel"), Text("lo")), usage=USAGE))
    with client.stream("POST", "/stream", json={"text": "hi"}) as response:
        body = b"".join(response.iter_bytes())
    assert b"event: done" in body
    assert streamed.get(timeout=5) == {
        "model": MODEL,
        "attempts": 1,
        "usage": [100, 20, 120],
        "cost": pytest.approx(1.0 + 100 * 0.01 + 20 * 0.1),
    }
