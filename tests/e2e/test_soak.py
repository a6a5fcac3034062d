"""`make soak`'s checks can fail, and pass only what the contracts allow.

The soak itself runs for many minutes and is not part of `make test`; these tests keep its parts
honest in seconds: every shape of every failure its provider plays, sent through the example
app over real HTTP by the soak's own client, gets an answer its checks accept (no false alarm),
and answers that break a contract are caught (no blind spot).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest

from app.service import create_app
from bench.soak import (
    DRAFT,
    MODEL,
    STREAM,
    SUMMARY,
    Request,
    Verdict,
    check,
    invalid_requests,
    read_answer,
    request_for,
)
from bench.soak_provider import FAILURES, call_of, shapes, success
from fixtures import FakeWorkersAI
from fixtures.script import Outcome

from ..conftest import Serve, no_sleep, workers_ai_settings

KINDS = {SUMMARY: "summary", DRAFT: "draft", STREAM: "stream"}
TIMEOUT_S = 1.0


async def exchange(port: int, request: Request) -> tuple[int, dict[str, str], bytes]:
    """`request` on a connection of its own, read by the soak's client."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(10):
            writer.write(request.raw)
            status, headers, body, _ = await read_answer(reader)
    finally:
        writer.close()
    return status, headers, body


def test_every_failure_the_provider_plays_gets_an_answer_the_checks_accept(
    fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    """Each request's first call plays one shape (its retry, or the empty stream's recovery
    call, succeeds), all at once; the calls of refused requests must never come."""
    first: dict[int, Outcome] = {}
    cases: list[tuple[Request, str]] = []
    index = itertools.count(1)
    for route, kind in KINDS.items():
        for failure in ["ok", *FAILURES]:
            for which in range(len(shapes(failure, kind, 0, TIMEOUT_S))):
                request = request_for(route, next(index), user=7)
                shape = shapes(failure, kind, request.index, TIMEOUT_S)[which]
                first[request.index] = shape
                cases.append((request, f"{kind} {failure} {which} {type(shape).__name__}"))
    refused = invalid_requests(next(index))
    called: list[int] = []

    def choose(model: str, inputs: Any) -> Outcome:
        kind, user, request = call_of(inputs)
        called.append(request)
        assert user == "u7"
        return first.pop(request, None) or success(kind, request)

    fake_workers_ai.default = choose
    settings = workers_ai_settings(
        fake_workers_ai,
        ai_model=MODEL,
        ai_timeout_s=TIMEOUT_S,
        ai_stream_idle_timeout_s=0.6,
        ai_stream_max_s=2.0,
        daily_call_limit=1000,
        breaker_failure_threshold=1000,
    )
    client = serve(create_app(settings, sleep=no_sleep))
    port = client.base_url.port
    assert port is not None

    async def all_at_once() -> list[tuple[int, dict[str, str], bytes]]:
        requests = [request for request, _ in cases] + refused
        return await asyncio.gather(*(exchange(port, request) for request in requests))

    answers = asyncio.run(all_at_once())
    verdicts = {
        name: check(request, *answer)
        for (request, name), answer in zip(cases, answers[: len(cases)], strict=True)
    }
    wrong = {name: verdict for name, verdict in verdicts.items() if verdict.problem or verdict.unexpected}
    assert wrong == {}
    assert len(verdicts) == len(cases) == 42
    assert {name: v.outcome for name, v in verdicts.items() if " ok " in name} == {
        "summary ok 0 Reply": "200 model",
        "draft ok 0 Reply": "200 reply",
        "stream ok 0 Stream": "stream done",
    }
    # Failures end in each of their documented answers (the shapes are not all alike).
    assert {v.outcome for v in verdicts.values()} >= {
        "200 fallback call/timeout",
        "200 fallback call/provider_error",
        "200 fallback output/empty_response",
        "503 model_temporarily_unavailable",
        "503 model_quota_exhausted",
        "503 model_unavailable",
        "502 incompatible_model_response",
        "stream error call/timeout",
        "stream error call/provider_error",
    }
    refusals = [
        check(request, *answer) for request, answer in zip(refused, answers[len(cases) :], strict=True)
    ]
    assert [(v.outcome, v.problem) for v in refusals] == [("400 invalid_request", None)] * len(refused)
    assert refused[0].index not in called


def headers(**values: str) -> dict[str, str]:
    return {"x-trace-id": "t1", **{name.replace("_", "-"): value for name, value in values.items()}}


def envelope(data: Any, fallback: Any = None) -> bytes:
    return json.dumps({"ok": True, "data": data, "fallback": fallback}).encode()


def error(token: str, retryable: bool, **extra: Any) -> bytes:
    return json.dumps({"error": token, "retryable": retryable, "trace_id": "t1", **extra}).encode()


def sse(*events: tuple[str, Any]) -> bytes:
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode()


DONE = {
    "finish_reason": "stop",
    "usage": None,
    "model": MODEL,
    "fallback_model": None,
    "attempts": 1,
    "trace_id": "t1",
}
STREAM_HEAD = headers(content_type="text/event-stream; charset=utf-8")
TIMEOUT_EVENT = {"guard": "call", "reason": "timeout", "detail": "...", "trace_id": "t1"}

# (route, status, headers, body, the problem the checks must name)
BROKEN: list[tuple[str, int, dict[str, str], bytes, str]] = [
    (SUMMARY, 500, {}, b"Internal Server Error", "500 from a degrading route"),
    (SUMMARY, 200, headers(), b'{"ok": true}', "200 whose body is not the envelope"),
    (SUMMARY, 200, headers(), envelope({"label": "label q8", "confidence": 0.9}), "the model's answer to another request"),
    (
        SUMMARY,
        200,
        headers(),
        envelope({"label": "billing", "confidence": 0.3}, {"guard": "call", "reason": "rate_limited", "detail": ""}),
        "fallback reason 'rate_limited' under guard 'call'",
    ),
    (
        SUMMARY,
        200,
        headers(),
        envelope({"label": "general", "confidence": 0.1}, {"guard": "call", "reason": "timeout", "detail": ""}),
        "a fallback whose data is not the keyword label of the request",
    ),
    (DRAFT, 500, {"content-type": "text/plain"}, b"Internal Server Error", "500 whose body is not an error body"),
    (DRAFT, 503, headers(), error("model_temporarily_unavailable", True), "503 model_temporarily_unavailable without a Retry-After in whole seconds"),
    (DRAFT, 503, headers(retry_after="5"), error("circuit_open", False), "503 circuit_open with retryable False"),
    (DRAFT, 502, headers(), error("model_quota_exhausted", False), "502 with error 'model_quota_exhausted', not one of that status's tokens"),
    (DRAFT, 503, {"retry-after": "5"}, error("circuit_open", True), "503 circuit_open without its trace id in the body and x-trace-id"),
    (DRAFT, 200, headers(), json.dumps({"model": MODEL, "reply": "Reply to q8.", "attempts": 1, "trace_id": "t1"}).encode(), "a reply to another request"),
    (DRAFT, 200, headers(), json.dumps({"model": MODEL, "reply": "Reply to q7.", "attempts": 3, "trace_id": "t1"}).encode(), "attempts 3 outside 1 to 2"),
    (STREAM, 200, headers(content_type="text/plain"), b"Reply to q7.", "200 from the streaming route that is not an event stream"),
    (STREAM, 200, STREAM_HEAD, sse(("delta", {"text": "Reply "})), "a stream that ends without done or error"),
    (STREAM, 200, STREAM_HEAD, sse(("done", DONE), ("error", TIMEOUT_EVENT)), "done before the end of the stream"),
    (STREAM, 200, STREAM_HEAD, sse(("delta", {"text": "Reply "}), ("done", DONE)), "a completed stream whose text is not this request's reply"),
    (STREAM, 200, STREAM_HEAD, sse(("delta", {"text": "q8."}), ("error", TIMEOUT_EVENT)), "a delta that is not part of this request's reply"),
    (STREAM, 200, STREAM_HEAD, sse(("error", TIMEOUT_EVENT)), "an error event before any output (that is an error response)"),
    (STREAM, 200, STREAM_HEAD, sse(("delta", {"text": "Reply "}), ("error", {**TIMEOUT_EVENT, "guard": "budget"})), "error event reason 'timeout' under guard 'budget'"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "status", "head", "body", "problem"), BROKEN)
def test_answers_that_break_a_contract_are_caught(
    route: str, status: int, head: dict[str, str], body: bytes, problem: str
) -> None:
    assert check(request_for(route, 7, user=1), status, head, body).problem == problem


def test_a_refused_request_must_be_answered_400() -> None:
    request = invalid_requests(9)[0]
    answer = error("model_unavailable", False)
    assert check(request, 503, headers(), answer) == Verdict(
        "503 model_unavailable", "a request the app must refuse was not answered 400"
    )
    assert (
        check(request, 400, headers(), error("invalid_request", False)).problem == "400 without its problems"
    )
