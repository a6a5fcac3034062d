"""The stream relay: a model's stream, from its first call to the client's last event.

`open_stream` is one streaming attempt up to the commit point, the call `AI.stream` walks the
chain with: it reads the stream until its first output part (the attempt succeeded), its end
(complete, without output) or a failure (raised, like `run`). `relay` is the body of the
`EventStream` a streaming route answers: the committed attempt's events as the client's events,
then exactly one of `done` and `error`.

The relay knows nothing of budgets, breakers or ledgers. However the stream ends, it hands what
happened (`Relayed`) to its `ended` callback, which the streaming tail (`guards.walk._streaming`)
gives it to do the accounting; `done` and `error` give the data of the last event.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from ..contracts._classify import classify
from ..contracts._errors import GuardTripped, ProviderError
from ..contracts._stream import (
    ReasoningDelta,
    StreamEnd,
    StreamEvent,
    StreamingBinding,
    TextDelta,
    ToolCallDelta,
    is_output,
)
from ..contracts._unicode import has_lone_surrogate, well_formed
from ..contracts._vocabulary import Kind, Reason
from ..stores._breaker import Outcome
from ..waits._alarm import Alarm
from ._event_stream import GUARDS_EVENTS, StreamCut, StreamWriter
from ._hold import Window, hold

__all__ = [
    "DEFAULT_STREAM_MAX_CHARS",
    "DEFAULT_STREAM_MAX_S",
    "REJECTED",
    "SHUTDOWN_DETAIL",
    "Opened",
    "Relayed",
    "no_events",
    "open_stream",
    "relay",
    "settled",
    "stop_streams",
]

#: How long a streamed answer may last, from the request's start (a route's `stream_max_s`).
DEFAULT_STREAM_MAX_S = 300.0
#: How many characters of output it may carry (a route's `stream_max_chars`): the body cap of a
#: whole answer, `DEFAULT_MAX_BODY_BYTES` of the adapters.
DEFAULT_STREAM_MAX_CHARS = 1 << 20


#: `Relayed.kind` of a structured stream whose whole answer the output guard rejected.
REJECTED = "rejected"

#: The `error` event's detail of a stream cut because the server stops (`call`/`timeout`).
SHUTDOWN_DETAIL = "the server is stopping: the stream was cut at the end of its graceful shutdown"

#: The alarms of the streams this process relays, and whether `stop_streams` was called.
_live: set[Alarm] = set()
_stopping = False
#: One future per relay this process runs, done once the relay has ended and settled.
_unsettled: set[asyncio.Future[None]] = set()
#: How long `settled()` waits at most, by default.
SETTLED_WAIT_S = 1.0


def stop_streams() -> int:
    """End every stream this process relays, and every one it starts from now on, with an
    `error` event (`call`/`timeout`, `SHUTDOWN_DETAIL`) as its time limit would: the provider
    stream is closed, the spend settled, the request logged with `cut: "shutdown"`. For a
    server at the end of its graceful period (`guards.serve` calls it), before it cancels what
    is left. A stream whose client holds its last event ends when the client takes it. Returns
    how many streams were told."""
    global _stopping
    _stopping = True
    live = list(_live)
    for alarm in live:
        alarm.ring()
    return len(live)


async def settled(timeout_s: float = SETTLED_WAIT_S) -> None:
    """Wait until every stream this event loop relays has ended and settled (its spend, its
    request's log line), for `timeout_s` at most. For the app's shutdown (`Guards.aclose`),
    before the store closes and the log is flushed: plain uvicorn cancels the requests still in
    flight just before it, and their streams settle as they end."""
    loop = asyncio.get_running_loop()
    pending = [future for future in _unsettled if future.get_loop() is loop]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)


@dataclass(slots=True, eq=False)
class Opened:
    """A stream opened by one attempt, read up to its first output part (or its end)."""

    iter_events: AsyncIterator[StreamEvent]
    #: The events read so far: the attempt's preamble and its first output part.
    first: list[StreamEvent]
    end: StreamEnd | None
    started: float
    model: str | None = None
    #: Whether its first events hold a lone surrogate: the answer is rejected before it
    #: commits (`invalid_unicode`), the stream closed.
    invalid: bool = False
    #: When its first output part came (`time.perf_counter()`), when a window held it past
    #: it (None: the attempt returned then).
    first_output_at: float | None = None

    @property
    def committed(self) -> bool:
        return not self.invalid and any(is_output(event) for event in self.first)


async def open_stream(
    binding: StreamingBinding, model: str, inputs: Mapping[str, Any], *, window: Window | None = None
) -> Opened:
    """One streaming attempt, up to the commit point: read until the first output part (the
    attempt succeeds), the end of a stream that had none, or a failure (raised, like `run`;
    the preamble read so far is dropped with the attempt). First events holding a lone
    surrogate are an answer rejected before it commits (`Opened.invalid`). With a `window`
    (a hold, a minimum rate: `guards.streams._hold`), the commit point is the window's end:
    its events join the first ones, and a failure inside it is raised as one before."""
    started = time.perf_counter()
    events = binding.stream(model, inputs)
    first: list[StreamEvent] = []
    try:
        async for event in events:
            if isinstance(event, StreamEnd):  # complete, without output
                await aclose(events)
                return Opened(events, first, event, started, model=event.model)
            first.append(event)
            if is_output(event):
                if any(map(_lone_surrogate, first)):  # nothing sent yet: refused whole
                    await aclose(events)
                    return Opened(events, first, None, started, invalid=True)
                if window is None:
                    return Opened(events, first, None, started)
                first_output_at = time.perf_counter()
                end, rest = await hold(events, first, window)
                if end is not None:
                    await aclose(events)
                served = end.model if end is not None else None
                return Opened(rest, first, end, started, model=served, first_output_at=first_output_at)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await aclose(events)
        raise
    await aclose(events)
    raise ProviderError("provider", note="stream truncated")


@dataclass(frozen=True, slots=True)
class Relayed:
    """How a relayed stream ended: `kind` is `"ok"`, `"rejected"` (a structured stream whose
    answer the output guard refused: `failure` says why), the classifier's kind of the failure
    that cut it, or `"cancelled"` (the client left, or the server is stopping); `outcome` the
    breaker's verdict on the model (`released`: none); `end` the completion signal, if it
    came; `delivered` the characters of output sent; `failure` what the `error` event said
    (None after `done`, and when the stream was cancelled without one: its client left, or the
    server cancelled the request while the response waited on the client);
    `stopped` whether the server cut it (`stop_streams`, or its cancellation of the request
    while the client read: then `failure` is the shutdown's too)."""

    kind: str
    outcome: Outcome
    end: StreamEnd | None
    delivered: int
    failure: GuardTripped | None
    stopped: bool = False


async def relay(
    opened: Opened,
    *,
    provider: str,
    model: str,
    deadline: float,
    max_s: float,
    max_chars: int,
    done: Callable[[StreamEnd | None], dict[str, Any]],
    error: Callable[[GuardTripped], dict[str, Any]],
    ended: Callable[[Relayed], Awaitable[None]],
    writer: StreamWriter | None = None,
) -> AsyncIterator[bytes]:
    """The client's events for a committed attempt (`opened`): its first events, the rest of
    the stream, then `done` (with the data `done(end)` gives) or `error` (`error(tripped)`;
    also when `done(end)` raises `GuardTripped`: a structured stream's answer, refused).
    `ended` is awaited once, however the stream ends (shielded when it is cancelled; `settled()`
    waits for it). `model` names the chain entry in failures; `provider` in a truncation.

    Limits: the stream ends with `error` at `deadline` (event-loop time; the route's `max_s`
    after the request began: `call`/`timeout`), when the server stops (`stop_streams`, or the
    server's cancellation while the client reads, raised as `StreamCut`: also `call`/`timeout`,
    `SHUTDOWN_DETAIL`) and before an event would take its output past
    `max_chars` characters (`call`/`provider_error`). Either way the provider's stream is
    closed at once. One timer for the whole stream (`Alarm`), and no clock read per event.
    `writer` writes the events (guards' own, `GUARDS_EVENTS`, by default), each lone surrogate
    of their text replaced by U+FFFD (the first events have none: `open_stream`).
    """
    writer = GUARDS_EVENTS.writer() if writer is None else writer
    text, encode = writer.text, writer.event
    task = asyncio.current_task()
    assert task is not None
    alarm, settle = _alarm(deadline), _settler(ended)
    delivered = 0
    end: StreamEnd | None = opened.end
    try:
        if preamble := writer.start():
            yield preamble
        for event in opened.first:  # a hold's may hold a lone surrogate past the first output
            delivered += chars(event)
            if delivered > max_chars:
                raise _OverSize
            yield encode(_well_formed(event))
        if end is None:
            if alarm.rang:  # the limit passed before the first events were out
                raise _TimeUp
            # `alarm.waiting` is set exactly while the loop's header awaits the next event: the
            # only wait the alarm may interrupt (see `Alarm`).
            alarm.waiting = task
            async for event in opened.iter_events:
                alarm.waiting = None
                if type(event) is TextDelta:  # the hot path: one per token
                    delivered += len(event.text)
                    if delivered > max_chars:
                        raise _OverSize
                    piece = event.text
                    yield text(piece if piece.isascii() else well_formed(piece))
                elif isinstance(event, StreamEnd):
                    end = event
                    break
                else:
                    delivered += chars(event)
                    if delivered > max_chars:
                        raise _OverSize
                    yield encode(_well_formed(event))
                if alarm.rang:  # it rang while the client had the last event
                    raise _TimeUp
                alarm.waiting = task
            else:
                raise ProviderError(provider, note="stream truncated")
    except BaseException as exc:
        relayed, cut = _ended_by(exc, alarm.interrupted(task), model, max_s, max_chars, end, delivered)
        _put_away(alarm)
        # The provider's stream is closed before the client hears of the end (a client that
        # leaves meanwhile does not keep the end from being settled). The client gone, or the
        # request cancelled (its `error` event handed to the response: `StreamCut`): settled now.
        with anyio.CancelScope(shield=True):
            await aclose(opened.iter_events)
            if relayed.failure is None or cut:
                await settle(relayed)
        if (failure := relayed.failure) is None:
            raise
        if cut:
            raise StreamCut(writer.error(error(failure)), exc) from None
        try:
            yield writer.error(error(failure))
        finally:
            await settle(relayed)
        return
    _put_away(alarm)
    last, relayed = _finished(writer, done, error, end, delivered, model)
    try:
        yield last
    finally:
        await settle(relayed)


def _alarm(deadline: float) -> Alarm:
    """A stream's alarm at `deadline`, among those `stop_streams` rings (rung at once when it
    was called)."""
    alarm = Alarm(deadline)
    _live.add(alarm)
    if _stopping:
        alarm.ring()
    return alarm


def _put_away(alarm: Alarm) -> None:
    """The stream is over: its alarm stopped, and no longer among those `stop_streams` rings."""
    alarm.waiting = None
    _live.discard(alarm)
    alarm.close()


def _settler(ended: Callable[[Relayed], Awaitable[None]]) -> Callable[[Relayed], Awaitable[None]]:
    """`ended`, awaited once, which `settled()` waits for until it has returned."""
    unsettled = asyncio.get_running_loop().create_future()
    _unsettled.add(unsettled)
    return functools.partial(_settle, ended, unsettled)


async def _settle(
    ended: Callable[[Relayed], Awaitable[None]], unsettled: asyncio.Future[None], relayed: Relayed
) -> None:
    """Hand how the relay ended to its `ended` callback, then mark the relay settled
    (`settled()` waits for it)."""
    try:
        await ended(relayed)
    finally:
        _unsettled.discard(unsettled)
        unsettled.set_result(None)


def _ended_by(
    exc: BaseException,
    rang: bool,
    model: str,
    max_s: float,
    max_chars: int,
    end: StreamEnd | None,
    delivered: int,
) -> tuple[Relayed, bool]:
    """How a stream stopped by `exc` ended (`rang`: its alarm interrupted the wait for the next
    event), and whether the server cut it while its client read (its request is being
    cancelled). A cancellation that is neither the alarm's nor its client's (the response
    cancels the scope the relay runs in when its client leaves) is the server's, cancelling the
    request while its client reads: uvicorn at the end of its graceful shutdown."""
    rang = rang or isinstance(exc, _TimeUp)
    cut = (
        not rang
        and isinstance(exc, asyncio.CancelledError)
        and anyio.current_effective_deadline() != -math.inf
    )
    stopped = (rang and _stopping) or cut
    failure = _failure(exc, rang, stopped, model, max_s, max_chars)
    if failure is None or stopped:  # not the model's doing: no verdict on it, the attempt cancelled
        return Relayed(Kind.cancelled.value, Outcome.released, end, delivered, failure, stopped), cut
    kind = failure.kind.value if failure.kind else "ok"
    return Relayed(kind, Outcome.failure, end, delivered, failure), False


def _failure(
    exc: BaseException, rang: bool, stopped: bool, model: str, max_s: float, max_chars: int
) -> GuardTripped | None:
    """What the `error` event of a stream ended by `exc` says (`rang`: its time limit passed;
    `stopped`: the server cut it). None: the client left, or the server cancelled the request
    while the response waited on the client (no event)."""
    if stopped:
        return GuardTripped(Reason.timeout, SHUTDOWN_DETAIL, model=model)
    if rang:
        return GuardTripped(
            Reason.timeout,
            f"the stream reached its time limit ({max_s:g}s)",
            kind=Kind.model_temporarily_unavailable,
            model=model,
        )
    if isinstance(exc, _OverSize):
        return GuardTripped(
            Reason.provider_error,
            f"the stream reached its size limit ({max_chars} characters)",
            kind=Kind.model_unavailable,
            model=model,
        )
    if isinstance(exc, Exception):
        kind = classify(exc).kind
        return GuardTripped(Reason.provider_error, "stream interrupted after output", kind=kind, model=model)
    return None


def _finished(
    writer: StreamWriter,
    done: Callable[[StreamEnd | None], dict[str, Any]],
    error: Callable[[GuardTripped], dict[str, Any]],
    end: StreamEnd | None,
    delivered: int,
    model: str,
) -> tuple[bytes, Relayed]:
    """The last event of a stream that completed (`end`), and how it ended: `done`, or
    `error` when the provider filtered it (`moderation_blocked`) or when `done` raised the
    output guard's `GuardTripped` (a structured stream's answer, refused: `REJECTED`)."""
    if end is not None and end.finish_reason == "content_filter":
        failure = GuardTripped(Reason.moderation_blocked, "the provider filtered the stream", model=model)
        return writer.error(error(failure)), Relayed("ok", Outcome.success, end, delivered, failure)
    try:
        data = done(end)
    except GuardTripped as rejected:  # the provider answered: a success for its breaker
        return writer.error(error(rejected)), Relayed(REJECTED, Outcome.success, end, delivered, rejected)
    return writer.done(data), Relayed("ok", Outcome.success, end, delivered, None)


def _lone_surrogate(event: StreamEvent) -> bool:
    if isinstance(event, TextDelta | ReasoningDelta):
        return has_lone_surrogate(event.text)
    if isinstance(event, ToolCallDelta):
        return has_lone_surrogate(event.arguments + (event.id or "") + (event.name or ""))
    return False


def _well_formed(event: StreamEvent) -> StreamEvent:
    """`event` with each lone surrogate of its text replaced by U+FFFD: after the first
    output, the client has the answer's start, so a lone surrogate no longer ends it."""
    if isinstance(event, TextDelta):
        return event if event.text.isascii() else TextDelta(well_formed(event.text))
    if isinstance(event, ReasoningDelta):
        return ReasoningDelta(well_formed(event.text))
    if isinstance(event, ToolCallDelta):
        return ToolCallDelta(
            event.index,
            None if event.id is None else well_formed(event.id),
            None if event.name is None else well_formed(event.name),
            well_formed(event.arguments),
        )
    return event


class _TimeUp(Exception):
    """The stream's time limit passed while the client had its last event."""


class _OverSize(Exception):
    """The next event would take the stream's output past its size limit."""


async def aclose(events: AsyncIterator[StreamEvent]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


async def no_events() -> AsyncIterator[StreamEvent]:
    """An upstream with nothing left (a recovered answer is relayed from `first` alone)."""
    return
    yield  # pragma: no cover


def chars(event: StreamEvent) -> int:
    """The characters of output an event carries (a tool call's id and name included: they
    are sent to the client too)."""
    if isinstance(event, TextDelta | ReasoningDelta):
        return len(event.text)
    if isinstance(event, ToolCallDelta):
        return len(event.arguments) + len(event.id or "") + len(event.name or "")
    return 0
