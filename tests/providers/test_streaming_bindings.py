"""Streaming bindings (`WorkersAI.stream`, `OpenAICompatible.stream`, `FakeBinding.stream`)
against the fake HTTP servers and in-process, plus the SSE parser they share.

The contract (guards/contracts/_stream.py): deltas as the bytes arrive, then exactly one `StreamEnd`;
every failure a `ProviderError` (an error status, an in-band error after HTTP 200, a truncated
body, a stall), never with the provider's text; closing the iterator closes the connection; a
cut stream behind AI Gateway resumes with no gap and no duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from fixtures import (
    Drop,
    Fail,
    FakeBinding,
    FakeOpenAI,
    FakeWorkersAI,
    Hang,
    Meta,
    Raw,
    Reasoning,
    Reply,
    Script,
    Stream,
    Text,
    ToolArgs,
    ToolName,
)
from fixtures.script import Outcome
from guards import (
    ConfigurationError,
    Kind,
    ProviderError,
    ReasoningDelta,
    StreamEnd,
    StreamEvent,
    StreamingBinding,
    TextDelta,
    ToolCallDelta,
    Usage,
    classify,
    is_output,
)
from guards.providers import EventTooLarge, OpenAICompatible, SSEEvent, SSEParser, WorkersAI

WORKERS_MODEL = "@cf/meta/llama-3.3-70b-instruct-fp8-fast"
OPENAI_MODEL = "gpt-4o-mini"
INPUTS: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}]}
CANARY = "CANARY-PROVIDER-TEXT"
USAGE = Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15)
PARTS = (Text("The "), Text("quick "), Text("brown "), Text("fox "), Text("jumps."))
WHOLE_TEXT = "The quick brown fox jumps."


# --- targets: the three bindings behind one face ------------------------------------------------


@dataclass
class Target:
    """A streaming binding and the fake that scripts it."""

    kind: str
    fake: Script
    model: str
    factory: Callable[..., Any]

    @property
    def http(self) -> bool:
        return self.kind != "fake"

    @property
    def chunks(self) -> bool:
        """Whether the wire is OpenAI's chunks (which carry `finish_reason` and `model`)."""
        return self.kind != "workers-ai"

    def script(self, *outcomes: Outcome) -> None:
        self.fake.script(self.model, *outcomes)

    def stream(
        self, outcome: Outcome | None = None, *, inputs: dict[str, Any] = INPUTS, **overrides: Any
    ) -> list[StreamEvent]:
        events, error = self.attempt(outcome, inputs=inputs, **overrides)
        if error is not None:
            raise error
        return events

    def attempt(
        self, outcome: Outcome | None = None, *, inputs: dict[str, Any] = INPUTS, **overrides: Any
    ) -> tuple[list[StreamEvent], ProviderError | None]:
        """One stream through a fresh binding: the events received, and the failure if any."""
        if outcome is not None:
            self.script(outcome)

        async def go() -> tuple[list[StreamEvent], ProviderError | None]:
            binding = self.factory(**overrides)
            events: list[StreamEvent] = []
            try:
                async for event in binding.stream(self.model, inputs):
                    events.append(event)
            except ProviderError as error:
                return events, error
            finally:
                await binding.aclose()
            return events, None

        return asyncio.run(go())

    def failure(self, outcome: Outcome | None = None, **overrides: Any) -> ProviderError:
        _, error = self.attempt(outcome, **overrides)
        assert error is not None, "the stream did not fail"
        return error

    def run_failure(self, outcome: Outcome) -> ProviderError:
        self.script(outcome)

        async def go() -> ProviderError:
            binding = self.factory()
            try:
                with pytest.raises(ProviderError) as info:
                    await binding.run(self.model, INPUTS)
                return info.value
            finally:
                await binding.aclose()

        return asyncio.run(go())


def workers_ai_target(server: FakeWorkersAI, kind: str = "workers-ai", **defaults: Any) -> Target:
    def make(**overrides: Any) -> WorkersAI:
        options = {
            "account_id": server.account_id,
            "api_token": server.api_token,
            "base_url": server.base_url,
            **defaults,
            **overrides,
        }
        return WorkersAI(**options)

    return Target(kind, server, WORKERS_MODEL, make)


def openai_target(server: FakeOpenAI, kind: str = "openai") -> Target:
    def make(**overrides: Any) -> OpenAICompatible:
        return OpenAICompatible(**{"api_key": server.api_key, "base_url": server.base_url, **overrides})

    return Target(kind, server, OPENAI_MODEL, make)


def fake_target(fake: FakeBinding) -> Target:
    return Target("fake", fake, WORKERS_MODEL, lambda **_: fake)


@contextlib.contextmanager
def serving(kind: str) -> Iterator[Target]:
    """The target of `kind`: `fake` (in-process), `workers-ai` (native events),
    `workers-ai-chunks` (OpenAI-style chunks on Workers AI) or `openai`."""
    if kind == "fake":
        yield fake_target(FakeBinding())
    elif kind == "openai":
        with FakeOpenAI() as server:
            yield openai_target(server)
    else:
        with FakeWorkersAI(openai_chunks=kind == "workers-ai-chunks") as server:
            yield workers_ai_target(server, kind)


@pytest.fixture(params=["fake", "workers-ai", "workers-ai-chunks", "openai"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    with serving(request.param) as served:
        yield served


@pytest.fixture(params=["workers-ai", "workers-ai-chunks", "openai"])
def http_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    with serving(request.param) as served:
        yield served


@pytest.fixture(params=["fake", "workers-ai-chunks", "openai"])
def chunk_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The targets whose wire is OpenAI's chunks (which carry `finish_reason` and `model`)."""
    with serving(request.param) as served:
        yield served


@pytest.fixture(params=["workers-ai-chunks", "openai"])
def chunk_http_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    with serving(request.param) as served:
        yield served


@pytest.fixture(params=["workers-ai", "gateway"])
def gateway(request: pytest.FixtureRequest) -> Iterator[tuple[Target, FakeWorkersAI | FakeOpenAI]]:
    """A target whose streams can resume: Workers AI told where to resume, or the AI Gateway
    compat endpoint (resume address derived from its base URL)."""
    if request.param == "gateway":
        with FakeOpenAI(gateway=True) as server:
            yield openai_target(server, "gateway"), server
    else:
        with FakeWorkersAI() as workers:
            yield workers_ai_target(workers, resume_base=workers.base_url), workers


def texts(events: list[StreamEvent]) -> list[str]:
    return [e.text for e in events if isinstance(e, TextDelta)]


def only_end(events: list[StreamEvent]) -> StreamEnd:
    """The stream's `StreamEnd`: exactly one, and last."""
    ends = [e for e in events if isinstance(e, StreamEnd)]
    assert len(ends) == 1
    assert events[-1] is ends[0]
    return ends[0]


def assert_no_canary(error: ProviderError) -> None:
    for text in (str(error), repr(error), error.describe(), error.note, *map(str, error.args)):
        assert CANARY not in text


def wait_disconnected(fake: Script) -> bool:
    return fake.wait_for(lambda calls: bool(calls) and calls[-1].disconnected, 5)


# --- the happy path -----------------------------------------------------------------------------


def test_bindings_are_streaming_bindings() -> None:
    async def scenario() -> None:
        bindings = [
            FakeBinding(),
            WorkersAI(account_id="a", api_token="t"),
            OpenAICompatible(api_key=None, base_url="http://127.0.0.1:9"),
        ]
        for binding in bindings:
            assert isinstance(binding, StreamingBinding)
            await binding.aclose()

    asyncio.run(scenario())


def test_text_deltas_arrive_in_order_then_one_end_with_usage(target: Target) -> None:
    events = target.stream(Stream(PARTS))
    assert texts(events) == [p.text for p in PARTS]
    assert "".join(texts(events)) == WHOLE_TEXT
    end = only_end(events)
    assert end.usage == USAGE
    assert end.finish_reason == ("stop" if target.chunks else None)


def test_default_reply_streams_as_its_text(target: Target) -> None:
    events = target.stream()
    assert "".join(texts(events)) == Reply().response
    assert only_end(events).usage == USAGE


def test_end_names_the_model_that_served(target: Target) -> None:
    """OpenAI chunks name the model; Workers AI's native events do not (the requested one)."""
    end = only_end(target.stream(Stream(PARTS, model="served-model-2024")))
    assert end.model == ("served-model-2024" if target.chunks else target.model)


def test_the_request_asks_for_a_stream(target: Target) -> None:
    target.stream(Stream(PARTS))
    inputs = target.fake.calls[-1].inputs
    assert inputs["stream"] is True
    if target.kind == "openai":
        assert inputs["stream_options"] == {"include_usage": True}
        assert inputs["messages"] == INPUTS["messages"]
    else:
        assert inputs == {**INPUTS, "stream": True}


def test_reasoning_and_tool_call_deltas(target: Target) -> None:
    parts = [
        Meta(),
        Reasoning("Looking it up."),
        ToolName(0, "call_1", "lookup"),
        ToolArgs(0, '{"q": '),
        ToolArgs(0, '"fox"}'),
        Text("Done."),
    ]
    events = target.stream(Stream(parts, finish_reason="tool_calls"))
    assert events[:-1] == [
        ReasoningDelta("Looking it up."),
        ToolCallDelta(0, id="call_1", name="lookup"),
        ToolCallDelta(0, arguments='{"q": '),
        ToolCallDelta(0, arguments='"fox"}'),
        TextDelta("Done."),
    ]
    assert [is_output(e) for e in events] == [True, False, True, True, True, False]
    assert only_end(events).finish_reason == ("tool_calls" if target.chunks else None)


def test_preamble_only_first_event_yields_nothing(target: Target) -> None:
    """OpenAI's role-only first chunk (Workers AI: an empty response) is no event at all."""
    events = target.stream(Stream([Meta(), Text("Hi.")]))
    assert events[0] == TextDelta("Hi.")


def test_content_filter_is_reported_in_the_end(chunk_target: Target) -> None:
    end = only_end(chunk_target.stream(Stream([Text("I can")], finish_reason="content_filter")))
    assert end.finish_reason == "content_filter"


def test_workers_ai_reads_both_shapes_in_one_stream() -> None:
    """The shape is detected per event: native events and OpenAI-style chunks may mix."""
    body = (
        b'data: {"response": "Hel"}\n\n'
        b'data: {"object": "chat.completion.chunk", "model": "m2", '
        b'"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": null}]}\n\n'
        b'data: {"response": "", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]}\n\n'
        b'data: {"response": "", "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}\n\n'
        b"data: [DONE]\n\n"
    )
    with FakeWorkersAI() as server:
        events = workers_ai_target(server).stream(Raw(200, body, "text/event-stream"))
    assert events == [
        TextDelta("Hel"),
        TextDelta("lo"),
        ToolCallDelta(0, name="f", arguments='{"a": 1}'),
        StreamEnd(usage=Usage(1, 2, 3), model="m2"),
    ]


def test_workers_ai_null_finalization_tool_chunk_is_skipped() -> None:
    body = (
        b'data: {"response": "", "tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}\n\n'
        b'data: {"response": "", "tool_calls": [{"id": null, "type": null, "function": {"name": null}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    with FakeWorkersAI() as server:
        events = workers_ai_target(server).stream(Raw(200, body, "text/event-stream"))
    assert events == [ToolCallDelta(0, id="c", name="f"), StreamEnd(model=WORKERS_MODEL)]


def test_a_json_answer_to_a_stream_request_is_one_delta(http_target: Target) -> None:
    """Workers AI in JSON mode answers with one JSON body even when asked to stream."""
    if http_target.kind == "openai":
        outcome = Raw(
            200,
            json.dumps(
                {
                    "model": "served",
                    "choices": [{"message": {"content": '{"a": 1}'}, "finish_reason": "stop"}],
                }
            ).encode(),
            "application/json",
        )
    else:
        body = {"result": {"response": {"a": 1}}, "success": True, "errors": []}
        outcome = Raw(200, json.dumps(body).encode(), "application/json")
    events = http_target.stream(outcome)
    assert json.loads("".join(texts(events))) == {"a": 1}
    only_end(events)


def test_fake_binding_plays_like_the_chunk_wires() -> None:
    """The in-process fake and both HTTP servers give the same events for one script."""
    outcome = Stream(
        [Meta(), Reasoning("r"), Text("a"), ToolName(1, "c", "f"), ToolArgs(1, "{}"), Text("b")],
        finish_reason="length",
        model="served",
    )
    fake = fake_target(FakeBinding()).stream(outcome)
    with FakeWorkersAI(openai_chunks=True) as workers, FakeOpenAI() as openai:
        over_workers = workers_ai_target(workers).stream(outcome)
        over_openai = openai_target(openai).stream(outcome)
    assert fake == over_workers == over_openai
    assert only_end(fake) == StreamEnd("length", USAGE, "served")


def test_connection_is_reused_after_a_complete_stream(http_target: Target) -> None:
    """Also when the consumer stops at the end and closes the iterator there."""
    http_target.script(Stream(PARTS), Stream(PARTS), Stream(PARTS))

    async def thrice() -> None:
        binding = http_target.factory()
        try:
            whole = [e async for e in binding.stream(http_target.model, INPUTS)]
            assert "".join(texts(whole)) == WHOLE_TEXT
            events = binding.stream(http_target.model, INPUTS)
            async for event in events:
                if isinstance(event, StreamEnd):
                    break
            await events.aclose()
            whole = [e async for e in binding.stream(http_target.model, INPUTS)]
            assert "".join(texts(whole)) == WHOLE_TEXT
        finally:
            await binding.aclose()

    asyncio.run(thrice())
    assert isinstance(http_target.fake, FakeWorkersAI | FakeOpenAI)
    assert http_target.fake.connections == 1
    assert not any(call.disconnected for call in http_target.fake.calls)


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("after", [0, 2], ids=["first-event", "after-text"])
def test_in_band_error_raises_with_status_200_and_its_code(target: Target, after: int) -> None:
    outcome = Stream(PARTS, error_after=after, error_code=3040, error_message=f"AiError: {CANARY} (1234)")
    events, error = target.attempt(outcome)
    assert error is not None
    assert (error.status, error.code) == (200, 3040)
    assert texts(events) == [p.text for p in PARTS[:after]]
    assert not any(isinstance(e, StreamEnd) for e in events)
    assert_no_canary(error)


def test_in_band_error_without_a_code(target: Target) -> None:
    error = target.failure(Stream(PARTS, error_after=1, error_message=CANARY))
    assert (error.status, error.code) == (200, None)
    assert_no_canary(error)


def test_openai_in_band_error_keeps_only_a_safe_token() -> None:
    with FakeOpenAI() as server:
        error = openai_target(server).failure(Stream(PARTS, error_after=1, error_message=CANARY))
    assert (error.provider, error.status, error.note) == ("openai", 200, "server_error")


def test_event_named_error_is_a_failure() -> None:
    body = b'data: {"response": "a"}\n\nevent: error\ndata: {"type": "overloaded_error"}\n\n'
    with FakeWorkersAI() as server:
        events, error = workers_ai_target(server).attempt(Raw(200, body, "text/event-stream"))
    assert events == [TextDelta("a")]
    assert error is not None
    assert (error.status, error.note) == (200, "error event")


def test_body_ending_without_the_completion_signal_is_truncated(target: Target) -> None:
    events, error = target.attempt(Stream(PARTS, done=False))
    assert error is not None
    assert (error.status, error.note) == (None, "stream truncated")
    assert "".join(texts(events)) == WHOLE_TEXT
    verdict = classify(error)
    assert (verdict.kind, verdict.retryable) == (Kind.model_temporarily_unavailable, True)


def test_cut_connection_is_truncated(target: Target) -> None:
    events, error = target.attempt(Stream(PARTS, cut_after=2))
    assert error is not None
    assert (error.status, error.note) == (None, "stream truncated")
    assert texts(events) == ["The ", "quick "]


def test_partial_trailing_event_is_discarded_and_truncated(target: Target) -> None:
    events, error = target.attempt(Stream(PARTS, cut_after=2, partial_tail=True))
    assert error is not None
    assert error.note == "stream truncated"
    assert texts(events) == ["The ", "quick "]


def test_partial_trailing_event_at_a_clean_eof_is_truncated(http_target: Target) -> None:
    body = b'data: {"response": "a", "choices": [{"delta": {"content": "a"}}]}\n\ndata: {"response": "b'
    events, error = http_target.attempt(Raw(200, body, "text/event-stream"))
    assert error is not None
    assert error.note == "stream truncated"
    assert texts(events) == ["a"]


@pytest.mark.parametrize(
    "marker", [b"[DONE] ", b"[DONE]\t", b"[DONE]  \r"], ids=["space", "tab", "spaces-cr"]
)
def test_the_end_marker_tolerates_trailing_whitespace(http_target: Target, marker: bytes) -> None:
    """`data: [DONE] ` ends the stream, as the official OpenAI client reads it."""
    body = b'data: {"response": "a", "choices": [{"delta": {"content": "a"}}]}\n\ndata: ' + marker + b"\n\n"
    events = http_target.stream(Raw(200, body, "text/event-stream"))
    assert texts(events) == ["a"]
    only_end(events)


def test_finish_reason_then_eof_is_complete(chunk_http_target: Target) -> None:
    """A stream that ends after a `finish_reason` is complete, without usage or `[DONE]`."""
    chunk = {"model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    finish = {"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (chunk, finish))
    events = chunk_http_target.stream(Raw(200, body, "text/event-stream"))
    assert events == [TextDelta("hi"), StreamEnd("length", None, "m")]


def test_finish_reason_then_a_cut_is_complete(chunk_target: Target) -> None:
    events = chunk_target.stream(Stream(PARTS, cut_after=len(PARTS) + 1))  # the parts and the finish chunk
    assert "".join(texts(events)) == WHOLE_TEXT
    assert only_end(events) == StreamEnd("stop", None, chunk_target.model)


def test_stall_fails_within_the_idle_timeout(target: Target) -> None:
    started = time.monotonic()
    events, error = target.attempt(Stream(PARTS, stall_after=2, stall_s=0.2), idle_timeout_s=0.2)
    elapsed = time.monotonic() - started
    assert error is not None
    assert (error.status, error.note) == (None, "stream stalled")
    assert classify(error).retryable
    assert texts(events) == ["The ", "quick "]
    assert 0.15 <= elapsed < 2.0
    if target.http:
        assert wait_disconnected(target.fake)


@pytest.mark.parametrize(
    "trickle",
    [b": keep-alive\n", b"\n", b"data: x", b":"],
    ids=["comments", "blank-lines", "a-line-that-never-ends", "bytes-of-a-comment"],
)
def test_bytes_without_a_complete_event_are_a_stall(http_target: Target, trickle: bytes) -> None:
    """Idle means no complete event: a provider trickling bytes every 20 ms is still idle."""
    started = time.monotonic()
    outcome = Stream(PARTS, stall_after=2, trickle=trickle, trickle_s=0.02)
    events, error = http_target.attempt(outcome, idle_timeout_s=0.3)
    elapsed = time.monotonic() - started
    assert error is not None
    assert (error.status, error.note) == (None, "stream stalled")
    assert texts(events) == ["The ", "quick "]
    assert 0.25 <= elapsed < 2.0
    assert wait_disconnected(http_target.fake)


def test_a_slow_consumer_is_not_a_stall(http_target: Target) -> None:
    """Time the consumer holds the stream is not the provider's: events that came promptly are
    no stall, however long the consumer takes with each."""
    http_target.script(Stream(PARTS))

    async def slowly() -> list[StreamEvent]:
        binding = http_target.factory(idle_timeout_s=0.2)
        received = []
        try:
            async for event in binding.stream(http_target.model, INPUTS):
                received.append(event)
                await asyncio.sleep(0.3)
        finally:
            await binding.aclose()
        return received

    events = asyncio.run(slowly())
    assert "".join(texts(events)) == WHOLE_TEXT
    only_end(events)


def test_stall_before_the_answer_head(http_target: Target) -> None:
    """No byte at all for the idle timeout is a stall too (the first-byte wait included)."""
    error = http_target.failure(Hang(), idle_timeout_s=0.2)
    assert error.note == "stream stalled"
    assert wait_disconnected(http_target.fake)


@pytest.mark.parametrize(
    "outcome",
    [
        pytest.param(Fail(code=3040, status=429, retry_after="7", message=CANARY), id="429-retry-after"),
        pytest.param(Fail(status=503, message=CANARY), id="503"),
        pytest.param(Fail(code=10000, status=401, message=CANARY), id="401"),
        pytest.param(Fail(code=3036, status=429, message=CANARY, shape="gateway"), id="gateway-envelope"),
        pytest.param(Fail(code=5006, status=200, message=CANARY), id="failure-with-200"),
        pytest.param(Raw(502, f"<html>{CANARY}</html>".encode()), id="html-502"),
        pytest.param(Drop(), id="drop"),
    ],
)
def test_error_before_the_body_fails_like_run(target: Target, outcome: Outcome) -> None:
    streamed = target.failure(outcome)
    ran = target.run_failure(outcome)
    facts = ("provider", "code", "status", "retry_after_s", "json_mode_failed", "quota_exhausted", "note")
    assert [getattr(streamed, f) for f in facts] == [getattr(ran, f) for f in facts]
    assert_no_canary(streamed)


def test_error_status_keeps_retry_after(target: Target) -> None:
    error = target.failure(Fail(code=3040, status=429, retry_after="7"))
    assert (error.status, error.retry_after_s) == (429, 7)


def test_wrong_credentials_fail_before_the_body(http_target: Target) -> None:
    key = "api_key" if http_target.kind == "openai" else "api_token"
    error = http_target.failure(**{key: "wrong"})
    assert error.status == 401


def test_connection_refused_is_a_transport_failure() -> None:
    with FakeWorkersAI() as server:
        target = workers_ai_target(server)
    error = target.failure()
    assert error.transport
    assert error.note == "ConnectError"


def test_oversized_event_is_refused(http_target: Target) -> None:
    error = http_target.failure(Stream([Text("y" * 500)]), max_body_bytes=200)
    assert error.status == 200
    assert "over 200 bytes" in error.note


@pytest.mark.parametrize(
    ("option", "value"),
    [("idle_timeout_s", 0), ("idle_timeout_s", -1.0), ("max_reconnects", -1)],
)
def test_bad_stream_options_are_a_configuration_error(option: str, value: float) -> None:
    with pytest.raises(ConfigurationError):
        WorkersAI(account_id="a", api_token="t", **{option: value})
    with pytest.raises(ConfigurationError):
        OpenAICompatible(api_key=None, base_url="http://127.0.0.1:9", **{option: value})


# --- cancellation -------------------------------------------------------------------------------


def test_closing_the_iterator_closes_the_connection(target: Target) -> None:
    target.script(Stream(PARTS, stall_after=2))

    async def scenario() -> None:
        binding = target.factory()
        try:
            events = binding.stream(target.model, INPUTS)
            assert await anext(events) == TextDelta("The ")
            assert await anext(events) == TextDelta("quick ")
            await events.aclose()
            assert await asyncio.to_thread(wait_disconnected, target.fake)
            # The binding is still usable afterwards.
            assert "".join(texts([e async for e in binding.stream(target.model, INPUTS)])) == Reply().response
        finally:
            await binding.aclose()

    asyncio.run(scenario())


def test_cancelling_the_consumer_closes_the_connection(target: Target) -> None:
    target.script(Stream(PARTS, stall_after=1))
    received: list[StreamEvent] = []

    async def consume(binding: Any) -> None:
        async for event in binding.stream(target.model, INPUTS):
            received.append(event)

    async def scenario() -> None:
        binding = target.factory()
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(consume(binding), 0.3)
            assert await asyncio.to_thread(wait_disconnected, target.fake)
        finally:
            await binding.aclose()

    asyncio.run(scenario())
    assert received == [TextDelta("The ")]


def test_a_finished_stream_is_not_a_disconnect(target: Target) -> None:
    target.stream(Stream(PARTS))
    assert not target.fake.calls[-1].disconnected


# --- resume (Cloudflare AI Gateway) ------------------------------------------------------------


@pytest.mark.parametrize("partial_tail", [False, True], ids=["clean-cut", "partial-tail"])
@pytest.mark.parametrize("cut_after", [2, 3])
def test_a_cut_stream_resumes_without_gap_or_duplicate(
    gateway: tuple[Target, FakeWorkersAI | FakeOpenAI], cut_after: int, partial_tail: bool
) -> None:
    target, server = gateway
    events = target.stream(Stream(PARTS, resumable=True, cut_after=cut_after, partial_tail=partial_tail))
    assert texts(events) == [p.text for p in PARTS]
    assert "".join(texts(events)) == WHOLE_TEXT
    assert only_end(events).usage == USAGE
    [run_id] = server.run_ids
    assert server.resumes == [(run_id, cut_after)]
    assert len(server.calls) == 1


def test_a_resumed_stream_can_be_cut_again(gateway: tuple[Target, FakeWorkersAI | FakeOpenAI]) -> None:
    target, server = gateway
    outcome = Stream(PARTS, resumable=True, cut_after=1, partial_tail=True, resume_cuts=[2, 1])
    events = target.stream(outcome)
    assert "".join(texts(events)) == WHOLE_TEXT
    [run_id] = server.run_ids
    assert server.resumes == [(run_id, 1), (run_id, 3), (run_id, 4)]


def test_a_cut_after_the_last_text_resumes_the_ending(
    gateway: tuple[Target, FakeWorkersAI | FakeOpenAI],
) -> None:
    target, server = gateway
    events = target.stream(Stream(PARTS, resumable=True, cut_after=len(PARTS)))
    assert "".join(texts(events)) == WHOLE_TEXT
    assert only_end(events).usage == USAGE
    assert [start for _, start in server.resumes] == [len(PARTS)]


def test_reconnects_are_bounded(gateway: tuple[Target, FakeWorkersAI | FakeOpenAI]) -> None:
    target, server = gateway
    outcome = Stream(PARTS, resumable=True, cut_after=2, resume_cuts=[0] * 10)
    events, error = target.attempt(outcome, max_reconnects=3)
    assert error is not None
    assert (error.status, error.note) == (None, "stream interrupted")
    assert texts(events) == ["The ", "quick "]
    assert [start for _, start in server.resumes] == [2, 2, 2]


def test_default_reconnect_limit_is_five(gateway: tuple[Target, FakeWorkersAI | FakeOpenAI]) -> None:
    target, server = gateway
    error = target.failure(Stream(PARTS, resumable=True, cut_after=1, resume_cuts=[0] * 10))
    assert error.note == "stream interrupted"
    assert len(server.resumes) == 5


def test_no_reconnect_when_disabled(gateway: tuple[Target, FakeWorkersAI | FakeOpenAI]) -> None:
    target, server = gateway
    error = target.failure(Stream(PARTS, resumable=True, cut_after=2), max_reconnects=0)
    assert error.note == "stream truncated"
    assert server.resumes == []


def test_expired_resume_buffer_is_404(gateway: tuple[Target, FakeWorkersAI | FakeOpenAI]) -> None:
    target, server = gateway
    target.script(Stream(PARTS, resumable=True, cut_after=2))

    async def scenario() -> ProviderError:
        binding = target.factory()
        try:
            events = binding.stream(target.model, INPUTS)
            assert await anext(events) == TextDelta("The ")
            server.expire_runs()  # the resume is asked for only once the cut is read
            with pytest.raises(ProviderError) as info:
                async for _ in events:
                    pass
            return info.value
        finally:
            await binding.aclose()

    error = asyncio.run(scenario())
    assert (error.status, error.note) == (404, "stream resume expired")
    assert len(server.resumes) == 1


def test_no_resume_without_a_run_id(gateway: tuple[Target, FakeWorkersAI | FakeOpenAI]) -> None:
    target, server = gateway
    error = target.failure(Stream(PARTS, cut_after=2))
    assert error.note == "stream truncated"
    assert server.resumes == []


def test_no_resume_before_a_complete_event(gateway: tuple[Target, FakeWorkersAI | FakeOpenAI]) -> None:
    target, server = gateway
    error = target.failure(Stream(PARTS, resumable=True, cut_after=0, partial_tail=True))
    assert error.note == "stream truncated"
    assert server.resumes == []


def test_no_resume_without_a_resume_address() -> None:
    """Workers AI resumes only when told where; OpenAI's own base URL has no resume."""
    with FakeWorkersAI() as server:
        error = workers_ai_target(server).failure(Stream(PARTS, resumable=True, cut_after=2))
        assert error.note == "stream truncated"
        assert server.resumes == []


def test_resume_sends_the_same_credentials() -> None:
    """The fake gateway refuses a resume without the key: a resumed stream proves it was sent."""
    with FakeOpenAI(gateway=True) as server:
        target = openai_target(server, "gateway")
        events = target.stream(
            Stream(PARTS, resumable=True, cut_after=2), headers={"cf-aig-authorization": "Bearer gw"}
        )
        assert "".join(texts(events)) == WHOLE_TEXT
        assert server.calls[-1].headers["cf-aig-authorization"] == "Bearer gw"


def test_stall_is_not_resumed(gateway: tuple[Target, FakeWorkersAI | FakeOpenAI]) -> None:
    target, server = gateway
    error = target.failure(Stream(PARTS, resumable=True, stall_after=2), idle_timeout_s=0.2)
    assert error.note == "stream stalled"
    assert server.resumes == []


# --- the SSE parser -----------------------------------------------------------------------------

SAMPLE = (
    "\ufeff: a comment\r\n"
    "event: delta\r\n"
    'data: {"a": 1}\r\n'
    "\r\n"
    "data:no space\n"
    "data:  two spaces\n"
    "id: 7\n"
    "retry: 100\n"
    "\n"
    ": keep-alive\n"
    "\n"
    "data\n"
    "\r"
    "data: x\u00e9\u4e2d\r"
    "\r"
    "event: error\n"
    "data: [DONE]\n"
    "\n"
    "data: partial"
).encode()
EXPECTED = [
    SSEEvent('{"a": 1}', "delta"),
    SSEEvent("no space\n two spaces"),
    SSEEvent(""),
    SSEEvent("x\u00e9\u4e2d"),
    SSEEvent("[DONE]", "error"),
]


def test_parser_reads_the_sample_whole() -> None:
    parser = SSEParser()
    assert parser.feed(SAMPLE) == EXPECTED
    assert parser.partial


def test_parser_gives_the_same_events_for_every_split() -> None:
    """Any cut, with or without an empty read at the cut (a CR's LF may come after it)."""
    for cut in range(len(SAMPLE) + 1):
        parser = SSEParser()
        assert parser.feed(SAMPLE[:cut]) + parser.feed(SAMPLE[cut:]) == EXPECTED, cut
        parser = SSEParser()
        events = parser.feed(SAMPLE[:cut]) + parser.feed(b"") + parser.feed(SAMPLE[cut:])
        assert events == EXPECTED, cut


def test_parser_gives_the_same_events_for_every_two_cuts() -> None:
    for first, second in itertools.combinations(range(len(SAMPLE) + 1), 2):
        parser = SSEParser()
        pieces = (SAMPLE[:first], b"", SAMPLE[first:second], b"", SAMPLE[second:])
        assert [e for piece in pieces for e in parser.feed(piece)] == EXPECTED, (first, second)


@pytest.mark.parametrize("empty", [False, True], ids=["bytes", "bytes-and-empty-reads"])
def test_parser_gives_the_same_events_byte_by_byte(empty: bool) -> None:
    parser = SSEParser()
    pieces = [piece for i in range(len(SAMPLE)) for piece in (SAMPLE[i : i + 1], b"")[: 1 + empty]]
    events = list(itertools.chain.from_iterable(parser.feed(piece) for piece in pieces))
    assert events == EXPECTED


def test_an_empty_read_between_cr_and_lf_changes_nothing() -> None:
    parser = SSEParser()
    events = parser.feed(b"data: a\r") + parser.feed(b"") + parser.feed(b"\ndata: b\n\n")
    assert events == [SSEEvent("a\nb")]


def test_parser_never_emits_an_unterminated_event() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: one\n\ndata: two\n") == [SSEEvent("one")]
    assert parser.partial
    assert parser.feed(b"\n") == [SSEEvent("two")]
    assert not parser.partial


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"data: " + b"x" * 200, id="long-line"),
        pytest.param(b"data: xxxxxxxxxx\n" * 30, id="long-event"),
    ],
)
def test_parser_caps_lines_and_events(body: bytes) -> None:
    parser = SSEParser(max_event_bytes=100)
    with pytest.raises(EventTooLarge):
        parser.feed(body)
