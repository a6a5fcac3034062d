"""The walk's deadline (`guards/waits/_deadline.py`) seen from a route, in process (the app runs in
the test's event loop over `httpx.ASGITransport`, so the test can cancel it from outside):
an outside cancellation stays a cancellation, also when it lands as the deadline fires, and a
deadline still fires on time behind thousands of walks that ended before their mark."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import FakeBinding, Hang, Reply
from guards import AI, Attempt, Guards

from ..conftest import LogLines, asgi_client

MODEL = "@cf/test/model"


class Label(BaseModel):
    label: str


class Ask(BaseModel):
    text: str


class CancelOnRecord:
    """A ledger that cancels a task when it records an attempt (set `task` first)."""

    def __init__(self) -> None:
        self.task: asyncio.Task[object] | None = None
        self.attempts: list[Attempt] = []

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)
        if self.task is not None:
            self.task.cancel()


def make_app(fake: FakeBinding, timeout_s: float, ledger: CancelOnRecord | None = None) -> FastAPI:
    guards = Guards(fake, ledger=ledger)
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, timeout_s=timeout_s)
    async def label(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run({"prompt": body.text})

    return app


@pytest.fixture
def fake() -> FakeBinding:
    return FakeBinding(Reply({"label": "billing"}))


async def until_called(fake: FakeBinding, calls: int = 1) -> None:
    """Let the event loop run until the fake saw `calls` calls (bounded)."""
    for _ in range(10_000):
        if len(fake.calls) >= calls:
            return
        await asyncio.sleep(0)
    raise AssertionError("the fake was not called")


def test_a_walk_cancelled_from_outside_stays_cancelled(fake: FakeBinding) -> None:
    fake.script(MODEL, Hang())

    async def scenario() -> None:
        async with asgi_client(make_app(fake, timeout_s=5)) as client:
            request = asyncio.create_task(client.post("/label", json={"text": "hi"}))
            await until_called(fake)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(scenario())
    assert fake.calls[0].disconnected  # the call in flight was cancelled, not abandoned


@pytest.mark.parametrize("timeout_s", [0.05, 0.3], ids=["own-timer", "mark-queue"])
def test_an_outside_cancel_as_the_deadline_fires_is_not_turned_into_a_timeout(
    fake: FakeBinding, timeout_s: float, guards_log: LogLines
) -> None:
    """The deadline cancels the hung call; while the walk handles that (it records the attempt),
    the server cancels the request too. The walk must end cancelled, not answer a timeout
    (which would log its outcome: a cancelled walk logs none)."""
    fake.script(MODEL, Hang())
    ledger = CancelOnRecord()

    async def scenario() -> None:
        async with asgi_client(make_app(fake, timeout_s, ledger)) as client:
            request = asyncio.create_task(client.post("/label", json={"text": "hi"}))
            ledger.task = request
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(scenario())
    assert len(ledger.attempts) == 1
    assert fake.calls[0].disconnected
    assert guards_log.events("request") == []


def test_a_deadline_fires_on_time_behind_many_finished_walks(fake: FakeBinding) -> None:
    """Thousands of quick walks end before their mark; a hung one among them still gets its
    timer at the mark and answers at its deadline (0.3 s), while quick ones keep coming."""
    app = make_app(fake, timeout_s=0.3)

    async def quick(client: httpx.AsyncClient, count: int) -> list[int]:
        return [(await client.post("/label", json={"text": "hi"})).status_code for _ in range(count)]

    async def scenario() -> tuple[int, float, list[int]]:
        async with asgi_client(app) as client:
            before = await quick(client, 1_000)
            fake.script(MODEL, Hang())
            started = time.monotonic()

            async def timed() -> tuple[httpx.Response, float]:
                # When the hung request's answer came, not when the quick ones after it ended.
                response = await client.post("/label", json={"text": "hi"})
                return response, time.monotonic() - started

            hung = asyncio.create_task(timed())
            await until_called(fake, 1_001)
            during = await quick(client, 500)
            response, elapsed = await asyncio.wait_for(hung, 5)
            return response.status_code, elapsed, before + during

    status, elapsed, quick_statuses = asyncio.run(scenario())
    assert status == 503
    assert 0.3 <= elapsed < 2.0
    assert set(quick_statuses) == {200}
    assert fake.calls[1_000].disconnected


class TimerCountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts the timers scheduled on it (`call_later` goes through `call_at`)."""

    timers = 0

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        self.timers += 1
        return super().call_at(when, callback, *args, context=context)


def test_steady_quick_walks_share_a_coarse_timer(fake: FakeBinding) -> None:
    """Under steady load, every walk ending long before its mark (0.1 s in), the walks' shared
    timer ticks at most every 25 ms: the event loop schedules a few dozen timers in 0.6 s
    (and the metrics' flush one per second), not one every request or two."""
    app = make_app(fake, timeout_s=5)

    async def scenario() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, TimerCountingLoop)
        async with asgi_client(app) as client:
            assert (await client.post("/label", json={"text": "hi"})).status_code == 200
            requests, timers, end = 0, loop.timers, time.monotonic() + 0.6
            while time.monotonic() < end:
                assert (await client.post("/label", json={"text": "hi"})).status_code == 200
                requests += 1
                await asyncio.sleep(0)  # a turn of the loop between requests, as a server has
            return requests, loop.timers - timers

    with asyncio.Runner(loop_factory=TimerCountingLoop) as runner:
        requests, timers = runner.run(scenario())
    assert requests >= 100, "too few requests for a steady load: the test proves nothing"
    assert timers <= 0.6 / 0.025 + 6, f"{timers} timers for {requests} requests"
