"""Where budget counters, spend and breaker state live."""

from ._base import (
    DAILY_TTL_S,
    Admission,
    BreakerDecision,
    BreakerState,
    Outcome,
    SpendReservation,
    Store,
    StoreUnavailable,
    utc_day,
)
from ._memory import MemoryStore
from ._redis import RedisStore
from ._sqlite import SQLiteStore
from ._url import open_store

__all__ = [
    "DAILY_TTL_S",
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
    "utc_day",
]
