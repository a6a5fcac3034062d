"""`Deadline`: the one deadline of a walk, cheap enough for every request.

A walk (`AI.run`, or `AI.stream` up to its first output) has one deadline. When it passes, the
walk's task is cancelled where it awaits, so the provider request in flight is aborted and its
connection closed, and the walk sees `TimeoutError`: what `asyncio.timeout_at` does. But most
walks end within milliseconds, and an event-loop timer per walk (a `TimerHandle`, a heap push,
then the cancelled handle's removal) costs more than every guard of the walk together. So a
deadline is armed in two steps:

1. At the start the walk joins its event loop's *mark queue*: running walks in start order
   (a dict, which keeps insertion order), with one loop timer for the oldest. Joining and
   leaving cost a dict insertion and removal. A walk leaves the queue when it ends: the
   queue holds only walks in flight, so nothing of a finished walk outlives it (walks kept
   for `MARK_AFTER_S` after their end would survive into the garbage collector's older
   generations, and its collections would cost more than the rest of the deadline).
2. Between `MARK_AFTER_S` and `MARK_AFTER_S + MARK_TICK_S` into the walk, if it still runs,
   the queue's timer gives it a real timer at its deadline and calls its `on_mark` (the
   disconnect watcher starts there).

The queue's timer ticks at most once per `MARK_TICK_S`: under steady load, walks start every
few hundred microseconds, and a timer re-armed at each next mark would fire every request or
two; each tick marks every walk that came due since the last. A deadline within `MARK_AFTER_S +
MARK_TICK_S` gets its real timer at once, so a mark is never later than its deadline.
`expire()` ends the walk now, the same way (the client left). A deadline already passed when
the block is entered (`timeout_s <= 0`: the request's intake spent it) raises `TimeoutError`
there, before anything of the block runs.
"""

from __future__ import annotations

import asyncio
import sys
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["MARK_AFTER_S", "MARK_TICK_S", "Deadline"]

#: How long a deadline runs on the shared mark queue before it gets its own timer (at least).
MARK_AFTER_S = 0.1
#: The shared timer's tick: a mark comes at most this much after `MARK_AFTER_S`.
MARK_TICK_S = 0.025

_RUNNING, _EXPIRED, _DONE = 0, 1, 2
#: A deadline this close gets its own timer at once (its mark would not come before it).
_OWN_TIMER_S = MARK_AFTER_S + MARK_TICK_S
#: `asyncio.get_running_loop`, one attribute lookup less on every walk.
_running_loop = asyncio.get_running_loop


class Deadline:
    """A deadline `timeout_s` from entering a `with` block of the current task; `when` is it in
    event-loop time (`loop.time()`).

    Entering with `timeout_s <= 0` raises `TimeoutError` at once (the block does not run). On
    exit after it expired, the task's cancellation becomes `TimeoutError` (unless the task
    was also cancelled from elsewhere: then the `CancelledError` goes on), like
    `asyncio.timeout`.
    """

    __slots__ = (
        "_cancelling",
        "_mark_arg",
        "_on_mark",
        "_queue",
        "_state",
        "_task",
        "_timer",
        "timeout_s",
        "when",
    )
    _task: asyncio.Task[Any] | None

    def __init__(
        self, timeout_s: float, on_mark: Callable[[Any], None] | None = None, mark_arg: Any = None
    ) -> None:
        self.timeout_s = timeout_s
        #: Called as `on_mark(mark_arg)` at the mark (no callable made per block).
        self._on_mark = on_mark
        self._mark_arg = mark_arg
        self._timer: asyncio.TimerHandle | None = None
        self._state = _RUNNING
        #: The mark queue the deadline waits in (None: it has its own timer).
        self._queue: _MarkQueue | None = None

    def __enter__(self) -> Deadline:
        loop = _running_loop()
        queue = _last
        if queue is None or queue.loop() is not loop:
            queue = _queue(loop)
        task = _current_task(loop)
        if task is None:
            raise RuntimeError("a Deadline must be used inside a task")
        now = queue.time()
        timeout_s = self.timeout_s
        when = self.when = now + timeout_s
        if timeout_s <= 0:
            self._state = _DONE
            raise TimeoutError
        self._task = task
        if timeout_s <= _OWN_TIMER_S:
            self._timer = loop.call_at(when, self.expire)
            return self
        queue.running[self] = now + MARK_AFTER_S
        self._queue = queue
        if queue.timer is None:
            queue.timer = loop.call_at(now + MARK_AFTER_S, queue.fire)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        elif self._queue is not None:
            self._queue.running.pop(self, None)  # leave the mark queue
            self._queue = None
        task, expired = self._task, self._state == _EXPIRED
        # Let go of the task and callback.
        self._state, self._task, self._on_mark, self._mark_arg = _DONE, None, None, None
        # `uncancel` first, whatever the exception: the expiry's cancel request is spent.
        if (
            expired
            and task is not None
            and task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def expire(self) -> None:
        """End the block now: cancel the task where it awaits (no effect once it ended)."""
        task = self._task
        if self._state == _RUNNING and task is not None:
            self._state = _EXPIRED
            # Cancellations already requested are not this deadline's (see `__exit__`).
            self._cancelling = task.cancelling()
            task.cancel()

    def _marked(self, loop: asyncio.AbstractEventLoop) -> None:
        """`MARK_AFTER_S` into the block: a real timer at the deadline, then `on_mark`."""
        if self._state != _RUNNING:
            return
        self._timer = loop.call_at(self.when, self.expire)
        if self._on_mark is not None:
            self._on_mark(self._mark_arg)


class _MarkQueue:
    """One event loop's running deadlines without a timer of their own, by mark (start +
    MARK_AFTER_S, so they join in mark order), with one loop timer: at the oldest's mark, but
    never sooner than MARK_TICK_S after the last tick. A deadline leaves when its block ends,
    or when it is marked (it then has its own timer)."""

    __slots__ = ("loop", "running", "time", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        #: A weak reference: the queue lives as long as its loop, not the other way round.
        self.loop = weakref.ref(loop)
        #: `loop.time`; for asyncio's own loops, what it returns (`time.monotonic`) without
        #: the method's Python frame.
        self.time: Callable[[], float] = (
            time.monotonic if getattr(type(loop), "time", None) is asyncio.BaseEventLoop.time else loop.time
        )
        self.running: dict[Deadline, float] = {}
        self.timer: asyncio.TimerHandle | None = None

    def fire(self) -> None:
        self.timer = None
        loop = self.loop()
        if loop is None:
            return
        running = self.running
        now = self.time()
        due = []
        for deadline, mark in running.items():  # in mark order: up to the first not due
            if mark > now:
                break
            due.append(deadline)
        try:
            for deadline in due:
                del running[deadline]
                if deadline._state == _RUNNING:
                    deadline._marked(loop)
        finally:  # even if a mark callback raised: the later deadlines still get theirs
            if running:
                self.timer = loop.call_at(max(next(iter(running.values())), now + MARK_TICK_S), self.fire)


#: `asyncio.current_task(loop)`: on CPython 3.11 a Python function around this dict's `get`,
#: called directly (one frame less on every walk); elsewhere the public function.
_tasks = getattr(asyncio.tasks, "_current_tasks", None)
_current_task: Callable[[asyncio.AbstractEventLoop], asyncio.Task[Any] | None] = (
    _tasks.get if sys.version_info[:2] == (3, 11) and isinstance(_tasks, dict) else asyncio.current_task
)

_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _MarkQueue] = weakref.WeakKeyDictionary()
#: The queue of the last loop asked for: one loop per process or thread is the usual case.
_last: _MarkQueue | None = None


def _queue(loop: asyncio.AbstractEventLoop) -> _MarkQueue:
    global _last
    queue = _queues.get(loop)
    if queue is None:
        queue = _queues[loop] = _MarkQueue(loop)
    _last = queue
    return queue
