"""`Tx`: the write transaction a batch of the store's operations runs in, and each operation's
reads and writes within it.

Atomicity: operations run inside `BEGIN IMMEDIATE` transactions: the write lock is taken before
anything is read, so no other worker can write until COMMIT. Within one, a check reads what it
needs (the window's last admissions, the day's count, the spend settled and held, the breaker's
row, a task's record), the pure decision is made in Python (`_limits`, `admit` / `record`,
`_task.refusal`) and its writes follow in the same transaction. That is atomic because the
write lock is held from the start: Python never decides a write from a value read outside it.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence

from .._base import (
    DAILY_TTL_S,
    DAY_S,
    MINUTE_S,
    Admission,
    Charge,
    Passage,
    Step,
    StoredAnswer,
    StoreUnavailable,
    TaskClaim,
    TaskStatus,
    bounded_key,
    utc_day,
)
from .._breaker import CLOSED, Breaker, BreakerState, keep_s
from .._limits import charge_with_more, near_scopes
from .._step import first_admitted, run_step
from .._task import TaskRecord, new_lease, refusal
from ._schema import dump_breaker, load_breaker
from ._sql import (
    BREAKER,
    COMPLETE_TASK,
    COOLDOWN_CHUNK,
    COUNT_DAY,
    DAY_COUNT,
    DISOWN_TASK,
    DROP_BREAKER,
    DROP_TASK,
    DROP_TASK_STEPS,
    GET_ANSWER,
    HELD,
    HOLD,
    HOLDS,
    NEW_TASK,
    OWN_TASK,
    OWNER_LIVE,
    PUT_ANSWER,
    PUT_BREAKER,
    RELEASE_HOLD,
    RELEASE_TASK,
    RENEW_TASK,
    REPLACE_HOLD,
    SAVE_STEP,
    SETTLE,
    SETTLED,
    SHARE_ALL,
    SHARE_DROP,
    SHARE_PUT,
    START_COOLDOWN,
    START_DAY,
    TAKE_TASK,
    TASK,
    TASK_STEPS,
    WINDOW_ADD,
    WINDOW_AT,
    WINDOW_LAST,
    WINDOW_LAST_AND_DAY_COUNT,
    WINDOW_PRUNE,
    cooldown_read,
)

__all__ = ["Tx"]


class Tx:
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
        for i in range(0, len(unread), COOLDOWN_CHUNK):
            chunk = unread[i : i + COOLDOWN_CHUNK]
            ends.update(dict.fromkeys(chunk, 0.0))
            ends.update(self.conn.execute(cooldown_read(len(chunk)), chunk).fetchall())
        return tuple(max(0.0, ends[key] - now) for key in bounded)

    def start_cooldown(self, key: str, seconds: float, now: float) -> None:
        if now + seconds > now:  # not lost in rounding
            key = bounded_key(key)
            self.conn.execute(START_COOLDOWN, {"key": key, "until": now + seconds})
            self._cooldowns.pop(key, None)  # read again if needed

    def breaker(self, key: str, now: float) -> BreakerState:
        """The breaker's state; a missing or expired row is a closed, healthy breaker."""
        key = bounded_key(key)
        item = self._breakers.get(key)
        if item is None:
            row = self.conn.execute(BREAKER, {"key": key}).fetchone()
            try:
                item = (CLOSED, None) if row is None else (load_breaker(row[0]), float(row[1]))
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
                last, counted = conn.execute(WINDOW_LAST_AND_DAY_COUNT, (key, day_key, now)).fetchone()
            else:
                last = conn.execute(WINDOW_LAST, (key,)).fetchone()[0]
            seq = 0 if last is None else last + 1
            if seq >= per_minute:
                row = conn.execute(WINDOW_AT, (key, seq - per_minute)).fetchone()
                if row is not None and row[0] > now - MINUTE_S:  # still in the window: full
                    refusal = Admission(False, "per_minute", row[0] + MINUTE_S - now)
        next_day = DAY_S - now % DAY_S  # until the next UTC midnight
        if per_day is not None:
            if per_minute is None:
                row = conn.execute(DAY_COUNT, (day_key, now)).fetchone()
                counted = None if row is None else row[0]
            # Both spent: name the limit that frees up last, like MemoryStore.
            if (counted or 0) >= per_day and (refusal is None or next_day > (refusal.retry_after_s or 0.0)):
                refusal = Admission(False, "per_day", next_day)
        spend_key = f"{key}:spend:{day}"
        if charge.spend is not None:
            settled = conn.execute(SETTLED, (spend_key, now)).fetchone()
            held = conn.execute(HELD, (spend_key, now)).fetchone()[0]
            if (0.0 if settled is None else settled[0]) + held + charge.spend > charge.spend_cap and (
                refusal is None or next_day > (refusal.retry_after_s or 0.0)
            ):
                refusal = Admission(False, "spend_per_day", next_day)
        if refusal is not None or dry:
            return refusal, None  # nothing written
        if per_minute is not None:
            conn.execute(WINDOW_ADD, (key, seq, now, now + MINUTE_S))
            conn.execute(WINDOW_PRUNE, (key, now - MINUTE_S))
        if per_day is not None:
            if counted is None:
                conn.execute(START_DAY, (day_key, now + DAILY_TTL_S))
            else:
                conn.execute(COUNT_DAY, (day_key,))
        if charge.spend is None:
            return None, None
        reservation = reservation or os.urandom(8).hex()
        conn.execute(HOLD, (reservation, spend_key, charge.spend, now + charge.hold_s))
        return None, reservation

    def settle(self, key: str, reservation: str, actual: float, now: float) -> None:
        day_key = f"{bounded_key(key)}:spend:{utc_day(now)}"
        self.conn.execute(RELEASE_HOLD, {"id": reservation, "key": day_key})
        self.conn.execute(
            SETTLE, {"key": day_key, "actual": actual, "expires": now + DAILY_TTL_S, "now": now}
        )

    # The primitives of `_limits`: a count is a `guards_counter` row; a held counter a
    # `guards_spend` row (its settled total) and `guards_hold` rows (its holds, each one's id
    # the reservation and the counter's key: a reservation holds in several counters).

    def count(self, key: str, now: float) -> int:
        row = self.conn.execute(DAY_COUNT, (key, now)).fetchone()
        return 0 if row is None else int(row[0])

    def add_count(self, key: str, ttl_s: float, now: float) -> None:
        if self.conn.execute(DAY_COUNT, (key, now)).fetchone() is None:
            self.conn.execute(START_DAY, (key, now + ttl_s))
        else:
            self.conn.execute(COUNT_DAY, (key,))

    def holds(self, key: str, now: float) -> tuple[float, list[tuple[float, float]]]:
        settled = self.conn.execute(SETTLED, (key, now)).fetchone()
        holds = self.conn.execute(HOLDS, (key, now)).fetchall()
        return (0.0 if settled is None else float(settled[0])), holds

    def hold(self, key: str, reservation: str, amount: float, until: float, ttl_s: float, now: float) -> None:
        self.conn.execute(HOLD, (f"{reservation} {key}", key, amount, until))

    def settle_hold(self, key: str, reservation: str, actual: float, ttl_s: float, now: float) -> None:
        self.conn.execute(RELEASE_HOLD, {"id": f"{reservation} {key}", "key": key})
        self.conn.execute(SETTLE, {"key": key, "actual": actual, "expires": now + ttl_s, "now": now})

    def replace_hold(self, key: str, reservation: str, actual: float, now: float) -> None:
        self.conn.execute(REPLACE_HOLD, (actual, f"{reservation} {key}", key, now))

    def hash_all(self, key: str, now: float) -> dict[str, str]:
        return dict(self.conn.execute(SHARE_ALL, (key, now)).fetchall())

    def hash_put(self, key: str, name: str, value: str, ttl_s: float, now: float) -> None:
        self.conn.execute(
            SHARE_PUT, {"key": key, "name": name, "value": value, "now": now, "expires": now + ttl_s}
        )

    def hash_pop(self, key: str, name: str, now: float) -> str | None:
        row = self.conn.execute(SHARE_DROP, (key, name)).fetchone()
        return None if row is None or row[1] <= now else str(row[0])

    def spent(self, key: str, now: float) -> float:
        row = self.conn.execute(SETTLED, (f"{bounded_key(key)}:spend:{utc_day(now)}", now)).fetchone()
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
        row = conn.execute(TASK, (key,)).fetchone()
        record = None if row is None else TaskRecord(row[0], float(row[4]), row[1], float(row[2]), row[3])
        refused = refusal(record, fingerprint, now)
        if refused is not None:
            return refused
        lease = new_lease()
        if record is None or record.expires_at <= now:  # none, or expired: a new task
            if owner is not None:
                owner = bounded_key(owner)
                live, oldest = conn.execute(OWNER_LIVE, (owner, now)).fetchone()
                if max_live is not None and live >= max_live:
                    return TaskClaim(TaskStatus.full, retry_after_s=float(oldest) - now)
                conn.execute(OWN_TASK, (key, owner, now + ttl_s))
            conn.execute(DROP_TASK_STEPS, (key,))
            conn.execute(NEW_TASK, (key, fingerprint, lease, now + lease_s, now + ttl_s))
            return TaskClaim(TaskStatus.claimed, lease)
        conn.execute(TAKE_TASK, (lease, now + lease_s, key))
        return TaskClaim(TaskStatus.claimed, lease, dict(conn.execute(TASK_STEPS, (key, now)).fetchall()))

    def task_save(self, key: str, lease: str, name: str, value: str, lease_s: float, now: float) -> bool:
        key = bounded_key(key)
        row = self.conn.execute(
            RENEW_TASK, {"key": key, "lease": lease, "until": now + lease_s, "now": now}
        ).fetchone()
        if row is None:
            return False
        self.conn.execute(SAVE_STEP, (key, name, value, row[0]))
        return True

    def task_complete(self, key: str, lease: str, response: str, now: float) -> bool:
        key = bounded_key(key)
        params = {"key": key, "lease": lease, "response": response, "now": now}
        if self.conn.execute(COMPLETE_TASK, params).rowcount != 1:
            return False
        self.conn.execute(DROP_TASK_STEPS, (key,))
        return True

    def task_release(self, key: str, lease: str) -> None:
        self.conn.execute(RELEASE_TASK, (bounded_key(key), lease))

    def task_drop(self, key: str, lease: str, now: float) -> None:
        key = bounded_key(key)
        if self.conn.execute(DROP_TASK, {"key": key, "lease": lease, "now": now}).rowcount == 1:
            self.conn.execute(DISOWN_TASK, (key,))
        else:
            self.conn.execute(RELEASE_TASK, (key, lease))

    def put_answer(self, key: str, value: str, ttl_s: float, now: float) -> None:
        row = {"key": bounded_key(key), "value": value, "now": now, "expires": now + ttl_s}
        self.conn.execute(PUT_ANSWER, row)

    def get_answer(self, key: str, max_age_s: float, now: float) -> StoredAnswer | None:
        row = self.conn.execute(GET_ANSWER, (bounded_key(key), now)).fetchone()
        if row is None or now - row[1] >= max_age_s:
            return None
        return StoredAnswer(str(row[0]), now - float(row[1]))

    def flush(self) -> None:
        for key in self._dirty:
            state, expires = self._breakers[key]
            if expires is None:
                self.conn.execute(DROP_BREAKER, {"key": key})
            else:
                self.conn.execute(PUT_BREAKER, {"key": key, "state": dump_breaker(state), "expires": expires})
        self._dirty.clear()
