"""Where budget counters, spend, breaker state, cooldowns and multi-step tasks live."""

from ._base import (
    DAILY_TTL_S,
    MAX_KEY_CHARS,
    Admission,
    BreakerDecision,
    BreakerState,
    Charge,
    Health,
    Outcome,
    Passage,
    Report,
    SpendReservation,
    Step,
    Store,
    StoreUnavailable,
    TaskClaim,
    TaskStatus,
    bounded_key,
    utc_day,
)
from ._memory import MemoryStore
from ._redis import RedisStore
from ._sqlite import SQLiteStore
from ._url import open_store

__all__ = [
    "DAILY_TTL_S",
    "MAX_KEY_CHARS",
    "Admission",
    "BreakerDecision",
    "BreakerState",
    "Charge",
    "Health",
    "MemoryStore",
    "Outcome",
    "Passage",
    "RedisStore",
    "Report",
    "SQLiteStore",
    "SpendReservation",
    "Step",
    "Store",
    "StoreUnavailable",
    "TaskClaim",
    "TaskStatus",
    "bounded_key",
    "open_store",
    "utc_day",
]
