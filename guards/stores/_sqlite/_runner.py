"""`Runner`: how a store's operations reach its file, in transactions run inline on the caller's
event loop or on the store's thread, each within its time.

Threads: each store has one connection, and one thread that waits for the file's lock when it
must. The operations an event loop starts in one turn are taken together, at the end of that
turn, and run in one transaction, one operation after the other, so a burst costs one lock
acquisition and one commit rather than one per operation (a commit writes its pages to the
WAL: most of an operation's cost when alone). When the connection is idle and the file's write
lock free at once (`BEGIN IMMEDIATE` answered without waiting: no busy handler), that
transaction runs right there, on the caller's loop ("inline"): handing it to a thread and
back (a wake-up each way, the GIL handed over at each SQLite call) cost more than the
statements. Otherwise (the lock held by another worker or by the store's thread, a sweep or a
WAL checkpoint due) the operations go to the store's thread, which waits for the lock, runs
what is waiting (up to `_BATCH` operations) per transaction, and answers each caller's loop
once per batch. (What an inline transaction never does: see `guards.stores._sqlite._database`.)

Timeouts: waiting for the file's write lock (the busy timeout) is bounded by `timeout_s` per
operation; past it the operation raises `StoreUnavailable`, as when the file cannot be opened.
An operation held up by its own process instead (a busy event loop, the GIL, a garbage
collection pause: they stall the store's thread too) gets one more `timeout_s` before it gives
up, so a worker's own pause does not read as a store outage; no operation waits longer than
`2 * timeout_s`. An operation whose caller gave up is skipped, or its transaction rolled back
rather than committed, so `StoreUnavailable` means the operation had no effect (unless the
commit itself outlasted the second `timeout_s`). An inline operation is answered within the
loop turn that runs it, so only operations handed to the thread have a timer. A store is not
tied to an event loop, and a process forked after using it starts a thread and a connection of
its own.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import sqlite3
import threading
import time
import weakref
from typing import Any, TypeVar

from ...contracts._clock import Clock
from .._base import StoreUnavailable
from .._epoch import Epoch
from ._database import Database, is_busy
from ._jobs import Job, Redo, Work, answer_all
from ._schema import read_epoch, sweep
from ._tx import Tx

__all__ = ["Runner"]

_T = TypeVar("_T")

#: The most operations one transaction of the store's thread carries.
_BATCH = 100


class Runner:
    """Runs a store's operations (`run`) in write transactions on its file (`Database`): inline
    when the file's write lock is free at once, else on the store's thread, which it starts on
    first need and stops at `close`."""

    def __init__(
        self, path: str, *, clock: Clock, timeout_s: float, sweep_interval_s: float, epoch: Epoch
    ) -> None:
        self._db = Database(path)
        self._path = path
        self._clock = clock
        self._timeout_s = timeout_s
        self._sweep_interval_s = sweep_interval_s
        self._epoch = epoch
        #: Operations handed over to the thread, a loop turn's at a time (None: stop).
        self._jobs: queue.SimpleQueue[list[Job[Any]] | None] = queue.SimpleQueue()
        #: Per event loop, the operations started in its current turn, not yet handed over.
        self._outbox: dict[asyncio.AbstractEventLoop, list[Job[Any]]] = {}
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        # Owned by the store's thread:
        self._next_sweep = 0.0
        #: Held by whoever uses the connection: the thread, or a caller's loop (`_run_inline`).
        self._conn_lock = threading.Lock()
        #: Results of the thread's batch, for `_serve` to answer once the connection is free.
        self._answers: list[tuple[Job[Any], Any]] = []
        _RUNNERS.add(self)

    def after_fork(self) -> None:
        """In a forked child: the parent's thread is gone and its connection must not be used
        (nor closed) here; the next operation starts a thread and a connection of the child's."""
        self._db.after_fork()
        self._thread, self._jobs, self._outbox = None, queue.SimpleQueue(), {}
        self._start_lock, self._conn_lock = threading.Lock(), threading.Lock()
        self._answers = []

    async def close(self) -> None:
        """Close the connection and stop the thread. Callable from any event loop, and twice."""
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(None)  # after the operations already queued, which end by their deadlines
            await asyncio.to_thread(thread.join, max(1.0, 4 * self._timeout_s))

    async def run(self, work: Work[_T]) -> _T:
        """Run `work` in a write transaction on the store's thread, within `timeout_s`."""
        if self._closed:
            raise StoreUnavailable(f"SQLite store {self._path}: closed")
        loop = asyncio.get_running_loop()
        job = Job(loop, work, time.monotonic() + self._timeout_s)
        started = self._outbox.get(loop)
        if started is None:  # the turn's first operation: hand them over when the turn ends
            started = self._outbox[loop] = []
            loop.call_soon(self._hand_over, loop)
        started.append(job)
        try:
            return await job.future
        finally:
            if job.timer is not None:
                job.timer.cancel()
            job.abandon()  # no effect once answered; otherwise (cancelled) the thread rolls back

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """The operations `loop` started in this turn (on `loop`): run here and now when the
        file's write lock is free (`_run_inline`), else handed to the store's thread, each
        with its timer."""
        jobs = self._outbox.pop(loop)
        if self._db.conn is not None:
            try:
                jobs = self._run_inline(jobs)
            except Exception as exc:  # a bug: answer every caller
                for job in jobs:
                    job.fail_here(exc)
                return
            if not jobs:
                return
        now = time.monotonic()
        for job in jobs:
            job.timer = loop.call_later(max(0.0, job.deadline - now), self._expire, job)
        with self._start_lock:
            if not self._closed:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name="guards-sqlite", daemon=True)
                    self._thread.start()
                self._jobs.put(jobs)
                return
        closed = StoreUnavailable(f"SQLite store {self._path}: closed")
        for job in jobs:
            job.fail_here(closed)

    def _expire(self, job: Job[Any]) -> None:
        """The operation's time is up (on the caller's loop). If the store's thread is waiting
        for the file's lock, the store is slow: give up (the thread skips or rolls back the
        operation). Otherwise this process held the operation up (a busy event loop, the GIL,
        a garbage collection pause), or its commit has begun: wait once more, then give up."""
        if job.future.done():
            return
        if not job.graced and (not self._db.lock_wait or not job.abandon()):
            job.graced = True
            job.timer = job.loop.call_later(self._timeout_s, self._expire, job)
            return
        job.abandon()
        job.future.set_exception(self._timed_out())

    def _timed_out(self) -> StoreUnavailable:
        return StoreUnavailable(f"SQLite store {self._path}: timed out after {self._timeout_s} s")

    def _serve(self) -> None:
        """The store's thread: runs the queued operations, as many as are waiting (up to
        `_BATCH`) in each transaction, on its own connection. One transaction per batch rather
        than per operation: under a burst the thread keeps up with the event loop (each SQLite
        call hands the GIL over), and one commit writes the batch."""
        waiting: collections.deque[Job[Any]] = collections.deque()  # handed over, not yet run
        closing = False
        while waiting or not closing:
            if not waiting:
                jobs = self._jobs.get()
                if jobs is None:
                    break
                waiting.extend(jobs)
            while not closing:  # and whatever else was handed over meanwhile
                try:
                    jobs = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if jobs is None:
                    closing = True  # once the operations handed over before it have run
                else:
                    waiting.extend(jobs)
            batch = [waiting.popleft() for _ in range(min(_BATCH, len(waiting)))]
            with self._conn_lock:
                if self._db.checkpoint_due:
                    self._db.checkpoint()  # then this batch: the first write after it, here too
                try:
                    self._run_batch(batch, inline=False)
                except Exception as exc:  # a bug: answer every caller, and keep serving
                    for job in batch:
                        job.fail(exc)
                answers, self._answers = self._answers, []
            # Once the connection is free: woken, the callers' next operations may run inline.
            answer_all(answers)
        with self._conn_lock:
            self._db.disconnect()

    def _run_inline(self, jobs: list[Job[Any]]) -> list[Job[Any]]:
        """On the caller's loop: run `jobs` in one transaction here, if this process's
        connection is idle and the file's write lock free at once (`BEGIN IMMEDIATE`, no
        waiting). Returns the operations left for the store's thread: all of them when the
        lock is taken (by the thread, another connection), a sweep or a checkpoint is due
        (they run on the thread); else none."""
        if not self._conn_lock.acquire(blocking=False):
            return jobs
        try:
            if (
                self._closed
                or self._db.conn is None
                or self._db.checkpoint_due
                or self._clock.time() >= self._next_sweep
            ):
                return jobs
            return self._run_batch(jobs, inline=True)
        finally:
            self._conn_lock.release()

    def _run_batch(self, batch: list[Job[Any]], *, inline: bool) -> list[Job[Any]]:
        """Run `batch`, in one transaction unless some operations must run again without the
        others. Inline (on the caller's loop), returns the operations left for the thread:
        the file's lock was taken; on the thread, waits for it (to each one's deadline)."""
        while batch:
            live = []
            for job in batch:
                if job.abandoned:  # its caller gave up: skip it
                    job.fail(self._timed_out())
                else:
                    live.append(job)
            if not live:
                return []
            try:
                batch = self._transact(live, inline)
            except sqlite3.Error as exc:
                if inline and (is_busy(exc) or self._db.conn is not None):
                    return live  # the lock is taken, or an error the thread deals with (closing)
                if not is_busy(exc):
                    self._db.failed(exc)
                    reason = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
                    unavailable = StoreUnavailable(f"SQLite store {self._path}: {reason}")
                    for job in live:
                        job.fail(unavailable)
                    return []
                # Locked past the earliest deadline: those operations fail, the others wait on.
                locked = StoreUnavailable(f"SQLite store {self._path}: database is locked")
                now, batch = time.monotonic(), []
                for job in live:
                    if now >= job.deadline:
                        job.abandon()
                        job.fail(locked)
                    else:
                        batch.append(job)
        return []

    def _transact(self, jobs: list[Job[Any]], inline: bool) -> list[Job[Any]]:
        """Run `jobs` in one write transaction and commit it; returns the operations to run
        again (in a new transaction) when the batch had to be rolled back, else nothing.
        Inline: on the connection already open, the write lock taken at once or not at all
        (SQLITE_BUSY), no sweep; answers set on the spot (this is the callers' loop)."""
        db = self._db
        conn = db.begin(None if inline else min(job.deadline for job in jobs))
        try:
            epoch = read_epoch(conn)
            now = self._clock.time()
            next_sweep = self._sweep(conn, now) if not inline and now >= self._next_sweep else None
            done = self._work(Tx(conn), jobs)
            if not all(job.commit() for job, _ in done):  # a caller gave up meanwhile
                raise Redo(jobs)
            conn.execute("COMMIT")
        except Redo as redo:
            db.rollback(conn)
            return redo.jobs
        except BaseException:
            db.rollback(conn)
            raise
        db.commits += 1
        if epoch != self._epoch.known:  # committed: a marker made here exists now
            self._epoch.found(epoch)
        if next_sweep is not None:
            self._next_sweep = next_sweep
        if inline:
            for job, result in done:
                job.succeed(result)
        else:
            self._answers.extend(done)  # answered once the connection is free (`_serve`)
        return []

    def _work(self, tx: Tx, jobs: list[Job[Any]]) -> list[tuple[Job[Any], Any]]:
        """Each operation's work within `tx`, in order, then the breaker rows written back:
        the operations done and their results. One that raises (a bug) fails alone: its
        caller gets the error, and the batch is run again without it (`Redo`)."""
        done: list[tuple[Job[Any], Any]] = []
        for job in jobs:
            if job.abandoned:  # its caller gave up before it ran: leave it out
                job.fail(self._timed_out())
                continue
            try:
                done.append((job, job.work(tx, self._clock.time())))
            except sqlite3.Error:
                raise
            except Exception as exc:  # a bug in one operation: its caller gets it, alone
                job.fail(exc)
                raise Redo([j for j in jobs if j is not job]) from None
        tx.flush()
        return done

    def _sweep(self, conn: sqlite3.Connection, now: float) -> float:
        """Delete expired rows (`sweep`); returns when the next sweep is due."""
        return now + self._sweep_interval_s if sweep(conn, now) else now


#: The runners of this process (each store's), told when the process forks.
_RUNNERS: weakref.WeakSet[Runner] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for runner in list(_RUNNERS):
        runner.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
