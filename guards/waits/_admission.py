"""`Admission`: at most `limit` holders at a time, the others waiting, newest first.

Why our own: the wait in front of a provider's connection pool must cost the same for the
thousandth waiter as for the first. httpcore's pool rescans every queued request against every
connection on each event (a request arriving, leaving or finishing), so 1,000 requests queued
on 100 connections starve the event loop and no deadline fires in time. An `Admission` sized
to the pool keeps that queue empty: requests wait here instead, where joining, leaving and
being handed a slot are O(1) (amortized: a waiter that gives up stays in the deque, done, and
is dropped when reached or when the dead outnumber the living).

A freed slot goes to the newest waiter: under overload it has the most deadline left, while the
oldest would start its call with its deadline nearly spent (first come, first served then keeps
the pool busy with calls that time out anyway). Every waiter gives up at its own deadline, so
none is passed over for longer than that.

A waiter gives up only by being cancelled (the walk's deadline, a client gone, shutdown). What
the cancelled call did is told to the walk in the `CancelledError`'s argument, so that a
request that outlasted its deadline in our own queue is not blamed on the provider:

- `NOT_ADMITTED`: cancelled while waiting; the call never left (no attempt, no verdict);
- `ADMITTED_LATE`: it waited, got a connection, and was cancelled before its answer was read
  to the end (before the head came, or while its body came); it ran on what was left of its
  deadline, so its timeout says nothing of the provider (an attempt, but no breaker verdict).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["ADMITTED_LATE", "NOT_ADMITTED", "Admission", "never_admitted", "waited_for_admission"]

NOT_ADMITTED = "guards: cancelled while waiting for admission"
ADMITTED_LATE = "guards: cancelled after waiting for admission"
#: Waiters that gave up, tolerated in the deque beyond as many as the living before it is
#: compacted (so the deque stays O(living), and compaction costs O(1) amortized per waiter).
_COMPACT_AFTER = 64


class Admission:
    """At most `limit` holders at a time. `await acquire()` takes a slot, or waits for one;
    `release()` gives it back (to the newest waiter, if any). One event loop."""

    __slots__ = ("_free", "_queued", "_waiters", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("an admission limit must be at least 1")
        self.limit = limit
        # Invariant: `_free > 0` only while no live waiter is queued (a released slot goes
        # straight to the newest live waiter).
        self._free = limit
        self._waiters: deque[asyncio.Future[None]] = deque()
        #: Waiters neither handed a slot nor given up: the living part of `_waiters`.
        self._queued = 0

    @property
    def in_use(self) -> int:
        """Slots held now."""
        return self.limit - self._free

    @property
    def waiting(self) -> int:
        """Waiters queued now."""
        return self._queued

    async def acquire(self) -> bool:
        """Take a slot, waiting when none is free; True when it waited. Cancelled while
        waiting, it raises `CancelledError(NOT_ADMITTED)` holding nothing."""
        if self._free:
            self._free -= 1
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._queued += 1
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():
                self._queued -= 1
                if len(self._waiters) > 2 * self._queued + _COMPACT_AFTER:
                    self._waiters = deque(w for w in self._waiters if not w.done())
            else:  # handed a slot just as it was cancelled: pass the slot on
                self.release()
            raise asyncio.CancelledError(NOT_ADMITTED) from None
        return True

    def release(self) -> None:
        """Give a slot back: to the newest live waiter, else to the free count."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.pop()
            if not waiter.done():  # done: it gave up (and was counted out then)
                waiter.set_result(None)
                self._queued -= 1
                return
        self._free += 1


def _cancelled_as(exc: BaseException | None) -> object:
    """The argument of the cancellation behind `exc` (itself, or the cause of a deadline's
    `TimeoutError`), or None."""
    if isinstance(exc, TimeoutError):
        exc = exc.__cause__
    return exc.args[0] if isinstance(exc, asyncio.CancelledError) and exc.args else None


def never_admitted(exc: BaseException | None) -> bool:
    """Whether `exc` ended a call that was still waiting for admission: it never left."""
    return _cancelled_as(exc) == NOT_ADMITTED


def waited_for_admission(exc: BaseException | None) -> bool:
    """Whether `exc` ended a call that waited for admission, before its answer was read
    (whether or not it got a connection): its deadline was spent in our queue, not on the
    provider."""
    return _cancelled_as(exc) in (NOT_ADMITTED, ADMITTED_LATE)
