"""Multi-step tasks over real HTTP: the example app's `POST /report` (summarize, classify,
draft) under an `Idempotency-Key`, against the fake Workers AI server counting the calls that
reach the provider, on each store: memory (one uvicorn server), SQLite (two app processes on
one file) and Redis (two app processes on one server), and a worker killed between steps."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY
from pydantic import BaseModel

from app.service import DRAFT_PROMPT, REPORT_SUMMARY_PROMPT, SUMMARY_PROMPT, create_app
from fixtures import Fail, FakeBinding, FakeWorkersAI, Hang, ManualClock, Reply
from fixtures.redis_server import free_port
from guards import AI, Budget, Guards, Task, header_key
from guards.stores import RedisStore, SQLiteStore

from ..conftest import STORE_TIMEOUT_S, LogLines, Serve, no_sleep, workers_ai_settings
from ..e2e.test_shared_state import MODEL, AppProcess, _flush, app_process_env
from ..observe.test_metrics import parse, series

CANARY = "CANARY-TASK-STEP-51e2"
SUMMARY = Reply(f"The customer was charged twice ({CANARY}-summary).")
LABEL = Reply({"label": "billing", "confidence": 0.9})
DRAFT = Reply(f"We are sorry, a refund is on its way ({CANARY}-draft).")
INCOMPATIBLE = Fail(code=5035, status=403)
TEXT = "I was charged twice, please refund me"
#: The daily cap of these tests' app (DAILY_CALL_LIMIT): one unit per request that called.
CAP = 3
#: AI_TIMEOUT_S of the app processes: a lease lasts 2 x 5 + 60 s.
TIMEOUT_S = 5.0
LEASE_S = 2 * TIMEOUT_S + 60


def step_of(call: Any) -> str:
    """Which step of /report a provider call was for, from its system prompt."""
    system = call.inputs["messages"][0]["content"]
    for name, prompt in (
        ("summarize", REPORT_SUMMARY_PROMPT),
        ("classify", SUMMARY_PROMPT),
        ("draft", DRAFT_PROMPT),
    ):
        if system.startswith(prompt):
            return name
    raise AssertionError("not a /report call")


def report(url: str, key: str | None, user: str, text: str = TEXT) -> httpx.Response:
    headers = {"x-user-id": user}
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(f"{url}/report", json={"text": text}, headers=headers, timeout=30)


def report_scenario(urls: list[str], fake: FakeWorkersAI) -> dict[str, Any]:
    """The issue's list, each request sent to the next of `urls` (the workers) in turn:
    failing at `draft` then retried, replayed, reused with another body, the daily cap, and
    two concurrent requests with one key. Returns what the replay answered."""
    worker = iter(urls * 10)
    user = f"u-{uuid.uuid4().hex[:8]}"
    key = f"report-{uuid.uuid4()}"

    # Fails at the third step: a public error like /draft-reply's, three calls made (and paid).
    fake.script(MODEL, SUMMARY, LABEL, INCOMPATIBLE)
    failed = report(next(worker), key, user)
    assert failed.status_code == 502, failed.text
    assert failed.json()["error"] == "model_incompatible"
    assert [step_of(c) for c in fake.calls] == ["summarize", "classify", "draft"]

    # Retried with the same key (on another worker): one call, the two first steps resumed.
    fake.script(MODEL, DRAFT)
    resumed = report(next(worker), key, user)
    assert resumed.status_code == 200, resumed.text
    assert [step_of(c) for c in fake.calls[3:]] == ["draft"]
    body = resumed.json()
    assert body == {
        "summary": SUMMARY.response,
        "label": "billing",
        "reply": DRAFT.response,
        "resumed_steps": ["summarize", "classify"],
        "trace_id": resumed.headers["x-trace-id"],
    }
    assert "idempotent-replayed" not in resumed.headers

    # A third request replays: no call, the same body to the byte, the route's headers.
    replayed = report(next(worker), key, user)
    assert replayed.status_code == 200
    assert replayed.content == resumed.content
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.headers["x-ai-model"] == resumed.headers["x-ai-model"] == MODEL
    assert replayed.headers["content-type"] == "application/json"
    assert replayed.headers["x-trace-id"] != resumed.headers["x-trace-id"]  # its own request
    assert len(fake.calls) == 4

    # The same key with another body: 422, nothing called.
    reused = report(next(worker), key, user, text="Another message entirely")
    assert reused.status_code == 422
    assert reused.json() == {
        "error": "idempotency_key_reused",
        "retryable": False,
        "trace_id": reused.headers["x-trace-id"],
    }
    assert len(fake.calls) == 4

    # The daily cap counts one unit per request that called: the failed one, the resumed one,
    # and this one (three calls, one unit); the replay and the 422 were free.
    fake.script(MODEL, SUMMARY, LABEL, DRAFT)
    assert report(next(worker), f"report-{uuid.uuid4()}", user).status_code == 200
    assert len(fake.calls) == 7
    capped = report(next(worker), f"report-{uuid.uuid4()}", user)
    assert capped.status_code == 429, capped.text
    assert capped.json()["error"] == "budget_exceeded"
    assert len(fake.calls) == 7
    assert report(next(worker), key, user).content == resumed.content  # a replay passes the cap

    # Two concurrent requests with one key: one runs, the other is 409 at once.
    fake.script(MODEL, Reply(SUMMARY.response, delay_s=2.0), LABEL, DRAFT)
    concurrent_key, other_user = f"report-{uuid.uuid4()}", f"v-{uuid.uuid4().hex[:8]}"

    async def both() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(timeout=30) as client:

            async def one(url: str) -> tuple[httpx.Response, float]:
                response = await client.post(
                    f"{url}/report",
                    json={"text": TEXT},
                    headers={"Idempotency-Key": concurrent_key, "x-user-id": other_user},
                )
                return response, time.monotonic()

            return await asyncio.gather(one(next(worker)), one(next(worker)))

    started = time.monotonic()
    answers = sorted(asyncio.run(both()), key=lambda a: a[0].status_code)
    (ran, ran_at), (conflict, conflict_at) = answers
    assert [ran.status_code, conflict.status_code] == [200, 409], [a[0].text for a in answers]
    assert conflict.json() == {
        "error": "task_in_progress",
        "retryable": True,
        "trace_id": conflict.headers["x-trace-id"],
    }
    assert conflict.headers["retry-after"] == "1"
    assert conflict_at < ran_at  # at once: while the other still waited for its first step
    assert conflict_at - started < 2.0
    assert len(fake.calls) == 10
    return {"replayed": replayed, "key": key, "user": user}


# --- memory: one uvicorn server, in process (its log lines are read too) ------------------------


def test_report_resumes_replays_and_charges_once_on_memory(
    fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    settings = workers_ai_settings(
        fake_workers_ai, daily_call_limit=CAP, breaker_failure_threshold=1000, ai_timeout_s=TIMEOUT_S
    )
    client = serve(create_app(settings, sleep=no_sleep))
    before = parse(client.get("/metrics").text)
    outcome = report_scenario([str(client.base_url)], fake_workers_ai)
    after = parse(client.get("/metrics").text)

    def steps(outcome: str) -> float:
        name = series("guards_task_steps_total", route="report", outcome=outcome)
        return after.get(name, 0.0) - before.get(name, 0.0)

    # saved: 2 + 1 (retry) + 3 + 3 (concurrent); resumed: 2; replayed: 2; conflict: 422 + 409.
    assert (steps("saved"), steps("resumed"), steps("replayed"), steps("conflict")) == (9, 2, 2, 2)
    requests = guards_log.events("request")
    report_lines = [line for line in requests if line["route"] == "report"]
    assert report_lines[1]["resumed_steps"] == ["summarize", "classify"]
    assert report_lines[2]["replayed"] is True
    assert report_lines[2]["attempts"] == 0
    # The resumed request made one call: on its own line, with no `attempt` line of its own.
    resumed = report_lines[1]
    assert not [line for line in guards_log.events("attempt") if line["trace_id"] == resumed["trace_id"]]
    assert (resumed["attempts"], resumed["completion_tokens"]) == (1, 5)
    # Step results and the client's key are never logged.
    for line in guards_log.lines:
        assert CANARY not in line
        assert outcome["key"] not in line
        assert outcome["user"] not in line


def test_a_request_cut_between_steps_leaves_a_task_the_next_one_resumes_on_memory(
    fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    """In one process, a client that leaves during `draft` (the request is cancelled, its lease
    released) leaves the task to the next request: it calls `draft` only."""
    settings = workers_ai_settings(fake_workers_ai, breaker_failure_threshold=1000, ai_timeout_s=TIMEOUT_S)
    client = serve(create_app(settings, sleep=no_sleep))
    fake_workers_ai.script(MODEL, SUMMARY, LABEL, Hang())
    key = f"report-{uuid.uuid4()}"

    def leave() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{client.base_url}/report",
                json={"text": TEXT},
                headers={"Idempotency-Key": key},
                timeout=httpx.Timeout(30, read=0.5),
            )

    leaving = threading.Thread(target=leave)
    leaving.start()
    assert fake_workers_ai.wait_for(lambda calls: len(calls) == 3 and calls[2].disconnected, timeout=10)
    leaving.join(10)
    fake_workers_ai.script(MODEL, DRAFT)
    resumed = client.post("/report", json={"text": TEXT}, headers={"Idempotency-Key": key})
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["resumed_steps"] == ["summarize", "classify"]
    assert [step_of(c) for c in fake_workers_ai.calls] == ["summarize", "classify", "draft", "draft"]


# --- SQLite and Redis: two app processes sharing the store --------------------------------------


@pytest.fixture
def redis_db(redis_url: str) -> str:
    """A database of the session's Redis for this module's app processes, emptied first."""
    url = redis_url.rsplit("/", 1)[0] + "/5"
    asyncio.run(_flush(url))
    return url


@pytest.fixture(params=["sqlite", "redis"])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a store two app processes share."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/guards.db"
    return str(request.getfixturevalue("redis_db"))


def start_apps(fake: FakeWorkersAI, store_url: str, count: int) -> list[AppProcess]:
    env = app_process_env(
        fake,
        store_url,
        DAILY_CALL_LIMIT=str(CAP),
        BREAKER_FAILURE_THRESHOLD="1000",
        AI_TIMEOUT_S=str(TIMEOUT_S),
    )
    apps = [AppProcess(env) for _ in range(count)]
    try:
        for app in apps:
            app.wait_ready()
    except BaseException:
        for app in apps:
            app.stop()
        raise
    return apps


@pytest.fixture
def two_apps(fake_workers_ai: FakeWorkersAI, shared_store: str) -> Iterator[list[AppProcess]]:
    apps = start_apps(fake_workers_ai, shared_store, 2)
    yield apps
    for app in apps:
        app.stop()


def test_report_resumes_replays_and_charges_once_across_two_processes(
    two_apps: list[AppProcess], fake_workers_ai: FakeWorkersAI
) -> None:
    report_scenario([app.url for app in two_apps], fake_workers_ai)


def test_a_worker_killed_between_steps_leaves_a_task_the_next_request_resumes(
    fake_workers_ai: FakeWorkersAI, shared_store: str, serve: Serve
) -> None:
    """A worker process is SIGKILLed while `draft` is in flight: `summarize` and `classify`
    were saved. Its lease holds the task (409) until it lapses (2 x timeout_s + 60 s, read on
    a manual clock); then the next request resumes with one call."""
    (doomed,) = start_apps(fake_workers_ai, shared_store, 1)
    key = f"report-{uuid.uuid4()}"
    fake_workers_ai.script(MODEL, SUMMARY, LABEL, Hang())
    errors: list[BaseException] = []

    def send() -> None:
        try:
            report(doomed.url, key, "killed")
        except httpx.TransportError as exc:
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert fake_workers_ai.wait_for(lambda calls: len(calls) == 3, timeout=20)
        os.kill(doomed.process.pid, signal.SIGKILL)
        doomed.process.wait(10)
        sender.join(10)
    finally:
        doomed.stop()
    assert errors  # the client lost its connection: no answer came
    assert [step_of(c) for c in fake_workers_ai.calls] == ["summarize", "classify", "draft"]

    # Another worker on the same store, whose clock we move.
    clock = ManualClock(time.time())
    if shared_store.startswith("sqlite"):
        store: Any = SQLiteStore(shared_store.removeprefix("sqlite:///"), clock=clock)
    else:
        store = RedisStore(shared_store, clock=clock, timeout_s=STORE_TIMEOUT_S)
    settings = workers_ai_settings(
        fake_workers_ai, daily_call_limit=CAP, breaker_failure_threshold=1000, ai_timeout_s=TIMEOUT_S
    )
    client = serve(create_app(settings, sleep=no_sleep, store=store))
    held = client.post(
        "/report", json={"text": TEXT}, headers={"Idempotency-Key": key, "x-user-id": "killed"}
    )
    assert held.status_code == 409  # the dead worker's lease still holds the task
    clock.advance(LEASE_S)
    fake_workers_ai.script(MODEL, DRAFT)
    resumed = client.post(
        "/report", json={"text": TEXT}, headers={"Idempotency-Key": key, "x-user-id": "killed"}
    )
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["resumed_steps"] == ["summarize", "classify"]
    assert [step_of(c) for c in fake_workers_ai.calls[3:]] == ["draft"]


# --- the key itself -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [b"", b"x" * 256, b"caf\xc3\xa9", b"tab\there", b"\x7f"],
    ids=["empty", "256-chars", "utf-8", "tab", "del"],
)
def test_a_malformed_key_is_400_before_anything_is_called_or_charged(
    key: bytes, fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    settings = workers_ai_settings(fake_workers_ai, daily_call_limit=1)
    client = serve(create_app(settings, sleep=no_sleep))
    refused = client.post("/report", json={"text": TEXT}, headers=[(b"idempotency-key", key)])
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == "invalid_request"
    assert fake_workers_ai.calls == []
    fake_workers_ai.script(MODEL, SUMMARY, LABEL, DRAFT)
    longest = "k" * 255  # the longest key there is, and the cap still has its one unit
    assert (
        client.post("/report", json={"text": TEXT}, headers={"Idempotency-Key": longest}).status_code == 200
    )


def test_without_a_key_report_runs_every_step_every_time(
    fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    client = serve(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    fake_workers_ai.script(MODEL, SUMMARY, LABEL, DRAFT, SUMMARY, LABEL, DRAFT)
    for _ in range(2):
        answer = client.post("/report", json={"text": TEXT})
        assert answer.status_code == 200
        assert answer.json()["resumed_steps"] == []
    assert len(fake_workers_ai.calls) == 6


# --- a degrading task route, and the OpenAPI document -------------------------------------------


class Answer(BaseModel):
    first: str
    second: str


def test_a_degrading_task_stores_only_an_answer_without_fallback(serve: Serve, fake_ai: FakeBinding) -> None:
    guards = Guards(fake_ai, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/two")
    @guards.route(model=MODEL, attempts=4, task=Task(), fallback=Answer(first="-", second="-"))
    async def two(ai: AI[str]) -> Answer:
        return Answer(
            first=await ai.step("first", {"prompt": "1"}), second=await ai.step("second", {"prompt": "2"})
        )

    client = serve(app)
    key = {"Idempotency-Key": "degrading-1"}
    fake_ai.script(MODEL, Reply("one"), INCOMPATIBLE)
    degraded = client.post("/two", headers=key)
    assert degraded.json()["fallback"]["reason"] == "provider_error"
    fake_ai.script(MODEL, Reply("two"))
    answered = client.post("/two", headers=key)
    assert answered.json() == {"ok": True, "data": {"first": "one", "second": "two"}, "fallback": None}
    replayed = client.post("/two", headers=key)
    assert replayed.content == answered.content
    assert replayed.headers["idempotent-replayed"] == "true"
    assert len(fake_ai.calls) == 3


def test_only_task_routes_document_the_key_and_its_answers() -> None:
    document = create_app().openapi()["paths"]
    report_doc = document["/report"]["post"]
    assert [p["name"] for p in report_doc["parameters"]] == ["x-user-id", "Idempotency-Key"]
    assert {"409", "422"} <= set(report_doc["responses"])
    assert report_doc["responses"]["409"]["headers"]["retry-after"]
    assert "idempotent-replayed" in report_doc["responses"]["200"]["headers"]
    for path in ("/draft-reply", "/summary"):
        operation = document[path]["post"]
        assert "Idempotency-Key" not in [p["name"] for p in operation.get("parameters", [])]
        assert not {"409", "422"} & set(operation["responses"])
        assert all("x-service-level" in r["headers"] for r in operation["responses"].values())


def test_a_task_whose_store_is_down_runs_without_checkpoints(serve: Serve, fake_ai: FakeBinding) -> None:
    """The claim fails open: the request runs as if it had no key (the store's other guards
    decide for themselves: the breaker fails open by default, and this route has no budget)."""
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.1)  # nothing listens
    guards = Guards(fake_ai, store=store, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/one")
    @guards.route(model=MODEL, task=Task())
    async def one(ai: AI[str]) -> str:
        return await ai.step("only", {"prompt": "1"})

    client = serve(app)
    before = REGISTRY.get_sample_value("guards_store_unavailable_total", {"guard": "task", "action": "open"})
    fake_ai.default = Reply("answered")
    for _ in range(2):
        answer = client.post("/one", headers={"Idempotency-Key": "down-1"})
        assert answer.json() == "answered"
        assert "idempotent-replayed" not in answer.headers
    after = REGISTRY.get_sample_value("guards_store_unavailable_total", {"guard": "task", "action": "open"})
    assert (after or 0) - (before or 0) == 2
    assert len(fake_ai.calls) == 2


def test_a_request_that_resumes_every_step_makes_no_call_and_is_not_charged(
    serve: Serve, fake_ai: FakeBinding
) -> None:
    """The charge is in the store step of a request's first call: a request that loads every
    step from the task's checkpoints never reaches it. Here the handler fails after its steps
    once (500: the task is not completed), and the retry resumes both with no call."""
    guards = Guards(fake_ai, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    failures = [RuntimeError("the route's own code failed")]

    @app.post("/two")
    @guards.route(model=MODEL, attempts=4, task=Task(), budget=Budget(per_day=2, key=header_key("x-user-id")))
    async def two(ai: AI[str]) -> Answer:
        answer = Answer(
            first=await ai.step("first", {"prompt": "1"}), second=await ai.step("second", {"prompt": "2"})
        )
        if failures:
            raise failures.pop()
        return answer

    client = serve(app)
    fake_ai.default = Reply("said")

    def post(key: str) -> httpx.Response:
        return client.post("/two", headers={"Idempotency-Key": key, "x-user-id": "ada"})

    assert post("k1").status_code == 500  # two calls, one unit charged
    resumed = post("k1")
    assert resumed.json() == {"first": "said", "second": "said"}
    assert len(fake_ai.calls) == 2  # nothing called, nothing charged
    assert post("k2").status_code == 200  # the second unit
    refused = post("k3")
    assert (refused.status_code, refused.json()["error"]) == (429, "budget_exceeded")
    assert len(fake_ai.calls) == 4


class Word(BaseModel):
    word: str


class Number(BaseModel):
    number: int


def test_a_saved_step_that_no_longer_validates_runs_again(serve: Serve, fake_ai: FakeBinding) -> None:
    """Between two requests of a task the step's type changed (a new release of the app): the
    saved result is discarded, and the step calls the model again."""
    guards = Guards(fake_ai, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    step_type: list[type[BaseModel]] = [Word]

    @app.post("/typed")
    @guards.route(model=MODEL, attempts=4, task=Task())
    async def typed(ai: AI[str]) -> list[Any]:
        first = await ai.step("first", {"prompt": "1"}, output=step_type[0])
        return [first.model_dump(), await ai.step("second", {"prompt": "2"}), list(ai.resumed_steps)]

    client = serve(app)
    key = {"Idempotency-Key": "typed-1"}
    fake_ai.script(MODEL, Reply({"word": "one"}), INCOMPATIBLE)
    assert client.post("/typed", headers=key).status_code == 502
    step_type[0] = Number
    fake_ai.script(MODEL, Reply({"number": 1}), Reply("two"))
    assert client.post("/typed", headers=key).json() == [{"number": 1}, "two", []]
    assert len(fake_ai.calls) == 4
    assert fake_ai.calls[2].inputs["response_format"]["json_schema"]["title"] == "Number"
