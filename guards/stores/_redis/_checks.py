"""What the store learns of its servers' settings and answers (`Checks`, one per store). At each
new connection (to each node, on a cluster) the server's `maxmemory-policy`, `maxmemory`,
`appendonly` and `save` are read (`CONFIG GET`, behind that turn's operations) and a setting
under which guards' keys can be evicted or lost is warned once (`check_settings`). Keys evicted
are noticed at run time: `INFO stats` (`evicted_keys`) behind the `health` reads, at most once
a second per connection (each primary, on a cluster), a rise reported as a store reset
(`watch_evictions`, `Epoch.evicted`). And what an error reply to an operation raises
(`refused`): a write refused for memory is said so (`store_out_of_memory`), a server that no
longer takes writes drops its connection, any other error (a script's: say, a key of ours that
another program overwrote) fails that operation alone.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

from ...observe._log import emit, emit_warning
from .._base import StoreUnavailable
from .._epoch import Epoch
from ._protocol import ReplyError, Wire, packed, reply_code

__all__ = ["Checks"]


class Checks:
    """A store's checks of its servers (see the module docstring); `epoch` is the store's,
    told of the keys evicted."""

    def __init__(self, epoch: Epoch) -> None:
        self._epoch = epoch
        #: The server settings already warned about, (setting, value): once per store each.
        self._warned: set[tuple[str, str]] = set()
        #: Operations refused for memory (OOM) since the last `store_out_of_memory` line, and
        #: when the next line may be written (monotonic).
        self._oom_count = 0
        self._oom_next = 0.0

    def refused(self, wire: Wire | None, reply: Any) -> StoreUnavailable:
        """What an error reply to an operation raises: a write refused for memory is said so
        (`store_out_of_memory`, at most one line a second, with the count since the last); a
        server that no longer takes writes (a replica: `READONLY`, or one loading its data:
        `LOADING`) drops the connection, so the next operation connects again (and, behind
        Sentinel, asks where the primary is now; on a cluster, `Cluster.send` dropped it and
        `wire` is None). Else a script error: that operation alone."""
        text = str(reply) if isinstance(reply, ReplyError) else ""
        if text.startswith("OOM") or "-OOM " in text:  # (inside a script, Redis prefixes the error)
            self._oom_count += 1
            now = time.monotonic()
            if now >= self._oom_next:
                self._oom_next = now + 1.0
                count, self._oom_count = self._oom_count, 0
                emit_warning(
                    "store_out_of_memory",
                    store="redis",
                    count=count,
                    setting="maxmemory",
                    detail="Redis refused a write: used memory is over maxmemory (maxmemory-policy "
                    "noeviction). Give Redis more memory (see docs/stores.md for the memory per key)",
                )
            return StoreUnavailable("Redis store unavailable (OOM)")
        code = reply_code(reply) if isinstance(reply, ReplyError) else "ResponseError"
        if code in ("READONLY", "LOADING", "MASTERDOWN"):
            if wire is not None:
                wire.fail(StoreUnavailable(f"Redis store unavailable ({code})"))
            return StoreUnavailable(f"Redis store unavailable ({code})")
        return StoreUnavailable("Redis store unavailable (ResponseError)")  # a script error

    def watch_evictions(self, wires: Sequence[Wire]) -> None:
        """Behind a `health` read, in the same write: ask each server this loop's connections
        reach (`wires`: each primary, on a cluster) how many keys it has evicted (`INFO stats`), at
        most once per `_EVICTIONS_EVERY_S` per connection; nothing waits for the answer. A
        count that rose since the connection's last answer is a reset (`Epoch.evicted`); a
        connection's first answer (a new server, a failover) is its baseline."""
        now = time.monotonic()
        for wire in wires:
            if wire.failure is None and now >= wire.evictions_due:
                self._ask_evictions(wire, now)

    def _ask_evictions(self, wire: Wire, now: float) -> None:
        """`INFO stats` on `wire`, its answer read by `_evictions` (also at connect, with the
        settings: the baseline)."""
        wire.evictions_due = now + _EVICTIONS_EVERY_S
        with suppress(StoreUnavailable):  # broken, or too many in flight: next time
            wire.send(_INFO_STATS).add_done_callback(functools.partial(self._evictions, wire))

    def _evictions(self, wire: Wire, reply: asyncio.Future[Any]) -> None:
        """`INFO stats` answered on `wire` (see `watch_evictions`)."""
        if reply.cancelled() or reply.exception() is not None:
            return  # the connection failed: its next one starts a baseline of its own
        count = _evicted_keys(reply.result())
        if count is None:
            return
        last, wire.evicted = wire.evicted, count
        seen, wire.resets_seen = wire.resets_seen, self._epoch.resets
        # A reset noticed since the last answer (the marker found gone: `allkeys-*` evicts it
        # too, and the next step finds that first) is this one: counted once.
        if last is not None and count > last and seen == self._epoch.resets:
            self._epoch.evicted(count - last)

    async def check_settings(self, wire: Wire) -> None:
        """Read the server's settings that decide whether it keeps guards' keys (on each new
        connection: a failover may reach another server) and warn, once per store and value,
        when budget keys can be evicted (`maxmemory-policy` other than `noeviction` with a
        `maxmemory`: every guards key has a TTL, so `volatile-*` policies evict them too) or
        are lost on a restart (`appendonly no` and no `save` snapshots). A server whose CONFIG
        command is refused (managed Redis) is said once, at info level."""
        names = ("maxmemory-policy", "maxmemory", "appendonly", "save")
        self._ask_evictions(wire, time.monotonic())  # the baseline of `watch_evictions`
        try:
            sent = [wire.send(packed("CONFIG", "GET", name)) for name in names]
        except StoreUnavailable:  # the connection broke: the next one checks
            return
        replies = await asyncio.gather(*sent, return_exceptions=True)
        if any(isinstance(reply, StoreUnavailable) for reply in replies):
            return  # the connection broke meanwhile: the next one checks (an error reply: a result)
        found: dict[str, str] = {}
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, list) and len(reply) == 2:
                found[name] = str(reply[1])
        if len(found) < len(names):
            if ("config", "") not in self._warned:
                self._warned.add(("config", ""))
                emit("store_settings_unchecked", store="redis", detail="CONFIG GET refused or renamed")
            return
        policy = found["maxmemory-policy"]
        if policy != "noeviction" and found["maxmemory"] != "0":
            self._warn_setting(
                "maxmemory-policy",
                policy,
                "Redis may evict guards' keys when memory is full (they all have a TTL, so "
                "volatile-* policies evict them too): daily caps, spend, breakers and tasks are "
                "then forgotten. Set maxmemory-policy noeviction (and enough maxmemory)",
            )
        if found["appendonly"] == "no" and not found["save"].strip():
            self._warn_setting(
                "appendonly",
                "no",
                "Redis keeps guards' keys in memory only (appendonly no, and no save snapshots): "
                "a restart forgets daily caps, spend, breakers and tasks. Set appendonly yes",
            )

    def _warn_setting(self, setting: str, value: str, detail: str) -> None:
        if (setting, value) not in self._warned:
            self._warned.add((setting, value))
            emit_warning("store_setting", store="redis", setting=setting, value=value[:40], detail=detail)


#: How often (at most) each connection's server is asked how many keys it evicted (behind a
#: `health` read: `Checks.watch_evictions`).
_EVICTIONS_EVERY_S = 1.0
_INFO_STATS = packed("INFO", "stats")


def _evicted_keys(info: Any) -> int | None:
    """The `evicted_keys` of an `INFO stats` reply; None when it has none (an error reply, a
    server that does not count them)."""
    if not isinstance(info, str):
        return None
    start = info.find("\nevicted_keys:")
    if start < 0:
        return None
    start += len("\nevicted_keys:")
    end = info.find("\r", start, start + 24)
    value = info[start : end if end >= 0 else start + 24]
    return int(value) if value.isdigit() else None
