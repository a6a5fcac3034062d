"""The stream relay: a model's stream, from its first call to the client's last event.

`open_stream` is one streaming attempt up to the commit point, the call `AI.stream` walks the
chain with: it reads the stream until its first output part (the attempt succeeded), its end
(complete, without output) or a failure (raised, like `run`). `relay` is the body of the
`EventStream` a streaming route answers: the committed attempt's events as the client's events,
then exactly one of `done` and `error`.

The relay knows nothing of budgets, breakers or ledgers. However the stream ends, it hands what
happened (`Relayed`) to its `ended` callback, which the `AI` handle gives it to do the
accounting; `done` and `error` give the data of the last event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from ._breaker import Outcome
from ._classify import Kind, classify
from ._envelope import Reason
from ._errors import GuardTripped, ProviderError
from ._event_stream import delta, encode, sse
from ._stream import (
    ReasoningDelta,
    StreamEnd,
    StreamEvent,
    StreamingBinding,
    TextDelta,
    ToolCallDelta,
    is_output,
)

__all__ = ["Opened", "Relayed", "no_events", "open_stream", "relay"]


@dataclass(slots=True, eq=False)
class Opened:
    """A stream opened by one attempt, read up to its first output part (or its end)."""

    iter_events: AsyncIterator[StreamEvent]
    #: The events read so far: the attempt's preamble and its first output part.
    first: list[StreamEvent]
    end: StreamEnd | None
    started: float
    model: str | None = None

    @property
    def committed(self) -> bool:
        return any(is_output(event) for event in self.first)


async def open_stream(binding: StreamingBinding, model: str, inputs: Mapping[str, Any]) -> Opened:
    """One streaming attempt, up to the commit point: read until the first output part (the
    attempt succeeds), the end of a stream that had none, or a failure (raised, like `run`;
    the preamble read so far is dropped with the attempt)."""
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
                return Opened(events, first, None, started)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await aclose(events)
        raise
    await aclose(events)
    raise ProviderError("provider", note="stream truncated")


@dataclass(frozen=True, slots=True)
class Relayed:
    """How a relayed stream ended: `kind` is `"ok"`, the classifier's kind of the failure that
    cut it, or `"cancelled"` (the client left, or the server is stopping); `outcome` the
    breaker's verdict on the model; `end` the completion signal, if it came; `delivered` the
    characters of output sent; `failure` what the `error` event said (None after `done`, and
    when cancelled)."""

    kind: str
    outcome: Outcome
    end: StreamEnd | None
    delivered: int
    failure: GuardTripped | None


async def relay(
    opened: Opened,
    *,
    provider: str,
    model: str,
    done: Callable[[StreamEnd | None], dict[str, Any]],
    error: Callable[[GuardTripped], dict[str, Any]],
    ended: Callable[[Relayed], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """The client's events for a committed attempt (`opened`): its first events, the rest of
    the stream, then `done` (with the data `done(end)` gives) or `error` (`error(tripped)`).
    `ended` is awaited once, however the stream ends (shielded when it is cancelled). `model`
    names the chain entry in failures; `provider` in a truncation."""
    delivered = 0
    end: StreamEnd | None = opened.end
    try:
        for event in opened.first:
            delivered += chars(event)
            yield encode(event)
        if end is None:
            async for event in opened.iter_events:
                if type(event) is TextDelta:  # the hot path: one per token
                    delivered += len(event.text)
                    yield delta(event.text)
                    continue
                if isinstance(event, StreamEnd):
                    end = event
                    break
                delivered += chars(event)
                yield encode(event)
            else:
                raise ProviderError(provider, note="stream truncated")
    except Exception as exc:
        kind = classify(exc).kind
        failure = GuardTripped(
            Reason.provider_error, "stream interrupted after output", kind=kind, model=model
        )
        yield sse("error", error(failure))
        await ended(Relayed(kind.value, Outcome.failure, end, delivered, failure))
        return
    except BaseException:
        # The client left (or the server is stopping): no verdict on the model; what was
        # delivered is recorded, nothing more is fetched or billed.
        with anyio.CancelScope(shield=True):
            await ended(Relayed(Kind.cancelled.value, Outcome.released, end, delivered, None))
        raise
    if end is not None and end.finish_reason == "content_filter":
        failure = GuardTripped(Reason.moderation_blocked, "the provider filtered the stream", model=model)
        yield sse("error", error(failure))
        await ended(Relayed("ok", Outcome.success, end, delivered, failure))
        return
    yield sse("done", done(end))
    await ended(Relayed("ok", Outcome.success, end, delivered, None))


async def aclose(events: AsyncIterator[StreamEvent]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


async def no_events() -> AsyncIterator[StreamEvent]:
    """An upstream with nothing left (a recovered answer is relayed from `first` alone)."""
    return
    yield  # pragma: no cover


def chars(event: StreamEvent) -> int:
    """The characters of output an event carries."""
    if isinstance(event, TextDelta | ReasoningDelta):
        return len(event.text)
    if isinstance(event, ToolCallDelta):
        return len(event.arguments)
    return 0
