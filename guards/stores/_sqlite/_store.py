"""`SQLiteStore`: the `Store` operations, each one transaction on the store's file (`_run`).

The breaker's transitions are the pure functions of `guards.stores._breaker`: the row is read and
the new state written within one `BEGIN IMMEDIATE` transaction, which holds the file's write
lock from its start, so no other worker can change the row in between (the state machine is too
rich for one SQL statement; holding the write lock makes the pair atomic).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TypeVar

from ...contracts._clock import Clock, SystemClock
from .._base import (
    ADMITTED,
    Admission,
    Charge,
    Health,
    Passage,
    SpendReservation,
    Step,
    StoredAnswer,
    TaskClaim,
)
from .._breaker import Breaker, BreakerDecision, BreakerState, Outcome
from .._breaker import admit as breaker_admit
from .._breaker import record as breaker_record
from .._epoch import Epoch
from .._kept import POLL_S
from ._jobs import Work
from ._kept import kept_append, kept_get, kept_read, kept_set
from ._runner import Runner
from ._tx import Tx

__all__ = ["SQLiteStore"]

_T = TypeVar("_T")


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
        self._clock = clock or SystemClock()
        self._epoch = Epoch("sqlite")
        self._runner = Runner(
            self._path,
            clock=self._clock,
            timeout_s=timeout_s,
            sweep_interval_s=sweep_interval_s,
            epoch=self._epoch,
        )

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

    async def charge_budget(self, key: str, *, per_minute: int | None, per_day: int | None) -> Admission:
        if per_minute is None and per_day is None:
            return ADMITTED
        charge = Charge(key=key, per_minute=per_minute, per_day=per_day)
        return await self._run(lambda tx, now: tx.charge(charge, now)[0] or ADMITTED)

    async def reserve_spend(self, key: str, *, amount: float, cap: float, hold_s: float) -> SpendReservation:
        charge = Charge(key=key, spend=amount, spend_cap=cap, hold_s=hold_s)

        def reserve(tx: Tx, now: float) -> SpendReservation:
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
        def admit(tx: Tx, now: float) -> BreakerDecision:
            before = tx.breaker(key, now)
            state, decision = breaker_admit(before, policy, now)
            if state is not before:  # an open breaker's refusal, a closed one's admission: no write
                tx.put_breaker(key, state, policy, now)
            return decision

        return await self._run(admit)

    async def breaker_record(
        self, key: str, policy: Breaker, outcome: Outcome, *, probe: float | None
    ) -> BreakerState:
        def record(tx: Tx, now: float) -> BreakerState:
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
        await self._run(lambda tx, now: tx.put_answer(key, value, ttl_s, now))

    async def get_answer(self, key: str, *, max_age_s: float) -> StoredAnswer | None:
        return await self._run(lambda tx, now: tx.get_answer(key, max_age_s, now))

    async def health(self, legs: Sequence[tuple[str, str]]) -> Health:
        legs = tuple(legs)  # as they are now: the store's thread reads them later

        def read(tx: Tx, now: float) -> Health:
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

    # --- kept streams (`guards.stores._kept`): each one transaction ----------------------------

    async def kept_append(self, key: str, items: Sequence[str], *, at: int, ttl_s: float) -> bool:
        items = tuple(items)
        return await self._run(lambda tx, now: kept_append(tx.conn, key, items, at, ttl_s, now))

    async def kept_read(self, key: str, start: int, count: int) -> tuple[int, list[str]] | None:
        return await self._run(lambda tx, now: kept_read(tx.conn, key, start, count, now))

    async def kept_wait(self, key: str, length: int, timeout_s: float) -> None:
        await asyncio.sleep(min(timeout_s, POLL_S))  # a bounded poll: the reader reads again

    async def kept_set(self, name: str, value: str, *, ttl_s: float) -> None:
        await self._run(lambda tx, now: kept_set(tx.conn, name, value, ttl_s, now))

    async def kept_get(self, name: str) -> str | None:
        return await self._run(lambda tx, now: kept_get(tx.conn, name, now))

    # --- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connection and stop the thread. Callable from any event loop, and twice."""
        await self._runner.close()

    def _run(self, work: Work[_T]) -> Awaitable[_T]:
        """Run `work` in a write transaction (`Runner.run`), within `timeout_s`."""
        return self._runner.run(work)
