"""First-output limits: how long one attempt on a model may take to start answering, and how
long a stream that started may go quiet (a chain entry's `Model(first_output_s=...,
stream_idle_s=...)`, or the route's defaults).

The route's deadline bounds the whole chain; a model that accepts the request and never answers
would spend all of it, and the next model would never be tried. A first-output limit cancels
that attempt instead (its connection closed, as for the deadline) and fails it with
`NoFirstOutput`: a `ProviderError` with no status, so `model_temporarily_unavailable`, counted
on the model's breaker, with no cooldown (the provider asked for no pause). The walk then moves
to the next model while the deadline leaves room; the same model is tried again only on a
one-model chain (the retry policy's usual terms).

What the first output is:

- a stream: its first output part (`guards.is_output`), read by `open_stream`;
- a whole answer: its first byte, when the binding says when that came
  (`first_output_arrived()`: the HTTP adapters of `guards.providers` call it once the status
  line and headers arrived); a binding that says nothing has answered when `run` returns.

Costs nothing for a model with no limit: the walk wraps a call only when its leg has one.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from ..contracts._errors import ProviderError
from ..contracts._stream import StreamEvent
from ._admission import never_admitted, waited_for_admission
from ._alarm import Alarm

__all__ = ["NoFirstOutput", "first_output_arrived", "idle_limited", "limited"]

R = TypeVar("R")

#: What `first_output_arrived` calls: set around each attempt that has a first-output limit.
_arrived: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "guards_first_output", default=None
)


def first_output_arrived() -> None:
    """Tell guards that the answer of the model call in progress has begun: call it from a
    binding's `run` when the answer's first byte arrived (its status line and headers). The
    call's first-output limit (`Model(first_output_s=...)`) then no longer applies: the rest
    of the answer has the route's deadline. Does nothing when the call has no such limit, or
    outside a call. A binding that never calls it has answered when `run` returns."""
    signal = _arrived.get()
    if signal is not None:
        signal()


class NoFirstOutput(ProviderError):
    """An attempt produced no first output within its model's `first_output_s`. `moves_on`:
    the chain has another model, so the attempt is not retried on this one. `queued`: the
    limit passed while the call waited for a connection of the binding's own pool
    (`guards.waits._admission`), so it says nothing of the model (no breaker verdict); `never_sent`:
    it was still waiting (no attempt was made)."""

    def __init__(
        self, provider: str, limit_s: float, *, moves_on: bool, queued: bool = False, never_sent: bool = False
    ) -> None:
        self.limit_s = limit_s
        self.moves_on = moves_on
        self.queued = queued
        self.never_sent = never_sent
        note = f"no first output within {limit_s:g}s"
        if queued:
            note += " (waiting for a connection)"
        super().__init__(provider, note=note)

    def describe(self) -> str:
        return self.note  # the model is named by whoever reports it


def limited(
    call: Callable[[str, Mapping[str, Any]], Awaitable[R]],
    limit_s: float,
    provider: str,
    *,
    moves_on: bool,
    signalled: bool,
) -> Callable[[str, Mapping[str, Any]], Awaitable[R]]:
    """`call`, each attempt of it cancelled if it has not produced its first output within
    `limit_s` (then `NoFirstOutput` is raised). The first output is the call's return, or,
    with `signalled` (a binding's `run`), `first_output_arrived()` when the binding calls it.
    A cancellation from elsewhere (the route's deadline, the client gone) passes through."""

    async def attempt(model: str, inputs: Mapping[str, Any]) -> R:
        scope = asyncio.timeout(limit_s)
        try:
            async with scope:
                if not signalled:
                    return await call(model, inputs)
                token = _arrived.set(functools.partial(_disarm, scope))
                try:
                    return await call(model, inputs)
                finally:
                    _arrived.reset(token)
        except TimeoutError as expired:
            if scope.expired():
                raise NoFirstOutput(
                    provider,
                    limit_s,
                    moves_on=moves_on,
                    queued=waited_for_admission(expired),
                    never_sent=never_admitted(expired),
                ) from None
            raise

    return attempt


def _disarm(scope: asyncio.Timeout) -> None:
    """The first output arrived: the attempt's limit no longer applies."""
    if not scope.expired():
        scope.reschedule(None)


async def idle_limited(
    events: AsyncIterator[StreamEvent], idle_s: float, provider: str
) -> AsyncIterator[StreamEvent]:
    """`events`, failing with `ProviderError` (`note="stream stalled"`, as a binding's own idle
    timeout) when the next event takes longer than `idle_s` to come. Only the wait on the
    source counts, not the time the consumer holds an event. One timer for the whole stream
    (`Alarm`), moved before each wait. Closing this closes `events`."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    idle = Alarm(loop.time() + idle_s, defer_s=idle_s)
    next_event = events.__anext__
    try:
        while True:
            idle.when = loop.time() + idle_s
            idle.waiting = task
            try:
                event = await next_event()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if idle.interrupted(task):
                    raise ProviderError(provider, note="stream stalled") from None
                raise
            finally:
                idle.waiting = None
            yield event
    finally:
        idle.close()
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
