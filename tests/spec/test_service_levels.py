"""Service levels over real HTTP: the example app's level follows its models' health as the
store holds it (full → degraded → minimal → full), with `GET /health`, the `x-service-level`
header, the `guards_service_level` gauge and one log line per change; `/draft-reply/stream` is
shed at `degraded` with no provider call, the other routes keep answering on the models left.
On each store: memory (one uvicorn server), SQLite and Redis (two uvicorn servers, each with a
store of its own on one file or one server: two workers), on a manual clock; and two app
processes on real time. Overload (`max_in_flight`) and shedding a degrading route, on an app of
our own."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.service import create_app
from fixtures import Fail, FakeBinding, FakeWorkersAI, Hang, ManualClock, Reply, Stream, Text
from guards import AI, Breaker, Guards, Level, ModelDown, ServiceLevel
from guards.stores import MemoryStore, RedisStore, SQLiteStore, Store

from ..conftest import STORE_TIMEOUT_S, LogLines, Serve, no_sleep, wait_until, workers_ai_settings
from ..e2e.test_shared_state import AppProcess, _flush, app_process_env
from ..observe.test_metrics import parse, series

A = "@cf/test/a"
B = "@cf/test/b"
INCOMPATIBLE = Fail(code=5035, status=403)
LABEL = Reply({"label": "billing", "confidence": 0.9})
RESET_S = 30.0


def stores_for(kind: str, clock: ManualClock, tmp_path: Path, request: pytest.FixtureRequest) -> list[Store]:
    """The stores of this test's workers: one memory store, or two SQLite stores on one file,
    or two Redis stores on one server under one prefix."""
    if kind == "memory":
        return [MemoryStore(clock=clock)]
    if kind == "sqlite":
        return [SQLiteStore(tmp_path / "guards.db", clock=clock) for _ in range(2)]
    url, prefix = request.getfixturevalue("redis_url"), f"levels-{uuid.uuid4().hex[:8]}:"
    return [RedisStore(url, clock=clock, prefix=prefix, timeout_s=STORE_TIMEOUT_S) for _ in range(2)]


def health(client: httpx.Client) -> dict[str, Any]:
    answer = client.get("/health")
    assert answer.status_code == 200
    assert "x-service-level" not in answer.headers  # not a guarded route
    body: dict[str, Any] = answer.json()
    return body


def wait_for_level(workers: list[httpx.Client], level: str, down: list[str]) -> None:
    """Every worker reads the store at most once a second, on its own: poll each until it
    answers the level (a bounded wait)."""
    for worker in workers:
        wait_until(lambda w=worker: health(w) == {"ok": True, "level": level, "down": down}, timeout_s=10)


def gauge(client: httpx.Client) -> float:
    return parse(client.get("/metrics").text)[series("guards_service_level")]


def draft(client: httpx.Client) -> httpx.Response:
    return client.post("/draft-reply", json={"message": "Where is my parcel?"})


def stream(client: httpx.Client) -> httpx.Response:
    return client.post("/draft-reply/stream", json={"message": "Where is my parcel?"})


def summary(client: httpx.Client) -> httpx.Response:
    return client.post("/summary", json={"text": "refund please"}, headers={"x-user-id": "ada"})


def assert_shed(answer: httpx.Response, level: str) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.json() == {
        "error": "circuit_open",
        "retryable": True,
        "trace_id": answer.headers["x-trace-id"],
    }
    assert 1 <= int(answer.headers["retry-after"]) <= RESET_S
    assert answer.headers["x-service-level"] == level


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
def test_the_level_follows_the_models_and_sheds_the_stream(
    kind: str,
    fake_workers_ai: FakeWorkersAI,
    serve: Serve,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    guards_log: LogLines,
) -> None:
    clock = ManualClock()
    settings = workers_ai_settings(
        fake_workers_ai,
        ai_model=A,
        ai_fallback_models=B,
        breaker_failure_threshold=1,
        breaker_reset_s=RESET_S,
        daily_call_limit=1000,
    )
    workers = [
        serve(create_app(settings, sleep=no_sleep, store=store))
        for store in stores_for(kind, clock, tmp_path, request)
    ]
    first, last = workers[0], workers[-1]
    fake_workers_ai.default = Reply("Thank you for your message.")

    # full: nothing down, no header.
    wait_for_level(workers, "full", [])
    answered = draft(last)
    assert answered.status_code == 200
    assert "x-service-level" not in answered.headers

    # degraded: model a fails once (its breaker opens), b answers.
    fake_workers_ai.script(A, INCOMPATIBLE)
    assert draft(first).headers["x-ai-fallback"] == B
    wait_for_level(workers, "degraded", [A])
    assert gauge(last) == 1
    calls = len(fake_workers_ai.calls)
    assert_shed(stream(last), "degraded")
    assert len(fake_workers_ai.calls) == calls  # shed: no provider call
    kept = draft(last)
    assert kept.status_code == 200
    assert (kept.headers["x-ai-fallback"], kept.headers["x-service-level"]) == (B, "degraded")
    fake_workers_ai.script(B, LABEL)
    labelled = summary(last)
    assert labelled.json()["fallback"] is None
    assert labelled.headers["x-service-level"] == "degraded"
    assert [c.model for c in fake_workers_ai.calls[calls:]] == [B, B]  # a is skipped, no call
    invalid = last.post("/draft-reply", json={"message": ""})
    assert (invalid.status_code, invalid.headers["x-service-level"]) == (400, "degraded")

    # minimal: b fails too.
    fake_workers_ai.script(B, INCOMPATIBLE)
    assert draft(first).status_code == 502
    wait_for_level(workers, "minimal", [A, B])
    assert gauge(first) == 2
    calls = len(fake_workers_ai.calls)
    assert_shed(stream(first), "minimal")
    skipped = draft(last)  # not shed: the walk skips both models
    assert_shed(skipped, "minimal")
    fallback = summary(first).json()["fallback"]
    assert (fallback["guard"], fallback["reason"]) == ("budget", "circuit_open")
    assert len(fake_workers_ai.calls) == calls

    # full again: both breakers half-open after their reset timeout, and the walk probes them.
    clock.advance(RESET_S)
    wait_for_level(workers, "full", [])
    assert gauge(last) == 0
    streamed = stream(last)
    assert streamed.status_code == 200
    assert "x-service-level" not in streamed.headers
    assert "event: done" in streamed.text
    assert fake_workers_ai.calls[-1].model == A

    changes = [(e["from"], e["to"], e["down"]) for e in guards_log.events("service_level")]
    expected = [("full", "degraded", [A]), ("degraded", "minimal", [A, B]), ("minimal", "full", [])]
    assert changes == [change for change in expected for _ in workers]  # once per change, per worker


# --- two app processes on one store, on real time ------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_two_processes_agree_on_the_level(
    kind: str, fake_workers_ai: FakeWorkersAI, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A breaker opened through one process degrades the level of the other, which sheds its
    stream route, and both come back when the breaker's reset timeout passes (real time); the
    gauge of the processes' shared metrics holds the freshest reading."""
    if kind == "sqlite":
        store_url = f"sqlite:///{tmp_path}/guards.db"
    else:
        store_url = request.getfixturevalue("redis_url").rsplit("/", 1)[0] + "/6"
        asyncio.run(_flush(store_url))
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = app_process_env(
        fake_workers_ai,
        store_url,
        AI_MODEL=A,
        AI_FALLBACK_MODELS=B,
        BREAKER_FAILURE_THRESHOLD="1",
        BREAKER_RESET_S="6",  # the window in which the other process must see it
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
    )
    apps = [AppProcess(env) for _ in range(2)]
    clients: list[httpx.Client] = []
    try:
        for app in apps:
            app.wait_ready()
        clients += [httpx.Client(base_url=app.url, timeout=10) for app in apps]
        one, other = clients
        fake_workers_ai.default = Reply("Thank you for your message.")
        fake_workers_ai.script(A, INCOMPATIBLE)
        assert draft(one).headers["x-ai-fallback"] == B
        wait_for_level([other], "degraded", [A])
        assert gauge(other) == 1
        calls = len(fake_workers_ai.calls)
        shed = stream(other)
        assert shed.status_code == 503
        assert shed.headers["x-service-level"] == "degraded"
        assert len(fake_workers_ai.calls) == calls
        wait_for_level([other, one], "full", [])
        assert gauge(one) == 0
        assert stream(other).status_code == 200
    finally:
        for client in clients:
            client.close()
        for app in apps:
            app.stop()


# --- an app of our own: a shed degrading route, and overload -----------------------------------


def own_app(fake: FakeBinding, store: Store, max_in_flight: int | None = None) -> tuple[FastAPI, Guards]:
    guards = Guards(fake, store=store, sleep=no_sleep, max_in_flight=max_in_flight)
    app = FastAPI()
    guards.install(app)
    breaker = Breaker(failure_threshold=1, reset_timeout_s=RESET_S)

    @app.post("/optional")
    @guards.route(model=A, fallbacks=[B], breaker=breaker, fallback="no suggestion", shed_at="degraded")
    async def optional(ai: AI[str]) -> str:
        return await ai.run({"prompt": "suggest"})

    @app.post("/last-resort")
    @guards.route(model=A, fallbacks=[B], breaker=breaker, shed_at="minimal")
    async def last_resort(ai: AI[str]) -> str:
        return await ai.run({"prompt": "answer"})

    @app.post("/core")
    @guards.route(model=A, fallbacks=[B], breaker=breaker, timeout_s=5, first_output_s=None)  # a hang holds
    async def core(ai: AI[str]) -> str:
        return await ai.run({"prompt": "answer"})

    @app.get("/level")
    async def level() -> dict[str, Any]:
        seen = guards.service_level()
        return {"level": seen.level, "down": [[d.model, d.until] for d in seen.down]}

    return app, guards


def test_a_degrading_route_is_shed_with_the_envelope_naming_the_level(
    serve: Serve, fake_ai: FakeBinding
) -> None:
    clock = ManualClock()
    app, guards = own_app(fake_ai, MemoryStore(clock=clock))
    client = serve(app)
    fake_ai.default = Reply("a suggestion")
    fake_ai.script(A, INCOMPATIBLE)
    assert client.post("/core").status_code == 200  # a fails (its breaker opens), b answers
    wait_until(lambda: client.get("/level").json()["level"] == "degraded", timeout_s=10)
    assert guards.service_level() == ServiceLevel(Level.degraded, (ModelDown(A, clock.time() + RESET_S),))
    calls = len(fake_ai.calls)
    shed = client.post("/optional")
    assert shed.status_code == 200
    assert shed.headers["x-service-level"] == "degraded"
    body = shed.json()
    assert body["data"] == "no suggestion"
    assert (body["fallback"]["guard"], body["fallback"]["reason"]) == ("budget", "circuit_open")
    assert "degraded" in body["fallback"]["detail"]
    assert client.post("/last-resort").json() == "a suggestion"  # shed only at minimal
    assert len(fake_ai.calls) == calls + 1


def test_overload_sheds_the_routes_that_declare_a_level_and_serves_the_others(
    serve: Serve, fake_ai: FakeBinding
) -> None:
    """`max_in_flight=2`: with two guarded requests in flight on the worker, a request of a
    route declared `shed_at` is shed at once (no call, no charge), one of a route without it is
    served; once they end, nothing is shed."""
    app, _ = own_app(fake_ai, MemoryStore(), max_in_flight=2)
    client = serve(app)
    fake_ai.script(A, Hang(), Hang())
    fake_ai.default = Reply("answered")
    url = str(client.base_url)
    hung: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda: hung.append(httpx.post(f"{url}/core", timeout=30))) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    assert fake_ai.wait_for(lambda calls: len(calls) == 2, timeout=10)
    calls = len(fake_ai.calls)
    shed = client.post("/optional")
    assert shed.status_code == 200
    fallback = shed.json()["fallback"]
    assert (fallback["reason"], fallback["detail"]) == (
        "circuit_open",
        "shed: more than 2 requests in flight on this worker",
    )
    refused = client.post("/last-resort")  # any level at all: overload sheds it
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
    assert len(fake_ai.calls) == calls
    assert client.post("/core").json() == "answered"  # never shed: served even over the limit
    for thread in threads:
        thread.join(30)  # the hung calls end at the route's deadline (5 s)
    assert [r.status_code for r in hung] == [503, 503]
    assert client.post("/optional").json()["fallback"] is None  # counted out, however they ended


def test_a_stream_counts_in_flight_until_it_ends(serve: Serve, fake_ai: FakeBinding) -> None:
    guards = Guards(fake_ai, store=MemoryStore(), sleep=no_sleep, max_in_flight=1)
    app = FastAPI()
    guards.install(app)

    @app.post("/stream")
    @guards.route(model=A, shed_at="degraded")
    async def streamed(ai: AI[str]) -> Any:
        return await ai.stream({"prompt": "go"})

    client = serve(app)
    fake_ai.script(A, Stream(parts=(Text("a"), Text("b")), stall_after=1, stall_s=2))
    fake_ai.default = Stream(parts=(Text("done"),))
    url = str(client.base_url)
    first: list[httpx.Response] = []
    reader = threading.Thread(target=lambda: first.append(httpx.post(f"{url}/stream", timeout=30)))
    reader.start()
    assert fake_ai.wait_for(lambda calls: len(calls) == 1, timeout=10)
    wait_until(lambda: client.post("/stream").status_code == 503)  # the first still streams
    reader.join(30)
    assert client.post("/stream").status_code == 200
