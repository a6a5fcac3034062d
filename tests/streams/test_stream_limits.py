"""A stream cannot run forever: the example app under uvicorn, streaming from a fake Workers AI
server that trickles bytes without ever completing an event, or streams without end.

- "No event for the idle timeout" counts complete events only: comments, blank lines and a
  line that never ends do not keep a stream alive (`AI_STREAM_IDLE_TIMEOUT_S`).
- A stream ends with the `error` event at its time limit (`AI_STREAM_MAX_S`, the route's
  `stream_max_s`) and at its size limit (`AI_STREAM_MAX_CHARS`, `stream_max_chars`).
- Each time, the provider's connection is closed at that moment: the fake server sees it.

Every bound below is stated with the test; none is a sleep.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.service import create_app
from fixtures import FakeWorkersAI, Stream, Text

from ..conftest import LogLines, Serve, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
IDLE_S = 0.4
#: Time for the server to notice a closed connection, and slack for a loaded machine.
SLACK_S = 2.0

Post = Callable[..., tuple[list[tuple[str, Any]], float]]

#: What a provider can send to look alive without an event.
TRICKLES = {
    "comments": b": keep-alive\n",
    "blank-lines": b"\n",
    "a-line-that-never-ends": b"data: x",
    "single-bytes-of-a-comment": b":",
}


@pytest.fixture
def post(fake_workers_ai: FakeWorkersAI, serve: Serve) -> Post:
    """`post(**settings)`: one `/draft-reply/stream` request to the example app configured with
    `settings` (served once per settings); its events `(name, data)` and its wall time."""
    clients: dict[str, httpx.Client] = {}

    def call(**overrides: Any) -> tuple[list[tuple[str, Any]], float]:
        key = json.dumps(overrides, sort_keys=True)
        if key not in clients:
            settings = workers_ai_settings(
                fake_workers_ai, ai_stream_idle_timeout_s=IDLE_S, breaker_failure_threshold=1000, **overrides
            )
            clients[key] = serve(create_app(settings, sleep=no_sleep))
        started = time.monotonic()
        response = clients[key].post("/draft-reply/stream", json={"message": "Hi"}, timeout=30)
        elapsed = time.monotonic() - started
        events = []
        for block in response.text.split("\n\n"):
            lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
            if "event" in lines:
                events.append((lines["event"], json.loads(lines["data"])))
        return events, elapsed

    return call


def disconnected(server: FakeWorkersAI) -> bool:
    """Whether the server saw the client leave its last call, within SLACK_S."""
    return server.wait_for(lambda calls: bool(calls) and calls[-1].disconnected, SLACK_S)


def text(events: list[tuple[str, Any]]) -> str:
    return "".join(data["text"] for name, data in events if name == "delta")


@pytest.mark.parametrize("trickle", TRICKLES.values(), ids=TRICKLES.keys())
def test_bytes_without_an_event_end_the_stream_at_the_idle_timeout(
    post: Post, fake_workers_ai: FakeWorkersAI, trickle: bytes
) -> None:
    fake_workers_ai.script(
        MODEL, Stream(parts=(Text("Hello"), Text(" there")), stall_after=1, trickle=trickle)
    )
    events, elapsed = post(ai_timeout_s=10)
    assert text(events) == "Hello"
    name, data = events[-1]
    assert (name, data["guard"], data["reason"], data["detail"]) == (
        "error",
        "call",
        "provider_error",
        "stream interrupted after output",
    )
    assert IDLE_S <= elapsed < IDLE_S + SLACK_S
    assert disconnected(fake_workers_ai)


def test_a_trickle_before_the_first_word_is_a_stall(post: Post, fake_workers_ai: FakeWorkersAI) -> None:
    """Before any output the walk goes on: the stall is retried once (a transient failure), then
    the strict route answers 503, long before its 10 s deadline."""
    stalled = Stream(parts=(Text("Hello"),), stall_after=0, trickle=b": keep-alive\n")
    fake_workers_ai.script(MODEL, stalled, stalled)
    started = time.monotonic()
    events, _ = post(ai_timeout_s=10)
    assert events == []
    assert len(fake_workers_ai.calls) == 2
    assert time.monotonic() - started < 2 * IDLE_S + SLACK_S


def test_an_endless_stream_ends_at_the_time_limit(
    post: Post, fake_workers_ai: FakeWorkersAI, guards_log: LogLines
) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=(Text("la "),), endless=True, interval_s=0.01))
    events, elapsed = post(ai_stream_max_s=1.0)
    assert text(events).startswith("la la ")
    name, data = events[-1]
    assert (name, data["guard"], data["reason"], data["detail"]) == (
        "error",
        "call",
        "timeout",
        "the stream reached its time limit (1s)",
    )
    assert 1.0 <= elapsed < 1.0 + SLACK_S
    assert disconnected(fake_workers_ai)
    assert guards_log.wait_for(
        lambda: any('"route":"draft_reply_stream"' in line for line in guards_log.lines)
    )
    [request] = [e for e in guards_log.events("request") if e["route"] == "draft_reply_stream"]
    assert (request["outcome"], request["reason"], request["kind"]) == (
        "error",
        "timeout",
        "model_temporarily_unavailable",
    )


def test_an_endless_stream_ends_at_the_size_limit(post: Post, fake_workers_ai: FakeWorkersAI) -> None:
    """As fast as the fake can send: the client gets at most the limit, then `error`."""
    fake_workers_ai.script(MODEL, Stream(parts=(Text("la "),), endless=True))
    events, elapsed = post(ai_stream_max_chars=10_000)
    delivered = text(events)
    assert 9_000 < len(delivered) <= 10_000
    name, data = events[-1]
    assert (name, data["guard"], data["reason"], data["detail"]) == (
        "error",
        "call",
        "provider_error",
        "the stream reached its size limit (10000 characters)",
    )
    assert elapsed < SLACK_S
    assert disconnected(fake_workers_ai)


def test_a_stream_within_its_limits_is_whole(post: Post, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=(Text("la "),) * 100, interval_s=0.001))
    events, _ = post(ai_stream_max_chars=300, ai_stream_max_s=30)
    assert text(events) == "la " * 100
    assert events[-1][0] == "done"
    assert not fake_workers_ai.calls[-1].disconnected
