"""`SQLiteStore`: state in one SQLite file, shared by the workers of one machine.

Zero set-up: the file and its tables are created on first use (`CREATE TABLE IF NOT EXISTS`,
so several workers may start at once), and the file is put in WAL mode (readers never block
the writer, nor the writer them).

Schema: one row per piece of state, each with an `expires_at` (seconds since the epoch, store
time, `NOT NULL`):

- `guards_rate (key, ts, expires_at)`: one row per request admitted under a `per_minute` limit,
  at `ts`, kept until `ts + 60` (so a key's last row goes a minute after its last admission);
- `guards_counter (key, n, expires_at)`: the daily counter `{key}:day:{YYYY-MM-DD}`, kept
  `DAILY_TTL_S` after its first unit, and the monthly one `{key}:month:{YYYY-MM}`, kept
  `MONTHLY_TTL_S`;
- `guards_spend (key, settled, expires_at)`: settled spend `{key}:spend:{YYYY-MM-DD}`, kept
  `DAILY_TTL_S` after its first settlement, and likewise the month's (`{key}:spend:{YYYY-MM}`,
  `MONTHLY_TTL_S`) and the settled tokens of the day and month (`{key}:tokens:...`);
- `guards_hold (id, key, amount, expires_at)`: a spend or token hold, kept `hold_s` (then it
  lapses); the tokens of the minute window (`{key}:tokens:minute`) are holds kept 60 s;
- `guards_breaker (key, state, expires_at)`: a breaker's `BreakerState` as JSON, kept
  `policy.ttl_s` (or longer: `_breaker.keep_s`) after its last change. A closed breaker with
  no failures (and no calls counted: `Breaker.slow_call_s`) keeps no row;
- `guards_cooldown (key, expires_at)`: a cooldown, which ends (and whose row expires) at
  `expires_at`. Starting one is one upsert that only ever moves `expires_at` later;
- `guards_answer (key, value, stored_at, expires_at)`: a route's last good answer (its key a
  hash), kept `ttl_s` after it was stored. Storing one is one upsert.
- `guards_task (key, fingerprint, lease, lease_until, response, expires_at)`: a multi-step
  task (its lease, empty while nobody holds it, and once completed its stored response), and
  `guards_task_step (key, name, value, expires_at)`: its saved steps, and `guards_task_owner
  (key, owner, expires_at)`: whose live tasks it counts among (a route's caller); all kept to
  the task's expiry, `ttl_s` after its creation.

Atomicity: operations run inside `BEGIN IMMEDIATE` transactions (the write lock is taken before
anything is read, so no other worker can write until COMMIT), and each check and charge is one
conditional statement: `INSERT ... SELECT ... WHERE <the limit allows>` (with `ON CONFLICT DO
UPDATE ... WHERE` for counters), whose row count or `RETURNING` says whether it was admitted.
The breaker's state machine and a task's claim are the exceptions: the row is read and the
result of the pure decision (`admit` / `record`, `_task.refusal`) written back within the
transaction, which is atomic because the write lock is held from its start. Python never decides a write from a value read outside the write lock.

Time: `clock.time()`, read inside the transaction (one machine: every worker shares the
machine's clock). Expired rows are ignored on read, and deleted by a sweep run at most once per
`sweep_interval_s` of store time per store, at most `_SWEEP_BATCH` rows per table at a time.

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
once per batch.

An inline transaction never waits for a lock (it takes it at once or leaves the work to the
thread), never sweeps, and never checkpoints the WAL (a checkpoint syncs files). In WAL mode with
`synchronous = NORMAL` a commit only writes the WAL; the syncs come with checkpoints, and
SQLite's automatic checkpoint (run by a commit) is off: the store's thread checkpoints instead
(every `_WAL_PAGES` pages, with `journal_size_limit`: the WAL stays small on a small disk),
and runs the transaction right after it, the first write after a complete checkpoint, which
restarts the WAL and syncs its header. (Another worker's checkpoint can
leave that first write, and its one small sync, to an inline transaction of this one.)

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
import contextlib
import json
import os
import queue
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from ..contracts._clock import Clock, SystemClock
from ._base import (
    ADMITTED,
    DAILY_TTL_S,
    DAY_S,
    MINUTE_S,
    Admission,
    Charge,
    Health,
    Passage,
    SpendReservation,
    Step,
    StoredAnswer,
    StoreUnavailable,
    TaskClaim,
    TaskStatus,
    bounded_key,
    utc_day,
)
from ._breaker import CLOSED, Breaker, BreakerDecision, BreakerState, CircuitState, Outcome, keep_s
from ._breaker import admit as breaker_admit
from ._breaker import record as breaker_record
from ._epoch import Epoch
from ._limits import charge_with_more, near_scopes
from ._step import first_admitted, run_step
from ._task import TaskRecord, new_lease, refusal

__all__ = ["SQLiteStore"]

_T = TypeVar("_T")

#: Tables of the store, each with an `expires_at` column that the sweep relies on.
TABLES = (
    "guards_window",
    "guards_counter",
    "guards_spend",
    "guards_hold",
    "guards_breaker",
    "guards_cooldown",
    "guards_answer",
    "guards_task",
    "guards_task_step",
    "guards_task_owner",
)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS guards_window (
        key TEXT NOT NULL, seq INTEGER NOT NULL, ts REAL NOT NULL, expires_at REAL NOT NULL)""",
    "CREATE UNIQUE INDEX IF NOT EXISTS guards_window_seq ON guards_window (key, seq)",
    """CREATE TABLE IF NOT EXISTS guards_counter (
        key TEXT PRIMARY KEY, n INTEGER NOT NULL, expires_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS guards_spend (
        key TEXT PRIMARY KEY, settled REAL NOT NULL, expires_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS guards_hold (
        id TEXT PRIMARY KEY, key TEXT NOT NULL, amount REAL NOT NULL, expires_at REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS guards_hold_key ON guards_hold (key, expires_at)",
    """CREATE TABLE IF NOT EXISTS guards_breaker (
        key TEXT PRIMARY KEY, state TEXT NOT NULL, expires_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS guards_cooldown (
        key TEXT PRIMARY KEY, expires_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS guards_answer (
        key TEXT PRIMARY KEY, value TEXT NOT NULL, stored_at REAL NOT NULL, expires_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS guards_task (
        key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, lease TEXT NOT NULL,
        lease_until REAL NOT NULL, response TEXT, expires_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS guards_task_step (
        key TEXT NOT NULL, name TEXT NOT NULL, value TEXT NOT NULL, expires_at REAL NOT NULL,
        PRIMARY KEY (key, name))""",
    """CREATE TABLE IF NOT EXISTS guards_task_owner (
        key TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_at REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS guards_task_owner_live ON guards_task_owner (owner, expires_at)",
    # The store's epoch marker (see `guards.stores._epoch`): one row, never expiring (not swept).
    "CREATE TABLE IF NOT EXISTS guards_epoch (id TEXT NOT NULL)",
    *(f"CREATE INDEX IF NOT EXISTS {t}_expiry ON {t} (expires_at)" for t in TABLES),
)

#: The most rows of one table a sweep deletes; a sweep that hits it runs again next operation.
_SWEEP_BATCH = 1_000
_SWEEP = {
    t: f"DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE expires_at <= ? LIMIT {_SWEEP_BATCH})"
    for t in TABLES
}

_EPOCH = "SELECT id FROM guards_epoch"
_NEW_EPOCH = "INSERT INTO guards_epoch (id) VALUES (?)"

# --- budget --------------------------------------------------------------------------------------
# The per-minute window is a log of admissions numbered 0, 1, 2... per key. The window has room
# when the admission `per_minute` places back (seq = next - per_minute) is missing or older than
# 60 s: one indexed lookup, whatever the traffic. Each admission deletes at most two expired
# rows at the log's tail, so a key keeps about its last minute of admissions.
_WINDOW_LAST = "SELECT max(seq) FROM guards_window WHERE key = ?"
_WINDOW_AT = "SELECT ts FROM guards_window WHERE key = ? AND seq = ?"
_WINDOW_ADD = "INSERT OR REPLACE INTO guards_window (key, seq, ts, expires_at) VALUES (?, ?, ?, ?)"
#: The key's two oldest rows (those below its third oldest, if any), if expired: a range of
#: the (key, seq) index below one looked-up bound (cheaper than `rowid IN (... LIMIT 2)`).
_WINDOW_PRUNE = """DELETE FROM guards_window WHERE key = ?1 AND ts <= ?2 AND seq < coalesce(
    (SELECT seq FROM guards_window WHERE key = ?1 ORDER BY seq LIMIT 1 OFFSET 2), 9223372036854775807)"""
_DAY_COUNT = "SELECT n FROM guards_counter WHERE key = ? AND expires_at > ?"
#: Both reads of a charge with both limits, in one statement.
_WINDOW_LAST_AND_DAY_COUNT = """SELECT (SELECT max(seq) FROM guards_window WHERE key = ?),
    (SELECT n FROM guards_counter WHERE key = ? AND expires_at > ?)"""
#: The charge read the day's count: a live row is incremented (its `expires_at`, and so its
#: index entry, untouched); none, or an expired one, starts over.
_COUNT_DAY = "UPDATE guards_counter SET n = n + 1 WHERE key = ?"
_START_DAY = "INSERT OR REPLACE INTO guards_counter (key, n, expires_at) VALUES (?, 1, ?)"

# --- spend ---------------------------------------------------------------------------------------
_SETTLED = "SELECT settled FROM guards_spend WHERE key = ? AND expires_at > ?"
_HELD = "SELECT coalesce(sum(amount), 0.0) FROM guards_hold WHERE key = ? AND expires_at > ?"
_HOLD = "INSERT INTO guards_hold (id, key, amount, expires_at) VALUES (?, ?, ?, ?)"
_RELEASE_HOLD = "DELETE FROM guards_hold WHERE id = :id AND key = :key"
_HOLDS = "SELECT amount, expires_at FROM guards_hold WHERE key = ? AND expires_at > ?"
_REPLACE_HOLD = "UPDATE guards_hold SET amount = ? WHERE id = ? AND key = ? AND expires_at > ?"
_SETTLE = """INSERT INTO guards_spend (key, settled, expires_at) VALUES (:key, :actual, :expires)
    ON CONFLICT (key) DO UPDATE SET
        settled = CASE WHEN expires_at > :now THEN settled + excluded.settled ELSE excluded.settled END,
        expires_at = CASE WHEN expires_at > :now THEN expires_at ELSE excluded.expires_at END"""

# --- breaker -------------------------------------------------------------------------------------
_BREAKER = "SELECT state, expires_at FROM guards_breaker WHERE key = :key"
_PUT_BREAKER = """INSERT INTO guards_breaker (key, state, expires_at) VALUES (:key, :state, :expires)
    ON CONFLICT (key) DO UPDATE SET state = excluded.state, expires_at = excluded.expires_at"""
_DROP_BREAKER = "DELETE FROM guards_breaker WHERE key = :key"

# --- cooldowns -----------------------------------------------------------------------------------
#: Never shortens: a live row ending later is left alone; an expired one ends earlier than `now`,
#: so it is replaced.
_START_COOLDOWN = """INSERT INTO guards_cooldown (key, expires_at) VALUES (:key, :until)
    ON CONFLICT (key) DO UPDATE SET expires_at = excluded.expires_at
    WHERE expires_at < excluded.expires_at"""
#: The most keys one read binds (SQLite's default limit on host parameters is 32,766; 999
#: before 3.32): a longer list is read in several statements, within the same transaction.
_COOLDOWN_CHUNK = 500


# --- last good answers ---------------------------------------------------------------------------
_PUT_ANSWER = """INSERT INTO guards_answer (key, value, stored_at, expires_at) VALUES (:key, :value, :now, :expires)
    ON CONFLICT (key) DO UPDATE SET
        value = excluded.value, stored_at = excluded.stored_at, expires_at = excluded.expires_at"""
_GET_ANSWER = "SELECT value, stored_at FROM guards_answer WHERE key = ? AND expires_at > ?"
# --- tasks ---------------------------------------------------------------------------------------
_TASK = "SELECT fingerprint, lease, lease_until, response, expires_at FROM guards_task WHERE key = ?"
_NEW_TASK = """INSERT OR REPLACE INTO guards_task (key, fingerprint, lease, lease_until, response, expires_at)
    VALUES (?, ?, ?, ?, NULL, ?)"""
_TAKE_TASK = "UPDATE guards_task SET lease = ?, lease_until = ? WHERE key = ?"
_TASK_STEPS = "SELECT name, value FROM guards_task_step WHERE key = ? AND expires_at > ?"
_DROP_TASK_STEPS = "DELETE FROM guards_task_step WHERE key = ?"
#: Only the lease's holder writes, and only to a live task that has not completed.
_RENEW_TASK = """UPDATE guards_task SET lease_until = :until
    WHERE key = :key AND lease = :lease AND response IS NULL AND expires_at > :now RETURNING expires_at"""
_SAVE_STEP = "INSERT OR REPLACE INTO guards_task_step (key, name, value, expires_at) VALUES (?, ?, ?, ?)"
_COMPLETE_TASK = """UPDATE guards_task SET response = :response, lease = '', lease_until = 0
    WHERE key = :key AND lease = :lease AND response IS NULL AND expires_at > :now"""
_RELEASE_TASK = "UPDATE guards_task SET lease = '', lease_until = 0 WHERE key = ? AND lease = ?"
#: A task held by the lease that saved nothing and did not complete: deleted.
_DROP_TASK = """DELETE FROM guards_task WHERE key = :key AND lease = :lease AND response IS NULL
    AND expires_at > :now AND NOT EXISTS (SELECT 1 FROM guards_task_step WHERE key = :key)"""
#: An owner's live tasks (an index range of at most its cap, and the expired ones not swept yet).
_OWNER_LIVE = "SELECT count(*), min(expires_at) FROM guards_task_owner WHERE owner = ? AND expires_at > ?"
_OWN_TASK = "INSERT OR REPLACE INTO guards_task_owner (key, owner, expires_at) VALUES (?, ?, ?)"
_DISOWN_TASK = "DELETE FROM guards_task_owner WHERE key = ?"


def _cooldown_read(n: int) -> str:
    """The rows of `n` keys, expired or not (a transaction keeps them: `_Tx.cooldowns`)."""
    marks = ", ".join("?" * n)
    return f"SELECT key, expires_at FROM guards_cooldown WHERE key IN ({marks})"


def _dump_breaker(s: BreakerState) -> str:
    # JSON floats round-trip exactly (repr), so probe tickets compare equal after a round trip.
    return json.dumps(
        [
            s.state.value,
            list(s.failures),
            s.opened_at,
            s.probes,
            s.last_probe_at,
            s.successes,
            s.probe_since,
            s.open_s,
            list(s.calls),
            s.probe_s,
        ]
    )


def _load_breaker(text: str) -> BreakerState:
    # A row written before the open period was kept has seven fields (then `open_s` is 0.0),
    # one written before calls and probe intervals were kept eight (no calls, `probe_s` 0.0).
    # A version before them reads the first eight and ignores the rest.
    state, failures, opened_at, probes, last_probe_at, successes, probe_since, *kept = json.loads(text)
    return BreakerState(
        CircuitState(state),
        tuple(float(f) for f in failures),
        float(opened_at),
        int(probes),
        float(last_probe_at),
        int(successes),
        float(probe_since),
        float(kept[0]) if kept else 0.0,
        tuple(float(t) for t in kept[1]) if len(kept) > 1 else (),
        float(kept[2]) if len(kept) > 2 else 0.0,
    )


#: The most operations one transaction of the store's thread carries.
_BATCH = 100
#: A store's thread checkpoints the WAL (`SQLiteStore._checkpoint`) every `_WAL_PAGES` pages of
#: WAL (1 MiB of 4 KiB pages; SQLite's automatic checkpoint waits for 1,000), counted in
#: commits: `_CHECKPOINT_EVERY` until the first checkpoint tells how many pages a commit writes.
#: A small disk must hold the WAL: it is never longer than about that between checkpoints.
_WAL_PAGES = 256
_CHECKPOINT_EVERY = 20
#: `journal_size_limit`: the WAL a checkpoint leaves behind is cut back to this (SQLite keeps
#: the file at its largest otherwise, and a spike, say a checkpoint held up by another
#: worker, would keep its disk space for good).
_WAL_LIMIT_BYTES = 1024 * 1024
#: How often (at most) a store checks that its file is still the one at its path.
_CHECK_EVERY_S = 1.0
#: Connections dropped after their file was deleted or replaced: never closed (see
#: `SQLiteStore._abandon`), kept here to the end of the process. One per replacement.
_ABANDONED: list[sqlite3.Connection] = []
#: The (device, inode) of their files. SQLite maps a file's -shm once per process, shared by
#: every connection to that file: a new connection to an abandoned file would reuse the old,
#: possibly truncated mapping (SIGBUS), so the process never opens one of these again. An
#: open file's inode is never reused, so a new file at the path is never mistaken for one.
_ABANDONED_FILES: set[tuple[int, int]] = set()


class _Tx:
    """The write transaction a batch of operations runs in: its connection, the breaker rows
    it read or wrote (written back once, before COMMIT), and the cooldowns it read (the
    requests of a route read the same few). The write lock is held from BEGIN IMMEDIATE to
    COMMIT, so what these caches hold is what the file holds."""

    __slots__ = ("_breakers", "_cooldowns", "_dirty", "conn")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        #: key: (state, expires_at), or (CLOSED, None) when the key has no row.
        self._breakers: dict[str, tuple[BreakerState, float | None]] = {}
        self._dirty: set[str] = set()
        #: key: the cooldown's end (`expires_at`, maybe past), or 0.0 when the key has no row.
        self._cooldowns: dict[str, float] = {}

    def step(self, step: Step, now: float) -> Passage:
        """`Store.step`. The usual step is decided without `run_step`'s general walk, as
        `MemoryStore.step` does: no report, no leg cooling down, and the first leg's breaker
        closed with no row (no failure counted), so it is admitted at once (a closed breaker's
        admission writes nothing) and only the charge remains; its answer is `plain`, one
        shared `Passage` per shape. Anything else takes the general walk."""
        legs = step.legs
        if (
            step.report is None
            and legs
            and not any(self.cooldowns([cooldown_key for cooldown_key, _ in legs], now))
            and (step.breaker is None or self.breaker(legs[0][1], now) is CLOSED)
        ):
            charge = step.charge
            refusal, reservation = (None, None) if charge is None else self.charge(charge, now)
            near = () if charge is None or refusal else near_scopes(self, charge, now)
            return first_admitted(len(legs), step.breaker is not None, refusal, reservation, near)
        return run_step(self, step, now)

    # The primitives of a step (see `guards.stores._step`), each on the caller's key as the
    # store writes it (`bounded_key`).

    def cooldowns(self, keys: Sequence[str], now: float) -> tuple[float, ...]:
        ends = self._cooldowns
        bounded = [bounded_key(key) for key in keys]
        unread = [key for key in dict.fromkeys(bounded) if key not in ends]
        for i in range(0, len(unread), _COOLDOWN_CHUNK):
            chunk = unread[i : i + _COOLDOWN_CHUNK]
            ends.update(dict.fromkeys(chunk, 0.0))
            ends.update(self.conn.execute(_cooldown_read(len(chunk)), chunk).fetchall())
        return tuple(max(0.0, ends[key] - now) for key in bounded)

    def start_cooldown(self, key: str, seconds: float, now: float) -> None:
        if now + seconds > now:  # not lost in rounding
            key = bounded_key(key)
            self.conn.execute(_START_COOLDOWN, {"key": key, "until": now + seconds})
            self._cooldowns.pop(key, None)  # read again if needed

    def breaker(self, key: str, now: float) -> BreakerState:
        """The breaker's state; a missing or expired row is a closed, healthy breaker."""
        key = bounded_key(key)
        item = self._breakers.get(key)
        if item is None:
            row = self.conn.execute(_BREAKER, {"key": key}).fetchone()
            try:
                item = (CLOSED, None) if row is None else (_load_breaker(row[0]), float(row[1]))
            except (ValueError, TypeError):  # not written by this store: a store error
                raise StoreUnavailable("SQLite store: a breaker row is unreadable") from None
            self._breakers[key] = item
        state, expires = item
        return state if expires is not None and expires > now else CLOSED

    def put_breaker(self, key: str, state: BreakerState, policy: Breaker, now: float) -> None:
        """Keep `state` `ttl_s` from now; a healthy closed breaker: no row at all (written back
        once, at `flush`)."""
        key = bounded_key(key)
        expires = None if state == CLOSED else now + keep_s(state, policy)
        if expires is None and self._breakers.get(key, (CLOSED, None))[1] is None:
            return  # no row, and none wanted
        self._breakers[key] = (state, expires)
        self._dirty.add(key)

    def charge(
        self,
        charge: Charge,
        now: float,
        *,
        dry: bool = False,
        reservation: str | None = None,
        alone: bool = False,
    ) -> tuple[Admission | None, str | None]:
        if charge.more is not None and not alone:  # months, tokens, scopes (`_limits`)
            return charge_with_more(self, charge, now)
        conn, key = self.conn, bounded_key(charge.key)
        refusal: Admission | None = None
        per_minute, per_day = charge.per_minute, charge.per_day
        seq = 0
        day = utc_day(now)
        day_key = f"{key}:day:{day}"
        counted: int | None = None  # the day's count, None when no live row
        if per_minute is not None:
            if per_day is not None:
                last, counted = conn.execute(_WINDOW_LAST_AND_DAY_COUNT, (key, day_key, now)).fetchone()
            else:
                last = conn.execute(_WINDOW_LAST, (key,)).fetchone()[0]
            seq = 0 if last is None else last + 1
            if seq >= per_minute:
                row = conn.execute(_WINDOW_AT, (key, seq - per_minute)).fetchone()
                if row is not None and row[0] > now - MINUTE_S:  # still in the window: full
                    refusal = Admission(False, "per_minute", row[0] + MINUTE_S - now)
        next_day = DAY_S - now % DAY_S  # until the next UTC midnight
        if per_day is not None:
            if per_minute is None:
                row = conn.execute(_DAY_COUNT, (day_key, now)).fetchone()
                counted = None if row is None else row[0]
            # Both spent: name the limit that frees up last, like MemoryStore.
            if (counted or 0) >= per_day and (refusal is None or next_day > (refusal.retry_after_s or 0.0)):
                refusal = Admission(False, "per_day", next_day)
        spend_key = f"{key}:spend:{day}"
        if charge.spend is not None:
            settled = conn.execute(_SETTLED, (spend_key, now)).fetchone()
            held = conn.execute(_HELD, (spend_key, now)).fetchone()[0]
            if (0.0 if settled is None else settled[0]) + held + charge.spend > charge.spend_cap and (
                refusal is None or next_day > (refusal.retry_after_s or 0.0)
            ):
                refusal = Admission(False, "spend_per_day", next_day)
        if refusal is not None or dry:
            return refusal, None  # nothing written
        if per_minute is not None:
            conn.execute(_WINDOW_ADD, (key, seq, now, now + MINUTE_S))
            conn.execute(_WINDOW_PRUNE, (key, now - MINUTE_S))
        if per_day is not None:
            if counted is None:
                conn.execute(_START_DAY, (day_key, now + DAILY_TTL_S))
            else:
                conn.execute(_COUNT_DAY, (day_key,))
        if charge.spend is None:
            return None, None
        reservation = reservation or os.urandom(8).hex()
        conn.execute(_HOLD, (reservation, spend_key, charge.spend, now + charge.hold_s))
        return None, reservation

    def settle(self, key: str, reservation: str, actual: float, now: float) -> None:
        day_key = f"{bounded_key(key)}:spend:{utc_day(now)}"
        self.conn.execute(_RELEASE_HOLD, {"id": reservation, "key": day_key})
        self.conn.execute(
            _SETTLE, {"key": day_key, "actual": actual, "expires": now + DAILY_TTL_S, "now": now}
        )

    # The primitives of `_limits`: a count is a `guards_counter` row; a held counter a
    # `guards_spend` row (its settled total) and `guards_hold` rows (its holds, each one's id
    # the reservation and the counter's key: a reservation holds in several counters).

    def count(self, key: str, now: float) -> int:
        row = self.conn.execute(_DAY_COUNT, (key, now)).fetchone()
        return 0 if row is None else int(row[0])

    def add_count(self, key: str, ttl_s: float, now: float) -> None:
        if self.conn.execute(_DAY_COUNT, (key, now)).fetchone() is None:
            self.conn.execute(_START_DAY, (key, now + ttl_s))
        else:
            self.conn.execute(_COUNT_DAY, (key,))

    def holds(self, key: str, now: float) -> tuple[float, list[tuple[float, float]]]:
        settled = self.conn.execute(_SETTLED, (key, now)).fetchone()
        holds = self.conn.execute(_HOLDS, (key, now)).fetchall()
        return (0.0 if settled is None else float(settled[0])), holds

    def hold(self, key: str, reservation: str, amount: float, until: float, ttl_s: float, now: float) -> None:
        self.conn.execute(_HOLD, (f"{reservation} {key}", key, amount, until))

    def settle_hold(self, key: str, reservation: str, actual: float, ttl_s: float, now: float) -> None:
        self.conn.execute(_RELEASE_HOLD, {"id": f"{reservation} {key}", "key": key})
        self.conn.execute(_SETTLE, {"key": key, "actual": actual, "expires": now + ttl_s, "now": now})

    def replace_hold(self, key: str, reservation: str, actual: float, now: float) -> None:
        self.conn.execute(_REPLACE_HOLD, (actual, f"{reservation} {key}", key, now))

    def spent(self, key: str, now: float) -> float:
        row = self.conn.execute(_SETTLED, (f"{bounded_key(key)}:spend:{utc_day(now)}", now)).fetchone()
        return 0.0 if row is None else float(row[0])

    def task_claim(
        self,
        key: str,
        fingerprint: str,
        lease_s: float,
        ttl_s: float,
        owner: str | None,
        max_live: int | None,
        now: float,
    ) -> TaskClaim:
        conn, key = self.conn, bounded_key(key)
        row = conn.execute(_TASK, (key,)).fetchone()
        record = None if row is None else TaskRecord(row[0], float(row[4]), row[1], float(row[2]), row[3])
        refused = refusal(record, fingerprint, now)
        if refused is not None:
            return refused
        lease = new_lease()
        if record is None or record.expires_at <= now:  # none, or expired: a new task
            if owner is not None:
                owner = bounded_key(owner)
                live, oldest = conn.execute(_OWNER_LIVE, (owner, now)).fetchone()
                if max_live is not None and live >= max_live:
                    return TaskClaim(TaskStatus.full, retry_after_s=float(oldest) - now)
                conn.execute(_OWN_TASK, (key, owner, now + ttl_s))
            conn.execute(_DROP_TASK_STEPS, (key,))
            conn.execute(_NEW_TASK, (key, fingerprint, lease, now + lease_s, now + ttl_s))
            return TaskClaim(TaskStatus.claimed, lease)
        conn.execute(_TAKE_TASK, (lease, now + lease_s, key))
        return TaskClaim(TaskStatus.claimed, lease, dict(conn.execute(_TASK_STEPS, (key, now)).fetchall()))

    def task_save(self, key: str, lease: str, name: str, value: str, lease_s: float, now: float) -> bool:
        key = bounded_key(key)
        row = self.conn.execute(
            _RENEW_TASK, {"key": key, "lease": lease, "until": now + lease_s, "now": now}
        ).fetchone()
        if row is None:
            return False
        self.conn.execute(_SAVE_STEP, (key, name, value, row[0]))
        return True

    def task_complete(self, key: str, lease: str, response: str, now: float) -> bool:
        key = bounded_key(key)
        params = {"key": key, "lease": lease, "response": response, "now": now}
        if self.conn.execute(_COMPLETE_TASK, params).rowcount != 1:
            return False
        self.conn.execute(_DROP_TASK_STEPS, (key,))
        return True

    def task_release(self, key: str, lease: str) -> None:
        self.conn.execute(_RELEASE_TASK, (bounded_key(key), lease))

    def task_drop(self, key: str, lease: str, now: float) -> None:
        key = bounded_key(key)
        if self.conn.execute(_DROP_TASK, {"key": key, "lease": lease, "now": now}).rowcount == 1:
            self.conn.execute(_DISOWN_TASK, (key,))
        else:
            self.conn.execute(_RELEASE_TASK, (key, lease))

    def flush(self) -> None:
        for key in self._dirty:
            state, expires = self._breakers[key]
            if expires is None:
                self.conn.execute(_DROP_BREAKER, {"key": key})
            else:
                self.conn.execute(
                    _PUT_BREAKER, {"key": key, "state": _dump_breaker(state), "expires": expires}
                )
        self._dirty.clear()


_Work = Callable[[_Tx, float], _T]


class _Job(Generic[_T]):
    """One operation handed to the store's thread: its work, its deadline, the caller's future,
    and who decides its fate when time runs out (the caller abandons it, or the thread has
    begun committing it, and then its answer stands)."""

    __slots__ = ("abandoned", "committing", "deadline", "future", "graced", "lock", "loop", "timer", "work")

    def __init__(self, loop: asyncio.AbstractEventLoop, work: _Work[_T], deadline: float) -> None:
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
        self._call(self._fail, error)

    def _call(self, callback: Callable[[Any], None], arg: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            self.loop.call_soon_threadsafe(callback, arg)

    def _succeed(self, result: _T) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def _fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def _answer_all(done: list[tuple[_Job[Any], Any]]) -> None:
    """From the store's thread: the results of a committed batch, to their callers, each
    caller's loop woken once."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Job[Any], Any]]] = {}
    for job, result in done:
        by_loop.setdefault(job.loop, []).append((job, result))
    for loop, answers in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            loop.call_soon_threadsafe(_answer, answers)


def _answer(answers: list[tuple[_Job[Any], Any]]) -> None:
    for job, result in answers:
        job._succeed(result)


class _Redo(Exception):
    """Roll the batch back and run it again without the operations that left it."""


class SQLiteStore:
    """A `Store` in one SQLite file: exact across the worker processes of one machine.

    `timeout_s` bounds every operation (waiting for this store's thread and for the file's
    write lock); past it, or when the file cannot be opened, operations raise `StoreUnavailable`.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Clock | None = None,
        timeout_s: float = 0.1,
        sweep_interval_s: float = 60.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._path = os.fspath(path)
        self._shm = self._path + "-shm"
        self._clock = clock or SystemClock()
        self._timeout_s = timeout_s
        self._sweep_interval_s = sweep_interval_s
        #: Operations handed over to the thread, a loop turn's at a time (None: stop).
        self._jobs: queue.SimpleQueue[list[_Job[Any]] | None] = queue.SimpleQueue()
        #: Per event loop, the operations started in its current turn, not yet handed over.
        self._outbox: dict[asyncio.AbstractEventLoop, list[_Job[Any]]] = {}
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        # Owned by the store's thread:
        self._conn: sqlite3.Connection | None = None
        self._next_sweep = 0.0
        #: True while the thread waits for another connection to release the file's lock.
        self._lock_wait = False
        #: Whether this store has had its file (then it never creates one again).
        self._opened = False
        self._files: tuple[tuple[int, int], tuple[int, int], tuple[int, int, int]] = (
            (0, 0),
            (0, 0),
            (0, 0, 0),
        )
        self._next_check = 0.0
        #: Held by whoever uses the connection: the thread, or a caller's loop (`_run_inline`).
        self._conn_lock = threading.Lock()
        #: Commits since the last WAL checkpoint, and how many call for the next one.
        self._commits = 0
        self._checkpoint_every = _CHECKPOINT_EVERY
        #: A write failed for want of disk space (SQLITE_FULL): checkpoints truncate the WAL
        #: (`_checkpoint`) until one succeeds.
        self._full = False
        #: Results of the thread's batch, for `_serve` to answer once the connection is free.
        self._answers: list[tuple[_Job[Any], Any]] = []
        self._epoch = Epoch("sqlite")
        _STORES.add(self)

    def _after_fork(self) -> None:
        """In a forked child: the parent's thread is gone and its connection must not be used
        (nor closed) here; the next operation starts a thread and a connection of the child's."""
        if self._conn is not None:
            _INHERITED.append(self._conn)
        self._conn, self._thread, self._jobs, self._outbox = None, None, queue.SimpleQueue(), {}
        self._start_lock, self._conn_lock = threading.Lock(), threading.Lock()
        self._commits, self._answers, self._full = 0, [], False

    def __repr__(self) -> str:
        return f"SQLiteStore({self._path!r})"

    @property
    def clock(self) -> Clock:
        """The clock the store reads its time from (`now`)."""
        return self._clock

    @property
    def epoch(self) -> Epoch:
        """The store's epoch as this worker knows it, and the resets it noticed (see
        docs/stores.md, "When the store forgets")."""
        return self._epoch

    async def now(self) -> float:
        return self._clock.time()

    # --- the Store operations: each one transaction (see `_run`) ----------------------------------
    # The breaker's transitions are the pure functions of `_breaker.py`: the row is read and the
    # new state written within one `BEGIN IMMEDIATE` transaction, which holds the file's write
    # lock from its start, so no other worker can change the row in between (the state machine
    # is too rich for one SQL statement; holding the write lock makes the pair atomic).

    async def charge_budget(self, key: str, *, per_minute: int | None, per_day: int | None) -> Admission:
        if per_minute is None and per_day is None:
            return ADMITTED
        charge = Charge(key=key, per_minute=per_minute, per_day=per_day)
        return await self._run(lambda tx, now: tx.charge(charge, now)[0] or ADMITTED)

    async def reserve_spend(self, key: str, *, amount: float, cap: float, hold_s: float) -> SpendReservation:
        charge = Charge(key=key, spend=amount, spend_cap=cap, hold_s=hold_s)

        def reserve(tx: _Tx, now: float) -> SpendReservation:
            refusal, reservation = tx.charge(charge, now)
            if refusal is not None:
                return SpendReservation(False, retry_after_s=refusal.retry_after_s)
            return SpendReservation(True, reservation)

        return await self._run(reserve)

    async def settle_spend(self, key: str, reservation: str, *, actual: float) -> None:
        await self._run(lambda tx, now: tx.settle(key, reservation, actual, now))

    async def spent(self, key: str) -> float:
        """Settled spend of the current UTC day under `key` (for dashboards and tests)."""
        return await self._run(lambda tx, now: tx.spent(key, now))

    async def breaker_admit(self, key: str, policy: Breaker) -> BreakerDecision:
        def admit(tx: _Tx, now: float) -> BreakerDecision:
            before = tx.breaker(key, now)
            state, decision = breaker_admit(before, policy, now)
            if state is not before:  # an open breaker's refusal, a closed one's admission: no write
                tx.put_breaker(key, state, policy, now)
            return decision

        return await self._run(admit)

    async def breaker_record(
        self, key: str, policy: Breaker, outcome: Outcome, *, probe: float | None
    ) -> BreakerState:
        def record(tx: _Tx, now: float) -> BreakerState:
            before = tx.breaker(key, now)
            state = breaker_record(before, policy, now, outcome, probe=probe)
            if state is not before:
                tx.put_breaker(key, state, policy, now)
            return state

        return await self._run(record)

    async def cooldowns(self, keys: Sequence[str]) -> tuple[float, ...]:
        keys = tuple(keys)  # as they are now: the store's thread reads them later
        if not keys:
            return ()
        return await self._run(lambda tx, now: tx.cooldowns(keys, now))

    async def start_cooldown(self, key: str, seconds: float) -> None:
        if not seconds > 0:
            return  # nothing to start, and a running cooldown is never shortened
        await self._run(lambda tx, now: tx.start_cooldown(key, seconds, now))

    async def step(self, step: Step) -> Passage:
        return await self._run(lambda tx, now: tx.step(step, now))

    async def put_answer(self, key: str, value: str, *, ttl_s: float) -> None:
        def put(tx: _Tx, now: float) -> None:
            row = {"key": bounded_key(key), "value": value, "now": now, "expires": now + ttl_s}
            tx.conn.execute(_PUT_ANSWER, row)

        await self._run(put)

    async def get_answer(self, key: str, *, max_age_s: float) -> StoredAnswer | None:
        def get(tx: _Tx, now: float) -> StoredAnswer | None:
            row = tx.conn.execute(_GET_ANSWER, (bounded_key(key), now)).fetchone()
            if row is None or now - row[1] >= max_age_s:
                return None
            return StoredAnswer(str(row[0]), now - float(row[1]))

        return await self._run(get)

    async def health(self, legs: Sequence[tuple[str, str]]) -> Health:
        legs = tuple(legs)  # as they are now: the store's thread reads them later

        def read(tx: _Tx, now: float) -> Health:
            breakers = tuple(tx.breaker(breaker_key, now) for _, breaker_key in legs)
            return Health(now, breakers, tx.cooldowns([cooldown_key for cooldown_key, _ in legs], now))

        return await self._run(read)

    async def task_claim(
        self,
        key: str,
        *,
        fingerprint: str,
        lease_s: float,
        ttl_s: float,
        owner: str | None = None,
        max_live: int | None = None,
    ) -> TaskClaim:
        return await self._run(
            lambda tx, now: tx.task_claim(key, fingerprint, lease_s, ttl_s, owner, max_live, now)
        )

    async def task_save(self, key: str, lease: str, name: str, value: str, *, lease_s: float) -> bool:
        return await self._run(lambda tx, now: tx.task_save(key, lease, name, value, lease_s, now))

    async def task_complete(self, key: str, lease: str, response: str) -> bool:
        return await self._run(lambda tx, now: tx.task_complete(key, lease, response, now))

    async def task_release(self, key: str, lease: str) -> None:
        await self._run(lambda tx, now: tx.task_release(key, lease))

    async def task_drop(self, key: str, lease: str) -> None:
        await self._run(lambda tx, now: tx.task_drop(key, lease, now))

    # --- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connection and stop the thread. Callable from any event loop, and twice."""
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(None)  # after the operations already queued, which end by their deadlines
            await asyncio.to_thread(thread.join, max(1.0, 4 * self._timeout_s))

    # --- the store's thread ----------------------------------------------------------------------

    async def _run(self, work: _Work[_T]) -> _T:
        """Run `work` in a write transaction on the store's thread, within `timeout_s`."""
        if self._closed:
            raise StoreUnavailable(f"SQLite store {self._path}: closed")
        loop = asyncio.get_running_loop()
        job = _Job(loop, work, time.monotonic() + self._timeout_s)
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
        if self._conn is not None:
            try:
                jobs = self._run_inline(jobs)
            except Exception as exc:  # a bug: answer every caller
                for job in jobs:
                    job._fail(exc)
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
            job._fail(closed)

    def _expire(self, job: _Job[Any]) -> None:
        """The operation's time is up (on the caller's loop). If the store's thread is waiting
        for the file's lock, the store is slow: give up (the thread skips or rolls back the
        operation). Otherwise this process held the operation up (a busy event loop, the GIL,
        a garbage collection pause), or its commit has begun: wait once more, then give up."""
        if job.future.done():
            return
        if not job.graced and (not self._lock_wait or not job.abandon()):
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
        waiting: collections.deque[_Job[Any]] = collections.deque()  # handed over, not yet run
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
                if self._commits >= self._checkpoint_every:
                    self._checkpoint()  # then this batch: the first write after it, here too
                try:
                    self._run_batch(batch, inline=False)
                except Exception as exc:  # a bug: answer every caller, and keep serving
                    for job in batch:
                        job.fail(exc)
                answers, self._answers = self._answers, []
            # Once the connection is free: woken, the callers' next operations may run inline.
            _answer_all(answers)
        with self._conn_lock:
            self._disconnect()

    def _run_inline(self, jobs: list[_Job[Any]]) -> list[_Job[Any]]:
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
                or self._conn is None
                or self._commits >= self._checkpoint_every
                or self._clock.time() >= self._next_sweep
            ):
                return jobs
            return self._run_batch(jobs, inline=True)
        finally:
            self._conn_lock.release()

    def _checkpoint(self) -> None:
        """On the store's thread, before a batch: copy the WAL into the database file (a
        passive checkpoint, which waits for nobody), as SQLite's automatic checkpoint would
        after a commit every `_WAL_PAGES` pages of WAL. It is off: it syncs the files, which
        an inline commit must not do. So does the first commit after a complete checkpoint
        (it restarts the WAL and syncs its header): the batch that follows, on this thread.
        The next checkpoint comes after as many commits as wrote `_WAL_PAGES` pages of WAL
        this time (SQLite says how many pages the WAL holds).

        After a write failed for want of disk space (`_full`), the checkpoint truncates the
        WAL to nothing once it is copied, giving its space back (a passive one only lets the
        next commit reuse it), until one succeeds: due at once after each failed write (the
        thread then checkpoints before its next batch), else at the usual count of commits.
        It fails while the database file cannot grow by the pages it copies, or answers busy
        while another connection reads an older snapshot or writes; once space returns, it
        succeeds and writes go on. (Without it, no commit succeeded, so no checkpoint was ever
        due: a WAL that had filled the disk stayed there, through restarts.)"""
        commits, self._commits = self._commits, 0
        if self._conn is None or not os.access(self._shm, os.W_OK):  # (see `_check_files`)
            return
        if self._full:
            try:
                row = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error:  # still full, or another connection's checkpoint: next time
                return
            self._full = row is None or row[0] != 0  # 1: held up by another connection
            return
        try:
            row = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error:  # another connection's checkpoint is running: next time
            return
        pages = row[1] if row is not None and isinstance(row[1], int) else -1
        if pages > 0:
            self._checkpoint_every = max(1, min(_WAL_PAGES, commits * _WAL_PAGES // pages))

    def _run_batch(self, batch: list[_Job[Any]], *, inline: bool) -> list[_Job[Any]]:
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
                if inline and (_is_busy(exc) or self._conn is not None):
                    return live  # the lock is taken, or an error the thread deals with (closing)
                if not _is_busy(exc):  # cannot open, I/O error, file replaced: start afresh next time
                    if _is_full(exc):  # the connection stays, to checkpoint at once (`_checkpoint`)
                        self._full = True
                        self._commits = max(self._commits, self._checkpoint_every)
                    elif not _is_unwritable(exc):  # (an unwritable -shm: the connection waits)
                        self._disconnect()
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

    def _transact(self, jobs: list[_Job[Any]], inline: bool) -> list[_Job[Any]]:
        """Run `jobs` in one write transaction and commit it; returns the operations to run
        again (in a new transaction) when the batch had to be rolled back, else nothing.
        Inline: on the connection already open, the write lock taken at once or not at all
        (SQLITE_BUSY), no sweep; answers set on the spot (this is the callers' loop)."""
        if inline:
            conn = self._conn
            assert conn is not None
            self._check_files()
            conn.execute("BEGIN IMMEDIATE")
        else:
            deadline = min(job.deadline for job in jobs)
            conn = self._connect(deadline)
            self._check_files()
            self._when_free(deadline, lambda: conn.execute("BEGIN IMMEDIATE"))  # the write lock, first
        try:
            # The epoch marker, read with every transaction (a table of one row) and made again
            # when it is missing: a file replaced by an empty one, its tables emptied.
            row = conn.execute(_EPOCH).fetchone()
            if row is None:
                row = (os.urandom(8).hex(),)
                conn.execute(_NEW_EPOCH, row)
            epoch: str = row[0]
            now = self._clock.time()
            next_sweep = self._sweep(conn, now) if not inline and now >= self._next_sweep else None
            tx = _Tx(conn)
            done: list[tuple[_Job[Any], Any]] = []
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
                    jobs = [j for j in jobs if j is not job]
                    raise _Redo from None
            tx.flush()
            if not all(job.commit() for job, _ in done):  # a caller gave up meanwhile
                raise _Redo
            conn.execute("COMMIT")
        except _Redo:
            self._rollback(conn)
            return jobs
        except BaseException:
            self._rollback(conn)
            raise
        self._commits += 1
        if epoch != self._epoch.known:  # committed: a marker made here exists now
            self._epoch.found(epoch)
        if next_sweep is not None:
            self._next_sweep = next_sweep
        if inline:
            for job, result in done:
                job._succeed(result)
        else:
            self._answers.extend(done)  # answered once the connection is free (`_serve`)
        return []

    def _connect(self, deadline: float) -> sqlite3.Connection:
        """The thread's connection: opened on first use, in WAL mode, with the schema."""
        if self._conn is not None:
            return self._conn
        # No SQLite busy handler (timeout 0): `_when_free` is the busy timeout. Once this store
        # has had its file, it never creates one again (`mode=rw`): a file deleted under running
        # workers must not come back empty behind their backs (every limit would start over).
        if not os.access(self._shm, os.W_OK) and os.path.exists(self._shm):  # (see `_check_files`)
            raise _file_problem(_UNWRITABLE)
        target, uri = self._path, False
        if self._opened:
            target, uri = f"file:{quote(os.path.abspath(self._path))}?mode=rw", True
            with contextlib.suppress(FileNotFoundError):  # then `mode=rw` fails to open it
                found = os.stat(self._path)
                if (found.st_dev, found.st_ino) in _ABANDONED_FILES:
                    raise _file_problem("the database file is one this process abandoned")
        # Used by the thread and, under `_conn_lock`, inline on a caller's loop.
        conn = sqlite3.connect(target, timeout=0, isolation_level=None, uri=uri, check_same_thread=False)
        try:
            # Switching to WAL (a no-op once the file is) needs the file to itself: SQLite answers
            # SQLITE_BUSY while another worker opens it at the same moment.
            self._when_free(deadline, lambda: conn.execute("PRAGMA journal_mode = WAL").fetchall())
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable across crashes of workers
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # the thread checkpoints (`_checkpoint`)
            conn.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT_BYTES}")
            self._when_free(deadline, lambda: conn.execute("BEGIN IMMEDIATE"))
            try:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute("COMMIT")
            except BaseException:
                self._rollback(conn)
                raise
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._opened = True
        self._files = self._identify()
        self._next_check = time.monotonic() + _CHECK_EVERY_S
        return conn

    def _identify(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int]]:
        """The file, its -wal and its -shm as this connection has them open: (device, inode),
        and the -shm's size."""
        db, wal, shm = (os.stat(self._path + suffix) for suffix in ("", "-wal", "-shm"))
        return (db.st_dev, db.st_ino), (wal.st_dev, wal.st_ino), (shm.st_dev, shm.st_ino, shm.st_size)

    def _check_files(self) -> None:
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
        db, wal, (dev, ino, size) = self._files
        problem = None
        try:
            shm = os.stat(self._path + "-shm")
            if (shm.st_dev, shm.st_ino) != (dev, ino) or shm.st_size < size:
                problem = "WAL index (-shm) replaced or truncated"
            elif shm.st_size > size:
                self._files = (db, wal, (dev, ino, shm.st_size))
            if problem is None and not os.access(self._shm, os.W_OK):
                raise _file_problem(_UNWRITABLE)
            if problem is None and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + _CHECK_EVERY_S
                now = (os.stat(self._path), os.stat(self._path + "-wal"))
                if [(f.st_dev, f.st_ino) for f in now] != [db, wal]:
                    problem = "database file replaced"
        except FileNotFoundError:
            problem = "database file deleted"
        if problem is not None:
            self._abandon()
            raise _file_problem(problem)

    def _abandon(self) -> None:
        """Drop the connection without ever closing it. Closing it would checkpoint into the
        old file and then delete the -wal and -shm at the path by name, which may belong to
        the new file by then; its mapped -shm may be truncated. `_ABANDONED` keeps it
        alive to the end of the process, whose exit releases its descriptors and locks."""
        conn, self._conn = self._conn, None
        if conn is not None:
            _ABANDONED.append(conn)
            _ABANDONED_FILES.add(self._files[0])

    def _when_free(self, deadline: float, attempt: Callable[[], _T]) -> _T:
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
                    if not _is_busy(exc) or left <= 0:
                        raise
                self._lock_wait = True
                time.sleep(min(delay * (0.5 + random.random()), left))
                delay = min(2 * delay, 0.002)
        finally:
            self._lock_wait = False

    def _sweep(self, conn: sqlite3.Connection, now: float) -> float:
        """Delete expired rows (a bounded batch per table); returns when the next sweep is due."""
        complete = True
        for statement in _SWEEP.values():
            if conn.execute(statement, (now,)).rowcount >= _SWEEP_BATCH:
                complete = False
        return now + self._sweep_interval_s if complete else now

    def _rollback(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:  # closing the connection rolls back too
                if conn is self._conn:
                    self._conn = None
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if not os.access(self._shm, os.W_OK) and os.path.exists(self._shm):
            _INHERITED.append(conn)  # closing it would write to its unwritable mapping: kept
            return
        with contextlib.suppress(sqlite3.Error):
            conn.close()


#: Stores of this process, and connections kept rather than closed: inherited from a parent
#: process, or dropped while their -shm was unwritable (never used again).
_STORES: weakref.WeakSet[SQLiteStore] = weakref.WeakSet()
_INHERITED: list[sqlite3.Connection] = []


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _is_busy(exc: sqlite3.Error) -> bool:
    name = getattr(exc, "sqlite_errorname", "")
    return name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in str(exc)


#: Why a store is unavailable while its -shm cannot be written (see `SQLiteStore._check_files`).
_UNWRITABLE = "WAL index (-shm) not writable"


def _is_unwritable(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorname", None) == _UNWRITABLE


def _is_full(exc: sqlite3.Error) -> bool:
    """No disk space for a write (the WAL, the database file growing)."""
    return getattr(exc, "sqlite_errorname", None) == "SQLITE_FULL"


def _file_problem(problem: str) -> sqlite3.OperationalError:
    """The error a batch fails with when the store's file is no longer safe to use."""
    error = sqlite3.OperationalError(problem)
    error.sqlite_errorname = problem
    return error
