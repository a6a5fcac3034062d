"""`SQLiteStore`: state in one SQLite file, shared by the workers of one machine.

(Being implemented: see the Store protocol in `_base.py`.)
"""

from __future__ import annotations

from pathlib import Path

from .._clock import Clock

__all__ = ["SQLiteStore"]


class SQLiteStore:
    def __init__(self, path: str | Path, *, clock: Clock | None = None, timeout_s: float = 0.1) -> None:
        raise NotImplementedError
