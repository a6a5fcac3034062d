"""Kept streams: the events of a resumable stream, kept in the store so that a client may
resume it from any worker (`guards.streams._kept` writes and reads them).

A kept stream is one list of strings under one key (one key: on Redis Cluster, one slot), each
item one Server-Sent Event, appended in order by the one worker that produces the stream, read
from any position by any worker. `StreamKeeper` is what a store implements for it (the three
built-in stores do; a store of your own may, for routes declared `resumable`):

- `kept_append(key, items, at=n, ttl_s=...)`: append `items` if the list holds exactly `n`
  items now (a list that expired, or was evicted, is never made again from its middle: the
  append answers False, and the producer stops keeping), and keep the list `ttl_s` from now;
- `kept_read(key, start, count)`: the list's length and its items `start` to `start + count -
  1` (fewer at the end), or None when there is no such list (never kept, or expired);
- `kept_wait(key, length, timeout_s)`: return once the list may hold more than `length` items,
  or after `timeout_s`: at once in memory, by a bounded poll elsewhere;
- `kept_set(name, value, ttl_s)`, `kept_get(name)`: a name pointing at a stream (a chat's
  current stream), kept `ttl_s`.

`MemoryKept` is the in-memory implementation (`MemoryStore`'s): bounded by `max_lists` lists
(the oldest written go first) besides every list's expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["POLL_S", "MemoryKept", "StreamKeeper"]

#: How often a store that cannot wake its readers (SQLite, Redis) looks again for new items.
POLL_S = 0.05


@runtime_checkable
class StreamKeeper(Protocol):
    """A store that keeps resumable streams (see the module docstring). Each operation raises
    `StoreUnavailable` when the store cannot be reached, like every store operation."""

    async def kept_append(self, key: str, items: Sequence[str], *, at: int, ttl_s: float) -> bool: ...
    async def kept_read(self, key: str, start: int, count: int) -> tuple[int, list[str]] | None: ...
    async def kept_wait(self, key: str, length: int, timeout_s: float) -> None: ...
    async def kept_set(self, name: str, value: str, *, ttl_s: float) -> None: ...
    async def kept_get(self, name: str) -> str | None: ...


class _List:
    __slots__ = ("expires", "grown", "items")

    def __init__(self) -> None:
        self.items: list[str] = []
        self.expires = 0.0
        self.grown = asyncio.Event()


class MemoryKept:
    """Kept streams in this process's memory, on `time` (the store's clock)."""

    def __init__(self, time: Callable[[], float], max_lists: int = 10_000) -> None:
        self._time = time
        self._max_lists = max_lists
        self._lists: dict[str, _List] = {}
        self._names: dict[str, tuple[str, float]] = {}

    def _live(self, key: str) -> _List | None:
        kept = self._lists.get(key)
        if kept is not None and kept.expires <= self._time():
            del self._lists[key]
            return None
        return kept

    async def kept_append(self, key: str, items: Sequence[str], *, at: int, ttl_s: float) -> bool:
        kept = self._live(key)
        if kept is None:
            if at != 0:
                return False
            kept = _List()
        elif len(kept.items) != at:
            return False
        self._lists.pop(key, None)  # written again: the newest
        self._lists[key] = kept
        kept.items.extend(items)
        kept.expires = self._time() + ttl_s
        kept.grown.set()
        kept.grown = asyncio.Event()
        now = self._time()
        while len(self._lists) > self._max_lists or next(iter(self._lists.values())).expires <= now:
            del self._lists[next(iter(self._lists))]
        return True

    async def kept_read(self, key: str, start: int, count: int) -> tuple[int, list[str]] | None:
        kept = self._live(key)
        return None if kept is None else (len(kept.items), kept.items[start : start + count])

    async def kept_wait(self, key: str, length: int, timeout_s: float) -> None:
        kept = self._live(key)
        if kept is None or len(kept.items) > length:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(kept.grown.wait(), timeout_s)

    async def kept_set(self, name: str, value: str, *, ttl_s: float) -> None:
        now = self._time()
        self._names.pop(name, None)  # written again: the newest
        self._names[name] = (value, now + ttl_s)
        names = self._names
        while len(names) > self._max_lists or next(iter(names.values()))[1] <= now:
            del names[next(iter(names))]

    async def kept_get(self, name: str) -> str | None:
        found = self._names.get(name)
        return None if found is None or found[1] <= self._time() else found[0]

    def clear(self) -> None:
        self._lists.clear()
        self._names.clear()
