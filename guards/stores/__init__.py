"""Where budget counters, spend, breaker state, cooldowns, last good answers and multi-step
tasks live.

`SQLiteStore` and `RedisStore` are imported on first use: `sqlite3`, and Redis's protocol
library (hiredis, the extra `route-guards[redis]`), are loaded only by an app that uses them.
"""

from typing import TYPE_CHECKING, Any

from ._base import (
    DAILY_TTL_S,
    MAX_KEY_CHARS,
    SHARE_TENANTS_CAP,
    TOKEN_WINDOW_CAP,
    Admission,
    BreakerDecision,
    BreakerState,
    Charge,
    Health,
    MoreLimits,
    Outcome,
    Passage,
    Report,
    Share,
    SpendReservation,
    Step,
    Store,
    StoredAnswer,
    StoreUnavailable,
    TaskClaim,
    TaskStatus,
    bounded_key,
    utc_day,
)
from ._kept import StreamKeeper
from ._memory import MemoryStore
from ._url import open_store

if TYPE_CHECKING:
    from ._redis import RedisStore
    from ._sqlite import SQLiteStore

__all__ = [
    "DAILY_TTL_S",
    "MAX_KEY_CHARS",
    "SHARE_TENANTS_CAP",
    "TOKEN_WINDOW_CAP",
    "Admission",
    "BreakerDecision",
    "BreakerState",
    "Charge",
    "Health",
    "MemoryStore",
    "MoreLimits",
    "Outcome",
    "Passage",
    "RedisStore",
    "Report",
    "SQLiteStore",
    "Share",
    "SpendReservation",
    "Step",
    "Store",
    "StoreUnavailable",
    "StoredAnswer",
    "StreamKeeper",
    "TaskClaim",
    "TaskStatus",
    "bounded_key",
    "open_store",
    "utc_day",
]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from ._redis import RedisStore

        return RedisStore
    if name == "SQLiteStore":
        from ._sqlite import SQLiteStore

        return SQLiteStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
