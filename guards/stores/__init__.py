"""Where budget counters and breaker state live."""

from ._base import Admission, Store
from ._memory import MemoryStore

__all__ = ["Admission", "MemoryStore", "Store"]
