"""`make bench`: the guard pipeline's own cost per request on the success path.

Both sides run in the same process, interleaved, and each figure is the median of several
rounds, so the ratio holds on a shared, noisy machine:

- bare: a handler that awaits the zero-latency fake binding directly;
- guarded: the same handler behind `Guards.route` (rate limit, daily cap, breaker, cooldown
  read, deadline, output validation, metrics, trace id, attribution headers), called as
  FastAPI calls it, minus HTTP and FastAPI itself.

The fixtures' `FakeBinding` renders and parses Workers AI's wire format on every call; the same
pair is also measured with a binding that returns a ready result (`const`), which isolates the
pipeline from the fake's own work.

Tracing (`tracing_*`): the same guarded route with tracing off (the default), with the
OpenTelemetry API's no-op tracer (tracing on, no SDK set up) and with the SDK, interleaved.

Cold start (`import_*`, `first_answer_*`): what `from guards import AI, Guards` costs after
`import fastapi`, and the example app's time from its process's start to its first answer,
next to a bare FastAPI app's (`bench/bare_app.py`), each in fresh processes (see
`import_costs` and `first_answer_times`).

Each figure is printed on its own line as `name = value unit`. The same pipeline's cost in
CPU instructions, which the machine's noise does not move: `make bench-instructions`.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import inspect
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from fixtures import FakeBinding, FakeWorkersAI, Reply, Stream, Text
from fixtures.redis_server import RedisServer, free_port
from fixtures.stores import PiecewiseStore
from guards import (
    AI,
    AIResult,
    Breaker,
    Budget,
    EventStream,
    Guards,
    Outcome,
    ProviderError,
    Retry,
    StreamEnd,
    StreamEvent,
    TextDelta,
    estimate_effort,
    header_key,
)
from guards.providers import SSEParser, WorkersAI
from guards.stores import Charge, MemoryStore, RedisStore, SQLiteStore, Step, Store
from guards.testing.redis_cluster import RedisCluster

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
    fake: FakeBinding | ConstantBinding | ReadyAnswer, store: Store | None = None, tracing: Any = False
) -> tuple[Callable[..., Awaitable[Any]], str, str]:
    guards = Guards(fake, store=store, tracing=tracing)

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
    # also lets the loop run the deadlines' shared timer (see guards/waits/_deadline.py).
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


class DroppingExporter:
    """An OpenTelemetry span exporter that drops every span (the SDK's own work is measured,
    not an exporter's)."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


async def tracing_costs() -> dict[str, float]:
    """CPU time per request of the guarded route (ready-result binding), interleaved: tracing
    off (the default), on with the OpenTelemetry API alone (no SDK set up: its no-op tracer),
    and on with the SDK (a real `TracerProvider`, spans handed to a processor that drops them)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(DroppingExporter()))  # type: ignore[arg-type]
    binding = ConstantBinding()
    sides = {
        "off": guarded_endpoint(binding),
        "noop": guarded_endpoint(binding, tracing=True),
        "sdk": guarded_endpoint(binding, tracing=provider),
    }
    requests = [Request(scope_for(f"user-{i}")) for i in range(USERS)]
    response = Response()

    async def timed(side: tuple[Callable[..., Awaitable[Any]], str, str]) -> float:
        endpoint, request_param, response_param = side
        gc.collect()
        start = time.process_time()
        for i in range(PER_ROUND):
            response.raw_headers.clear()
            await endpoint(**{request_param: requests[i % USERS], response_param: response})
            await asyncio.sleep(0)
        return (time.process_time() - start) / PER_ROUND * 1e6

    logging.getLogger("guards").setLevel(logging.WARNING)
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for side in sides.values():
        await timed(side)  # warm up
    for _ in range(ROUNDS):
        for name, side in sides.items():
            samples[name].append(await timed(side))
    logging.getLogger("guards").setLevel(logging.NOTSET)
    provider.shutdown()
    return {name: statistics.median(values) for name, values in samples.items()}


async def store_checks(store: PiecewiseStore, count: int = 2_000) -> float:
    """Median wall time of one budget check (`charge_budget`), in microseconds."""
    samples = []
    for i in range(count):
        start = time.perf_counter()
        await store.charge_budget(f"bench:user-{i % 100}", per_minute=10**9, per_day=10**9)
        samples.append(time.perf_counter() - start)
    await store.aclose()
    return statistics.median(samples) * 1e6


async def store_cooldown_reads(store: PiecewiseStore, count: int = 2_000) -> float:
    """Median wall time of one fallback chain's cooldown read (`cooldowns` of 3 keys, one of
    them cooling down), in microseconds."""
    chain = ["bench:openai:gpt-4o-mini", "bench:anthropic:claude-haiku", "bench:workers-ai:llama"]
    await store.start_cooldown(chain[1], 3_600)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await store.cooldowns(chain)
        samples.append(time.perf_counter() - start)
    await store.aclose()
    return statistics.median(samples) * 1e6


class CountingStore:
    """A store that counts the operations the guards make on it: every awaited method call but
    `now` and `aclose` is one store operation (one transaction on SQLite, one round trip on
    Redis when nothing else is in flight)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.operations = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        if name in ("now", "aclose") or not inspect.iscoroutinefunction(method):
            return method

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.operations += 1
            return await method(*args, **kwargs)

        return counted


class FailingBinding:
    """Every call fails with the provider error given (no retry: the route's `Retry(attempts=1)`)."""

    def __init__(self, status: int) -> None:
        self.status = status

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        raise ProviderError("bench", status=self.status)

    async def aclose(self) -> None:
        return None


async def store_operations(make: Callable[[], Store], binding: Any, requests: int = 200) -> float:
    """Store operations per request of a route with a daily cap, a rate limit and a breaker
    (which never opens here), counted by wrapping the store. A failing binding gets a route of
    its own per request, so a cooldown started by one request does not skip the next."""
    total = 0
    store = make()
    for i in range(requests):
        counting = CountingStore(store)
        guards = Guards(binding, store=counting)  # type: ignore[arg-type]

        @guards.route(
            model=f"{MODEL}-{i}",
            fallback="fallback",
            retry=Retry(attempts=1),
            breaker=Breaker(failure_threshold=10**9),
            budget=Budget(per_minute=10**9, per_day=10**9, key=header_key("x-user-id")),
        )
        async def label(ai: AI[str]) -> str:
            return await ai.run(INPUTS)

        params = inspect.signature(label).parameters.values()
        request_param = next(p.name for p in params if p.annotation is Request)
        response_param = next(p.name for p in params if p.annotation is Response)
        await label(**{request_param: Request(scope_for(f"user-{i}")), response_param: Response()})
        total += counting.operations
    await store.aclose()
    return total / requests


async def redis_round_trips(url: str, binding: Any, requests: int = 200) -> float:
    """Round trips to Redis per guarded request (one model, breaker and budget), counted by the
    server: each is one EVALSHA (`INFO commandstats`; the commands a script runs inside Redis
    are counted apart, under their own names)."""
    import redis.asyncio as redis

    admin = redis.Redis.from_url(url)
    before = await _commands(admin)
    per_request = await store_operations(lambda: RedisStore(url), binding, requests)
    after = await _commands(admin)
    await admin.aclose()
    if int(after - before) != round(per_request * requests):
        raise AssertionError(f"{after - before} EVALSHA for {per_request * requests:.0f} store operations")
    return (after - before) / requests


async def _commands(admin: Any) -> int:
    stats = await admin.info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))


async def window_check(store: PiecewiseStore, in_window: int, count: int = 300) -> float:
    """Median wall time of one per-minute check on a key that already holds `in_window`
    admissions in its 60 s window (filled concurrently, so SQLite batches them)."""
    key = f"bench:window-{in_window}"
    for start in range(0, in_window, 100):
        await asyncio.gather(
            *(
                store.charge_budget(key, per_minute=10**9, per_day=None)
                for _ in range(min(100, in_window - start))
            )
        )
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        await store.charge_budget(key, per_minute=10**9, per_day=None)
        samples.append(time.perf_counter() - began)
    await store.aclose()
    return statistics.median(samples) * 1e6


async def _reads(admins: list[Any]) -> int:
    """Reads the servers made from their clients' connections (`INFO stats`), all together: a
    client's write to a node is one read there, so a lone client's round trips to its nodes."""
    total = 0
    for admin in admins:
        total += int((await admin.info("stats"))["total_reads_processed"])
    return total


async def node_round_trips(
    url: str, nodes: list[tuple[str, int]], binding: Any, requests: int = 200
) -> tuple[float, float]:
    """Per guarded request (one model, breaker and budget, as `store_operations`): the scripts
    the store ran (EVALSHA on every node) and its round trips, one per node it wrote to in each
    sequential exchange (the servers' reads, less the counters' own)."""
    import redis.asyncio as redis

    admins = [redis.Redis(host=host, port=port) for host, port in nodes]
    scripts_before, reads_before = sum([await _commands(a) for a in admins]), await _reads(admins)
    await store_operations(lambda: RedisStore(url), binding, requests)
    scripts_after, reads_after = sum([await _commands(a) for a in admins]), await _reads(admins)
    for admin in admins:
        await admin.aclose()
    reads = reads_after - reads_before - 2 * len(admins)  # each node's two INFO before the last
    return (scripts_after - scripts_before) / requests, reads / requests


async def step_cost(store: RedisStore, count: int = 2_000) -> float:
    """Median wall time of a request's store step (one model, its breaker, a daily budget: the
    walk's first step, which a route keeps per caller: 100 callers here), in microseconds."""
    legs = [(f"guards:cooldown:{MODEL}", f"guards:breaker:{MODEL}")]
    steps = [
        Step(None, legs, Breaker(), Charge(f"bench:user-{i}", per_minute=10**9, per_day=10**9))
        for i in range(100)
    ]
    samples = []
    for i in range(count):
        step = steps[i % 100]
        start = time.perf_counter()
        await store.step(step)
        samples.append(time.perf_counter() - start)
    await store.aclose()
    return statistics.median(samples) * 1e6


def print_cluster_figures() -> None:
    """Redis Cluster beside one Redis server: a request's step (wall time), and the scripts and
    round trips of a guarded request (success and failure)."""
    success, failure = ConstantBinding(), FailingBinding(500)
    with RedisServer() as server, RedisCluster() as cluster:
        one = [("127.0.0.1", server.port)]
        single = asyncio.run(step_cost(RedisStore(server.url, timeout_s=10)))
        clustered = asyncio.run(step_cost(RedisStore(cluster.url, timeout_s=10)))
        print(f"store_redis_step_us = {single:.1f} us")
        print(f"store_redis_cluster_step_us = {clustered:.1f} us")
        print(f"store_redis_cluster_step_vs_redis = {clustered / single:.2f} x")
        for name, binding in (("", success), ("failed_", failure)):
            scripts, trips = asyncio.run(node_round_trips(server.url, one, binding))
            print(f"redis_scripts_per_{name}request = {scripts:.2f} scripts")
            print(f"redis_node_round_trips_per_{name}request = {trips:.2f} round trips")
            scripts, trips = asyncio.run(node_round_trips(cluster.url, cluster.primaries, binding))
            print(f"redis_cluster_scripts_per_{name}request = {scripts:.2f} scripts")
            print(f"redis_cluster_node_round_trips_per_{name}request = {trips:.2f} round trips")


def print_store_figures() -> None:
    """Store operations per request (success and failure), and what a check costs as its key's
    window fills up (300 vs 30,000 admissions in the last 60 s)."""
    success, failure, limited = ConstantBinding(), FailingBinding(500), FailingBinding(429)
    memory_ops = {
        name: asyncio.run(store_operations(MemoryStore, b))
        for name, b in (("success", success), ("failure", failure), ("rate_limited", limited))
    }
    print(f"store_ops_per_success_request = {memory_ops['success']:.2f} ops")
    print(f"store_ops_per_failed_request = {memory_ops['failure']:.2f} ops")
    print(f"store_ops_per_rate_limited_request = {memory_ops['rate_limited']:.2f} ops")
    with RedisServer() as server:
        print(
            f"redis_round_trips_per_request = {asyncio.run(redis_round_trips(server.url, success)):.2f} round trips"
        )
        print(
            f"redis_round_trips_per_failed_request = {asyncio.run(redis_round_trips(server.url, failure)):.2f} round trips"
        )
        print(
            f"redis_round_trips_per_rate_limited_request = {asyncio.run(redis_round_trips(server.url, limited)):.2f} round trips"
        )
        small = asyncio.run(window_check(RedisStore(server.url, timeout_s=10), 300))
        large = asyncio.run(window_check(RedisStore(server.url, timeout_s=10), 30_000))
        print(f"store_redis_check_300_us = {small:.1f} us")
        print(f"store_redis_check_30k_us = {large:.1f} us")
        print(f"store_redis_check_30k_vs_300 = {large / small:.2f} x")
    with tempfile.TemporaryDirectory() as folder:
        small = asyncio.run(window_check(SQLiteStore(f"{folder}/window.db", timeout_s=10), 300))
        large = asyncio.run(window_check(SQLiteStore(f"{folder}/window.db", timeout_s=10), 30_000))
        print(f"store_sqlite_check_300_us = {small:.1f} us")
        print(f"store_sqlite_check_30k_us = {large:.1f} us")
        print(f"store_sqlite_check_30k_vs_300 = {large / small:.2f} x")


async def chain_skip() -> dict[str, float]:
    """A three-model chain whose first two models are skipped (the first cooling down, the
    second behind an open breaker) against a one-model route; both answer on the first call.
    CPU time per request, medians of interleaved rounds."""
    binding = ConstantBinding()
    store = MemoryStore()
    guards = Guards(binding, store=store, providers={"other": binding})
    breaker = Breaker(failure_threshold=1, reset_timeout_s=10**6)
    chain = ("@cf/bench/cooling", "other:@cf/bench/open", MODEL)

    @guards.route(model=MODEL, breaker=breaker)
    async def single(ai: AI[Label]) -> Label:
        return await ai.run(INPUTS)

    @guards.route(model=chain[0], fallbacks=chain[1:], breaker=breaker)
    async def walked(ai: AI[Label]) -> Label:
        return await ai.run(INPUTS)

    await store.start_cooldown(f"guards:cooldown:{chain[0]}", 10**6)
    await store.breaker_record(f"guards:breaker:{chain[1]}", breaker, Outcome.failure, probe=None)
    request, response = Request(scope_for("bench")), Response()

    def caller(endpoint: Callable[..., Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
        params = inspect.signature(endpoint).parameters.values()
        request_param = next(p.name for p in params if p.annotation is Request)
        response_param = next(p.name for p in params if p.annotation is Response)

        async def run() -> None:
            for _ in range(PER_ROUND):
                response.raw_headers.clear()
                await endpoint(**{request_param: request, response_param: response})
                await asyncio.sleep(0)

        return run

    async def timed(run: Callable[[], Awaitable[None]]) -> float:
        gc.collect()
        start = time.process_time()
        await run()
        return (time.process_time() - start) / PER_ROUND * 1e6

    runs = {"single": caller(single), "chain": caller(walked)}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    logging.getLogger("guards").setLevel(logging.WARNING)
    for run in runs.values():
        await run()  # warm up
    for _ in range(ROUNDS):
        for name, run in runs.items():
            samples[name].append(await timed(run))
    logging.getLogger("guards").setLevel(logging.NOTSET)
    return {name: statistics.median(values) for name, values in samples.items()}


STREAM_EVENTS = 1_000
TTFB_EVENTS = 5


def streaming_endpoint(binding: Any) -> Callable[[], Awaitable[list[float]]]:
    """A guarded streaming route over `binding`, driven as an ASGI server drives it (minus
    HTTP to the client). Calling the result streams once and returns when each body chunk
    was sent, in seconds from the request's start."""
    guards = Guards(binding)

    @guards.route(model=MODEL)
    async def relay(ai: AI[str]) -> EventStream:
        return await ai.stream(INPUTS)

    params = inspect.signature(relay).parameters.values()
    request_param = next(p.name for p in params if p.annotation is Request)
    response_param = next(p.name for p in params if p.annotation is Response)
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def run() -> list[float]:
        start = time.perf_counter()
        stamps: list[float] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                stamps.append(time.perf_counter() - start)

        stream = await relay(**{request_param: Request(scope_for("bench")), response_param: Response()})
        await stream({"type": "http"}, receive, send)
        return stamps

    return run


class InstantStream:
    """A streaming binding whose events cost nothing: isolates the relay's own work."""

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        raise NotImplementedError

    async def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncIterator[StreamEvent]:
        for _ in range(STREAM_EVENTS):
            yield TextDelta("token ")
        yield StreamEnd("stop")

    async def aclose(self) -> None:
        return None


async def stream_figures(server: FakeWorkersAI) -> dict[str, float]:
    """Streaming through a guarded route against the raw binding, interleaved, medians (wall
    time): time to the first delta of a short answer from the fake Workers AI server over
    loopback HTTP; time per event of a long one (first delta to last), raw over HTTP; and the
    relay's own cost per event, with a binding whose events cost nothing."""
    binding = WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url)
    guarded = streaming_endpoint(binding)
    instant = InstantStream()
    relayed = streaming_endpoint(instant)

    async def raw(source: Any) -> list[float]:
        start = time.perf_counter()
        return [time.perf_counter() - start async for event in source.stream(MODEL, INPUTS)]

    short = Stream(parts=tuple(Text("token ") for _ in range(TTFB_EVENTS)))
    long = Stream(parts=tuple(Text("token ") for _ in range(STREAM_EVENTS)))
    samples: dict[str, list[float]] = {
        name: [] for name in ("raw_ttfb", "guarded_ttfb", "raw_event", "relay")
    }

    def per_event(stamps: list[float]) -> float:
        return (stamps[STREAM_EVENTS - 1] - stamps[0]) / (STREAM_EVENTS - 1)

    logging.getLogger("guards").setLevel(logging.WARNING)
    for round_ in range(ROUNDS + 1):  # the first round warms up
        server.default = short
        raw_ttfb, guarded_ttfb = (await raw(binding))[0], (await guarded())[0]
        server.default = long
        raw_event = per_event(await raw(binding))
        relay = per_event(await relayed()) - per_event(await raw(instant))
        if round_:
            for name, value in zip(samples, (raw_ttfb, guarded_ttfb, raw_event, relay), strict=True):
                samples[name].append(value)
    logging.getLogger("guards").setLevel(logging.NOTSET)
    await binding.aclose()
    return {name: statistics.median(values) for name, values in samples.items()}


MIB = 1 << 20
#: 1 MiB answers that are worst cases for a JSON-mode answer's check (code fences, nesting,
#: long strings); the first took minutes with the code-fence regex of the output guard.
WORST_ANSWERS = (
    "```\n" + "\n" * (MIB - 4),
    "```json" + " " * (MIB - 9) + "\nx",
    "```\n" * (MIB // 4),
    "[" * MIB,
    '{"label": "' + "a" * (MIB - 30) + '", "confidence": 0.5}',
)
#: 1 MiB event streams that are worst cases for the SSE parser, and the piece size they arrive
#: in: one unterminated line trickled in small pieces, CRLFs split across pieces, blank lines.
WORST_STREAMS = (
    (b"data: " + b"x" * (MIB - 8), 16),
    (b"data: a\r\n\r\n" * (MIB // 11), 64),
    (b"\n" * MIB, 4096),
)


class ReadyAnswer:
    """A binding that answers with one ready text."""

    def __init__(self) -> None:
        self.answer = ""

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        return AIResult(self.answer, model=model)

    async def aclose(self) -> None:
        return None


async def worst_answer_check() -> float:
    """The slowest of the 1 MiB worst cases through a guarded JSON-mode route (the output
    guard's unwrapping and validation, and the rest of the route), CPU time per request,
    median of rounds, in seconds."""
    binding = ReadyAnswer()
    endpoint, request_param, response_param = guarded_endpoint(binding)
    logging.getLogger("guards").setLevel(logging.WARNING)
    worst = 0.0
    for answer in WORST_ANSWERS:
        binding.answer = answer
        samples = []
        for _ in range(ROUNDS):
            gc.collect()
            start = time.process_time()
            await endpoint(**{request_param: Request(scope_for("bench")), response_param: Response()})
            samples.append(time.process_time() - start)
        worst = max(worst, statistics.median(samples))
    logging.getLogger("guards").setLevel(logging.NOTSET)
    return worst


async def list_errors_check() -> float:
    """A route whose output is a list of objects, answered with half a million invalid items in
    1 MiB: CPU time per request, median of rounds, in seconds. The output guard's validation
    stops at the first invalid item (pydantic-core would report an error for each)."""
    binding = ReadyAnswer()
    binding.answer = "[" + "1," * (MIB // 2 - 1) + "1]"
    guards = Guards(binding)

    @guards.route(model=MODEL, breaker=None)
    async def labels(ai: AI[list[Label]]) -> list[Label]:
        return await ai.run(INPUTS)

    params = inspect.signature(labels).parameters.values()
    request_param = next(p.name for p in params if p.annotation is Request)
    response_param = next(p.name for p in params if p.annotation is Response)
    logging.getLogger("guards").setLevel(logging.WARNING)
    samples = []
    for _ in range(ROUNDS):
        gc.collect()
        start = time.process_time()
        await labels(**{request_param: Request(scope_for("bench")), response_param: Response()})
        samples.append(time.process_time() - start)
    logging.getLogger("guards").setLevel(logging.NOTSET)
    return statistics.median(samples)


def worst_sse_parse() -> float:
    """The slowest of the 1 MiB worst-case streams through `SSEParser`, CPU time, median of
    rounds, in seconds."""
    worst = 0.0
    for body, size in WORST_STREAMS:
        pieces = [body[i : i + size] for i in range(0, len(body), size)]
        samples = []
        for _ in range(ROUNDS):
            parser = SSEParser(max_event_bytes=2 * MIB)
            start = time.process_time()
            for piece in pieces:
                parser.feed(piece)
            samples.append(time.process_time() - start)
        worst = max(worst, statistics.median(samples))
    return worst


def effort_estimate() -> float:
    """CPU time of one effort estimate of a 4,000-character turn, in microseconds (median of
    rounds). The turn is prose with one question and no fence, so every rule reads it whole."""
    sentence = "My parcel was sent on Monday and the tracking page has not changed since then. "
    text = (sentence * 60)[:3_989] + " Why is it?"
    inputs = {
        "messages": [{"role": "system", "content": "You draft replies."}, {"role": "user", "content": text}]
    }
    assert len(text) == 4_000
    assert estimate_effort(inputs) == "complex"  # by length, the last rule
    samples = []
    for _ in range(ROUNDS):
        start = time.process_time()
        for _ in range(PER_ROUND):
            estimate_effort(inputs)
        samples.append((time.process_time() - start) / PER_ROUND * 1e6)
    return statistics.median(samples)


# --- cold start ----------------------------------------------------------------------------
#
# Fresh processes, run with the repository first on their path and with Python's bytecode cache
# on (`PYTHONDONTWRITEBYTECODE` removed): an installed wheel's modules are compiled once, so a
# start that compiled guards from source would measure the compiler. One process of each kind
# runs first, unmeasured, to fill the cache.

ROOT = Path(__file__).resolve().parent.parent
#: Fresh processes per import figure.
IMPORT_RUNS = 9
#: Starts per app for the time to first answer (interleaved: bare, app, bare, app...).
START_RUNS = 5
START_TIMEOUT_S = 60.0

_IMPORT = """
import time
t0 = time.perf_counter()
import fastapi
t1 = time.perf_counter()
import guards
t2 = time.perf_counter()
from guards import AI, Guards
t3 = time.perf_counter()
print((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t1) * 1e3)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return {**env, **extra}


def import_costs(runs: int = IMPORT_RUNS) -> dict[str, float]:
    """Medians over `runs` fresh processes, in milliseconds: `fastapi` (`import fastapi`), then
    after it `package` (`import guards`, which imports its names on first use: nothing else)
    and `guards` (`import guards` and `from guards import AI, Guards`: what every guarded app
    imports, the engine with it); and `ratio`, the median of each process's `guards` over its
    `fastapi`."""

    def once() -> tuple[float, ...]:
        out = subprocess.run(
            [sys.executable, "-c", _IMPORT], cwd=ROOT, env=_env(), capture_output=True, text=True, check=True
        )
        return tuple(float(ms) for ms in out.stdout.split())

    once()  # fills the bytecode cache
    samples = [once() for _ in range(runs)]
    medians = {
        name: statistics.median(sample[index] for sample in samples)
        for index, name in enumerate(("fastapi", "package", "guards"))
    }
    # Each process's own ratio: a slow moment of the machine slows both of its imports.
    medians["ratio"] = statistics.median(guards / fastapi for fastapi, _, guards in samples)
    return medians


#: The served apps: (module:attribute, method, path, body, extra environment).
_APPS: dict[str, tuple[str, str, str, bytes | None, dict[str, str]]] = {
    "bare": ("bench.bare_app:app", "GET", "/hello", None, {}),
    "app": (
        "app.main:app",
        "POST",
        "/draft-reply",
        b'{"message": "Where is my parcel?"}',
        {"AI_PROVIDER": "fake", "GUARDS_STORE": "memory://", "OTEL_TRACES_EXPORTER": "none"},
    ),
}


def _answered(port: int, method: str, path: str, body: bytes | None) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status == 200
    except OSError:  # not listening yet (refused, reset)
        return False
    finally:
        connection.close()


def first_answer_ms(name: str) -> float:
    """One start of app `name` (see `_APPS`): milliseconds from `Popen` to its first 200."""
    target, method, path, body, extra = _APPS[name]
    port = free_port()
    command = [sys.executable, "-m", "guards.serve", target, "--port", str(port),
               "--log-level", "warning", "--no-access-log"]  # fmt: skip
    started = time.perf_counter()
    server = subprocess.Popen(
        command, cwd=ROOT, env=_env(**extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while not _answered(port, method, path, body):
            if server.poll() is not None:
                raise RuntimeError(f"{name} exited with {server.returncode} before answering")
            if time.perf_counter() - started > START_TIMEOUT_S:
                raise RuntimeError(f"{name} did not answer in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.002)  # polling for the port to open, bounded by the timeout
        return (time.perf_counter() - started) * 1e3
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


def first_answer_times(runs: int = START_RUNS) -> dict[str, float]:
    """Medians over `runs` interleaved starts of each app, in milliseconds, by app name; and
    `ratio`, the median of each round's app over its bare app."""
    for name in _APPS:
        first_answer_ms(name)  # fills the bytecode cache
    samples: dict[str, list[float]] = {name: [] for name in _APPS}
    for _ in range(runs):
        for name in _APPS:
            samples[name].append(first_answer_ms(name))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    medians["ratio"] = statistics.median(
        app / bare for bare, app in zip(samples["bare"], samples["app"], strict=True)
    )
    return medians


def print_startup_figures() -> None:
    """`import_*` and `first_answer_*`."""
    imports = import_costs()
    print(f"import_fastapi_ms = {imports['fastapi']:.1f} ms")
    print(f"import_guards_over_fastapi_ms = {imports['guards']:.1f} ms")
    print(f"import_guards_vs_fastapi = {imports['ratio']:.3f} x")
    print(f"import_guards_package_only_ms = {imports['package']:.2f} ms")
    started = first_answer_times()
    print(f"first_answer_bare_ms = {started['bare']:.0f} ms")
    print(f"first_answer_app_ms = {started['app']:.0f} ms")
    print(f"first_answer_app_over_bare_ms = {started['app'] - started['bare']:.0f} ms")
    print(f"first_answer_app_vs_bare = {started['ratio']:.2f} x")


def main() -> None:
    print_startup_figures()  # first: fresh processes, before this one heats the machine up
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

    traced = asyncio.run(tracing_costs())
    print(f"tracing_off_call_us = {traced['off']:.2f} us")
    print(f"tracing_noop_overhead_us = {traced['noop'] - traced['off']:.2f} us")
    print(f"tracing_noop_ratio = {traced['noop'] / traced['off']:.3f} x")
    print(f"tracing_sdk_overhead_us = {traced['sdk'] - traced['off']:.2f} us")
    print(f"tracing_sdk_ratio = {traced['sdk'] / traced['off']:.3f} x")

    skip = asyncio.run(chain_skip())
    print(f"single_model_call_us = {skip['single']:.2f} us")
    print(f"chain_skip_two_call_us = {skip['chain']:.2f} us")
    print(f"chain_skip_ratio = {skip['chain'] / skip['single']:.2f} x")
    print(f"effort_estimate_us = {effort_estimate():.2f} us")

    # Hostile text: a 1 MiB answer is checked in well under 50 ms whatever it holds.
    print(f"answer_check_1mib_worst_ms = {asyncio.run(worst_answer_check()) * 1e3:.1f} ms")
    print(f"answer_check_1mib_list_errors_ms = {asyncio.run(list_errors_check()) * 1e3:.1f} ms")
    print(f"sse_parse_1mib_worst_ms = {worst_sse_parse() * 1e3:.1f} ms")

    with FakeWorkersAI() as server:
        stream = asyncio.run(stream_figures(server))
    print(f"stream_ttfb_raw_us = {stream['raw_ttfb'] * 1e6:.0f} us")
    print(f"stream_ttfb_guarded_us = {stream['guarded_ttfb'] * 1e6:.0f} us")
    print(f"stream_ttfb_overhead_us = {(stream['guarded_ttfb'] - stream['raw_ttfb']) * 1e6:.0f} us")
    print(f"stream_event_raw_us = {stream['raw_event'] * 1e6:.1f} us")
    print(f"stream_relay_per_event_us = {stream['relay'] * 1e6:.2f} us")
    print(f"stream_relay_overhead_per_event = {stream['relay'] / stream['raw_event'] * 100:.1f} %")

    # Stores: one budget check each, and one 3-key cooldown read, wall time (SQLite and Redis
    # do I/O).
    print(f"store_memory_check_us = {asyncio.run(store_checks(MemoryStore())):.1f} us")
    print(f"store_memory_cooldowns_us = {asyncio.run(store_cooldown_reads(MemoryStore())):.1f} us")
    with tempfile.TemporaryDirectory() as folder:
        sqlite = SQLiteStore(f"{folder}/bench.db")
        print(f"store_sqlite_check_us = {asyncio.run(store_checks(sqlite)):.1f} us")
        sqlite = SQLiteStore(f"{folder}/bench.db")
        print(f"store_sqlite_cooldowns_us = {asyncio.run(store_cooldown_reads(sqlite)):.1f} us")
    with RedisServer() as server:
        print(f"store_redis_check_us = {asyncio.run(store_checks(RedisStore(server.url))):.1f} us")
        cooldowns_us = asyncio.run(store_cooldown_reads(RedisStore(server.url)))
        print(f"store_redis_cooldowns_us = {cooldowns_us:.1f} us")
    print_store_figures()
    print_cluster_figures()


if __name__ == "__main__":
    main()
