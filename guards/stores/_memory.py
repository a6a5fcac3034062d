"""`MemoryStore`: state in this process's memory.

Atomicity: every method does all its work synchronously, with no `await` between reading and
writing a key, so on one event loop no other task can interleave. Not shared between workers.

Bounded: every key has an expiry; expired keys are ignored on read and swept out in full at most
once per `sweep_interval_s`, so memory holds only keys live within their TTL. Last good answers
(user data, one per distinct question) are also capped in number: past `max_answers`, the oldest
stored goes first.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..contracts._clock import Clock, SystemClock
from ._base import (
    ADMITTED,
    DAILY_TTL_S,
    DAY_S,
    MAX_KEY_CHARS,
    MINUTE_S,
    Admission,
    Charge,
    Health,
    Passage,
    SpendReservation,
    Step,
    StoredAnswer,
    TaskClaim,
    TaskStatus,
    bounded_key,
    utc_day,
)
from ._breaker import CLOSED, Breaker, BreakerDecision, BreakerState, Outcome, keep_s
from ._breaker import admit as breaker_admit
from ._breaker import record as breaker_record
from ._kept import MemoryKept
from ._limits import charge_with_more, near_scopes
from ._step import first_admitted, plainly_admitted, run_step
from ._task import TaskRecord, new_lease, refusal

__all__ = ["MemoryStore"]


class MemoryStore:
    """A `Store` in process memory: exact for one process (one uvicorn worker). It keeps at most
    `max_answers` last good answers and `max_streams` resumable streams (the oldest stored go
    first)."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        sweep_interval_s: float = 60.0,
        max_answers: int = 10_000,
        max_streams: int = 10_000,
    ) -> None:
        self._clock = clock or SystemClock()
        # The system clock's `time` is `time.time` itself: one Python call less per operation.
        self._time = time.time if type(self._clock) is SystemClock else self._clock.time
        self._data: dict[str, tuple[Any, float]] = {}
        #: Each budget key's rate and daily count, in one record (see `_Budget`).
        self._budgets: dict[str, _Budget] = {}
        self._sweep_interval_s = sweep_interval_s
        self._next_sweep = 0.0
        self._state = _State(self)
        #: Last good answers: key -> (value, stored at, expires at), oldest stored first.
        self._answers: dict[str, tuple[str, float, float]] = {}
        self._max_answers = max_answers
        #: Each task owner's live tasks: owner -> {task key: expires at}, oldest first.
        self._owners: dict[str, dict[str, float]] = {}
        #: Resumable streams' events (`guards.stores._kept`).
        self._kept = MemoryKept(self._time, max_streams)
        self.kept_append = self._kept.kept_append
        self.kept_read = self._kept.kept_read
        self.kept_wait = self._kept.kept_wait
        self.kept_set = self._kept.kept_set
        self.kept_get = self._kept.kept_get

    def __len__(self) -> int:
        """Live keys (expired ones may linger until the next sweep; they are not counted). A
        budget's rate and daily count are two keys, as a shared store keeps them."""
        now = self._clock.time()
        live = sum(1 for _, expires in self._data.values() if expires > now)
        live += sum((b.rate_until > now) + (b.day_until > now) for b in self._budgets.values())
        live += sum(1 for tasks in self._owners.values() if any(e > now for e in tasks.values()))
        return live + sum(1 for _, _, expires in self._answers.values() if expires > now)

    @property
    def clock(self) -> Clock:
        """The clock the store reads its time from (`now`)."""
        return self._clock

    async def now(self) -> float:
        return self._clock.time()

    def charge_now(self, charge: Charge) -> Admission | None:
        """Pay `charge` at once, synchronously (every limit or none): the refusal, or None when
        charged. Its spend, if any, counts at its full amount for the UTC day (settled at
        once, never held). What a budget's share uses while its shared store is down
        (`Budget(on_store_failure="local")`)."""
        now = self._tick()
        refusal, reservation = self._state.charge(charge, now)
        if reservation is not None and charge.spend is not None:
            self._state.settle(charge.key, reservation, charge.spend, now)
        return refusal

    async def charge_budget(self, key: str, *, per_minute: int | None, per_day: int | None) -> Admission:
        now = self._tick()
        refusal, _ = self._state.charge(Charge(key=key, per_minute=per_minute, per_day=per_day), now)
        return refusal or ADMITTED

    async def reserve_spend(self, key: str, *, amount: float, cap: float, hold_s: float) -> SpendReservation:
        now = self._tick()
        refusal, reservation = self._state.charge(
            Charge(key=key, spend=amount, spend_cap=cap, hold_s=hold_s), now
        )
        if refusal is not None:
            return SpendReservation(False, retry_after_s=refusal.retry_after_s)
        return SpendReservation(True, reservation)

    async def settle_spend(self, key: str, reservation: str, *, actual: float) -> None:
        self._state.settle(key, reservation, actual, self._tick())

    async def spent(self, key: str) -> float:
        """Settled spend of the current UTC day under `key` (for dashboards and tests)."""
        now = self._tick()
        return float(self._get(f"{bounded_key(key)}:spend:{utc_day(now)}", now, ((0.0, {}), 0.0))[0][0])

    async def breaker_admit(self, key: str, policy: Breaker) -> BreakerDecision:
        now = self._tick()
        before = self._state.breaker(key, now)
        state, decision = breaker_admit(before, policy, now)
        if state is not before:  # an open breaker's refusal, a closed one's admission: no write
            self._state.put_breaker(key, state, policy, now)
        return decision

    async def breaker_record(
        self, key: str, policy: Breaker, outcome: Outcome, *, probe: float | None
    ) -> BreakerState:
        now = self._tick()
        before = self._state.breaker(key, now)
        state = breaker_record(before, policy, now, outcome, probe=probe)
        if state is not before:
            self._state.put_breaker(key, state, policy, now)
        return state

    async def cooldowns(self, keys: Sequence[str]) -> tuple[float, ...]:
        return self._state.cooldowns(keys, self._tick())

    async def start_cooldown(self, key: str, seconds: float) -> None:
        self._state.start_cooldown(key, seconds, self._tick())

    async def step(self, step: Step) -> Passage:
        now = self._time()  # `_tick`, inline: every request's path
        if now >= self._next_sweep:
            self._sweep(now)
        legs = step.legs
        if step.report is None and legs:
            # The usual admission, decided without `run_step`'s general walk: no leg cooling
            # down and the first leg's breaker closed with no failure counted (no key at all),
            # so it is admitted at once, as `run_step` would (a closed breaker's admission
            # writes nothing). Anything else takes the general walk.
            data = self._data
            for cooldown_key, _ in legs:
                item = data.get(cooldown_key)
                if (item is not None and item[1] > now) or len(cooldown_key) > MAX_KEY_CHARS:
                    break
            else:
                breaker_key = legs[0][1]
                item = data.get(breaker_key)
                if (item is None or item[1] <= now) and len(breaker_key) <= MAX_KEY_CHARS:
                    # Only the charge remains to decide (the common answer is shared).
                    charge = step.charge
                    refusal, reservation = (None, None) if charge is None else self._state.charge(charge, now)
                    if (  # (one call less: every request)
                        refusal is None
                        and reservation is None
                        and (charge is None or (more := charge.more) is None or not more.watched)
                    ):
                        return plainly_admitted(len(legs), step.breaker is not None)
                    near = () if charge is None or refusal else near_scopes(self._state, charge, now)
                    return first_admitted(len(legs), step.breaker is not None, refusal, reservation, near)
        return run_step(self._state, step, now)

    async def put_answer(self, key: str, value: str, *, ttl_s: float) -> None:
        now = self._tick()
        answers, key = self._answers, bounded_key(key)
        answers.pop(key, None)  # stored again: the newest
        if ttl_s > 0:
            answers[key] = (value, now, now + ttl_s)
        while len(answers) > self._max_answers:
            del answers[next(iter(answers))]

    async def get_answer(self, key: str, *, max_age_s: float) -> StoredAnswer | None:
        now = self._tick()
        item = self._answers.get(bounded_key(key))
        if item is None or item[2] <= now or now - item[1] >= max_age_s:
            return None
        return StoredAnswer(item[0], now - item[1])

    async def health(self, legs: Sequence[tuple[str, str]]) -> Health:
        now, state = self._tick(), self._state
        breakers = tuple(state.breaker(breaker_key, now) for _, breaker_key in legs)
        return Health(now, breakers, state.cooldowns([cooldown_key for cooldown_key, _ in legs], now))

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
        now = self._tick()
        task = self._task(key, now)
        refused = refusal(task[0] if task is not None else None, fingerprint, now)
        if refused is not None:
            return refused
        if task is None:
            key = bounded_key(key)
            if owner is not None:
                owner = bounded_key(owner)
                live = self._live_tasks(owner, now)
                if max_live is not None and len(live) >= max_live:
                    return TaskClaim(TaskStatus.full, retry_after_s=min(live.values()) - now)
                live.pop(key, None)
                live[key] = now + ttl_s
            task = (TaskRecord(fingerprint, now + ttl_s, owner=owner or ""), {})
            self._data[key] = (task, now + ttl_s)
        record, steps = task
        record.lease, record.lease_until = new_lease(), now + lease_s
        return TaskClaim(TaskStatus.claimed, record.lease, dict(steps))

    async def task_save(self, key: str, lease: str, name: str, value: str, *, lease_s: float) -> bool:
        now = self._tick()
        task = self._task(key, now)
        if task is None or task[0].lease != lease or task[0].response is not None:
            return False
        task[0].lease_until = now + lease_s
        task[1][name] = value
        return True

    async def task_complete(self, key: str, lease: str, response: str) -> bool:
        task = self._task(key, self._tick())
        if task is None or task[0].lease != lease or task[0].response is not None:
            return False
        record, steps = task
        record.response, record.lease, record.lease_until = response, "", 0.0
        steps.clear()
        return True

    async def task_release(self, key: str, lease: str) -> None:
        task = self._task(key, self._tick())
        if task is not None and task[0].lease == lease:
            task[0].lease, task[0].lease_until = "", 0.0

    async def task_drop(self, key: str, lease: str) -> None:
        now = self._tick()
        task = self._task(key, now)
        if task is None or task[0].lease != lease:
            return
        record, steps = task
        if steps or record.response is not None:
            record.lease, record.lease_until = "", 0.0
            return
        key = bounded_key(key)
        del self._data[key]
        live = self._owners.get(record.owner)
        if live is not None:
            live.pop(key, None)
            if not live:
                del self._owners[record.owner]

    async def aclose(self) -> None:
        self._kept.clear()
        self._data.clear()
        self._budgets.clear()
        self._answers.clear()
        self._owners.clear()

    def _live_tasks(self, owner: str, now: float) -> dict[str, float]:
        """`owner`'s live tasks (made when missing), the expired ones dropped: the oldest
        first, as a route's tasks share one TTL (one expiring out of order only counts a
        little longer)."""
        live = self._owners.get(owner)
        if live is None:
            live = self._owners[owner] = {}
        while live:
            oldest = next(iter(live))
            if live[oldest] > now:
                break
            del live[oldest]
        return live

    def _task(self, key: str, now: float) -> tuple[TaskRecord, dict[str, str]] | None:
        """The live task under `key` (its record and saved steps, changed in place), or None."""
        item = self._data.get(bounded_key(key))
        if item is None or item[1] <= now:
            return None
        task: tuple[TaskRecord, dict[str, str]] = item[0]
        return task

    def _get(self, key: str, now: float, default: tuple[Any, float]) -> tuple[Any, float]:
        item = self._data.get(key)
        if item is None or item[1] <= now:
            return default
        return item

    def _tick(self) -> float:
        """The store's time now, after sweeping out expired keys when a sweep is due."""
        now = self._time()
        if now >= self._next_sweep:
            self._sweep(now)
        return now

    def _sweep(self, now: float) -> None:
        self._data = {k: v for k, v in self._data.items() if v[1] > now}
        self._budgets = {k: b for k, b in self._budgets.items() if b.rate_until > now or b.day_until > now}
        self._answers = {k: v for k, v in self._answers.items() if v[2] > now}
        owners = {}
        for owner, tasks in self._owners.items():
            live = {k: expires for k, expires in tasks.items() if expires > now}
            if live:
                owners[owner] = live
        self._owners = owners
        self._next_sweep = now + self._sweep_interval_s


#: What `_State.charge` answers when a charge passes without holding spend.
_PASSED: tuple[None, None] = (None, None)


class _Budget:
    """A budget key's rate window and daily count, kept as one record: a charge finds both with
    one lookup of the key itself, and updates them in place (no key names to build per charge).
    The rate part lives until a minute after its last admission (`rate_until`); the daily count
    counts the UTC day number `day` and lives `DAILY_TTL_S` from that day's first unit."""

    __slots__ = ("count", "day", "day_until", "rate_until", "stamps")

    def __init__(self) -> None:
        #: Admissions in the last minute, oldest first (None until the first: a daily count
        #: alone needs no deque, which is most of a record's memory).
        self.stamps: deque[float] | None = None
        self.rate_until = 0.0
        self.day = -1.0
        self.count = 0
        self.day_until = 0.0


class _State:
    """The primitives of a step (see `guards.stores._step`) on a memory store's data. Each
    runs synchronously: no other task interleaves."""

    __slots__ = ("_store",)

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    def cooldowns(self, keys: Sequence[str], now: float) -> tuple[float, ...]:
        data = self._store._data
        waits = []
        for key in keys:
            item = data.get(bounded_key(key))  # (until, until): a cooldown's value is its expiry
            waits.append(0.0 if item is None or item[1] <= now else max(0.0, item[0] - now))
        return tuple(waits)

    def start_cooldown(self, key: str, seconds: float, now: float) -> None:
        key = bounded_key(key)
        until = max(now + seconds, self._store._get(key, now, (now, 0.0))[0])
        if until > now:
            self._store._data[key] = (until, until)

    def breaker(self, key: str, now: float) -> BreakerState:
        item = self._store._data.get(bounded_key(key))
        return item[0] if item is not None and item[1] > now else CLOSED

    def put_breaker(self, key: str, state: BreakerState, policy: Breaker, now: float) -> None:
        key = bounded_key(key)
        # `is` first: the usual closed state is CLOSED itself, and comparing field by field costs.
        if state is CLOSED or state == CLOSED:
            self._store._data.pop(key, None)  # a healthy breaker needs no key at all
        else:
            self._store._data[key] = (state, now + keep_s(state, policy))

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
        store, key = self._store, charge.key
        if len(key) > MAX_KEY_CHARS:
            key = bounded_key(key)
        budget = store._budgets.get(key)
        refusal: Admission | None = None
        per_minute, per_day = charge.per_minute, charge.per_day
        if per_minute is not None and budget is not None and (stamps := budget.stamps) is not None:
            horizon = now - MINUTE_S
            while stamps and stamps[0] <= horizon:  # each stamp leaves once: amortized O(1)
                stamps.popleft()
            if len(stamps) >= per_minute:
                # Room comes back when the `per_minute`-th most recent admission leaves the window.
                refusal = Admission(False, "per_minute", stamps[-per_minute] + MINUTE_S - now)
        day = now // DAY_S
        if per_day is not None:
            count = budget.count if budget is not None and budget.day == day and budget.day_until > now else 0
            if count >= per_day:
                next_day = DAY_S - now % DAY_S  # until the next UTC midnight
                # Both spent: name the limit that frees up last, so Retry-After is honest.
                if refusal is None or next_day > (refusal.retry_after_s or 0.0):
                    refusal = Admission(False, "per_day", next_day)
        spend: tuple[str, float, dict[str, tuple[float, float]]] | None = None
        if charge.spend is not None:
            spend_key = f"{key}:spend:{utc_day(now)}"
            settled, holds = store._get(spend_key, now, ((0.0, {}), 0.0))[0]
            live_holds = {rid: hold for rid, hold in holds.items() if hold[1] > now}
            spend = (spend_key, settled, live_holds)
            over = (
                settled + sum(amount for amount, _ in live_holds.values()) + charge.spend > charge.spend_cap
            )
            next_day = DAY_S - now % DAY_S
            if over and (refusal is None or next_day > (refusal.retry_after_s or 0.0)):
                refusal = Admission(False, "spend_per_day", next_day)
        if refusal is not None or dry:
            return refusal, None
        if per_day is not None or per_minute is not None:
            if budget is None:
                budget = store._budgets[key] = _Budget()
            if per_day is not None:
                if budget.day != day or budget.day_until <= now:  # a new day's count
                    budget.day, budget.count, budget.day_until = day, 0, now + DAILY_TTL_S
                budget.count += 1
            if per_minute is not None:
                if budget.stamps is None:
                    budget.stamps = deque()
                budget.stamps.append(now)
                budget.rate_until = now + MINUTE_S
        if spend is None:
            return _PASSED
        assert charge.spend is not None
        reservation = reservation or os.urandom(8).hex()
        spend[2][reservation] = (charge.spend, now + charge.hold_s)
        store._data[spend[0]] = ((spend[1], spend[2]), now + DAILY_TTL_S)
        return None, reservation

    def settle(self, key: str, reservation: str, actual: float, now: float) -> None:
        store = self._store
        day_key = f"{bounded_key(key)}:spend:{utc_day(now)}"
        (settled, holds), expires = store._get(day_key, now, ((0.0, {}), now + DAILY_TTL_S))
        holds = {rid: hold for rid, hold in holds.items() if rid != reservation and hold[1] > now}
        store._data[day_key] = ((settled + actual, holds), expires)

    # The primitives of `_limits` (monthly counts, held counters), in `_data`: a count is an
    # int, a held counter (settled, {reservation: (amount, until)}), each with its expiry.

    def count(self, key: str, now: float) -> int:
        return int(self._store._get(key, now, (0, 0.0))[0])

    def add_count(self, key: str, ttl_s: float, now: float) -> None:
        count, expires = self._store._get(key, now, (0, now + ttl_s))
        self._store._data[key] = (count + 1, expires)

    def holds(self, key: str, now: float) -> tuple[float, list[tuple[float, float]]]:
        settled, holds = self._store._get(key, now, ((0.0, {}), 0.0))[0]
        return settled, [hold for hold in holds.values() if hold[1] > now]

    def hold(self, key: str, reservation: str, amount: float, until: float, ttl_s: float, now: float) -> None:
        settled, holds = self._store._get(key, now, ((0.0, {}), 0.0))[0]
        holds = {rid: hold for rid, hold in holds.items() if hold[1] > now}
        holds[reservation] = (amount, until)
        self._store._data[key] = ((settled, holds), now + ttl_s)

    def settle_hold(self, key: str, reservation: str, actual: float, ttl_s: float, now: float) -> None:
        (settled, holds), expires = self._store._get(key, now, ((0.0, {}), now + ttl_s))
        holds = {rid: hold for rid, hold in holds.items() if rid != reservation and hold[1] > now}
        self._store._data[key] = ((settled + actual, holds), expires)

    def replace_hold(self, key: str, reservation: str, actual: float, now: float) -> None:
        item = self._store._get(key, now, ((0.0, {}), 0.0))
        held = item[0][1].get(reservation)
        if held is not None and held[1] > now:
            item[0][1][reservation] = (actual, held[1])

    # The primitives of `_share` (a shared limit's minute): a hash is a dict, with its expiry.

    def hash_all(self, key: str, now: float) -> dict[str, str]:
        # (Never changed in place: `hash_put` and `hash_pop` replace the dict.)
        fields: dict[str, str] = self._store._get(key, now, ({}, 0.0))[0]
        return fields

    def hash_put(self, key: str, name: str, value: str, ttl_s: float, now: float) -> None:
        fields, expires = self._store._get(key, now, ({}, now + ttl_s))
        self._store._data[key] = ({**fields, name: value}, expires)

    def hash_pop(self, key: str, name: str, now: float) -> str | None:
        fields, expires = self._store._get(key, now, ({}, 0.0))
        if name not in fields:
            return None
        fields = dict(fields)
        value: str = fields.pop(name)
        self._store._data[key] = (fields, expires)
        return value
