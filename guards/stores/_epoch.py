"""`Epoch`: how a worker notices that its shared store forgot its state.

A shared store keeps one marker that never expires: an id made when the marker is found
missing (a new store, or one that lost its data: a flush, a restart without persistence, an
empty replica promoted, keys evicted under memory pressure, a SQLite file replaced by an empty
one). The operations that check it (`RedisStore`: every `step` and `task_claim`, inside their
script; `SQLiteStore`: every transaction) read the marker with the rest of their work, remake
it when it is missing, and hand the worker the id they found when it is not the one the
worker knows: no extra round trip, and nothing more on the usual path than the read.

A worker (one store object) that knew an id and finds another warns once and counts it
(`store_reset` with `cause` `marker`, `guards_store_reset_total`): each worker once per reset,
whichever of them remade the marker, and again at the next reset. A worker that knew none yet (its first
operation) learns the id silently: it cannot tell a new store from one that forgot before it
started, and it lost nothing it had seen. `MemoryStore` cannot forget while its process lives,
and has no marker.

On Redis Cluster a script reaches the keys of one hash slot only, so each slot an operation
uses keeps a marker of its own (at most 16,384, a few bytes each): a node that loses its data
loses its slots' markers with them, and a resharding moves them with their slots. A worker
knows each slot's id (`found_in`) and which of its resets it last used the slot after
(`seen_in`): a slot found reset that it had not used since the last reset it noticed is part
of that reset (a flush or a restart reaches every slot of a node at once, and each slot is
found as traffic reaches it), so a reset is warned and counted once.

Eviction is the loss the marker misses: every step reads it, so LRU seldom picks it while
traffic flows (and `volatile-*` policies never do: it has no TTL), while the keys around it go. `RedisStore` asks
the server instead how many keys it evicted (`INFO stats`, behind its `health` reads, at most
once a second per connection) and reports a rise as a reset (`evicted`, `cause` `evicted`): Redis
cannot say whose keys went, and any of them may have been a cap.
"""

from __future__ import annotations

import threading
import time

from ..observe._log import emit_warning
from ..observe._metrics import STORE_RESETS

__all__ = ["Epoch"]

#: What each store's warning says was lost, and what to set so it does not happen again.
_DETAIL = {
    "redis": "the store's epoch marker was gone: Redis lost its data (FLUSHALL/FLUSHDB, a restart "
    "without persistence, a replica promoted without the data, or keys evicted). Daily caps, spend, "
    "breakers, cooldowns and tasks started over. Set appendonly yes and maxmemory-policy noeviction",
    "sqlite": "the store's epoch marker was gone: the database file was replaced by an empty one or "
    "its tables emptied. Daily caps, spend, breakers, cooldowns and tasks started over",
}
_EVICTED = (
    "Redis evicted keys under memory pressure (INFO stats evicted_keys rose): any of guards' keys "
    "may be among them, so daily caps, spend, breakers, cooldowns and tasks may have started over. "
    "Set maxmemory-policy noeviction and enough maxmemory"
)


class Epoch:
    """The epoch a worker last saw in its store (`known`, "" before the first), and the resets
    it noticed (`resets`; `last_reset_at`: when the last was noticed, this worker's clock)."""

    __slots__ = ("_lock", "_parts", "_store", "known", "last_reset_at", "resets")

    def __init__(self, store: str) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.known = ""
        self.resets = 0
        self.last_reset_at: float | None = None
        #: Redis Cluster: per hash slot, the id this worker knows and the count of resets it
        #: had noticed when it last used the slot (see `found_in`).
        self._parts: dict[int, tuple[str, int]] = {}

    def known_in(self, part: int) -> str:
        """The id this worker knows of hash slot `part`'s marker ("" before the first)."""
        known = self._parts.get(part)
        return "" if known is None else known[0]

    def seen_in(self, part: int) -> None:
        """Redis Cluster: an operation found hash slot `part`'s marker as known."""
        known = self._parts.get(part)
        if known is not None and known[1] != self.resets:
            self._parts[part] = (known[0], self.resets)

    def found_in(self, part: int, epoch: str) -> None:
        """Redis Cluster: the marker of hash slot `part` is `epoch`, which was not the one
        known there when the operation was sent. A slot seen for the first time is learnt
        silently; a slot whose marker changed is a reset, unless the worker has not used the
        slot since the last reset it noticed (then it is part of that one)."""
        with self._lock:
            known = self._parts.get(part)
            if known is not None and epoch == known[0]:
                return
            self._parts[part] = (epoch, self.resets)
            if known is None or known[1] != self.resets:
                return
            self.resets += 1
            self.last_reset_at = time.time()
            self._parts[part] = (epoch, self.resets)
        self._warn(self.resets, "marker", _DETAIL[self._store])

    def found(self, epoch: str) -> None:
        """The store answered with marker `epoch`, which was not `known` when the operation
        was sent: a reset when this worker knew one (warned and counted once, even when
        several operations in flight bring the same news)."""
        with self._lock:  # several event loops (threads) may share the store
            if epoch == self.known:
                return
            forgot, self.known = bool(self.known), epoch
            if forgot:
                self.resets += 1
                self.last_reset_at = time.time()
        if forgot:
            self._warn(self.resets, "marker", _DETAIL[self._store])

    def evicted(self, count: int) -> None:
        """The server evicted `count` keys since this worker last asked (Redis `INFO stats`):
        a reset, warned and counted as one (they may have been guards' keys)."""
        with self._lock:
            self.resets += 1
            self.last_reset_at = time.time()
            resets = self.resets
        self._warn(resets, "evicted", _EVICTED, evicted=count)

    def _warn(self, resets: int, cause: str, detail: str, **more: int) -> None:
        emit_warning("store_reset", store=self._store, resets=resets, cause=cause, **more, detail=detail)
        STORE_RESETS.labels(store=self._store).inc()
