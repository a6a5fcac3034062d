"""Where budget counters, spend and breaker state live."""

from ._base import (
    Admission,
    BreakerDecision,
    BreakerState,
    Outcome,
    SpendReservation,
    Store,
    StoreUnavailable,
)
from ._memory import MemoryStore
from ._redis import RedisStore
from ._sqlite import SQLiteStore
from ._url import open_store

__all__ = [
    "Admission",
    "BreakerDecision",
    "BreakerState",
    "MemoryStore",
    "Outcome",
    "RedisStore",
    "SQLiteStore",
    "SpendReservation",
    "Store",
    "StoreUnavailable",
    "open_store",
]
