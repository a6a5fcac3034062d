"""Streaming routes over real HTTP: fall back before the first output, never after; cuts, in-band
errors, stalls and truncation end the stream with an `error` event; resume after a cut; empty
streams recover with one non-streaming call; a client that leaves cancels the upstream.

The route streams a Workers AI model (the `fake_workers_ai` server) with an OpenAI-compatible
fallback (`fake_openai`); each case counts the calls each server received."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fixtures import (
    Drop,
    Fail,
    FakeOpenAI,
    FakeWorkersAI,
    Meta,
    Reasoning,
    Reply,
    Stream,
    Text,
    ToolArgs,
    ToolName,
)
from guards import AI, Attempt, Breaker, EventStream, Guards
from guards.providers import OpenAICompatible, WorkersAI

from ..conftest import AppClient, LogLines, Serve, no_sleep, wait_until

PRIMARY = "@cf/test/model"
FALLBACK = "gpt-4o-mini"
ANSWER = Stream(parts=(Text("Your parcel"), Text(" is on"), Text(" its way.")))
IDLE_S = 0.4
#: Slack for a loaded machine on a bound a test measures.
SLACK_S = 2.0


class Ask(BaseModel):
    message: str


class Recorder:
    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)


@dataclass
class Events:
    """A streamed response, read to its end: its status and the events it carried."""

    status: int
    headers: httpx.Headers
    events: list[tuple[str, dict[str, Any]]]
    body: str

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    @property
    def text(self) -> str:
        return "".join(data["text"] for name, data in self.events if name == "delta")

    @property
    def last(self) -> tuple[str, dict[str, Any]]:
        return self.events[-1]


def parse_sse(body: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields["event"], json.loads(fields["data"])))
    return events


@pytest.fixture
def ledger() -> Recorder:
    return Recorder()


Post = Callable[..., Events]


@pytest.fixture
def client(
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    app_client: AppClient,
    ledger: Recorder,
) -> httpx.Client:
    """A client of a served app (a socket: clients here leave streams) whose `POST /stream`
    streams Workers AI first, then the OpenAI model."""
    guards = Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
            idle_timeout_s=IDLE_S,
        ),
        providers={
            "openai": OpenAICompatible(
                api_key=fake_openai.api_key, base_url=fake_openai.base_url, idle_timeout_s=IDLE_S
            )
        },
        sleep=no_sleep,
        ledger=ledger,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/stream")
    @guards.route(
        model=PRIMARY, fallbacks=[f"openai:{FALLBACK}"], timeout_s=5, breaker=Breaker(failure_threshold=100)
    )
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream({"messages": [{"role": "user", "content": body.message}]})

    return app_client(app, socket=True)


@pytest.fixture
def post(client: httpx.Client) -> Post:
    """`post()`: one request to the streaming route, read to its end."""

    def send() -> Events:
        response = client.post("/stream", json={"message": "Where is my parcel?"})
        body = response.text
        events = (
            parse_sse(body)
            if response.headers.get("content-type", "").startswith("text/event-stream")
            else []
        )
        return Events(response.status_code, response.headers, events, body)

    return send


def calls(server: FakeWorkersAI | FakeOpenAI) -> int:
    return len(server.calls)


# --- the table of cut positions -----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    primary: tuple[Any, ...]
    #: Before output: the fallback answers; after: the stream ends with an error event.
    committed: bool
    primary_calls: int
    #: The text the client keeps (after output) or None (the fallback's whole text).
    kept: str | None = None


CASES = {
    "cut-before-any-byte": Case((Drop(), Drop()), committed=False, primary_calls=2),
    "cut-after-stream-start-only": Case(
        (Stream(parts=(Meta(), Text("Hi")), cut_after=1),) * 2, committed=False, primary_calls=2
    ),
    "cut-after-tool-name-without-arguments": Case(
        (Stream(parts=(ToolName(0, "call_1", "lookup"), ToolArgs(0, '{"id": 7}')), cut_after=1),) * 2,
        committed=False,
        primary_calls=2,
    ),
    "cut-after-tool-arguments": Case(
        (
            Stream(
                parts=(ToolName(0, "call_1", "lookup"), ToolArgs(0, '{"id":'), ToolArgs(0, " 7}")),
                cut_after=2,
            ),
        ),
        committed=True,
        primary_calls=1,
        kept="",
    ),
    "cut-after-a-reasoning-delta": Case(
        (Stream(parts=(Reasoning("Let me think."), Text("Hello")), cut_after=1),),
        committed=True,
        primary_calls=1,
        kept="",
    ),
    "cut-after-one-text-character": Case(
        (Stream(parts=(Text("H"), Text("ello")), cut_after=1),), committed=True, primary_calls=1, kept="H"
    ),
    "in-band-error-as-first-event": Case(
        (Stream(parts=(Text("Hello"),), error_after=0, error_code=3040),) * 2,
        committed=False,
        primary_calls=2,
    ),
    "in-band-error-after-text": Case(
        (Stream(parts=(Text("Hel"), Text("lo")), error_after=1, error_code=3040),),
        committed=True,
        primary_calls=1,
        kept="Hel",
    ),
    "eof-without-done-after-text": Case(
        (Stream(parts=(Text("Hello"), Text(" there")), done=False),),
        committed=True,
        primary_calls=1,
        kept="Hello there",
    ),
    "eof-without-done-before-text": Case(
        (Stream(parts=(Meta(),), done=False),) * 2, committed=False, primary_calls=2
    ),
    "stall-after-text": Case(
        (Stream(parts=(Text("Hi"), Text(" there")), stall_after=1),),
        committed=True,
        primary_calls=1,
        kept="Hi",
    ),
    "stall-before-output": Case(
        (Stream(parts=(Meta(), Text("Hi")), stall_after=1),) * 2, committed=False, primary_calls=2
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cut_positions(
    case: Case, post: Post, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, ledger: Recorder
) -> None:
    fake_workers_ai.script(PRIMARY, *case.primary)
    fake_openai.script(FALLBACK, ANSWER)
    result = post()
    assert result.status == 200
    assert calls(fake_workers_ai) == case.primary_calls
    if case.committed:
        # The model was fixed at the first output: no other model, no replay.
        assert calls(fake_openai) == 0
        assert result.text == case.kept
        name, data = result.last
        assert name == "error"
        assert (data["guard"], data["reason"]) == ("call", "provider_error")
        assert data["detail"] == "stream interrupted after output"
        assert "done" not in result.names
        assert "x-ai-fallback" not in result.headers
    else:
        # The fallback answered; nothing of the failed model reached the client.
        assert calls(fake_openai) == 1
        assert result.text == ANSWER.text
        assert set(result.names) == {"delta", "done"}
        assert result.last[0] == "done"
        assert result.headers["x-ai-fallback"] == f"openai:{FALLBACK}"
        assert "lookup" not in result.body
    # Every call is in the ledger, the committed one with what it delivered.
    assert len(ledger.attempts) == calls(fake_workers_ai) + calls(fake_openai)


def test_an_uncut_stream_ends_with_done_carrying_usage_and_attribution(
    post: Post, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, ANSWER)
    result = post()
    assert result.status == 200
    assert result.text == ANSWER.text
    name, done = result.last
    assert name == "done"
    assert done["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert done["model"] == PRIMARY
    assert done["fallback_model"] is None
    assert done["attempts"] == 1
    assert done["trace_id"] == result.headers["x-trace-id"]
    assert result.headers["content-type"].startswith("text/event-stream")
    assert json.loads(json.dumps(fake_workers_ai.calls[0].inputs))["stream"] is True


def test_tool_calls_are_relayed_once_committed(post: Post, fake_workers_ai: FakeWorkersAI) -> None:
    parts = (ToolName(0, "call_1", "lookup"), ToolArgs(0, '{"id":'), ToolArgs(0, " 7}"))
    fake_workers_ai.script(PRIMARY, Stream(parts=parts, finish_reason="tool_calls"))
    result = post()
    tool_events = [data for name, data in result.events if name == "tool_call"]
    assert tool_events[0]["name"] == "lookup"
    assert "".join(e["arguments"] for e in tool_events) == '{"id": 7}'
    assert result.last[0] == "done"


def test_every_model_failing_before_output_is_a_real_error_status(
    post: Post, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
    fake_openai.script(FALLBACK, Fail(status=404))
    result = post()
    assert result.status == 502
    assert json.loads(result.body)["error"] == "model_incompatible"
    assert (calls(fake_workers_ai), calls(fake_openai)) == (1, 1)


def test_an_empty_stream_gets_one_non_streaming_recovery_call(
    post: Post, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    fake_workers_ai.script(PRIMARY, Stream(parts=()), Reply("Recovered answer."))
    result = post()
    assert result.status == 200
    assert result.text == "Recovered answer."
    assert result.last[0] == "done"
    first, second = fake_workers_ai.calls
    assert first.inputs.get("stream") is True
    assert "stream" not in second.inputs
    assert calls(fake_openai) == 0


def test_an_empty_stream_and_an_empty_recovery_is_empty_response(
    post: Post, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, Stream(parts=()), Reply(""))
    result = post()
    assert (result.status, json.loads(result.body)["error"]) == (502, "incompatible_model_response")
    assert calls(fake_workers_ai) == 2


def test_a_filtered_stream_before_output_is_moderation(
    post: Post, fake_openai: FakeOpenAI, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
    fake_openai.script(FALLBACK, Stream(parts=(Meta(),), finish_reason="content_filter"))
    result = post()
    assert (result.status, json.loads(result.body)["error"]) == (502, "incompatible_model_response")


def test_a_lone_surrogate_in_the_first_output_is_a_rejected_answer(
    post: Post,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    ledger: Recorder,
    guards_log: LogLines,
) -> None:
    """Before anything was sent, a `\\ud800` escape rejects the answer, as in a whole one: a
    502 with a real status (never a stream cut, nor a 500), the upstream closed, the model
    up; the request is never logged `ok`."""
    fake_workers_ai.script(PRIMARY, Stream(parts=(Text("\ud800Your parcel"), Text(" is on its way."))))
    result = post()
    assert (result.status, json.loads(result.body)["error"]) == (502, "incompatible_model_response")
    assert (calls(fake_workers_ai), calls(fake_openai)) == (1, 0)
    assert [(a.model, a.outcome) for a in ledger.attempts] == [(PRIMARY, "ok")]
    (line,) = guards_log.events("request")
    assert (line["outcome"], line["reason"]) == ("error", "schema_invalid")


def test_a_lone_surrogate_after_the_first_output_is_sent_as_a_replacement_character(
    post: Post, fake_workers_ai: FakeWorkersAI, ledger: Recorder
) -> None:
    """After the first output the client has the answer's start: a lone surrogate in a text,
    reasoning or tool-call part is sent as U+FFFD, and the stream completes."""
    parts = (
        Text("Your parcel"),
        Text(" is \udc00on"),
        Reasoning("hm\ud800"),
        ToolName(0, "call_\ud801", "lookup"),
        ToolArgs(0, '{"id": "\udfff"}'),
    )
    fake_workers_ai.script(PRIMARY, Stream(parts=parts, finish_reason="tool_calls"))
    result = post()
    assert result.status == 200
    assert result.text == "Your parcel is \ufffdon"
    assert [data for name, data in result.events if name == "reasoning"] == [{"text": "hm\ufffd"}]
    tools = [data for name, data in result.events if name == "tool_call"]
    assert tools[0]["id"] == "call_\ufffd"
    assert "".join(tool["arguments"] for tool in tools) == '{"id": "\ufffd"}'
    assert result.last[0] == "done"
    assert [a.outcome for a in ledger.attempts] == ["ok"]


def test_a_client_that_leaves_after_three_deltas_cancels_the_upstream(
    client: httpx.Client,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    ledger: Recorder,
    guards_log: LogLines,
) -> None:
    parts = tuple(Text(f"word{i} ") for i in range(50))
    fake_workers_ai.script(PRIMARY, Stream(parts=parts, interval_s=0.05))
    # Its own client: the connection closes when the block ends.
    own = httpx.Client(base_url=client.base_url, timeout=10)
    with own, own.stream("POST", "/stream", json={"message": "hi"}) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("event: delta"):
                seen += 1
                if seen == 3:
                    break
    assert fake_workers_ai.wait_for(lambda c: c and c[0].disconnected, timeout=5), "upstream not cancelled"
    assert guards_log.wait_for(lambda: guards_log.events("request"), timeout=5)
    (line,) = guards_log.events("request")
    assert line["outcome"] == "cancelled"
    assert calls(fake_openai) == 0
    (attempt,) = ledger.attempts
    assert attempt.outcome == "cancelled"
    assert attempt.delivered_chars is not None
    assert attempt.delivered_chars >= len("word0 word1 word2 ")


class CancelAfter:
    """ASGI middleware that cancels the request's task right after its `n`th body message, as a
    server does to the requests still running at the end of its graceful shutdown (uvicorn's
    `--timeout-graceful-shutdown`): the cancellation lands at the response's next wait. With
    `stall`, the client then takes nothing more: every later message waits forever."""

    def __init__(self, app: ASGIApp, n: int, stall: bool = False) -> None:
        self.app = app
        self.n = n
        self.stall = stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = 0

        async def counted(message: Message) -> None:
            nonlocal sent
            if self.stall and sent == self.n:
                await asyncio.Event().wait()  # until the request is cancelled again
            await send(message)
            if message["type"] == "http.response.body":
                sent += 1
                if sent == self.n:
                    task = asyncio.current_task()
                    assert task is not None
                    task.cancel()

        await self.app(scope, receive, counted)


#: What each stream of these tests sends, 50 ms apart.
WORDS_50 = tuple(Text(f"word{i} ") for i in range(50))


@pytest.fixture
def cancelled_post(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, ledger: Recorder
) -> Callable[..., httpx.Client]:
    """`cancelled_post(n, stall=False)`: a client of an app whose server (`CancelAfter`) cancels
    a request after its `n`th body message, the route streaming `WORDS_50` from Workers AI."""

    def make(n: int, stall: bool = False) -> httpx.Client:
        fake_workers_ai.script(PRIMARY, Stream(parts=WORDS_50, interval_s=0.05))
        guards = Guards(
            WorkersAI(
                account_id=fake_workers_ai.account_id,
                api_token=fake_workers_ai.api_token,
                base_url=fake_workers_ai.base_url,
            ),
            ledger=ledger,
        )
        app = FastAPI()
        guards.install(app)
        app.add_middleware(CancelAfter, n=n, stall=stall)

        @app.post("/stream")
        @guards.route(model=PRIMARY, timeout_s=5)
        async def stream(body: Ask, ai: AI[str]) -> EventStream:
            return await ai.stream({"messages": [{"role": "user", "content": body.message}]})

        return app_client(app, socket=True)

    return make


def assert_cut_by_the_server(
    n: int, fake_workers_ai: FakeWorkersAI, ledger: Recorder, guards_log: LogLines
) -> None:
    """The provider's stream was closed, the request logged as cut by the shutdown, and the
    attempt recorded as cancelled with the `n` events' text delivered."""
    assert fake_workers_ai.wait_for(lambda c: c and c[0].disconnected, timeout=5), "upstream not closed"
    assert guards_log.wait_for(lambda: guards_log.events("request"), timeout=5)
    (line,) = guards_log.events("request")
    assert (line["outcome"], line["reason"], line["cut"]) == ("error", "timeout", "shutdown")
    (attempt,) = ledger.attempts
    assert attempt.outcome == "cancelled"
    assert attempt.delivered_chars == len("".join(t.text for t in WORDS_50[:n]))


#: After the 3rd event the relay waits on the provider's next one; after the 4th the response
#: takes its turn of the event loop (`EventStream` takes one every 4 events) first.
@pytest.mark.parametrize("n", [3, 4], ids=["waiting-on-the-provider", "between-two-events"])
def test_a_stream_the_server_cancels_while_its_client_reads_ends_with_the_error_event(
    n: int,
    cancelled_post: Callable[..., httpx.Client],
    fake_workers_ai: FakeWorkersAI,
    ledger: Recorder,
    guards_log: LogLines,
) -> None:
    response = cancelled_post(n).post("/stream", json={"message": "Where is my parcel?"})
    events = parse_sse(response.text)  # the response is complete: its last chunk came
    assert [name for name, _ in events] == ["delta"] * n + ["error"]
    _, data = events[-1]
    assert (data["guard"], data["reason"]) == ("call", "timeout")
    assert "server is stopping" in data["detail"]
    assert data["trace_id"] == response.headers["x-trace-id"]
    assert_cut_by_the_server(n, fake_workers_ai, ledger, guards_log)


def test_a_cut_stream_whose_client_takes_nothing_more_ends_within_the_bound(
    cancelled_post: Callable[..., httpx.Client],
    fake_workers_ai: FakeWorkersAI,
    ledger: Recorder,
    guards_log: LogLines,
) -> None:
    """The stream's last events wait for a client that does not take them for `CUT_WRITE_S`
    (1 s) at most: then the cancellation goes on (the connection is closed unfinished), the
    request settled and logged all the same."""
    client = cancelled_post(3, stall=True)
    started = time.monotonic()
    with pytest.raises(httpx.RemoteProtocolError):
        client.post("/stream", json={"message": "Where is my parcel?"}, timeout=10)
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert_cut_by_the_server(3, fake_workers_ai, ledger, guards_log)


# --- resume -------------------------------------------------------------------------------------


@pytest.fixture
def resume_post(fake_gateway: FakeOpenAI, serve: Serve, ledger: Recorder) -> Post:
    guards = Guards(
        OpenAICompatible(api_key=fake_gateway.api_key, base_url=fake_gateway.base_url, idle_timeout_s=IDLE_S),
        sleep=no_sleep,
        ledger=ledger,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/stream")
    @guards.route(model=FALLBACK, timeout_s=5)
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": body.message})

    client = serve(app)

    def send() -> Events:
        response = client.post("/stream", json={"message": "hi"})
        return Events(response.status_code, response.headers, parse_sse(response.text), response.text)

    return send


WORDS = tuple(Text(w) for w in ("One", " two", " three", " four", " five"))


@pytest.mark.parametrize("delivered", [2, 3])
def test_resume_after_a_cut_continues_without_gap_or_duplicate(
    delivered: int, resume_post: Post, fake_gateway: FakeOpenAI
) -> None:
    fake_gateway.script(FALLBACK, Stream(parts=WORDS, resumable=True, cut_after=delivered, partial_tail=True))
    result = resume_post()
    assert result.text == "One two three four five"
    assert result.last[0] == "done"
    assert [position for _, position in fake_gateway.resumes] == [delivered]
    assert len(fake_gateway.calls) == 1


def test_reconnects_exhausted_end_with_the_error_event(resume_post: Post, fake_gateway: FakeOpenAI) -> None:
    fake_gateway.script(FALLBACK, Stream(parts=WORDS, resumable=True, cut_after=2, resume_cuts=(0,) * 10))
    result = resume_post()
    assert result.text == "One two"
    assert result.last[0] == "error"
    assert len(fake_gateway.resumes) == 5


def test_an_expired_run_ends_with_the_error_event(resume_post: Post, fake_gateway: FakeOpenAI) -> None:
    fake_gateway.script(FALLBACK, Stream(parts=WORDS, resumable=True, cut_after=2, interval_s=0.2))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(resume_post)
        # The run exists once the answer started; expire it before the cut (0.4 s later).
        assert fake_gateway.wait_for(lambda calls: calls, timeout=5)
        wait_until(lambda: fake_gateway.run_ids)
        fake_gateway.expire_runs()
        result = pending.result(timeout=10)
    assert result.text == "One two"
    assert result.last[0] == "error"
    assert [position for _, position in fake_gateway.resumes] == [2]
