"""Kept streams in the store's file (`guards.stores._kept`), each operation run in one of the
store's transactions: `guards_kept_list (key, length, expires_at)` per stream,
`guards_kept_item (key, n, value, expires_at)` per event (its `expires_at` the list's when it
was written: reads go by the list's row, the sweep by each row's), and `guards_kept_name
(key, value, expires_at)` per name."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from .._base import bounded_key

__all__ = ["kept_append", "kept_get", "kept_read", "kept_set"]


def _length(conn: sqlite3.Connection, key: str, now: float) -> int | None:
    row = conn.execute(
        "SELECT length FROM guards_kept_list WHERE key = ? AND expires_at > ?", (key, now)
    ).fetchone()
    return None if row is None else int(row[0])


def kept_append(
    conn: sqlite3.Connection, key: str, items: Sequence[str], at: int, ttl_s: float, now: float
) -> bool:
    key = bounded_key(key)
    if (_length(conn, key, now) or 0) != at:
        return False
    if at == 0:  # an expired list's rows go first: the stream starts afresh at 0
        conn.execute("DELETE FROM guards_kept_item WHERE key = ?", (key,))
    expires = now + ttl_s
    conn.executemany(
        "INSERT OR REPLACE INTO guards_kept_item (key, n, value, expires_at) VALUES (?, ?, ?, ?)",
        [(key, at + i, item, expires) for i, item in enumerate(items)],
    )
    conn.execute(
        "INSERT OR REPLACE INTO guards_kept_list (key, length, expires_at) VALUES (?, ?, ?)",
        (key, at + len(items), expires),
    )
    return True


def kept_read(
    conn: sqlite3.Connection, key: str, start: int, count: int, now: float
) -> tuple[int, list[str]] | None:
    key = bounded_key(key)
    length = _length(conn, key, now)
    if length is None:
        return None
    rows = conn.execute(
        "SELECT value FROM guards_kept_item WHERE key = ? AND n >= ? AND n < ? ORDER BY n",
        (key, start, min(start + count, length)),
    ).fetchall()
    return length, [row[0] for row in rows]


def kept_set(conn: sqlite3.Connection, name: str, value: str, ttl_s: float, now: float) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO guards_kept_name (key, value, expires_at) VALUES (?, ?, ?)",
        (bounded_key(name), value, now + ttl_s),
    )


def kept_get(conn: sqlite3.Connection, name: str, now: float) -> str | None:
    row = conn.execute(
        "SELECT value FROM guards_kept_name WHERE key = ? AND expires_at > ?", (bounded_key(name), now)
    ).fetchone()
    return None if row is None else str(row[0])
