"""`Alarm`: a deadline on the waits for a stream's next piece, with one event-loop timer for a
whole stream rather than one per event.

A stream alternates between waiting on its source (the provider) and handing what came to its
consumer (the client). A deadline may only interrupt the first: cancelling a task while it
hands an event to the client would lose the event and end the stream from the wrong place. So
the owner marks each wait (`waiting = task` before, `None` after: two attribute stores per
event), and the timer, when it fires:

- if the deadline moved later since it was armed (`when`, set freely per event), re-arms
  itself for the new time (one timer per period, however many events pass);
- if the owner waits on its source, cancels that task (`rang` is set; the owner turns the
  `CancelledError` into its own failure with `interrupted(task)`, like `asyncio.timeout`);
- otherwise (the consumer has the stream) sets `rang` for the owner to see at its next check,
  or, with `defer_s`, moves the deadline `defer_s` on: time spent by the consumer is not the
  source's.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Alarm"]


class Alarm:
    """Rings at `when` (event-loop time); `close()` it when the stream ends."""

    __slots__ = ("_cancelled", "_cancelling", "_loop", "_timer", "defer_s", "rang", "waiting", "when")

    def __init__(self, when: float, *, defer_s: float | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        #: The deadline; the owner may move it (later) at any time without touching the timer.
        self.when = when
        #: The task waiting on the source, set by the owner around each wait (None otherwise).
        self.waiting: asyncio.Task[Any] | None = None
        self.defer_s = defer_s
        self.rang = False
        self._cancelled = False  # a cancel request of ours is pending on `waiting`'s task
        self._cancelling = 0
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        if now < self.when:
            self._timer = self._loop.call_at(self.when, self._fire)
            return
        task = self.waiting
        if task is None and self.defer_s is not None:
            self.when = now + self.defer_s
            self._timer = self._loop.call_at(self.when, self._fire)
            return
        self.rang = True
        if task is not None:
            # Cancellations already requested are not this alarm's (see `interrupted`).
            self._cancelling = task.cancelling()
            self._cancelled = True
            task.cancel()

    def ring(self) -> None:
        """Ring now, whatever `when` says (the server is stopping: see `guards.streams._relay`)."""
        if self._timer is None:
            return  # closed, or rung already
        self._timer.cancel()
        self.when = self._loop.time()
        self.defer_s = None
        self._fire()

    def interrupted(self, task: asyncio.Task[Any]) -> bool:
        """Whether this alarm interrupted `task`'s wait: then its cancel request is withdrawn,
        and the owner raises its own failure instead of what the wait raised (a
        `CancelledError`, or whatever the source made of it). False when it did not, or when
        someone else cancelled the task too (that cancellation must go on)."""
        if not self._cancelled:
            return False
        self._cancelled = False
        return task.uncancel() <= self._cancelling

    def close(self) -> None:
        """Stop the timer (the stream ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
