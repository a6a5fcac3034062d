"""`EventStream`: what a guarded streaming route sends its client, as Server-Sent Events.

The vocabulary (each event's `data` is one JSON object):

    event: delta       {"text": "..."}                       a piece of the answer
    event: reasoning   {"text": "..."}                       a piece of visible reasoning
    event: tool_call   {"index": 0, "id": ..., "name": ..., "arguments": "..."}
                                                             a piece of a tool call (concatenate
                                                             `arguments` of one index in order)
    event: done        {"finish_reason", "usage", "model", "fallback_model", "attempts", "trace_id"}
                                                             the answer is complete (a structured
                                                             stream's also has `object`: its
                                                             validated answer)
    event: error       {"guard", "reason", "detail", "trace_id"}
                                                             the stream ended without completing;
                                                             `reason` is from the closed taxonomy

Exactly one of `done` and `error` ends every stream. Text already delivered before an `error`
is what the client keeps: guards never switches model or replays text once output was sent.
`model` and `fallback_model` follow the attribution mode (`null` when not shown).

How the events are written is the route's `StreamFormat` (`guards.route(...,
stream_format=...)`): `GUARDS_EVENTS`, this vocabulary, by default; `UI_MESSAGE_STREAM`
(`guards.streams._ui_stream`) for the Vercel AI SDK's `useChat`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import anyio
import anyio.lowlevel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..contracts._stream import ReasoningDelta, StreamEnd, StreamEvent, TextDelta, ToolCallDelta

__all__ = ["GUARDS_EVENTS", "EventStream", "StreamCut", "StreamFormat", "StreamWriter", "sse"]

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
#: A str as a JSON string literal (the C encoder json.dumps uses for strings).
_string: Callable[[str], str] = json.encoder.encode_basestring


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One Server-Sent Event. JSON never contains a raw newline, so `data` is one line."""
    return f"event: {event}\ndata: {_dumps(data)}\n\n".encode()


def delta(text: str) -> bytes:
    """A `delta` event: the relay's hot path, so the JSON is put together by hand."""
    return b'event: delta\ndata: {"text":' + _string(text).encode() + b"}\n\n"


def encode(event: StreamEvent) -> bytes:
    """A provider event as the client's event (`StreamEnd` is answered by the relay)."""
    if isinstance(event, TextDelta):
        return delta(event.text)
    if isinstance(event, ReasoningDelta):
        return sse("reasoning", {"text": event.text})
    if isinstance(event, ToolCallDelta):
        return sse(
            "tool_call",
            {"index": event.index, "id": event.id, "name": event.name, "arguments": event.arguments},
        )
    raise TypeError(f"not a client event: {type(event).__name__}")  # pragma: no cover


class StreamWriter(Protocol):
    """Writes one stream's events (a new one per stream: a format may keep state, such as the
    part that is open). The relay calls `start` once, then `text` (the hot path, one per
    token) and `event` for the output, and exactly one of `done` and `error` last."""

    def start(self) -> bytes: ...
    def text(self, text: str) -> bytes: ...
    def event(self, event: StreamEvent) -> bytes: ...
    def done(self, data: dict[str, Any]) -> bytes: ...
    def error(self, data: dict[str, Any]) -> bytes: ...


class StreamFormat(Protocol):
    """How a streaming route writes its events: its `name` (the OpenAPI document describes
    the route's events by it), the response's extra `headers`, and a `writer()` per stream.
    `done` gets the data of the `done` event, `error` that of the `error` event (see the
    module docstring)."""

    name: str
    headers: Mapping[str, str]

    def writer(self) -> StreamWriter: ...


class _GuardsWriter:
    """guards' own vocabulary: stateless, so one writer serves every stream."""

    start = staticmethod(lambda: b"")
    text = staticmethod(delta)
    event = staticmethod(encode)
    done = staticmethod(lambda data: sse("done", data))
    error = staticmethod(lambda data: sse("error", data))


class _GuardsEvents:
    name = "guards"
    headers: Mapping[str, str] = {}
    _writer = _GuardsWriter()

    def writer(self) -> StreamWriter:
        return self._writer


#: guards' own events (`delta`, `reasoning`, `tool_call`, `done`, `error`): the default format.
GUARDS_EVENTS: StreamFormat = _GuardsEvents()


#: Events relayed between two turns of the event loop that `EventStream` takes itself.
_TURN_EVERY = 4
#: Seconds a stream cut by the server (`StreamCut`) has to write its last events: a client that
#: does not take them by then does not get them (the server is stopping).
CUT_WRITE_S = 1.0


class StreamCut(Exception):
    """Raised by an `EventStream`'s body that the server cancelled while its client was still
    reading (uvicorn at the end of its graceful shutdown), once it settled: `last` are the
    events that end the stream (its `error` event), which the response writes (within
    `CUT_WRITE_S`) before `cancelled`, the server's cancellation, goes on."""

    def __init__(self, last: bytes, cancelled: BaseException) -> None:
        super().__init__()
        self.last = last
        self.cancelled = cancelled


class EventStream(Response):
    """A `text/event-stream` response that relays a guarded model stream.

    Returned by `AI.stream`; a guarded route returns it as is. Headers (status 200, the trace
    id, attribution) go out only once the first output part is in hand. When the client
    disconnects, the relay is cancelled at once (within `_TURN_EVERY` events at the latest, whatever the
    server), which closes the provider's stream. When the server cancels the request while
    its client reads, the body may end its stream first (`StreamCut`). A `background` task
    (Starlette's `BackgroundTask`, set by the handler) runs once the stream ended, whichever
    way, with its calls counted on the `ai` handle (`AI.usage`, `AI.cost`).
    """

    media_type = "text/event-stream"
    #: A resumable stream's (`guards.streams._kept`): its background task runs when the
    #: stream ends, which its client leaving does not do; not when the response ends.
    kept = False

    def __init__(self, body: AsyncIterator[bytes], headers: Mapping[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self._body = body
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def relay() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            sent = 0
            try:
                async for chunk in self._body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    # A server's `send` may return without suspending (hypercorn's does while its
                    # buffer has room), and events read in one network read come without
                    # suspending either: a turn of the loop every `_TURN_EVERY` events lets
                    # `watch` see the client leave, instead of every later event being written
                    # to a closed connection (a turn per event would cost more than the rest).
                    sent += 1
                    if not sent % _TURN_EVERY:
                        try:
                            await anyio.lowlevel.checkpoint()
                        except anyio.get_cancelled_exc_class() as cancelled:
                            if group.cancel_scope.cancel_called:
                                raise  # the client left
                            # The server cancels the request between two whole events: the
                            # body is told where it stands (it may end its stream: StreamCut).
                            athrow = getattr(self._body, "athrow", None)
                            if athrow is not None:
                                await athrow(cancelled)
                            raise
            except StreamCut as cut:
                # The server cancels the request while the client reads (the body saw that
                # its cancellation came from neither its client nor itself): the stream's last
                # events and the response's end, if the client takes them within the bound,
                # then the cancellation goes on.
                with anyio.move_on_after(CUT_WRITE_S):
                    await send({"type": "http.response.body", "body": cut.last, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                raise cut.cancelled from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            group.cancel_scope.cancel()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()  # the client left: stop relaying, close upstream

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(watch)
                await relay()
        finally:
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
        if self.background is not None and not self.kept:  # the stream ended, its calls counted
            await self.background()


def end_data(end: StreamEnd | None) -> dict[str, Any]:
    usage = end.usage if end is not None else None
    return {
        "finish_reason": end.finish_reason if end is not None else None,
        "usage": (
            {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
            }
            if usage is not None
            else None
        ),
    }
