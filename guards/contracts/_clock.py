"""Wall-clock time, injectable so tests advance time instead of waiting."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """Seconds since the Unix epoch (UTC). Budgets key their days by it; breakers time by it."""

    def time(self) -> float: ...


class SystemClock:
    """The real wall clock."""

    def time(self) -> float:
        return time.time()
