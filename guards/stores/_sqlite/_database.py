"""`Database`: a store's one connection to its file, and what keeps using it safe.

An inline transaction (see `guards.stores._sqlite._runner`) never waits for a lock (it takes it
at once or leaves the work to the thread), never sweeps, and never checkpoints the WAL (a
checkpoint syncs files). In WAL mode with `synchronous = NORMAL` a commit only writes the WAL;
the syncs come with checkpoints, and SQLite's automatic checkpoint (run by a commit) is off:
the store's thread checkpoints instead (`Database.checkpoint`, every `WAL_PAGES` pages, with
`journal_size_limit`: the WAL stays small on a small disk), and runs the transaction right
after it, the first write after a complete checkpoint, which restarts the WAL and syncs its
header. (Another worker's checkpoint can leave that first write, and its one small sync, to an
inline transaction of this one.)

The file under the connection is checked before each transaction (`Database.check_files`): a
file deleted or replaced, or a WAL index (-shm) truncated or no longer writable, makes the
store unavailable rather than a process killed by SIGBUS or writing to a file the other
workers no longer share. Waiting for the file's write lock is `Database.when_free`, the busy
timeout.
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import quote

from ._schema import SCHEMA

__all__ = [
    "CHECKPOINT_EVERY",
    "WAL_PAGES",
    "Database",
    "file_problem",
    "is_busy",
    "is_full",
    "is_unwritable",
]

_T = TypeVar("_T")

#: A store's thread checkpoints the WAL (`Database.checkpoint`) every `WAL_PAGES` pages of
#: WAL (1 MiB of 4 KiB pages; SQLite's automatic checkpoint waits for 1,000), counted in
#: commits: `CHECKPOINT_EVERY` until the first checkpoint tells how many pages a commit writes.
#: A small disk must hold the WAL: it is never longer than about that between checkpoints.
WAL_PAGES = 256
CHECKPOINT_EVERY = 20
#: `journal_size_limit`: the WAL a checkpoint leaves behind is cut back to this (SQLite keeps
#: the file at its largest otherwise, and a spike, say a checkpoint held up by another
#: worker, would keep its disk space for good).
_WAL_LIMIT_BYTES = 1024 * 1024
#: How often (at most) a store checks that its file is still the one at its path.
_CHECK_EVERY_S = 1.0
#: Connections dropped after their file was deleted or replaced: never closed (see
#: `Database.abandon`), kept here to the end of the process. One per replacement.
_ABANDONED: list[sqlite3.Connection] = []
#: The (device, inode) of their files. SQLite maps a file's -shm once per process, shared by
#: every connection to that file: a new connection to an abandoned file would reuse the old,
#: possibly truncated mapping (SIGBUS), so the process never opens one of these again. An
#: open file's inode is never reused, so a new file at the path is never mistaken for one.
_ABANDONED_FILES: set[tuple[int, int]] = set()


class Database:
    """The store's connection to the file at `path` (opened on first use, in WAL mode, with the
    schema; used by the store's thread and, under the store's connection lock, inline on a
    caller's loop), the identity of the files it has open, and the WAL's checkpoints."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.shm = path + "-shm"
        self.conn: sqlite3.Connection | None = None
        #: True while the thread waits for another connection to release the file's lock.
        self.lock_wait = False
        #: Whether this store has had its file (then it never creates one again).
        self.opened = False
        self.files: tuple[tuple[int, int], tuple[int, int], tuple[int, int, int]] = (
            (0, 0),
            (0, 0),
            (0, 0, 0),
        )
        self.next_check = 0.0
        #: Commits since the last WAL checkpoint, and how many call for the next one.
        self.commits = 0
        self.checkpoint_every = CHECKPOINT_EVERY
        #: A write failed for want of disk space (SQLITE_FULL): checkpoints truncate the WAL
        #: (`checkpoint`) until one succeeds.
        self.full = False

    def after_fork(self) -> None:
        """In a forked child: the parent's connection must not be used (nor closed) here."""
        if self.conn is not None:
            _INHERITED.append(self.conn)
        self.conn = None
        self.commits, self.full = 0, False

    @property
    def checkpoint_due(self) -> bool:
        return self.commits >= self.checkpoint_every

    def begin(self, deadline: float | None) -> sqlite3.Connection:
        """Open a write transaction (`BEGIN IMMEDIATE`: the write lock, first) and return its
        connection. Inline (`deadline` None): on the connection already open, the write lock
        taken at once or not at all (SQLITE_BUSY); else waiting for it until `deadline`."""
        if deadline is None:
            conn = self.conn
            assert conn is not None
            self.check_files()
            conn.execute("BEGIN IMMEDIATE")
            return conn
        conn = self.connect(deadline)
        self.check_files()
        self.when_free(deadline, lambda: conn.execute("BEGIN IMMEDIATE"))
        return conn

    def failed(self, exc: sqlite3.Error) -> None:
        """After an error other than a busy lock: out of disk space, the connection stays, to
        checkpoint at once (`checkpoint`); with an unwritable -shm it waits (see
        `check_files`); otherwise (cannot open, I/O error, file replaced) it is dropped, to
        start afresh next time."""
        if is_full(exc):
            self.full = True
            self.commits = max(self.commits, self.checkpoint_every)
        elif not is_unwritable(exc):
            self.disconnect()

    def checkpoint(self) -> None:
        """On the store's thread, before a batch: copy the WAL into the database file (a
        passive checkpoint, which waits for nobody), as SQLite's automatic checkpoint would
        after a commit every `WAL_PAGES` pages of WAL. It is off: it syncs the files, which
        an inline commit must not do. So does the first commit after a complete checkpoint
        (it restarts the WAL and syncs its header): the batch that follows, on this thread.
        The next checkpoint comes after as many commits as wrote `WAL_PAGES` pages of WAL
        this time (SQLite says how many pages the WAL holds).

        After a write failed for want of disk space (`full`), the checkpoint truncates the
        WAL to nothing once it is copied, giving its space back (a passive one only lets the
        next commit reuse it), until one succeeds: due at once after each failed write (the
        thread then checkpoints before its next batch), else at the usual count of commits.
        It fails while the database file cannot grow by the pages it copies, or answers busy
        while another connection reads an older snapshot or writes; once space returns, it
        succeeds and writes go on. (Without it, no commit succeeded, so no checkpoint was ever
        due: a WAL that had filled the disk stayed there, through restarts.)"""
        commits, self.commits = self.commits, 0
        if self.conn is None or not os.access(self.shm, os.W_OK):  # (see `check_files`)
            return
        if self.full:
            try:
                row = self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error:  # still full, or another connection's checkpoint: next time
                return
            self.full = row is None or row[0] != 0  # 1: held up by another connection
            return
        try:
            row = self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error:  # another connection's checkpoint is running: next time
            return
        pages = row[1] if row is not None and isinstance(row[1], int) else -1
        if pages > 0:
            self.checkpoint_every = max(1, min(WAL_PAGES, commits * WAL_PAGES // pages))

    def connect(self, deadline: float) -> sqlite3.Connection:
        """The thread's connection: opened on first use, in WAL mode, with the schema."""
        if self.conn is not None:
            return self.conn
        # No SQLite busy handler (timeout 0): `when_free` is the busy timeout. Once this store
        # has had its file, it never creates one again (`mode=rw`): a file deleted under running
        # workers must not come back empty behind their backs (every limit would start over).
        if not os.access(self.shm, os.W_OK) and os.path.exists(self.shm):  # (see `check_files`)
            raise file_problem(_UNWRITABLE)
        target, uri = self.path, False
        if self.opened:
            target, uri = f"file:{quote(os.path.abspath(self.path))}?mode=rw", True
            with contextlib.suppress(FileNotFoundError):  # then `mode=rw` fails to open it
                found = os.stat(self.path)
                if (found.st_dev, found.st_ino) in _ABANDONED_FILES:
                    raise file_problem("the database file is one this process abandoned")
        # Used by the thread and, under the runner's `_conn_lock`, inline on a caller's loop.
        conn = sqlite3.connect(target, timeout=0, isolation_level=None, uri=uri, check_same_thread=False)
        try:
            # Switching to WAL (a no-op once the file is) needs the file to itself: SQLite answers
            # SQLITE_BUSY while another worker opens it at the same moment.
            self.when_free(deadline, lambda: conn.execute("PRAGMA journal_mode = WAL").fetchall())
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable across crashes of workers
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # the thread checkpoints (`checkpoint`)
            conn.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT_BYTES}")
            self.when_free(deadline, lambda: conn.execute("BEGIN IMMEDIATE"))
            try:
                for statement in SCHEMA:
                    conn.execute(statement)
                conn.execute("COMMIT")
            except BaseException:
                self.rollback(conn)
                raise
        except BaseException:
            conn.close()
            raise
        self.conn = conn
        self.opened = True
        self.files = self.identify()
        self.next_check = time.monotonic() + _CHECK_EVERY_S
        return conn

    def identify(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int]]:
        """The file, its -wal and its -shm as this connection has them open: (device, inode),
        and the -shm's size."""
        db, wal, shm = (os.stat(self.path + suffix) for suffix in ("", "-wal", "-shm"))
        return (db.st_dev, db.st_ino), (wal.st_dev, wal.st_ino), (shm.st_dev, shm.st_ino, shm.st_size)

    def check_files(self) -> None:
        """Before each transaction: is the file this connection has open still the one at the
        path? The -shm (the WAL index, which SQLite maps into memory) is checked every time:
        a mapped file that shrank under the process kills it with SIGBUS at the next access,
        so a -shm replaced, deleted or truncated makes the store unavailable instead. So does
        a -shm this process may no longer write (immutable, on a file system remounted
        read-only, or its write permission taken away): every transaction writes to the
        mapping, and the kernel answers the write fault on a page of an immutable file with
        SIGBUS too. That connection is kept as it is, untouched (closing it would write to the
        mapping), and used again once the file is writable. (A change between this check and
        the transaction, microseconds later, is not caught.) The
        database file and its -wal (deleted, or replaced by another file) are checked at most
        once per `_CHECK_EVERY_S`: a worker notices within that, never writes to a file other
        workers no longer share, and answers `StoreUnavailable` until a database is at the
        path again."""
        db, wal, (dev, ino, size) = self.files
        problem = None
        try:
            shm = os.stat(self.path + "-shm")
            if (shm.st_dev, shm.st_ino) != (dev, ino) or shm.st_size < size:
                problem = "WAL index (-shm) replaced or truncated"
            elif shm.st_size > size:
                self.files = (db, wal, (dev, ino, shm.st_size))
            if problem is None and not os.access(self.shm, os.W_OK):
                raise file_problem(_UNWRITABLE)
            if problem is None and time.monotonic() >= self.next_check:
                self.next_check = time.monotonic() + _CHECK_EVERY_S
                now = (os.stat(self.path), os.stat(self.path + "-wal"))
                if [(f.st_dev, f.st_ino) for f in now] != [db, wal]:
                    problem = "database file replaced"
        except FileNotFoundError:
            problem = "database file deleted"
        if problem is not None:
            self.abandon()
            raise file_problem(problem)

    def abandon(self) -> None:
        """Drop the connection without ever closing it. Closing it would checkpoint into the
        old file and then delete the -wal and -shm at the path by name, which may belong to
        the new file by then; its mapped -shm may be truncated. `_ABANDONED` keeps it
        alive to the end of the process, whose exit releases its descriptors and locks."""
        conn, self.conn = self.conn, None
        if conn is not None:
            _ABANDONED.append(conn)
            _ABANDONED_FILES.add(self.files[0])

    def when_free(self, deadline: float, attempt: Callable[[], _T]) -> _T:
        """`attempt()`, retried while the file is locked, until `deadline` (monotonic): the busy
        timeout. SQLite's own busy handler sleeps in steps growing to 100 ms, so a waiting worker
        can miss its whole timeout to workers that keep the lock busy with short transactions;
        polling every 0.1 to 2 ms (with jitter) gets the lock soon after it is released."""
        delay = 0.0001
        try:
            while True:
                try:
                    return attempt()
                except sqlite3.OperationalError as exc:
                    left = deadline - time.monotonic()
                    if not is_busy(exc) or left <= 0:
                        raise
                self.lock_wait = True
                time.sleep(min(delay * (0.5 + random.random()), left))
                delay = min(2 * delay, 0.002)
        finally:
            self.lock_wait = False

    def rollback(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:  # closing the connection rolls back too
                if conn is self.conn:
                    self.conn = None
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

    def disconnect(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if not os.access(self.shm, os.W_OK) and os.path.exists(self.shm):
            _INHERITED.append(conn)  # closing it would write to its unwritable mapping: kept
            return
        with contextlib.suppress(sqlite3.Error):
            conn.close()


#: Connections kept rather than closed: inherited from a parent process, or dropped while
#: their -shm was unwritable (never used again).
_INHERITED: list[sqlite3.Connection] = []


def is_busy(exc: sqlite3.Error) -> bool:
    name = getattr(exc, "sqlite_errorname", "")
    return name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in str(exc)


#: Why a store is unavailable while its -shm cannot be written (see `Database.check_files`).
_UNWRITABLE = "WAL index (-shm) not writable"


def is_unwritable(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorname", None) == _UNWRITABLE


def is_full(exc: sqlite3.Error) -> bool:
    """No disk space for a write (the WAL, the database file growing)."""
    return getattr(exc, "sqlite_errorname", None) == "SQLITE_FULL"


def file_problem(problem: str) -> sqlite3.OperationalError:
    """The error a batch fails with when the store's file is no longer safe to use."""
    error = sqlite3.OperationalError(problem)
    error.sqlite_errorname = problem
    return error
