"""`SQLiteStore`: state in one SQLite file, shared by the workers of one machine.

Zero set-up: the file and its tables are created on first use (`CREATE TABLE IF NOT EXISTS`,
so several workers may start at once), and the file is put in WAL mode (readers never block
the writer, nor the writer them). Imported on first use (`guards.stores`), with `sqlite3`.

By concern, each module's docstring saying more:

- `_store`: `SQLiteStore`, the `Store` operations, each one transaction;
- `_tx`: the transaction an operation runs in (`Tx`), each operation's reads and writes, and
  why they are atomic;
- `_sql`: the statements `Tx` runs; `_schema`: the tables (one row per piece of state, each
  with its expiry), the sweep of expired rows, the epoch marker and the breaker's row format;
- `_runner`: how operations reach the file: taken a loop turn at a time, run inline on the
  caller's loop when the write lock is free at once, else on the store's thread, each within
  its time (`timeout_s`); `_jobs`: one operation handed over (`Job`) and its fate;
- `_database`: the connection to the file (WAL mode, the busy timeout, the WAL's checkpoints
  and size), and the checks that the file under it is still the one at its path.
"""

from ._store import SQLiteStore

__all__ = ["SQLiteStore"]
