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

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "EventTooLarge", "FrameError", "SSEEvent", "SSEParser"]

DEFAULT_MAX_EVENT_BYTES = 1 << 20

_BOM = b"\xef\xbb\xbf"


class FrameError(ValueError):
    """Bytes a stream parser cannot accept (the stream engine turns it into a `ProviderError`
    whose note is the error's own text, never the provider's)."""


class EventTooLarge(FrameError):
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
    split (empty chunks included) gives the same events as feeding it whole.

    Linear in the bytes fed, however they are split: only the new chunk is searched for line
    ends, and an unterminated line is kept as its pieces, joined once when it ends (a provider
    trickling one long line a byte at a time costs no more than sending it whole).
    """

    __slots__ = ("_data", "_event", "_max", "_pending", "_pending_size", "_size", "_skip_lf", "_started")

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._pending: list[bytes] = []  # the pieces of an unterminated line (none empty)
        self._pending_size = 0
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
        if not chunk:  # nothing read: in particular, a CR's pairing LF may still come
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
        if not self._started:
            if self._pending:  # a byte order mark's first bytes
                chunk = self._pending.pop() + chunk
                self._pending_size = 0
            if len(chunk) < len(_BOM) and _BOM.startswith(chunk):
                if chunk:
                    self._pending.append(chunk)
                    self._pending_size = len(chunk)
                return []
            self._started = True
            if chunk.startswith(_BOM):
                chunk = chunk[len(_BOM) :]
        if b"\r" in chunk:
            # A CR ending this read may be the first half of a CRLF: the LF is dropped next time.
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:  # no line ends here: the pending line grows
            if chunk:
                self._hold(chunk)
            return []
        lines = chunk.split(b"\n")
        if self._pending:
            self._pending.append(lines[0])
            lines[0] = b"".join(self._pending)
            self._pending.clear()
            self._pending_size = 0
        tail = lines.pop()
        if tail:
            self._hold(tail)
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

    def _hold(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._pending_size += len(piece)
        if self._pending_size > self._max:
            raise EventTooLarge(f"line over {self._max} bytes")

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
