"""`RedisStore`: state in Redis, shared by every worker of every machine.

(Being implemented: see the Store protocol in `_base.py`.)
"""

from __future__ import annotations

from .._clock import Clock

__all__ = ["RedisStore"]


class RedisStore:
    def __init__(
        self, url: str, *, clock: Clock | None = None, timeout_s: float = 0.1, prefix: str = "guards:"
    ) -> None:
        raise NotImplementedError
