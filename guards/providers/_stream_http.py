"""Streaming over HTTP, shared by the adapters: one request read as Server-Sent Events, decoded
into stream events, with stalls, cuts and AI Gateway's resume handled once (PROTOCOLS.md,
"Cloudflare AI Gateway", "Resume").

`stream_sse` is the engine; an adapter gives it the request, a `ChunkDecoder` (OpenAI's
`chat.completion.chunk` shape, and Workers AI's native `{"response": ...}` shape when asked)
and its own whole-body parser for answers that are not an event stream (an error status, or a
JSON body from a server that does not stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import anyio

from ..contracts._binding import AIResult, Usage
from ..contracts._errors import ProviderError
from ..contracts._stream import ReasoningDelta, StreamEnd, StreamEvent, TextDelta, ToolCallDelta
from ..waits._alarm import Alarm
from ._http import parse_usage, read_capped, refuse_encoded, transport_error
from ._httpx import httpx
from ._identifiers import identifier
from ._sse import FrameError, SSEEvent, SSEParser

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_RECONNECTS",
    "ChunkDecoder",
    "FrameParser",
    "InBandError",
    "StreamDecoder",
    "result_events",
    "stream_sse",
]

DEFAULT_IDLE_TIMEOUT_S = 30.0
DEFAULT_MAX_RECONNECTS = 5
RUN_ID_HEADER = "cf-aig-run-id"
#: After the completion signal, the rest of the body (normally just the end of the chunked
#: encoding, already on its way) is read for this long at most, so the connection can go back
#: to the pool; past it the connection is closed instead.
_DRAIN_S = 0.1
_DRAIN_BYTES = 64 << 10
#: One network read (up to 64 KiB) can hold ten thousand tiny events (`data:` and a blank line
#: is 7 bytes), 50 ms and more of parsing and decoding. A read is fed to the parser in slices
#: of at most this many bytes (under a millisecond each; a usual read is one slice, as is),
#: and the loop gets a turn after every `_YIELD_EVERY` events (about 5 µs each to parse and
#: decode, plus what the consumer does with them): no stretch lasts more than a few ms.
_SLICE_BYTES = 4096
_YIELD_EVERY = 64

#: Spots an in-band error object in a decoded event: the `ProviderError` to raise, or None.
InBandError = Callable[[dict[str, Any]], ProviderError | None]
#: Parses a whole (non-event-stream) answer like the adapter's `run`: a result, or raises.
WholeParser = Callable[[httpx.Response, bytes], AIResult]


class FrameParser(Protocol):
    """Cuts a body into its events as its bytes arrive (`SSEParser`; Bedrock's binary event
    stream): linear in the bytes fed, and raising `FrameError` for what it cannot accept."""

    def feed(self, data: bytes) -> Sequence[Any]: ...


class StreamDecoder(Protocol):
    """Turns the events a `FrameParser` cut into stream events (`ChunkDecoder` for OpenAI's
    chunks and Workers AI's events): `complete` once the completion signal came."""

    complete: bool

    def decode(self, event: Any) -> list[StreamEvent]: ...

    def end_at_eof(self) -> StreamEnd | None:
        """The end, when the body ending now completes the stream; else None (truncated)."""
        ...


class ChunkDecoder:
    """Turns the events of one stream into `StreamEvent`s, keeping what the end needs.

    Reads OpenAI's chunks (`choices[0].delta` with `content`, `reasoning_content` or
    `reasoning`, `tool_calls`; `finish_reason`; `usage`; `model`, the first one named; the
    model and the finish reason cleaned by `identifier`) and, with `native=True`,
    Workers AI's own events (`response`, top-level `tool_calls` and `finish_reason`, `usage`),
    detected per event. `[DONE]` completes the stream; so does the end of the body after a
    `finish_reason` (`end_at_eof`). Events that are not JSON objects are skipped; an in-band
    error object, or an event named `error`, raises `ProviderError` (status 200, never the
    provider's text).
    """

    __slots__ = (
        "_in_band_error",
        "_native",
        "_requested",
        "complete",
        "finish_reason",
        "model",
        "provider",
        "refused",
        "usage",
    )

    def __init__(
        self, provider: str, model: str, in_band_error: InBandError, *, native: bool = False
    ) -> None:
        self.provider = provider
        self._requested = model
        self._in_band_error = in_band_error
        self._native = native
        self.complete = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.model: str | None = None
        self.refused = False

    def decode(self, sse: SSEEvent) -> list[StreamEvent]:
        """The stream events one SSE event carries (often one, sometimes none); the last is
        `StreamEnd` when it completed the stream."""
        data = sse.data
        if data[:6] == "[DONE]" and (len(data) == 6 or data[6:].isspace()):
            return [self._end()]  # trailing whitespace tolerated, as the official OpenAI client does
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            chunk = None
        if not isinstance(chunk, dict):
            if sse.event == "error":
                raise ProviderError(self.provider, status=200, note="error event")
            return []  # a keep-alive or an unknown event: liberal in what we accept
        error = self._in_band_error(chunk)
        if error is None and sse.event == "error":
            error = ProviderError(self.provider, status=200, note="error event")
        if error is not None:
            raise error
        out: list[StreamEvent] = []
        if self.model is None:  # the same name in every chunk: cleaned once
            self.model = identifier(chunk.get("model"))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = parse_usage(usage)
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]  # `n` is never sent: only one choice streams
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(delta, out)
            self._finish(choice.get("finish_reason"))
        elif self._native:
            response = chunk.get("response")
            if isinstance(response, str) and response:
                out.append(TextDelta(response))
            tool_calls = chunk.get("tool_calls")
            if isinstance(tool_calls, list):
                _tool_call_deltas(tool_calls, out)
            self._finish(chunk.get("finish_reason"))
        return out

    def end_at_eof(self) -> StreamEnd | None:
        """The end, when the body ending now completes the stream: a `finish_reason` came
        (the answer is whole; only the usage chunk and `[DONE]` are missing)."""
        return self._end() if self.finish_reason is not None and not self.complete else None

    def _end(self) -> StreamEnd:
        self.complete = True
        # A refusal (structured outputs) is the model's own safety filter speaking, as in `run`.
        finish = "content_filter" if self.refused else self.finish_reason
        return StreamEnd(finish_reason=finish, usage=self.usage, model=self.model or self._requested)

    def _finish(self, reason: Any) -> None:
        if reason is not None:  # null in every chunk but the last
            self.finish_reason = identifier(reason) or self.finish_reason

    def _delta(self, delta: dict[str, Any], out: list[StreamEvent]) -> None:
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out.append(ReasoningDelta(reasoning))
        content = delta.get("content")
        if isinstance(content, list):  # content parts (some compatible servers)
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(p for p in parts if isinstance(p, str))
        if isinstance(content, str) and content:
            out.append(TextDelta(content))
        tool_calls = delta.get("tool_calls")
        if isinstance(tool_calls, list):
            _tool_call_deltas(tool_calls, out)
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self.refused = True


def _tool_call_deltas(items: list[Any], out: list[StreamEvent]) -> None:
    """OpenAI's `{index, id, function: {name, arguments}}` pieces, or Workers AI's flat
    `{name, arguments}` (arguments as an object are sent as their JSON text). A piece with
    neither id, name nor arguments (Workers AI's null finalization) is skipped."""
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        function = item.get("function")
        if not isinstance(function, dict):
            function = {}
        name = function.get("name") or item.get("name")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = item.get("arguments")
        if not isinstance(arguments, str):
            arguments = "" if arguments is None else json.dumps(arguments)
        call_id = item.get("id")
        index = item.get("index")
        delta = ToolCallDelta(
            index=index if isinstance(index, int) and not isinstance(index, bool) else position,
            id=call_id if isinstance(call_id, str) and call_id else None,
            name=name if isinstance(name, str) and name else None,
            arguments=arguments,
        )
        if delta.id or delta.name or delta.arguments:
            out.append(delta)


def result_events(result: AIResult, finish_reason: str | None = None) -> list[StreamEvent]:
    """A whole answer as a stream: its text (an object as its JSON text), its tool calls, the
    end. For servers that answer a streaming request with one JSON body (Workers AI in JSON
    mode does)."""
    events: list[StreamEvent] = []
    response = result.response
    text = response if isinstance(response, str) else "" if response is None else json.dumps(response)
    if text:
        events.append(TextDelta(text))
    _tool_call_deltas(list(result.tool_calls), events)
    if finish_reason is None:
        finish_reason = "content_filter" if result.moderated else "length" if result.truncated else None
    events.append(StreamEnd(finish_reason=finish_reason, usage=result.usage, model=result.model))
    return events


def _sse_parser(max_event_bytes: int) -> SSEParser:
    return SSEParser(max_event_bytes=max_event_bytes)


def _request(
    client: httpx.AsyncClient,
    method: str,
    target: str,
    payload: dict[str, Any] | None,
    content: bytes | None,
    headers: httpx.Headers | Mapping[str, str],
    timeout: httpx.Timeout,
) -> AbstractAsyncContextManager[httpx.Response]:
    """A stream's request (its POST, or a resume's GET), as sent: never redirected."""
    return client.stream(
        method,
        target,
        json=payload,
        content=content,
        headers=headers,
        timeout=timeout,
        follow_redirects=False,
    )


def _idle_timeout(base: httpx.Timeout, idle_timeout_s: float) -> httpx.Timeout:
    """The client's timeouts, with the read timeout (no byte for that long) set to the idle
    limit: a provider that sends no byte at all fails there, in httpx, at no cost per event
    (the stream's own alarm is for one that sends bytes but no complete event)."""
    return httpx.Timeout(connect=base.connect, read=idle_timeout_s, write=base.write, pool=base.pool)


def _is_json(response: httpx.Response) -> bool:
    kind: str = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def _slices(chunk: bytes) -> tuple[bytes, ...] | list[bytes]:
    """`chunk` in pieces of at most `_SLICE_BYTES` (the parser gives the same events for any
    split); a chunk that small is itself, uncopied."""
    if len(chunk) <= _SLICE_BYTES:
        return (chunk,)
    return [chunk[start : start + _SLICE_BYTES] for start in range(0, len(chunk), _SLICE_BYTES)]


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what is left of a completed stream, briefly and boundedly, so the connection can be
    reused; on any trouble the connection is simply closed with the response."""
    size = 0
    with contextlib.suppress(httpx.HTTPError), anyio.move_on_after(_DRAIN_S):
        async for chunk in chunks:
            size += len(chunk)
            if size > _DRAIN_BYTES:
                return


def _event_stream(response: httpx.Response, provider: str, resuming: bool) -> bool:
    """Whether `response`'s head announces the event stream asked for; else its body is a whole
    answer (an error status, or a JSON body from a server that does not stream). Raises
    `ProviderError` for an encoded body (never inflated) and for a resume whose buffer expired."""
    status = response.status_code
    refuse_encoded(response, provider)  # before any byte of the body
    if resuming and status == 404:
        raise ProviderError(provider, status=404, note="stream resume expired")
    return 200 <= status < 300 and (resuming or not _is_json(response))


def _resume_url(response: httpx.Response, resume_base: str | None, max_reconnects: int) -> str | None:
    """Where the run `response` started resumes (`cf-aig-run-id`), when the stream may resume."""
    if resume_base is None or max_reconnects <= 0:
        return None
    run_id = response.headers.get(RUN_ID_HEADER)
    return f"{resume_base}/run/{run_id}/resume" if run_id else None


def _stalled(idle: Alarm) -> bool:
    """Whether the idle alarm interrupted this task's wait on the provider (its cancellation)."""
    task = asyncio.current_task()
    return task is not None and idle.interrupted(task)


def _resume_at(
    provider: str, resume_url: str | None, delivered: int, reconnects: int, max_reconnects: int
) -> str:
    """Where a stream cut before its completion signal resumes, after the `delivered` complete
    events of its run. Raises `ProviderError`: `stream truncated` when it cannot resume (no
    run id, or no complete event yet), `stream interrupted` after `max_reconnects`."""
    if resume_url is None or delivered == 0:
        raise ProviderError(provider, note="stream truncated")
    if reconnects >= max_reconnects:
        raise ProviderError(provider, note="stream interrupted")
    return f"{resume_url}?from={delivered}"


async def stream_sse(
    client: httpx.AsyncClient,
    url: str,
    *,
    body: Mapping[str, Any] | bytes,
    headers: httpx.Headers | Mapping[str, str],
    provider: str,
    decoder: StreamDecoder,
    parse_whole: WholeParser,
    idle_timeout_s: float,
    max_reconnects: int,
    resume_base: str | None,
    max_event_bytes: int,
    new_parser: Callable[[int], FrameParser] | None = None,
) -> AsyncGenerator[StreamEvent, None]:
    """POST `body` to `url` (an object as JSON, bytes as they are: a signed body) and yield its
    stream events, then exactly one `StreamEnd`. The body is cut into events by
    `new_parser(max_event_bytes)` (default: an `SSEParser`) and each is decoded by `decoder`.

    Raises `ProviderError`: an answer (the resume's too) whose `Content-Encoding` is not
    `identity`, unread (`note="content-encoding refused"`: the body is read as sent, never
    inflated); an error status before the body (parsed by `parse_whole`, like `run`); an in-band error (from `decoder`); `note="stream stalled"` when no complete event
    came for `idle_timeout_s` while waiting on the provider (status None: comments, blank
    lines and parts of a line do not count, nor time the consumer holds the stream); `note="stream truncated"` when the body ends, or the
    connection breaks, before the completion signal (status None); a transport failure before
    the answer, as `run`.

    Resume: when the answer carries `cf-aig-run-id` and `resume_base` is set, a cut after at
    least one complete event reconnects with `GET {resume_base}/run/{id}/resume?from=N`, N the
    complete events received so far on this run (a trailing partial event is dropped, never
    yielded), with the same headers; the events continue with no gap and no duplicate. At most
    `max_reconnects` reconnections per stream (then `note="stream interrupted"`, status None);
    a 404 means the gateway's buffer expired (`status=404, note="stream resume expired"`).
    A stall is not resumed: the gateway would wait on the same provider.

    Closing the generator (or cancelling its consumer) closes the connection at once.
    """
    timeout = _idle_timeout(client.timeout, idle_timeout_s)
    method, target = "POST", url
    payload: dict[str, Any] | None = None if isinstance(body, bytes) else dict(body)
    content = body if isinstance(body, bytes) else None
    resume_url: str | None = None  # the run's resume address, once the answer gave a run id
    delivered = reconnects = 0  # complete SSE events received on this run (the resume position)
    # The idle alarm moves with each complete event and interrupts only a wait on the provider.
    loop = asyncio.get_running_loop()
    idle = Alarm(loop.time() + idle_timeout_s, defer_s=idle_timeout_s)
    current_task = asyncio.current_task
    try:
        while True:
            resuming = method == "GET"
            reading = False  # past the answer's head, into the event stream
            try:
                idle.waiting = current_task()
                async with _request(client, method, target, payload, content, headers, timeout) as response:
                    if not _event_stream(response, provider, resuming):
                        raw = await read_capped(response, provider, max_event_bytes)
                        idle.waiting = None
                        for event in result_events(parse_whole(response, raw)):
                            yield event
                        return
                    idle.waiting = None
                    if not resuming:
                        resume_url = _resume_url(response, resume_base, max_reconnects)
                    parser, reading = (new_parser or _sse_parser)(max_event_bytes), True
                    chunks = response.aiter_raw()  # as sent: never inflated
                    idle.waiting = current_task()
                    async for chunk in chunks:
                        idle.waiting = None
                        for piece in _slices(chunk):
                            if complete := parser.feed(piece):
                                idle.when = loop.time() + idle_timeout_s
                            for sse in complete:
                                delivered += 1
                                events = decoder.decode(sse)
                                if decoder.complete:
                                    await _drain(chunks)  # before the end: a consumer may stop there
                                for event in events:
                                    yield event
                                if decoder.complete:
                                    return
                                if not delivered % _YIELD_EVERY:
                                    await asyncio.sleep(0)  # the loop's turn (not a wait on the provider)
                        idle.waiting = current_task()
            except FrameError as exc:
                raise ProviderError(provider, status=response.status_code, note=str(exc)) from None
            except (httpx.ReadTimeout, asyncio.CancelledError) as exc:  # no byte, or no event, in time?
                if isinstance(exc, httpx.ReadTimeout) or _stalled(idle):
                    raise ProviderError(provider, note="stream stalled") from None
                raise
            except httpx.HTTPError as exc:
                if not reading and not resuming:
                    raise transport_error(provider, exc) from None
            finally:
                idle.waiting = None
            # The body ended, or the connection broke, before the completion signal.
            if (end := decoder.end_at_eof()) is not None:
                yield end
                return
            target = _resume_at(provider, resume_url, delivered, reconnects, max_reconnects)
            method, payload, content, reconnects = "GET", None, None, reconnects + 1
    finally:
        idle.close()
