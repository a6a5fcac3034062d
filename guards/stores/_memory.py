"""`MemoryStore`: state in this process's memory.

Atomicity: every method does all its work synchronously, with no `await` between reading and
writing a key, so on one event loop no other task can interleave. Not shared between workers.

Bounded: every key has an expiry; expired keys are ignored on read and swept out in full at most
once per `sweep_interval_s`, so memory holds only keys live within their TTL.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from .._breaker import CLOSED, Breaker, BreakerDecision, BreakerState, Outcome
from .._breaker import admit as breaker_admit
from .._breaker import record as breaker_record
from .._clock import Clock, SystemClock
from ._base import (
    ADMITTED,
    DAILY_TTL_S,
    DAY_S,
    MINUTE_S,
    Admission,
    SpendReservation,
    utc_day,
)

__all__ = ["MemoryStore"]


class MemoryStore:
    """A `Store` in process memory: exact for one process (one uvicorn worker)."""

    def __init__(self, *, clock: Clock | None = None, sweep_interval_s: float = 60.0) -> None:
        self._clock = clock or SystemClock()
        # The system clock's `time` is `time.time` itself: one Python call less per operation.
        self._time = time.time if type(self._clock) is SystemClock else self._clock.time
        self._data: dict[str, tuple[Any, float]] = {}
        self._sweep_interval_s = sweep_interval_s
        self._next_sweep = 0.0

    def __len__(self) -> int:
        """Live keys (expired ones may linger until the next sweep; they are not counted)."""
        now = self._clock.time()
        return sum(1 for _, expires in self._data.values() if expires > now)

    async def now(self) -> float:
        return self._clock.time()

    async def charge_budget(self, key: str, *, per_minute: int | None, per_day: int | None) -> Admission:
        now = self._tick()
        data = self._data
        refusal: Admission | None = None
        stamps: deque[float] | None = None
        if per_minute is not None:
            rate_key = key + ":rate"
            item = data.get(rate_key)
            stamps = item[0] if item is not None and item[1] > now else deque()
            horizon = now - MINUTE_S
            while stamps and stamps[0] <= horizon:
                stamps.popleft()
            if len(stamps) >= per_minute:
                refusal = Admission(False, "per_minute", stamps[0] + MINUTE_S - now if stamps else MINUTE_S)
        if per_day is not None:
            day_key = f"{key}:day:{utc_day(now)}"
            item = data.get(day_key)
            count, expires = item if item is not None and item[1] > now else (0, now + DAILY_TTL_S)
            if count >= per_day:
                wait = DAY_S - now % DAY_S  # until the next UTC midnight
                # Both spent: name the limit that frees up last, so Retry-After is honest.
                if refusal is None or wait > (refusal.retry_after_s or 0.0):
                    refusal = Admission(False, "per_day", wait)
            if refusal is None:
                data[day_key] = (count + 1, expires)
        if refusal is not None:
            return refusal
        if stamps is not None:
            stamps.append(now)
            data[rate_key] = (stamps, now + MINUTE_S)
        return ADMITTED

    async def reserve_spend(self, key: str, *, amount: float, cap: float, hold_s: float) -> SpendReservation:
        now = self._tick()
        day_key = f"{key}:spend:{utc_day(now)}"
        settled, holds = self._get(day_key, now, ((0.0, {}), 0.0))[0]
        live = {rid: hold for rid, hold in holds.items() if hold[1] > now}
        if settled + sum(amount for amount, _ in live.values()) + amount > cap:
            return SpendReservation(False, retry_after_s=DAY_S - now % DAY_S)
        reservation = os.urandom(8).hex()
        live[reservation] = (amount, now + hold_s)
        self._data[day_key] = ((settled, live), now + DAILY_TTL_S)
        return SpendReservation(True, reservation)

    async def settle_spend(self, key: str, reservation: str, *, actual: float) -> None:
        now = self._tick()
        day_key = f"{key}:spend:{utc_day(now)}"
        (settled, holds), expires = self._get(day_key, now, ((0.0, {}), now + DAILY_TTL_S))
        holds = {rid: hold for rid, hold in holds.items() if rid != reservation and hold[1] > now}
        self._data[day_key] = ((settled + actual, holds), expires)

    async def spent(self, key: str) -> float:
        """Settled spend of the current UTC day under `key` (for dashboards and tests)."""
        now = self._tick()
        return float(self._get(f"{key}:spend:{utc_day(now)}", now, ((0.0, {}), 0.0))[0][0])

    async def breaker_admit(self, key: str, policy: Breaker) -> BreakerDecision:
        now = self._tick()
        item = self._data.get(key)
        current = item[0] if item is not None and item[1] > now else CLOSED
        state, decision = breaker_admit(current, policy, now)
        if state is not CLOSED:  # a healthy breaker has no key (see `_put_breaker`): nothing to write
            self._put_breaker(key, state, policy, now)
        return decision

    async def breaker_record(
        self, key: str, policy: Breaker, outcome: Outcome, *, probe: float | None
    ) -> BreakerState:
        now = self._tick()
        state = breaker_record(self._get(key, now, (CLOSED, 0.0))[0], policy, now, outcome, probe=probe)
        self._put_breaker(key, state, policy, now)
        return state

    async def cooldowns(self, keys: Sequence[str]) -> tuple[float, ...]:
        now = self._tick()
        data = self._data
        waits = []
        for key in keys:
            item = data.get(key)  # (until, until): a cooldown's value is its expiry
            waits.append(0.0 if item is None or item[1] <= now else max(0.0, item[0] - now))
        return tuple(waits)

    async def start_cooldown(self, key: str, seconds: float) -> None:
        now = self._tick()
        until = max(now + seconds, self._get(key, now, (now, 0.0))[0])
        if until > now:
            self._data[key] = (until, until)

    async def aclose(self) -> None:
        self._data.clear()

    def _put_breaker(self, key: str, state: BreakerState, policy: Breaker, now: float) -> None:
        # `is` first: the usual closed state is CLOSED itself, and comparing field by field costs.
        if state is CLOSED or state == CLOSED:
            self._data.pop(key, None)  # a healthy breaker needs no key at all
        else:
            self._data[key] = (state, now + policy.ttl_s)

    def _get(self, key: str, now: float, default: tuple[Any, float]) -> tuple[Any, float]:
        item = self._data.get(key)
        if item is None or item[1] <= now:
            return default
        return item

    def _tick(self) -> float:
        """The store's time now, after sweeping out expired keys when a sweep is due."""
        now = self._time()
        if now >= self._next_sweep:
            self._data = {k: v for k, v in self._data.items() if v[1] > now}
            self._next_sweep = now + self._sweep_interval_s
        return now
