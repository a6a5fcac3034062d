"""Admission to a provider's connection pool (`guards.providers.http_client`).

At most `max_connections` calls are in flight; the others wait, newest first, until a
connection frees or their deadline passes. A request that spent its deadline waiting is a
timeout (`503 model_temporarily_unavailable` with `Retry-After`), but not the provider's fault:
no breaker verdict, and no provider attempt when it never got a connection. Over real HTTP
against the fake Workers AI server, with a pool of one connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fixtures import FakeWorkersAI, Hang, Reply
from guards import AI, Breaker, EventStream, Guards, Hedge
from guards.providers import WorkersAI, http_client, http_library

from ..conftest import LogLines, Serve, assert_error, no_sleep

MODEL = "@cf/test/model"
INPUTS = {"prompt": "Say hello."}
#: The deadlines of the two routes: a request on the short one ends while one on the long one
#: still runs, whichever holds the connection.
SHORT_S, LONG_S = 0.3, 1.0


def small_pool_app(fake: FakeWorkersAI) -> FastAPI:
    """Routes on one binding whose pool has a single connection, sharing the model's breaker,
    which opens after two failures."""
    client = http_client(max_connections=1)
    binding = WorkersAI(
        account_id=fake.account_id, api_token=fake.api_token, base_url=fake.base_url, client=client
    )
    guards = Guards(binding, sleep=no_sleep)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with guards:
            yield
        await client.aclose()  # shared, so not the binding's to close

    app = FastAPI(lifespan=lifespan)
    guards.install(app)
    breaker = Breaker(failure_threshold=2, reset_timeout_s=60)

    @app.post("/short")
    @guards.route(model=MODEL, timeout_s=SHORT_S, breaker=breaker)
    async def short(ai: AI[str]) -> str:
        return await ai.run(INPUTS)

    @app.post("/short/stream")
    @guards.route(model=MODEL, timeout_s=SHORT_S, breaker=breaker, name="short_stream")
    async def short_stream(ai: AI[str]) -> EventStream:
        return await ai.stream(INPUTS)

    @app.post("/long")
    @guards.route(model=MODEL, timeout_s=LONG_S, breaker=breaker)
    async def long(ai: AI[str]) -> str:
        return await ai.run(INPUTS)

    @app.post("/long/hedged")  # a hedge too late to start: its race runs the call all the same
    @guards.route(model=MODEL, timeout_s=LONG_S, breaker=breaker, name="long_hedged", hedge=Hedge(after_s=5))
    async def long_hedged(ai: AI[str]) -> str:
        return await ai.run(INPUTS)

    return app


async def wait_for_calls(fake: FakeWorkersAI, count: int) -> None:
    assert await asyncio.to_thread(fake.wait_for, lambda calls: len(calls) >= count, 5)


def request_line(log: LogLines, trace_id: str) -> dict[str, Any]:
    return next(line for line in log.events("request") if line["trace_id"] == trace_id)


@pytest.mark.parametrize("path", ["/short", "/short/stream"])
def test_a_request_that_never_got_a_connection_times_out_without_blame(
    path: str, fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    fake = fake_workers_ai
    fake.default = Hang()
    base = str(serve(small_pool_app(fake)).base_url)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            holder = asyncio.ensure_future(client.post("/long"))  # holds the only connection
            await wait_for_calls(fake, 1)
            queued = await client.post(path)  # waits for it, and its deadline passes first
            return queued, await holder

    queued, holder = asyncio.run(scenario())
    assert_error(queued, 503, "model_temporarily_unavailable", True)
    assert int(queued.headers["retry-after"]) >= 1
    assert_error(holder, 503, "model_temporarily_unavailable", True)
    assert len(fake.calls) == 1  # the queued request never reached the provider
    line = request_line(guards_log, queued.headers["x-trace-id"])
    assert (line["reason"], line["attempts"]) == ("timeout", 0)
    assert not [a for a in guards_log.events("attempt") if a["trace_id"] == queued.headers["x-trace-id"]]
    # One failure (the holder's), not two: the breaker (threshold 2) is closed.
    fake.default = Reply("Hello!")
    assert httpx.post(f"{base}/short", timeout=10).json() == "Hello!"


def test_a_request_that_waited_then_ran_out_of_deadline_is_no_verdict_on_the_model(
    fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    fake = fake_workers_ai
    fake.default = Hang()
    base = str(serve(small_pool_app(fake)).base_url)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            holder = asyncio.ensure_future(client.post("/short"))  # holds the connection for 0.3 s
            await wait_for_calls(fake, 1)
            late = asyncio.ensure_future(client.post("/long"))  # gets it then, with 0.7 s left
            return await holder, await late

    holder, late = asyncio.run(scenario())
    assert_error(holder, 503, "model_temporarily_unavailable", True)
    assert_error(late, 503, "model_temporarily_unavailable", True)
    assert len(fake.calls) == 2
    assert fake.wait_for(lambda calls: all(call.disconnected for call in calls), 5)
    assert request_line(guards_log, late.headers["x-trace-id"])["attempts"] == 1
    fake.default = Reply("Hello!")
    assert httpx.post(f"{base}/short", timeout=10).json() == "Hello!"


@pytest.mark.parametrize("path", ["/long", "/long/hedged"])
def test_a_request_that_waited_then_ran_out_of_deadline_reading_its_answer_is_no_verdict(
    path: str, fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    """The answer began (its head came) but its body did not come before the deadline, which
    the request had spent most of in the queue: still no verdict on the model."""
    fake = fake_workers_ai
    fake.script(MODEL, Hang(), Reply("Hello!", body_delay_s=5))
    base = str(serve(small_pool_app(fake)).base_url)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            holder = asyncio.ensure_future(client.post("/short"))  # holds the connection for 0.3 s
            await wait_for_calls(fake, 1)
            late = asyncio.ensure_future(client.post(path))  # gets it then: head, no body
            return await holder, await late

    holder, late = asyncio.run(scenario())
    assert_error(holder, 503, "model_temporarily_unavailable", True)
    assert_error(late, 503, "model_temporarily_unavailable", True)
    assert len(fake.calls) == 2
    assert request_line(guards_log, late.headers["x-trace-id"])["attempts"] == 1
    # One failure (the holder's), not two: the breaker (threshold 2) is closed.
    fake.default = Reply("Hello!")
    assert httpx.post(f"{base}/short", timeout=10).json() == "Hello!"


def test_waiters_are_admitted_newest_first_and_a_cancelled_one_holds_nothing(
    fake_workers_ai: FakeWorkersAI,
) -> None:
    """Newest first: under overload the newest waiter has the most deadline left, so serving it
    keeps the pool doing useful work (the oldest would often start with its deadline spent)."""
    fake = fake_workers_ai
    url = f"{fake.base_url}/accounts/{fake.account_id}/ai/run/"
    auth = {"authorization": f"Bearer {fake.api_token}"}

    async def scenario() -> None:
        async with http_client(max_connections=1) as client:
            fake.script("holder", Reply("first", delay_s=0.2))
            holder = asyncio.ensure_future(client.post(url + "holder", headers=auth, json=INPUTS))
            await wait_for_calls(fake, 1)
            waiters = {}
            for name in ("oldest", "gone", "middle", "newest"):
                waiters[name] = asyncio.ensure_future(client.post(url + name, headers=auth, json=INPUTS))
                await asyncio.sleep(0)  # let it queue: sending reaches the wait without pausing
            waiters.pop("gone").cancel()
            assert (await holder).status_code == 200
            for response in await asyncio.gather(*waiters.values()):
                assert response.status_code == 200
            # Nothing leaked: the one slot is free again, and a full pool waits at most its
            # pool timeout (httpx's PoolTimeout).
            fake.script("hang", Hang())
            hung = asyncio.ensure_future(client.post(url + "hang", headers=auth, json=INPUTS))
            await wait_for_calls(fake, 5)
            with pytest.raises(http_library.PoolTimeout):
                await client.post(
                    url + "late", headers=auth, json=INPUTS, timeout=http_library.Timeout(5, pool=0.05)
                )
            hung.cancel()

    asyncio.run(scenario())
    assert [call.model for call in fake.calls] == ["holder", "newest", "middle", "oldest", "hang"]


def test_http_client_refuses_an_empty_pool() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        http_client(max_connections=0)
