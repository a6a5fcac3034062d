"""Tasks in Python, shared by `MemoryStore` and `SQLiteStore` (RedisStore runs the same rules in
its Lua script).

A task is one record under its key (fingerprint, lease, lease end, stored response, expiry)
and its saved steps. `refusal` is the claim's decision, made on the record read inside the
store's atomic operation (no `await` in memory, the write lock held on SQLite); the store then
writes what the decision calls for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._base import TaskClaim, TaskStatus

__all__ = ["TaskRecord", "new_lease", "refusal"]


@dataclass(slots=True)
class TaskRecord:
    """A task's record. `lease` is empty while nobody holds it; `response` is set once it
    completed; every part of the task expires at `expires_at` (store time)."""

    fingerprint: str
    expires_at: float
    lease: str = ""
    lease_until: float = 0.0
    response: str | None = None
    #: The owner the task counts against ("": none).
    owner: str = ""


def refusal(record: TaskRecord | None, fingerprint: str, now: float) -> TaskClaim | None:
    """What a claim answers when the caller may not take the task's lease (`reused`, `done`,
    `busy`), or None when it may: no live task (a new one is made), or a live task nobody
    holds (released, or its holder's lease lapsed)."""
    if record is None or record.expires_at <= now:
        return None
    if record.fingerprint != fingerprint:
        return TaskClaim(TaskStatus.reused)
    if record.response is not None:
        return TaskClaim(TaskStatus.done, response=record.response)
    if record.lease and record.lease_until > now:
        return TaskClaim(TaskStatus.busy, retry_after_s=record.lease_until - now)
    return None


def new_lease() -> str:
    """A lease token: random, so a lapsed holder's late writes are told apart."""
    return os.urandom(8).hex()
