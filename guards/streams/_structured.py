"""A structured stream's text, kept as it is sent, for the output guard's check at its end.

A route typed with a JSON output (`AI[YourModel]`) streams the model's JSON text as it comes,
in whichever format (guards' events, the UI message stream); once the model completed, the
whole text is validated (`guards.walk._streaming`), and the `done` event carries the object,
or the output guard's `error` ends the stream. `KeptText` wraps the route's writer and keeps
the text it writes: exactly what the client received, within the stream's `stream_max_chars`.
"""

from __future__ import annotations

import io
from typing import Any

from ..contracts._stream import StreamEvent, TextDelta
from ._event_stream import StreamWriter

__all__ = ["KeptText"]


class KeptText:
    """A `StreamWriter` that writes as `writer` does and keeps the answer's text (`kept()`):
    one buffer, not an object per token (a list of 4-character tokens would take about 60
    bytes a token). Only text: reasoning and tool calls are not the answer."""

    __slots__ = ("_kept", "_writer")

    def __init__(self, writer: StreamWriter) -> None:
        self._writer = writer
        self._kept = io.StringIO()

    def start(self) -> bytes:
        return self._writer.start()

    def text(self, text: str) -> bytes:
        self._kept.write(text)
        return self._writer.text(text)

    def event(self, event: StreamEvent) -> bytes:
        if type(event) is TextDelta:
            self._kept.write(event.text)
        return self._writer.event(event)

    def done(self, data: dict[str, Any]) -> bytes:
        return self._writer.done(data)

    def error(self, data: dict[str, Any]) -> bytes:
        return self._writer.error(data)

    def kept(self) -> str:
        """The answer's text written so far."""
        return self._kept.getvalue()
