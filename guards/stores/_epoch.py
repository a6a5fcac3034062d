"""`Epoch`: how a worker notices that its shared store forgot its state.

A shared store keeps one marker that never expires: an id made when the marker is found
missing (a new store, or one that lost its data: a flush, a restart without persistence, an
empty replica promoted, keys evicted under memory pressure, a SQLite file replaced by an empty
one). The operations that check it (`RedisStore`: every `step` and `task_claim`, inside their
script; `SQLiteStore`: every transaction) read the marker with the rest of their work, remake
it when it is missing, and hand the worker the id they found when it is not the one the
worker knows: no extra round trip, and nothing more on the usual path than the read.

A worker (one store object) that knew an id and finds another warns once and counts it
(`store_reset`, `guards_store_reset_total`): each worker once per reset, whichever of them
remade the marker, and again at the next reset. A worker that knew none yet (its first
operation) learns the id silently: it cannot tell a new store from one that forgot before it
started, and it lost nothing it had seen. `MemoryStore` cannot forget while its process lives,
and has no marker.
"""

from __future__ import annotations

import threading
import time

from .._log import emit_warning
from .._metrics import STORE_RESETS

__all__ = ["Epoch"]

#: What each store's warning says was lost, and what to set so it does not happen again.
_DETAIL = {
    "redis": "the store's epoch marker was gone: Redis lost its data (FLUSHALL/FLUSHDB, a restart "
    "without persistence, a replica promoted without the data, or keys evicted). Daily caps, spend, "
    "breakers, cooldowns and tasks started over. Set appendonly yes and maxmemory-policy noeviction",
    "sqlite": "the store's epoch marker was gone: the database file was replaced by an empty one or "
    "its tables emptied. Daily caps, spend, breakers, cooldowns and tasks started over",
}


class Epoch:
    """The epoch a worker last saw in its store (`known`, "" before the first), and the resets
    it noticed (`resets`; `last_reset_at`: when the last was noticed, this worker's clock)."""

    __slots__ = ("_lock", "_store", "known", "last_reset_at", "resets")

    def __init__(self, store: str) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.known = ""
        self.resets = 0
        self.last_reset_at: float | None = None

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
            emit_warning("store_reset", store=self._store, resets=self.resets, detail=_DETAIL[self._store])
            STORE_RESETS.labels(store=self._store).inc()
