"""The store on the server side: one Lua script, `lua/store.lua` (shipped in the wheel, read
once at import, so it can be read, linted and diffed as Lua), whose every operation is one
`EVALSHA` of it by its SHA (`pack`), the operation's name in ARGV[1] and the time in ARGV[2]
('' = Redis `TIME`, else the store's clock: tests). The script is loaded with `SCRIPT LOAD`
(`LOAD_SCRIPT`) in a new connection's first write, and again when a server answers `NOSCRIPT`
(restarted, or its script cache flushed: `reloaded`; on a cluster, `Cluster.send`). Each
operation does its whole check-and-charge atomically on the server, nothing read in Python
and written back; it gives every key it writes its TTL, and builds the daily keys' names
itself from the stem it is given in KEYS (`...:day:`, `...:spend:`: same hash tag, so the same
slot) and the UTC day of its time, so workers with skewed clocks agree on days. Numbers travel
as strings in `%.17g` (exact for doubles) both ways (`num`); Lua numbers are doubles, so every
computation is the same IEEE arithmetic as `MemoryStore`'s in Python.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

from ...contracts._clock import Clock
from ._protocol import Wire, packed

__all__ = ["KEPT_SCRIPT", "LOAD_SCRIPT", "SCRIPT", "SHA", "now_arg", "num", "pack", "reloaded"]

#: The script's text (`lua/store.lua`), its SHA, and its `SCRIPT LOAD`, packed.
SCRIPT = resources.files("guards.stores._redis").joinpath("lua", "store.lua").read_text(encoding="utf-8")
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()
LOAD_SCRIPT = packed("SCRIPT", "LOAD", SCRIPT)
#: The kept streams' script (`lua/kept.lua`), sent whole with EVAL (it is short).
KEPT_SCRIPT = resources.files("guards.stores._redis").joinpath("lua", "kept.lua").read_text(encoding="utf-8")


def num(x: float | None) -> str:
    """A number as the script reads it ('' for None): `repr` of a float round-trips exactly."""
    return "" if x is None else repr(float(x))


def pack(op: str, keys: Sequence[str], now: str, args: Sequence[str]) -> bytes:
    """An EVALSHA of the script, in Redis' wire format."""
    return packed("EVALSHA", SHA, len(keys), *keys, op, now, *args)


def now_arg(clock: Clock | None) -> str:
    """The script's time argument: '' (Redis TIME) unless the store has a clock."""
    return "" if clock is None else num(clock.time())


async def reloaded(wire: Wire, loads: int, command: bytes) -> Any:
    """`command` sent again on `wire`, after its server answered it `NOSCRIPT` (it lost the
    script), behind a `SCRIPT LOAD` unless one was sent on `wire` since the command (`loads`:
    the wire's count of loads when the command was sent): its reply."""
    if wire.loads == loads:
        wire.load(LOAD_SCRIPT)
    return await wire.send(command)
