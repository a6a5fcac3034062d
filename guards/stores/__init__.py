"""Where budget counters and breaker state live."""

from ._base import Admission, BreakerDecision, BreakerState, Outcome, Store
from ._memory import MemoryStore

__all__ = ["Admission", "BreakerDecision", "BreakerState", "MemoryStore", "Outcome", "Store"]
