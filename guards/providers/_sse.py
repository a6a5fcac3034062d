"""An incremental Server-Sent Events parser (the `text/event-stream` format of the HTML standard).

Bytes go in as they arrive, whole events come out. An event is complete only at the blank line
that ends it: a trailing partial event is held back, and simply never comes out if the body
ends first (the stream reader decides whether that is a truncation). Lines end in LF, CRLF or
CR, also when a CRLF is split between two reads; `data:` lines of one event are joined with
`\\n`; `event:` names the event; comments (`:`), `id:`, `retry:` and unknown fields are ignored;
one leading space after the colon is dropped. A block without any `data:` line is no event
(the standard does not dispatch it), so keep-alive comments are never counted.

Bounded: a line, or the data of one event, longer than `max_event_bytes` raises
`EventTooLarge` instead of growing in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "EventTooLarge", "SSEEvent", "SSEParser"]

DEFAULT_MAX_EVENT_BYTES = 1 << 20

_BOM = b"\xef\xbb\xbf"


class EventTooLarge(ValueError):
    """A line or an event passed the parser's size cap (the adapter turns it into a
    `ProviderError`)."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One complete event: its `data` (lines joined with `\\n`) and its `event` name (`""`
    when it had none, which the standard calls `message`)."""

    data: str
    event: str = ""


class SSEParser:
    """`feed(chunk)` returns the events that chunk completed, in order. Feeding a body in any
    split gives the same events as feeding it whole."""

    __slots__ = ("_data", "_event", "_max", "_pending", "_size", "_skip_lf", "_started")

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._pending = b""  # an unterminated line
        self._skip_lf = False  # the last read ended in CR: a LF opening the next one is its pair
        self._started = False  # past a possible byte order mark
        self._data: list[str] = []
        self._event = ""
        self._size = 0

    @property
    def partial(self) -> bool:
        """Whether an event has begun but not ended (bytes held back for the next read)."""
        return bool(self._pending or self._data or self._event)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse `chunk`; raises `EventTooLarge` past the cap."""
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buffer = self._pending + chunk if self._pending else chunk
        if not self._started:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                self._pending = buffer
                return []
            self._started = True
            if buffer.startswith(_BOM):
                buffer = buffer[len(_BOM) :]
        if b"\r" in buffer:
            # A CR ending this read may be the first half of a CRLF: the LF is dropped next time.
            self._skip_lf = buffer.endswith(b"\r")
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buffer.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > self._max:
            raise EventTooLarge(f"line over {self._max} bytes")
        events: list[SSEEvent] = []
        for line in lines:
            if not line:  # the blank line: dispatch
                if self._data:
                    events.append(SSEEvent("\n".join(self._data), self._event))
                    self._data = []
                self._event, self._size = "", 0
            elif line[0] != 0x3A:  # ":" starts a comment
                self._field(line)
        return events

    def _field(self, line: bytes) -> None:
        field, colon, value = line.decode("utf-8", "replace").partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._size += len(line)
            if self._size > self._max:
                raise EventTooLarge(f"event over {self._max} bytes")
            self._data.append(value)
        elif field == "event":
            self._event = value
