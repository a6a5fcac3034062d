"""`RedisStore`: state in Redis, shared by every worker of every machine. One round trip per
operation: each operation is one `EVALSHA` of the store's Lua script (`_scripts`), which does
the whole check-and-charge atomically on the server (the requests' steps of one loop turn share
one EVALSHA, the script's `steps`: `Connections.step`); the one multi-key operation,
`cooldowns(keys)`, is one `EVALSHA` per key (each touching its own key only: on Redis Cluster
each key is in a slot of its own, and a multi-key script would be a cross-slot error), all sent
in one pipeline: still one round trip for a whole fallback chain, though not one transaction
across keys (each key's answer is exact at its own instant, microseconds apart, which a
fallback chain's choice does not notice). The store is put together from its parts: its keys
(`_keys`), its connections, one per event loop (`_connection`, over `_protocol` and
`_address`), its checks of the server's settings (`_checks`), its steps' arguments
(`_planner`) and, on Redis Cluster, its operations split per slot (`_slots`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from ...contracts._clock import Clock
from .._base import (
    ADMITTED,
    Admission,
    Health,
    Passage,
    SpendReservation,
    Step,
    StoredAnswer,
    TaskClaim,
)
from .._breaker import Breaker, BreakerDecision, BreakerState, Outcome
from .._cluster import key_slot
from .._epoch import Epoch
from .._kept import POLL_S
from .._step import plainly_admitted
from .._task import new_lease
from ._address import Address
from ._checks import Checks
from ._connection import Connections
from ._keys import Keys
from ._planner import Planner, decision_of, passage, policy_args, state_of, task_claim_of
from ._protocol import packed
from ._scripts import KEPT_SCRIPT, now_arg, num, pack
from ._slots import Slots

__all__ = ["RedisStore"]


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


class RedisStore:
    """A `Store` in Redis: exact across every worker and machine sharing the server.

    `url`: `redis://[[user]:password@]host:port/db`, `rediss://...` (TLS),
    `unix:///path/to/socket?db=n`, `redis+sentinel://...` or `redis+cluster://host:port,...`,
    with the options `Address` lists. `clock`: tests only (by default the time is Redis').
    `timeout_s` bounds every round trip. `prefix` starts every key (no `{` or `}` in it: hash
    tags are the store's): by default the URL's `prefix` option
    (`redis://host:6379/0?prefix=billing:`), else `guards:`. Apps that share one Redis share
    the state of what they name alike (a model's breaker and cooldown, a budget of the same
    scope and caller); a prefix of their own keeps them apart.
    """

    def __init__(
        self, url: str, *, clock: Clock | None = None, timeout_s: float = 0.1, prefix: str | None = None
    ) -> None:
        address = Address.parse(url)
        prefix = prefix if prefix is not None else address.prefix or "guards:"
        if "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix must not contain '{' or '}' (the store's hash tags)")
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        self._clock = clock
        self._prefix = prefix
        self._cluster = bool(address.cluster)
        keys = Keys(prefix, self._cluster)
        self._key = keys.key
        self._epoch_key = keys.epoch
        self._epoch = Epoch("redis")
        self._checks = Checks(self._epoch)
        self._connections = Connections(address, timeout_s, self._checks)
        self._planner = Planner(keys)
        #: On Redis Cluster: its operations split per slot.
        self._slots = (
            Slots(keys, self._planner, self._connections, self._epoch, clock) if self._cluster else None
        )

    def __repr__(self) -> str:
        return f"RedisStore(prefix={self._prefix!r})"  # never the URL: it may carry a password

    @property
    def cluster(self) -> bool:
        """Whether the store is on Redis Cluster (`redis+cluster://`, `rediss+cluster://`)."""
        return self._cluster

    @property
    def epoch(self) -> Epoch:
        """The store's epoch as this worker knows it, and the resets it noticed (see
        docs/stores.md, "When the store forgets")."""
        return self._epoch

    # --- the Store operations ---------------------------------------------------------------

    @property
    def clock(self) -> Clock | None:
        """The clock the store's time comes from, when one was given (tests); None: the
        server's (Redis `TIME`)."""
        return self._clock

    async def now(self) -> float:
        if self._clock is not None:
            return self._clock.time()
        reply = await self._run("now", [])
        return float(reply[0])

    async def charge_budget(self, key: str, *, per_minute: int | None, per_day: int | None) -> Admission:
        if per_minute is None and per_day is None:
            return ADMITTED  # nothing to check, nothing to charge
        tag = self._key(key)
        reply = await self._run("budget", [tag + ":window", tag + ":day:"], num(per_minute), num(per_day))
        if not reply:
            return ADMITTED
        return Admission(False, str(reply[0]), float(reply[1]))

    async def reserve_spend(self, key: str, *, amount: float, cap: float, hold_s: float) -> SpendReservation:
        reservation = os.urandom(8).hex()
        reply = await self._run(
            "reserve",
            [self._key(key) + ":spend:"],
            num(amount),
            num(cap),
            num(hold_s),
            reservation,
        )
        if not reply:
            return SpendReservation(True, reservation)
        return SpendReservation(False, retry_after_s=float(reply[0]))

    async def settle_spend(self, key: str, reservation: str, *, actual: float) -> None:
        await self._run("settle", [self._key(key) + ":spend:"], reservation, num(actual))

    async def spent(self, key: str) -> float:
        reply = await self._run("spent", [self._key(key) + ":spend:"])
        return float(reply[0])

    async def breaker_admit(self, key: str, policy: Breaker) -> BreakerDecision:
        return decision_of(await self._run("admit", [self._key(key) + ":breaker"], *policy_args(policy)))

    async def breaker_record(
        self, key: str, policy: Breaker, outcome: Outcome, *, probe: float | None
    ) -> BreakerState:
        reply = await self._run(
            "record",
            [self._key(key) + ":breaker"],
            *policy_args(policy),
            Outcome(outcome).value,
            num(probe),
        )
        return state_of(reply)

    async def cooldowns(self, keys: Sequence[str]) -> tuple[float, ...]:
        if not keys:
            return ()
        now = now_arg(self._clock)
        # One EVALSHA per key, all written in this turn: one round trip.
        replies = await asyncio.gather(
            *(self._connections.call(*self._cooldown_read(key, now)) for key in keys)
        )
        return tuple(float(reply[0]) for reply in replies)

    async def start_cooldown(self, key: str, seconds: float) -> None:
        if not seconds > 0:
            return  # nothing to start, and a running cooldown is never shortened
        await self._run("cool", [self._key(key) + ":cooldown"], num(seconds))

    async def put_answer(self, key: str, value: str, *, ttl_s: float) -> None:
        await self._run("put_answer", [self._key(key) + ":answer"], value, num(ttl_s))

    async def get_answer(self, key: str, *, max_age_s: float) -> StoredAnswer | None:
        reply = await self._run("get_answer", [self._key(key) + ":answer"], num(max_age_s))
        return StoredAnswer(reply[0], float(reply[1])) if reply else None

    async def step(self, step: Step) -> Passage:
        if self._slots is not None:
            return await self._slots.step(step)
        keys, args = self._planner.command(step, self._epoch.known)
        replies = await self._connections.step(keys, args, now_arg(self._clock))
        if len(replies) > 1:  # the store's epoch is not the one this worker knew
            self._epoch.found(replies[1])
        reply = replies[0]
        if reply == "P":  # the usual answer (see the script's `step`)
            return plainly_admitted(len(step.legs), step.breaker is not None)
        return passage(step, reply.split("|"))

    async def health(self, legs: Sequence[tuple[str, str]]) -> Health:
        self._checks.watch_evictions(self._connections.wires())
        if self._slots is not None:
            return await self._slots.health(legs)
        keys = [self._key(cooldown_key) + ":cooldown" for cooldown_key, _ in legs]
        keys += [self._key(breaker_key) + ":breaker" for _, breaker_key in legs]
        reply = await self._run("health", keys)
        n = len(legs)
        breakers = tuple(state_of(reply[1 + n + 10 * i : 11 + n + 10 * i]) for i in range(n))
        return Health(float(reply[0]), breakers, tuple(float(wait) for wait in reply[1 : 1 + n]))

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
        if self._slots is not None:
            return await self._slots.task_claim(key, fingerprint, lease_s, ttl_s, owner, max_live)
        keys = [self._key(key) + ":task", self._key(owner) + ":tasks" if owner is not None else ""]
        keys.append(self._epoch_key)  # last (the script's `check_epoch`)
        known = self._epoch.known
        reply = await self._run(
            "task_claim", keys, fingerprint, new_lease(), num(lease_s), num(ttl_s), num(max_live), known
        )
        return task_claim_of(reply, self._epoch, None)

    async def task_save(self, key: str, lease: str, name: str, value: str, *, lease_s: float) -> bool:
        reply = await self._run("task_save", [self._key(key) + ":task"], lease, name, value, num(lease_s))
        return reply[0] == "1"

    async def task_complete(self, key: str, lease: str, response: str) -> bool:
        reply = await self._run("task_complete", [self._key(key) + ":task"], lease, response)
        return reply[0] == "1"

    async def task_release(self, key: str, lease: str) -> None:
        await self._run("task_release", [self._key(key) + ":task"], lease)

    async def task_drop(self, key: str, lease: str) -> None:
        if not self._cluster:
            await self._run("task_drop", [self._key(key) + ":task"], lease)
            return
        owner = await self._run("task_drop", [self._key(key) + ":task"], lease, "c")
        if owner:  # the owner's set of live tasks: in another slot
            await self._run("task_untrack", owner, self._key(key) + ":task")

    # --- kept streams (`guards.stores._kept`): one EVAL of `lua/kept.lua` each ---------------

    async def kept_append(self, key: str, items: Sequence[str], *, at: int, ttl_s: float) -> bool:
        reply = await self._kept("append", key, str(at), _ms(ttl_s), *items)
        return bool(reply[0] == 1)

    async def kept_read(self, key: str, start: int, count: int) -> tuple[int, list[str]] | None:
        reply = await self._kept("read", key, str(start), str(count))
        return (int(reply[0]), reply[1:]) if reply else None

    async def kept_wait(self, key: str, length: int, timeout_s: float) -> None:
        await asyncio.sleep(min(timeout_s, POLL_S))  # a bounded poll: the reader reads again

    async def kept_set(self, name: str, value: str, *, ttl_s: float) -> None:
        await self._kept("set", name, value, _ms(ttl_s))

    async def kept_get(self, name: str) -> str | None:
        reply = await self._kept("get", name)
        return reply[0] if reply else None

    async def _kept(self, op: str, key: str, *args: str) -> list[Any]:
        redis_key = f"{self._key(key)}:kept"
        command = packed("EVAL", KEPT_SCRIPT, 1, redis_key, op, *args)
        if self._cluster:
            return await self._connections.call(command, key_slot(redis_key))
        return await self._connections.call(command)

    async def aclose(self) -> None:
        """Close the connections: this loop's now, other running loops' in their own loop.
        Connections of loops that already shut down were closed then. The store stays usable."""
        await self._connections.aclose()

    # --- machinery -------------------------------------------------------------------------

    def _cooldown_read(self, key: str, now: str) -> tuple[bytes, int | None]:
        """`cooldowns`' read of `key`: the packed script and, on a cluster, its slot."""
        redis_key = self._key(key) + ":cooldown"
        return pack("cooldown", [redis_key], now, ()), key_slot(redis_key) if self._cluster else None

    async def _run(self, op: str, keys: Sequence[str], *args: str) -> list[str]:
        """One operation: one EVALSHA of the script (on a cluster, to its first key's slot)."""
        command = pack(op, keys, now_arg(self._clock), args)
        if self._cluster:
            return await self._connections.call(command, key_slot(keys[0]) if keys else None)
        return await self._connections.call(command)
