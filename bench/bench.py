"""`make bench`: the guard pipeline's own cost per request on the success path.

Both sides run in the same process, interleaved, and each figure is the median of several
rounds, so the ratio holds on a shared, noisy machine:

- bare: a handler that awaits the zero-latency fake binding directly;
- guarded: the same handler behind `Guards.route` (rate limit, daily cap, breaker, deadline,
  output validation, trace id), called as FastAPI calls it, minus HTTP and FastAPI itself.

The fixtures' `FakeBinding` renders and parses Workers AI's wire format on every call; the same
pair is also measured with a binding that returns a ready result (`const`), which isolates the
pipeline from the fake's own work.

Each figure is printed on its own line as `name = value unit`.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from fixtures import FakeBinding, Reply
from fixtures.redis_server import RedisServer
from guards import AI, AIResult, Budget, Guards, header_key
from guards.stores import MemoryStore, RedisStore, SQLiteStore, Store

MODEL = "@cf/bench/model"
INPUTS = {"messages": [{"role": "user", "content": "Label this."}]}
ROUNDS = 9
PER_ROUND = 4_000
USERS = 1_000


class Label(BaseModel):
    label: str
    confidence: float


def scope_for(user: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/label",
        "headers": [(b"x-user-id", user.encode())],
        "client": ("127.0.0.1", 1234),
    }


def guarded_endpoint(
    fake: FakeBinding | ConstantBinding, store: Store | None = None
) -> tuple[Callable[..., Awaitable[Any]], str, str]:
    guards = Guards(fake, store=store)

    @guards.route(model=MODEL, budget=Budget(per_minute=10**9, per_day=10**9, key=header_key("x-user-id")))
    async def label(ai: AI[Label]) -> Label:
        return await ai.run(INPUTS)

    # FastAPI passes the request and a response to the endpoint; find their parameter names.
    params = inspect.signature(label).parameters.values()
    request_param = next(p.name for p in params if p.annotation is Request)
    response_param = next(p.name for p in params if p.annotation is Response)
    return label, request_param, response_param


class ConstantBinding:
    """Answers instantly with one ready result: no wire format, no recording."""

    def __init__(self) -> None:
        self.result = AIResult({"label": "billing", "confidence": 0.9}, model=MODEL)

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        return self.result

    async def aclose(self) -> None:
        return None

    def reset(self) -> None:
        return None


async def measure(fake: FakeBinding | ConstantBinding) -> dict[str, float]:
    endpoint, request_param, response_param = guarded_endpoint(fake)
    requests = [Request(scope_for(f"user-{i}")) for i in range(USERS)]
    response = Response()  # FastAPI makes one per request; reused here, it is not guards' cost

    # Each request passes through the event loop once (`sleep(0)`), as a served one does; that
    # also lets the loop drop the deadline timers the guarded side cancels.
    async def bare() -> None:
        for _ in range(PER_ROUND):
            result = await fake.run(MODEL, INPUTS)
            Label.model_validate(result.response)  # what any handler does with the answer
            await asyncio.sleep(0)

    async def guarded() -> None:
        for i in range(PER_ROUND):
            response.raw_headers.clear()
            await endpoint(**{request_param: requests[i % USERS], response_param: response})
            await asyncio.sleep(0)

    async def timed(run: Callable[[], Awaitable[None]]) -> float:
        fake.reset()  # the fake's call record is not what is measured
        gc.collect()
        # CPU time of this process: time the machine spends on other tenants is not counted.
        start = time.process_time()
        await run()
        return (time.process_time() - start) / PER_ROUND * 1e6

    logger = logging.getLogger("guards")
    handler = logging.NullHandler()
    samples: dict[str, list[float]] = {"bare": [], "guarded": [], "logged": []}
    await bare(), await guarded()  # warm up
    for _ in range(ROUNDS):
        # Interleaved, so a slow moment on the machine hits both sides alike.
        samples["bare"].append(await timed(bare))
        logger.setLevel(logging.WARNING)
        samples["guarded"].append(await timed(guarded))
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        samples["logged"].append(await timed(guarded))
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    return {name: statistics.median(values) for name, values in samples.items()}


async def store_checks(store: Store, count: int = 2_000) -> float:
    """Median wall time of one budget check (`charge_budget`), in microseconds."""
    samples = []
    for i in range(count):
        start = time.perf_counter()
        await store.charge_budget(f"bench:user-{i % 100}", per_minute=10**9, per_day=10**9)
        samples.append(time.perf_counter() - start)
    await store.aclose()
    return statistics.median(samples) * 1e6


async def redis_round_trips(url: str, requests: int = 500) -> float:
    """Round trips to Redis per guarded request (success path, closed breaker)."""
    import redis.asyncio as redis

    store = RedisStore(url)
    label, request_param, response_param = guarded_endpoint(ConstantBinding(), store)
    await label(**{request_param: Request(scope_for("warm-up")), response_param: Response()})
    admin = redis.Redis.from_url(url)
    before = await _commands(admin)
    for i in range(requests):
        await label(**{request_param: Request(scope_for(f"user-{i}")), response_param: Response()})
    after = await _commands(admin)
    await admin.aclose()
    await store.aclose()
    return (after - before) / requests


async def _commands(admin: Any) -> int:
    """Script calls so far: each store operation is one EVALSHA, one round trip (the commands a
    script runs inside Redis are counted apart, under their own names)."""
    stats = await admin.info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))


def main() -> None:
    figures = asyncio.run(measure(FakeBinding(Reply({"label": "billing", "confidence": 0.9}))))
    bare, guarded, logged = figures["bare"], figures["guarded"], figures["logged"]
    print(f"bare_call_us = {bare:.2f} us")
    print(f"guarded_call_us = {guarded:.2f} us")
    print(f"guard_overhead_us = {guarded - bare:.2f} us")
    print(f"guard_overhead_ratio = {guarded / bare:.2f} x")
    print(f"guard_overhead_logged_us = {logged - bare:.2f} us")
    const = asyncio.run(measure(ConstantBinding()))
    print(f"const_bare_call_us = {const['bare']:.2f} us")
    print(f"const_guard_overhead_us = {const['guarded'] - const['bare']:.2f} us")

    # Stores: one budget check each, wall time (SQLite and Redis do I/O).
    print(f"store_memory_check_us = {asyncio.run(store_checks(MemoryStore())):.1f} us")
    with tempfile.TemporaryDirectory() as folder:
        sqlite = SQLiteStore(f"{folder}/bench.db")
        print(f"store_sqlite_check_us = {asyncio.run(store_checks(sqlite)):.1f} us")
    with RedisServer() as server:
        print(f"store_redis_check_us = {asyncio.run(store_checks(RedisStore(server.url))):.1f} us")
        print(f"redis_round_trips_per_request = {asyncio.run(redis_round_trips(server.url)):.2f} round trips")


if __name__ == "__main__":
    main()
