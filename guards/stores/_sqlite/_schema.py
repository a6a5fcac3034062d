"""The store's file: its tables, and the format of the rows Python reads back.

Schema: one row per piece of state, each with an `expires_at` (seconds since the epoch, store
time, `NOT NULL`):

- `guards_window (key, seq, ts, expires_at)`: one row per request admitted under a `per_minute`
  limit, at `ts`, kept until `ts + 60` (so a key's last row goes a minute after its last
  admission);
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
  the task's expiry, `ttl_s` after its creation;
- `guards_kept_list`, `guards_kept_item`, `guards_kept_name`: resumable streams' events (see
  `guards.stores._sqlite._kept`), kept the route's `resumable.ttl_s` after their last write;
- `guards_share (key, name, value, expires_at)`: a shared limit's minute (see
  `guards.stores._share`), one row per field of its hashes, kept two minutes;
- `guards_epoch (id)`: the store's epoch marker (see `guards.stores._epoch`), one row, never
  expiring.

Time: `clock.time()`, read inside the transaction (one machine: every worker shares the
machine's clock). Expired rows are ignored on read, and deleted by a sweep (`sweep`) run at
most once per `sweep_interval_s` of store time per store, at most `_SWEEP_BATCH` rows per table
at a time.
"""

from __future__ import annotations

import json
import os
import sqlite3

from .._breaker import BreakerState, CircuitState

__all__ = [
    "SCHEMA",
    "TABLES",
    "dump_breaker",
    "load_breaker",
    "read_epoch",
    "sweep",
]

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
    "guards_kept_list",
    "guards_kept_item",
    "guards_kept_name",
    "guards_share",
)

SCHEMA = (
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
    # Kept streams (`guards.stores._sqlite._kept`).
    """CREATE TABLE IF NOT EXISTS guards_kept_list (
        key TEXT PRIMARY KEY, length INTEGER NOT NULL, expires_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS guards_kept_item (
        key TEXT NOT NULL, n INTEGER NOT NULL, value TEXT NOT NULL, expires_at REAL NOT NULL,
        PRIMARY KEY (key, n))""",
    """CREATE TABLE IF NOT EXISTS guards_kept_name (
        key TEXT PRIMARY KEY, value TEXT NOT NULL, expires_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS guards_share (
        key TEXT NOT NULL, name TEXT NOT NULL, value TEXT NOT NULL, expires_at REAL NOT NULL,
        PRIMARY KEY (key, name))""",
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


def sweep(conn: sqlite3.Connection, now: float) -> bool:
    """Delete expired rows (a bounded batch per table); False when a table had more (then the
    next sweep is due at once)."""
    complete = True
    for statement in _SWEEP.values():
        if conn.execute(statement, (now,)).rowcount >= _SWEEP_BATCH:
            complete = False
    return complete


def read_epoch(conn: sqlite3.Connection) -> str:
    """The epoch marker, read with every transaction (a table of one row) and made again when
    it is missing: a file replaced by an empty one, its tables emptied."""
    row = conn.execute(_EPOCH).fetchone()
    if row is None:
        row = (os.urandom(8).hex(),)
        conn.execute(_NEW_EPOCH, row)
    epoch: str = row[0]
    return epoch


def dump_breaker(s: BreakerState) -> str:
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


def load_breaker(text: str) -> BreakerState:
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
