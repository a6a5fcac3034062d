"""The SQL of the store's operations (`Tx` runs them), by the state each reads or writes."""

from __future__ import annotations

__all__ = [
    "BREAKER",
    "COMPLETE_TASK",
    "COOLDOWN_CHUNK",
    "COUNT_DAY",
    "DAY_COUNT",
    "DISOWN_TASK",
    "DROP_BREAKER",
    "DROP_TASK",
    "DROP_TASK_STEPS",
    "GET_ANSWER",
    "HELD",
    "HOLD",
    "HOLDS",
    "NEW_TASK",
    "OWNER_LIVE",
    "OWN_TASK",
    "PUT_ANSWER",
    "PUT_BREAKER",
    "RELEASE_HOLD",
    "RELEASE_TASK",
    "RENEW_TASK",
    "REPLACE_HOLD",
    "SAVE_STEP",
    "SETTLE",
    "SETTLED",
    "SHARE_ALL",
    "SHARE_DROP",
    "SHARE_PUT",
    "START_COOLDOWN",
    "START_DAY",
    "TAKE_TASK",
    "TASK",
    "TASK_STEPS",
    "WINDOW_ADD",
    "WINDOW_AT",
    "WINDOW_LAST",
    "WINDOW_LAST_AND_DAY_COUNT",
    "WINDOW_PRUNE",
    "cooldown_read",
]

# --- budget --------------------------------------------------------------------------------------
# The per-minute window is a log of admissions numbered 0, 1, 2... per key. The window has room
# when the admission `per_minute` places back (seq = next - per_minute) is missing or older than
# 60 s: one indexed lookup, whatever the traffic. Each admission deletes at most two expired
# rows at the log's tail, so a key keeps about its last minute of admissions.
WINDOW_LAST = "SELECT max(seq) FROM guards_window WHERE key = ?"
WINDOW_AT = "SELECT ts FROM guards_window WHERE key = ? AND seq = ?"
WINDOW_ADD = "INSERT OR REPLACE INTO guards_window (key, seq, ts, expires_at) VALUES (?, ?, ?, ?)"
#: The key's two oldest rows (those below its third oldest, if any), if expired: a range of
#: the (key, seq) index below one looked-up bound (cheaper than `rowid IN (... LIMIT 2)`).
WINDOW_PRUNE = """DELETE FROM guards_window WHERE key = ?1 AND ts <= ?2 AND seq < coalesce(
    (SELECT seq FROM guards_window WHERE key = ?1 ORDER BY seq LIMIT 1 OFFSET 2), 9223372036854775807)"""
DAY_COUNT = "SELECT n FROM guards_counter WHERE key = ? AND expires_at > ?"
#: Both reads of a charge with both limits, in one statement.
WINDOW_LAST_AND_DAY_COUNT = """SELECT (SELECT max(seq) FROM guards_window WHERE key = ?),
    (SELECT n FROM guards_counter WHERE key = ? AND expires_at > ?)"""
#: The charge read the day's count: a live row is incremented (its `expires_at`, and so its
#: index entry, untouched); none, or an expired one, starts over.
COUNT_DAY = "UPDATE guards_counter SET n = n + 1 WHERE key = ?"
START_DAY = "INSERT OR REPLACE INTO guards_counter (key, n, expires_at) VALUES (?, 1, ?)"

# --- spend ---------------------------------------------------------------------------------------
SETTLED = "SELECT settled FROM guards_spend WHERE key = ? AND expires_at > ?"
HELD = "SELECT coalesce(sum(amount), 0.0) FROM guards_hold WHERE key = ? AND expires_at > ?"
HOLD = "INSERT INTO guards_hold (id, key, amount, expires_at) VALUES (?, ?, ?, ?)"
RELEASE_HOLD = "DELETE FROM guards_hold WHERE id = :id AND key = :key"
HOLDS = "SELECT amount, expires_at FROM guards_hold WHERE key = ? AND expires_at > ?"
REPLACE_HOLD = "UPDATE guards_hold SET amount = ? WHERE id = ? AND key = ? AND expires_at > ?"
SETTLE = """INSERT INTO guards_spend (key, settled, expires_at) VALUES (:key, :actual, :expires)
    ON CONFLICT (key) DO UPDATE SET
        settled = CASE WHEN expires_at > :now THEN settled + excluded.settled ELSE excluded.settled END,
        expires_at = CASE WHEN expires_at > :now THEN expires_at ELSE excluded.expires_at END"""

# --- breaker -------------------------------------------------------------------------------------
BREAKER = "SELECT state, expires_at FROM guards_breaker WHERE key = :key"
PUT_BREAKER = """INSERT INTO guards_breaker (key, state, expires_at) VALUES (:key, :state, :expires)
    ON CONFLICT (key) DO UPDATE SET state = excluded.state, expires_at = excluded.expires_at"""
DROP_BREAKER = "DELETE FROM guards_breaker WHERE key = :key"

# --- cooldowns -----------------------------------------------------------------------------------
#: Never shortens: a live row ending later is left alone; an expired one ends earlier than `now`,
#: so it is replaced.
START_COOLDOWN = """INSERT INTO guards_cooldown (key, expires_at) VALUES (:key, :until)
    ON CONFLICT (key) DO UPDATE SET expires_at = excluded.expires_at
    WHERE expires_at < excluded.expires_at"""
#: The most keys one read binds (SQLite's default limit on host parameters is 32,766; 999
#: before 3.32): a longer list is read in several statements, within the same transaction.
COOLDOWN_CHUNK = 500


# --- last good answers ---------------------------------------------------------------------------
PUT_ANSWER = """INSERT INTO guards_answer (key, value, stored_at, expires_at) VALUES (:key, :value, :now, :expires)
    ON CONFLICT (key) DO UPDATE SET
        value = excluded.value, stored_at = excluded.stored_at, expires_at = excluded.expires_at"""
GET_ANSWER = "SELECT value, stored_at FROM guards_answer WHERE key = ? AND expires_at > ?"
# --- tasks ---------------------------------------------------------------------------------------
TASK = "SELECT fingerprint, lease, lease_until, response, expires_at FROM guards_task WHERE key = ?"
NEW_TASK = """INSERT OR REPLACE INTO guards_task (key, fingerprint, lease, lease_until, response, expires_at)
    VALUES (?, ?, ?, ?, NULL, ?)"""
TAKE_TASK = "UPDATE guards_task SET lease = ?, lease_until = ? WHERE key = ?"
TASK_STEPS = "SELECT name, value FROM guards_task_step WHERE key = ? AND expires_at > ?"
DROP_TASK_STEPS = "DELETE FROM guards_task_step WHERE key = ?"
#: Only the lease's holder writes, and only to a live task that has not completed.
RENEW_TASK = """UPDATE guards_task SET lease_until = :until
    WHERE key = :key AND lease = :lease AND response IS NULL AND expires_at > :now RETURNING expires_at"""
SAVE_STEP = "INSERT OR REPLACE INTO guards_task_step (key, name, value, expires_at) VALUES (?, ?, ?, ?)"
COMPLETE_TASK = """UPDATE guards_task SET response = :response, lease = '', lease_until = 0
    WHERE key = :key AND lease = :lease AND response IS NULL AND expires_at > :now"""
RELEASE_TASK = "UPDATE guards_task SET lease = '', lease_until = 0 WHERE key = ? AND lease = ?"
#: A task held by the lease that saved nothing and did not complete: deleted.
DROP_TASK = """DELETE FROM guards_task WHERE key = :key AND lease = :lease AND response IS NULL
    AND expires_at > :now AND NOT EXISTS (SELECT 1 FROM guards_task_step WHERE key = :key)"""
#: An owner's live tasks (an index range of at most its cap, and the expired ones not swept yet).
OWNER_LIVE = "SELECT count(*), min(expires_at) FROM guards_task_owner WHERE owner = ? AND expires_at > ?"
OWN_TASK = "INSERT OR REPLACE INTO guards_task_owner (key, owner, expires_at) VALUES (?, ?, ?)"
DISOWN_TASK = "DELETE FROM guards_task_owner WHERE key = ?"


def cooldown_read(n: int) -> str:
    """The rows of `n` keys, expired or not (a transaction keeps them: `Tx.cooldowns`)."""
    marks = ", ".join("?" * n)
    return f"SELECT key, expires_at FROM guards_cooldown WHERE key IN ({marks})"


# --- shared limits (`guards.stores._share`): a minute's hashes, a row per field ---------------
SHARE_ALL = "SELECT name, value FROM guards_share WHERE key = ? AND expires_at > ?"
#: A new field of a live hash keeps the hash's expiry (its first row's), as Redis does.
SHARE_PUT = """INSERT INTO guards_share (key, name, value, expires_at) VALUES (:key, :name, :value,
    coalesce((SELECT max(expires_at) FROM guards_share WHERE key = :key AND expires_at > :now), :expires))
    ON CONFLICT (key, name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at"""
SHARE_DROP = "DELETE FROM guards_share WHERE key = ? AND name = ? RETURNING value, expires_at"
