"""`make bench`: the guard pipeline's own cost per request on the success path.

Both sides run in the same process, interleaved, and each figure is the median of several
rounds, so the ratio holds on a shared, noisy machine:

- bare: a handler that awaits the zero-latency fake binding directly;
- guarded: the same handler behind `Guards.route` (rate limit, daily cap, breaker, deadline,
  output validation, trace id), called as FastAPI calls it, minus HTTP and FastAPI itself.

Each figure is printed on its own line as `name = value unit`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from fixtures import FakeBinding, Reply
from guards import AI, Budget, Guards, header_key

MODEL = "@cf/bench/model"
INPUTS = {"messages": [{"role": "user", "content": "Label this."}]}
ROUNDS = 7
PER_ROUND = 5_000
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


def guarded_endpoint(fake: FakeBinding) -> tuple[Callable[..., Awaitable[Any]], str, str]:
    guards = Guards(fake)

    @guards.route(model=MODEL, budget=Budget(per_minute=10**9, per_day=10**9, key=header_key("x-user-id")))
    async def label(ai: AI[Label]) -> Label:
        return await ai.run(INPUTS)

    # FastAPI passes the request and a response to the endpoint; find their parameter names.
    params = inspect.signature(label).parameters.values()
    request_param = next(p.name for p in params if p.annotation is Request)
    response_param = next(p.name for p in params if p.annotation is Response)
    return label, request_param, response_param


async def measure() -> dict[str, float]:
    fake = FakeBinding(Reply({"label": "billing", "confidence": 0.9}))
    endpoint, request_param, response_param = guarded_endpoint(fake)
    requests = [Request(scope_for(f"user-{i}")) for i in range(USERS)]

    async def bare() -> None:
        for i in range(PER_ROUND):
            result = await fake.run(MODEL, INPUTS)
            Label.model_validate(result.response)  # what any handler does with the answer
            fake.reset() if i % 1000 == 999 else None

    async def guarded() -> None:
        for i in range(PER_ROUND):
            await endpoint(**{request_param: requests[i % USERS], response_param: Response()})
            fake.reset() if i % 1000 == 999 else None

    async def timed(run: Callable[[], Awaitable[None]]) -> float:
        start = time.perf_counter()
        await run()
        return (time.perf_counter() - start) / PER_ROUND * 1e6

    logger = logging.getLogger("guards")
    handler = logging.NullHandler()
    samples: dict[str, list[float]] = {"bare": [], "guarded": [], "guarded_logged": []}
    await bare(), await guarded()  # warm up
    for _ in range(ROUNDS):
        samples["bare"].append(await timed(bare))
        logger.setLevel(logging.WARNING)
        samples["guarded"].append(await timed(guarded))
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        samples["guarded_logged"].append(await timed(guarded))
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    figures = asyncio.run(measure())
    bare, guarded, logged = figures["bare"], figures["guarded"], figures["guarded_logged"]
    print(f"bare_call_us = {bare:.2f} us")
    print(f"guarded_call_us = {guarded:.2f} us")
    print(f"guard_overhead_us = {guarded - bare:.2f} us")
    print(f"guard_overhead_ratio = {guarded / bare:.2f} x")
    print(f"guard_overhead_logged_us = {logged - bare:.2f} us")


if __name__ == "__main__":
    main()
