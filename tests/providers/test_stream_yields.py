"""A provider stream of many tiny events does not hold the worker's event loop.

One network read (up to 64 KiB) can hold ten thousand tiny events (`data:` and a blank line is
7 bytes); parsing and decoding them all before the loop runs again took 50 to 130 ms of CPU
per read. Over real HTTP: a guarded streaming route under uvicorn, its adapter reading a fake
provider that sends a MiB of tiny events at once, while a task of the same worker's loop
records each stretch of the loop's thread CPU time between two of its turns (CPU time, so
other tenants of the machine do not count) and a concurrent request is served.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time

import pytest
from fastapi import FastAPI

from fixtures import FakeOpenAI, FakeWorkersAI, Raw
from guards import AI, EventStream, Guards
from guards.providers import OpenAICompatible, WorkersAI

from ..conftest import Serve

MIB = 1 << 20
MODEL = "@cf/test/model"
#: A long stretch of CPU without another task's turn. The adapter yields every few dozen
#: events (well under a millisecond of parsing; the longest stretch is usually 2 to 6 ms, the
#: route's own work); a reader that parsed each network read whole holds the loop 80 to 300 ms
#: at a time, 7 times over the MiB of empty events (measured with the slicing and the yield
#: taken out of the adapter).
STRETCH_BOUND_S = 0.02
#: How many long stretches a stream may show: a loaded machine can stretch one of those few
#: ms past the bound now and then (20.2 ms once on CI), never the stream's every read.
LONG_STRETCHES = 2

#: Events that say nothing (skipped), and events of one character of text, on each wire.
EVENTS = {
    ("workers-ai", "empty"): b"data:\n\n",
    ("workers-ai", "text"): b'data: {"response":"x"}\n\n',
    ("openai", "empty"): b"data:\n\n",
    ("openai", "text"): b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n',
}


def lag_app(binding: WorkersAI | OpenAICompatible) -> FastAPI:
    """A guarded streaming route, `/health`, and `/stretches`: the CPU stretches between two
    turns of a monitor task longer than a millisecond, longest first (the monitor starts with
    the first `/stretches`, each of which starts a new record)."""
    guards = Guards(binding)
    app = FastAPI()
    guards.install(app)
    stretches: list[float] = []
    started: list[asyncio.Task[None]] = []

    async def monitor() -> None:
        while True:
            before = time.thread_time()
            await asyncio.sleep(0.001)
            if (stretch := time.thread_time() - before) > 0.001:
                stretches.append(stretch)

    @app.get("/stretches")
    async def record() -> list[float]:
        if not started:
            started.append(asyncio.create_task(monitor()))
            await asyncio.sleep(0.01)
        values = sorted(stretches, reverse=True)
        stretches.clear()
        return values

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/stream")
    @guards.route(model=MODEL, timeout_s=30, stream_max_s=30, breaker=None)
    async def stream(ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": "Hi"})

    return app


@pytest.mark.parametrize("kind", ["empty", "text"])
@pytest.mark.parametrize("wire", ["workers-ai", "openai"])
def test_a_read_of_many_tiny_events_lets_the_loop_run(
    request: pytest.FixtureRequest, serve: Serve, wire: str, kind: str
) -> None:
    event = EVENTS[wire, kind]
    count = MIB // len(event)
    server: FakeWorkersAI | FakeOpenAI
    if wire == "workers-ai":
        server = request.getfixturevalue("fake_workers_ai")
        binding: WorkersAI | OpenAICompatible = WorkersAI(
            account_id=server.account_id, api_token=server.api_token, base_url=server.base_url
        )
    else:
        server = request.getfixturevalue("fake_openai")
        binding = OpenAICompatible(api_key=server.api_key, base_url=server.base_url)
    # One word first (an answer of no text is no answer), then the tiny events, then the end.
    first = EVENTS[wire, "text"]
    server.default = Raw(200, first + event * count + b"data: [DONE]\n\n", "text/event-stream")
    client = serve(lag_app(binding))
    client.get("/stretches")
    # The objects earlier tests left are frozen out of the collector's passes (a full pass over
    # a whole suite's heap is a stretch of its own, not the stream's).
    gc.collect()
    gc.freeze()
    try:
        with client.stream("POST", "/stream", timeout=30) as response:
            assert response.status_code == 200
            chunks = response.iter_bytes()
            body = next(chunks)
            # A concurrent request, while the worker reads the rest: answered.
            assert client.get("/health", timeout=5).json() == {"ok": True}
            body += b"".join(chunks)
        stretches = client.get("/stretches").json()
    finally:
        gc.unfreeze()
    names = [line[7:] for line in body.decode().splitlines() if line.startswith("event: ")]
    assert names[-1] == "done", names[-3:]
    if kind == "text":
        texts = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
        assert sum(len(t.get("text", "")) for t in texts if isinstance(t, dict)) == count + 1
    long = [round(s * 1000, 1) for s in stretches if s >= STRETCH_BOUND_S]
    assert len(long) <= LONG_STRETCHES, f"the loop was held {long} ms of CPU at a time"
