"""`Job`: one operation of the store, handed from its caller's event loop to the store's thread
(or run inline, on that loop), and who decides its fate when time runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ._tx import Tx

__all__ = ["Job", "Redo", "Work", "answer_all"]

_T = TypeVar("_T")

#: An operation's work: what it does within the transaction `Tx`, at the store's time.
Work = Callable[[Tx, float], _T]


class Job(Generic[_T]):
    """One operation handed to the store's thread: its work, its deadline, the caller's future,
    and who decides its fate when time runs out (the caller abandons it, or the thread has
    begun committing it, and then its answer stands)."""

    __slots__ = ("abandoned", "committing", "deadline", "future", "graced", "lock", "loop", "timer", "work")

    def __init__(self, loop: asyncio.AbstractEventLoop, work: Work[_T], deadline: float) -> None:
        self.loop = loop
        self.future: asyncio.Future[_T] = loop.create_future()
        self.work = work
        self.deadline = deadline
        self.timer: asyncio.TimerHandle | None = None
        self.lock = threading.Lock()
        self.abandoned = False
        self.committing = False
        self.graced = False

    def abandon(self) -> bool:
        """Give up on the operation; False if it is already committing (its answer stands)."""
        with self.lock:
            self.abandoned = True
            return not self.committing

    def commit(self) -> bool:
        """May the thread commit? False if the caller has given up (then it rolls back)."""
        with self.lock:
            self.committing = not self.abandoned
            return self.committing

    # Called by the store's thread; the future is settled on its own loop.
    def fail(self, error: Exception) -> None:
        self._call(self.fail_here, error)

    def _call(self, callback: Callable[[Any], None], arg: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            self.loop.call_soon_threadsafe(callback, arg)

    def succeed(self, result: _T) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def fail_here(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def answer_all(done: list[tuple[Job[Any], Any]]) -> None:
    """From the store's thread: the results of a committed batch, to their callers, each
    caller's loop woken once."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job[Any], Any]]] = {}
    for job, result in done:
        by_loop.setdefault(job.loop, []).append((job, result))
    for loop, answers in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            loop.call_soon_threadsafe(_answer, answers)


def _answer(answers: list[tuple[Job[Any], Any]]) -> None:
    for job, result in answers:
        job.succeed(result)


class Redo(Exception):
    """Roll the batch back and run `jobs` again (the batch without the operations that left it)."""

    def __init__(self, jobs: list[Job[Any]]) -> None:
        super().__init__()
        self.jobs = jobs
