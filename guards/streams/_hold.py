"""The hold before a stream's commit point (`StreamHold`), and the minimum rate a model must
stream at before it (`Model(min_chars_per_s=...)`).

Without either, a stream commits at its first output part (`open_stream`). With a hold, the
commit point moves to the end of a *window* after the first output: its events are read but
not sent until it ends, so that the output guard can look at them first (the walk's
`guards.walk._streaming`), and a model that fails inside it moves on like one that failed
before its first output. With a minimum rate and no hold, the window is the first
`RATE_WINDOW_S` after the first output, with no output check. A window ends:

- when the output held reaches its characters (the hold's `chars`; a hold of seconds alone at
  `MAX_HOLD_CHARS`, so that what a stream holds is always bounded);
- when its time since the first output is up (the hold's `seconds`; with a rate and a hold of
  characters, at `chars / rate` at the latest, past which the rate can only fall short);
- when the stream completes inside it (no waiting for the rest of the time).

The rate is the characters of output received since the first output part (itself included)
over the time since it, taken when the window ends by its time: a model below it then is
cancelled (`BelowMinimumRate`, the verdict of a model with no first output:
`model_temporarily_unavailable`). A window that ends by its characters was fast enough, and
one that ends by the stream's completion needs no rate.

Time is the event loop's (`loop.time()`), as every wait of guards: a test bounds it with short
real deadlines. The route's deadline goes on running over the window: a hold never extends it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from ..contracts._errors import ConfigurationError, ProviderError
from ..contracts._settings import number, settings, whole
from ..contracts._stream import ReasoningDelta, StreamEnd, StreamEvent, TextDelta, ToolCallDelta
from ..waits._first_output import NoFirstOutput, first_output_arrived

__all__ = [
    "MAX_HOLD_CHARS",
    "MAX_HOLD_S",
    "RATE_WINDOW_S",
    "BelowMinimumRate",
    "StreamHold",
    "Window",
    "held_text",
    "hold",
    "output_chars",
    "window",
]

#: The most characters a hold may keep (`StreamHold.chars`), and where a hold of seconds alone
#: ends: what one held stream keeps in memory is bounded by it (plus its last event).
MAX_HOLD_CHARS = 65_536
#: The longest hold (`StreamHold.seconds`).
MAX_HOLD_S = 30.0
#: Without a hold, how long after its first output a stream's rate is measured, when its
#: model declares a minimum one.
RATE_WINDOW_S = 1.0


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class StreamHold:
    """A bounded hold before a stream's commit point (`route(stream_hold=...)`): after its first
    output part, a streamed answer is read but not sent until `chars` characters of output
    arrived (1 to 65,536), `seconds` passed since its first output (above 0, at most 30), or it
    completed, whichever comes first; meanwhile the output guard checks it, and a rejected
    answer (empty, moderated) moves on to the next model, unseen by the client. Either or both;
    a hold of seconds alone also ends at 65,536 characters. Raises `ConfigurationError` for a
    value out of its range, or neither given."""

    chars: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        whole("StreamHold.chars", self.chars, most=MAX_HOLD_CHARS, none="no limit of characters")
        number(
            "StreamHold.seconds", self.seconds, above=0, most=MAX_HOLD_S, unit="seconds", none="no time limit"
        )
        if self.chars is None and self.seconds is None:
            raise ConfigurationError(
                "StreamHold needs chars, seconds or both: e.g. StreamHold(chars=400, seconds=2)"
            )
        if self.seconds is not None:
            object.__setattr__(self, "seconds", float(self.seconds))


@dataclass(frozen=True, slots=True)
class Window:
    """What one attempt's stream holds after its first output: up to `chars` characters of
    output, for `seconds` at most (None: until the characters or the end), the model's
    `min_rate` in characters per second (None: none). `moves_on`: the chain has another model
    (a slow one is not retried); `provider` names the model's provider in failures."""

    chars: int
    seconds: float | None
    min_rate: float | None
    moves_on: bool = False
    provider: str = "provider"


def window(
    hold: StreamHold | None, min_rate: float | None, *, moves_on: bool, provider: str = "provider"
) -> Window | None:
    """The window of an attempt on a route with `hold` (None: none) to a model of minimum rate
    `min_rate` (None: none); None when it has neither (the stream commits at its first output)."""
    if hold is None:
        if min_rate is None:
            return None
        chars = max(1, math.ceil(min_rate * RATE_WINDOW_S))
        return Window(chars, RATE_WINDOW_S, min_rate, moves_on, provider)
    chars = hold.chars if hold.chars is not None else MAX_HOLD_CHARS
    seconds = hold.seconds
    if min_rate is not None and hold.chars is not None:
        hopeless = hold.chars / min_rate  # past it, even the chars would come too slowly
        seconds = hopeless if seconds is None else min(seconds, hopeless)
    return Window(chars, seconds, min_rate, moves_on, provider)


class BelowMinimumRate(NoFirstOutput):
    """A stream slower than its model's `min_chars_per_s` before its commit point: cancelled,
    with the verdict of a model that produced no first output in time (`NoFirstOutput`:
    `model_temporarily_unavailable`, billed, counted on its breaker, not retried on the same
    model when the chain has another)."""

    def __init__(self, provider: str, min_rate: float, *, moves_on: bool) -> None:
        self.min_rate = min_rate
        self.limit_s = RATE_WINDOW_S
        self.moves_on = moves_on
        self.queued = False
        self.never_sent = False
        super(NoFirstOutput, self).__init__(provider, note=f"below {min_rate:g} characters per second")


def output_chars(event: StreamEvent) -> int:
    """The characters of output an event carries (text, reasoning, tool-call arguments)."""
    if isinstance(event, TextDelta | ReasoningDelta):
        return len(event.text)
    if isinstance(event, ToolCallDelta):
        return len(event.arguments)
    return 0


def held_text(events: list[StreamEvent]) -> str:
    """The answer's text among held events (what the output guard checks)."""
    return "".join(event.text for event in events if type(event) is TextDelta)


async def hold(
    events: AsyncIterator[StreamEvent], first: list[StreamEvent], window: Window
) -> tuple[StreamEnd | None, AsyncIterator[StreamEvent]]:
    """Read `events` past the first output (the last of `first`) until `window` ends, each event
    appended to `first`: (the completion signal when the stream completed inside it, the rest
    of the stream to relay). Raises what the stream raises, `ProviderError` (`stream
    truncated`) for a body that ends without its completion signal, and `BelowMinimumRate`;
    the caller closes `events` then. Tells the first-output limit that the first output came
    (`first_output_arrived`): the window is the route deadline's, not that limit's."""
    first_output_arrived()
    loop = asyncio.get_running_loop()
    began, provider = loop.time(), window.provider
    until = None if window.seconds is None else began + window.seconds
    received = sum(map(output_chars, first))
    while received < window.chars:
        if until is None:
            event = await anext(events, None)
        else:
            reader = asyncio.ensure_future(anext(events, None))
            try:
                await asyncio.wait((reader,), timeout=until - loop.time())
            except BaseException:
                await _stopped(reader)
                raise
            if not reader.done():  # the window's time is up: its rate, then the commit
                if window.min_rate is not None and received < window.min_rate * (loop.time() - began):
                    await _stopped(reader)
                    raise BelowMinimumRate(provider, window.min_rate, moves_on=window.moves_on)
                return None, _Continued(reader, events)
            event = reader.result()
        if event is None:
            raise ProviderError(provider, note="stream truncated")
        if isinstance(event, StreamEnd):
            return event, events
        first.append(event)
        received += output_chars(event)
    return None, events


async def _stopped(reader: asyncio.Future[Any]) -> None:
    """Cancel a pending read and wait until it is over (the stream can be closed then)."""
    if not reader.done():
        reader.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait((reader,))
    if not reader.cancelled():
        reader.exception()  # retrieved: the caller raises its own


class _Continued:
    """The rest of a stream whose hold ended while its next event was being read (`reader`):
    that event, then the stream's. Closing it cancels the read and closes the stream."""

    __slots__ = ("_events", "_reader")

    def __init__(
        self, reader: asyncio.Future[StreamEvent | None], events: AsyncIterator[StreamEvent]
    ) -> None:
        self._reader: asyncio.Future[StreamEvent | None] | None = reader
        self._events = events

    def __aiter__(self) -> _Continued:
        return self

    async def __anext__(self) -> StreamEvent:
        reader = self._reader
        if reader is None:
            return await self._events.__anext__()
        try:
            event = await reader  # cancelled with the task awaiting it
        finally:
            if reader.done():
                self._reader = None
        if event is None:
            raise StopAsyncIteration
        return event

    async def aclose(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            await _stopped(reader)
        close = getattr(self._events, "aclose", None)
        if close is not None:
            await close()
