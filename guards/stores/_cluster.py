"""Redis Cluster for `RedisStore` (`redis+cluster://`): slots, and the client that routes by them.

Every key of the store is `<prefix>{<tag>}:<suffix>`, so an operation's keys share one slot:
that of its hash tag (`key_slot`). The client (`Cluster`, one per event loop, like the single
server's one connection per loop) learns which primary serves each slot (`CLUSTER SLOTS`, from
any seed of the URL or known node that answers) and keeps one connection (`_Wire`) per primary,
dialed by the store (its handshake: AUTH, TLS, the SCRIPT LOAD on a node's first connection,
and the settings check) and redialed on next use once it failed. `send(slot, command)` writes
to the slot's primary, with every other command of the loop's turn for that node (one write per
node per turn), and follows the cluster's answers:

- `MOVED <slot> <host:port>`: the slot has a new primary. The slot is updated at once, the
  whole map is asked again in the background (one refresh at a time), and the command is sent
  to the named node.
- `ASK <slot> <host:port>`: the slot is being migrated and the key is not (or no longer) on
  this node: `ASKING` and the command, in one write, on the named node; the map is unchanged.
- `TRYAGAIN`: a multi-key script whose keys are not all on one node while their slot migrates
  (a key the script is given but has not written yet counts as not there): sent again (from
  the map's node) every `_TRYAGAIN_S`, until the migration ends or the call's time is up.
- `NOSCRIPT`: the node lost the script (restarted, or a replica promoted): loaded on that
  node's connection, ahead of the command sent again (once per call).
- `CLUSTERDOWN`, and a connection that fails: `StoreUnavailable`, and the map is asked again
  on the next call (which waits for it).

A call follows at most `_MAX_HOPS` redirections in a row (TRYAGAIN starts the count again) and
starts none later than `timeout_s` after it began; each reply is itself bounded by `timeout_s`
(`_Wire`). So a call that cannot finish
raises `StoreUnavailable` within a few `timeout_s`. Any other error reply is returned to the
store (its `Checks.refused` says what it raises).

Nodes are addressed as the cluster announces them (`CLUSTER SLOTS`, `MOVED`, `ASK`): the address
each was started with (an empty host, a node that does not know its own: the host asked).
"""

from __future__ import annotations

import asyncio
import binascii
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ._base import StoreUnavailable

__all__ = ["SLOTS", "Cluster", "key_slot", "slot_tag"]

#: Redis Cluster's slots: 0 to 16383.
SLOTS = 16384

Node = tuple[str, int]


class _Wire(Protocol):
    """What the client uses of a connection (`guards.stores._redis._protocol.Wire`)."""

    failure: str | None
    loads: int
    evicted: int | None
    evictions_due: float
    resets_seen: int

    def send(self, command: bytes) -> asyncio.Future[Any]: ...
    def load(self, command: bytes) -> None: ...
    def fail(self, error: StoreUnavailable) -> None: ...
    async def close(self) -> None: ...


def key_slot(key: str) -> int:
    """The Redis Cluster slot of `key` (as `CLUSTER KEYSLOT`): CRC16-XMODEM of its UTF-8 bytes
    mod 16384, or of its hash tag's only: the bytes between its first `{` and the first `}`
    after it, when there are any."""
    data = key.encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return binascii.crc_hqx(data, 0) & (SLOTS - 1)


_tags: list[str] = []


def slot_tag(slot: int) -> str:
    """A short string (decimal digits, at most 6) whose `key_slot` is `slot`: a hash tag that
    puts a key in `slot` (`<prefix>{<slot_tag(s)>}:...`). The smallest such number, from a
    table of all 16384 slots built on first use (about 30 ms)."""
    if not _tags:
        _tags.extend(_tag_table())
    return _tags[slot]


def _tag_table() -> list[str]:
    """For each slot, the smallest number whose decimal string is in that slot: numbers taken
    in chunks (the CRCs in one comprehension each), the first of each slot kept (a dict built
    from the chunk reversed keeps the smallest), until every slot has one (at 109,758)."""
    found: dict[int, str] = {}
    crc, start, chunk = binascii.crc_hqx, 0, 1 << 15
    while len(found) < SLOTS:
        names = [str(n) for n in range(start, start + chunk)]
        slots = [crc(name.encode(), 0) & (SLOTS - 1) for name in names]
        first = dict(zip(reversed(slots), reversed(names), strict=True))
        found = first | found  # the earlier chunks' numbers are smaller: they win
        start += chunk
    return [found[slot] for slot in range(SLOTS)]


#: The most redirections (MOVED, ASK) one call follows in a row.
_MAX_HOPS = 5
#: The pause before a command answered TRYAGAIN is sent again.
_TRYAGAIN_S = 0.005

_CLUSTER_SLOTS = b"*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n"
_ASKING = b"*1\r\n$6\r\nASKING\r\n"


class Cluster:
    """The store's client of a Redis Cluster in one event loop (see the module docstring).

    `seeds`: the URL's nodes, asked for the map (with the known nodes). `dial(node)`: a new
    connection to `node` with the store's handshake, usable at once. `load`: the packed SCRIPT
    LOAD. `timeout_s`: the store's."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        seeds: Sequence[Node],
        dial: Callable[[Node], _Wire],
        load: bytes,
        timeout_s: float,
    ) -> None:
        self._loop = loop
        self._seeds = tuple(seeds)
        self._dial = dial
        self._load = load
        self._timeout_s = timeout_s
        #: Each slot's primary (None: no node serves it); empty until the map was first read.
        self._slots: list[Node | None] = []
        #: Whether the next call reads the map first (a connection failed, or CLUSTERDOWN).
        self._stale = True
        self._refreshing: asyncio.Task[None] | None = None
        #: One connection per node in use (replaced once it failed).
        self._wires: dict[Node, _Wire] = {}
        #: Connections to nodes that no longer serve a slot: closed once their last reply is
        #: due (`_retire`), or with the client.
        self._retired: set[_Wire] = set()
        self._closed = False
        #: Why the last refresh found no map (the last failure's code).
        self._reason = "Redis store unavailable (no cluster node answered)"

    async def send(self, slot: int | None, command: bytes) -> Any:
        """`command` (packed) on the primary of `slot` (None: any primary, for a command without
        keys; a keyed command sent so is redirected once, which teaches the map its slot); its
        reply, redirections followed. `StoreUnavailable` when the cluster cannot answer."""
        if self._stale:
            await self._refreshed()
        loop = self._loop
        node = self._slots[slot] if slot is not None else self._any()
        if node is None:
            raise StoreUnavailable("Redis store unavailable (CLUSTERDOWN)")
        end = loop.time() + self._timeout_s
        asking = loaded = False
        hops = 0
        while True:
            wire = self._wire(node)
            loads = wire.loads
            try:
                if asking:
                    _quiet(wire.send(_ASKING))  # in the same write as the command, just ahead
                reply = await wire.send(command)
            except StoreUnavailable:
                self._stale = True  # the map is read again on the next call
                raise
            if not isinstance(reply, Exception):
                return reply
            text = str(reply)
            code = text.split(" ", 1)[0]
            if code == "NOSCRIPT" and not loaded:
                loaded = True
                if wire.loads == loads:  # no load sent on this connection since the command
                    wire.load(self._load)
                continue
            if code not in ("MOVED", "ASK", "TRYAGAIN"):
                if code == "CLUSTERDOWN":
                    self._stale = True
                    raise StoreUnavailable("Redis store unavailable (CLUSTERDOWN)")
                if code in ("READONLY", "LOADING", "MASTERDOWN"):  # not (or not yet) a primary
                    self._stale = True
                    wire.fail(StoreUnavailable(f"Redis store unavailable ({code})"))
                return reply  # the store's `Checks.refused` says what it raises
            hops += 1
            if hops > _MAX_HOPS or loop.time() > end:
                raise StoreUnavailable(f"Redis store unavailable ({code})")
            if code == "TRYAGAIN":  # bounded by the call's time
                await asyncio.sleep(_TRYAGAIN_S)
                asking, hops = False, 0
                node = (self._slots[slot] if slot is not None else None) or node
                continue
            target = _redirection(text, node[0])
            if target is None:
                raise StoreUnavailable(f"Redis store unavailable ({code})")
            moved, node = target
            asking = code == "ASK"
            if not asking:
                self._slots[moved] = node
                if slot is not None:  # our map was wrong: read it again, in the background
                    self._refresh()

    def primaries(self) -> list[_Wire]:
        """A connection to each primary of the map (dialed where there is none, or it failed);
        none while the map is not known."""
        return [] if self._stale else [self._wire(node) for node in self._known()]

    async def close(self) -> None:
        """Close every connection; returns once their sockets are closed."""
        self._closed = True
        if self._refreshing is not None:
            self._refreshing.cancel()
        wires = [*self._wires.values(), *self._retired]
        self._wires.clear()
        self._retired.clear()
        for wire in wires:
            await wire.close()

    # --- the map -----------------------------------------------------------------------------

    def _wire(self, node: Node) -> _Wire:
        """The connection to `node`, dialed when there is none or it failed."""
        wire = self._wires.get(node)
        if wire is None or wire.failure is not None:
            wire = self._wires[node] = self._dial(node)
        return wire

    async def _refreshed(self) -> None:
        """Wait for the map (the refresh under way, or a new one); `StoreUnavailable` when no
        node gave it."""
        await asyncio.shield(self._refresh())  # a caller that gives up leaves it to the others
        if self._stale:
            raise StoreUnavailable(self._reason)

    def _refresh(self) -> asyncio.Task[None]:
        """The refresh under way, or a new one."""
        task = self._refreshing
        if task is None or task.done():
            task = self._refreshing = self._loop.create_task(self._read_map())
        return task

    async def _read_map(self) -> None:
        """Ask for `CLUSTER SLOTS`: first on the connections already open (answered in a round
        trip), else on every seed and known node at once; the first good answer is the map.
        Never raises: when none answers, the map stays stale and `_reason` says why."""
        live = [node for node, wire in self._wires.items() if wire.failure is None]
        rest = [node for node in dict.fromkeys([*self._seeds, *self._known()]) if node not in live]
        for nodes in (live, rest):
            if not nodes:
                continue
            asks = [self._loop.create_task(self._ask(node)) for node in nodes]
            for ask in asks:
                _quiet(ask)  # those left behind once one answered
            try:
                for answer in asyncio.as_completed(asks):
                    try:
                        table = await answer
                    except StoreUnavailable as exc:
                        self._reason = str(exc)
                        continue
                    self._install(table)
                    return
            finally:
                for ask in asks:
                    ask.cancel()
        self._stale = True

    def _any(self) -> Node | None:
        """A primary, for a command without a slot: the first slot's."""
        return next((node for node in self._slots if node is not None), None)

    def _known(self) -> list[Node]:
        return list(dict.fromkeys(node for node in self._slots if node is not None))

    async def _ask(self, node: Node) -> list[Node | None]:
        """`node`'s map: each slot's primary. `StoreUnavailable` when it cannot say (its
        connection failed, an error reply, a node that is not in cluster mode)."""
        reply = await self._wire(node).send(_CLUSTER_SLOTS)
        if isinstance(reply, Exception) or not isinstance(reply, list) or not reply:
            code = str(reply).split(" ", 1)[0][:32] if isinstance(reply, Exception) else "CLUSTERDOWN"
            raise StoreUnavailable(f"Redis store unavailable ({code if code.isalnum() else 'ResponseError'})")
        table: list[Node | None] = [None] * SLOTS
        try:
            for entry in reply:
                start, last, primary = int(entry[0]), int(entry[1]), entry[2]
                host = str(primary[0]) or node[0]
                table[start : last + 1] = [(host, int(primary[1]))] * (last + 1 - start)
        except (IndexError, TypeError, ValueError):
            raise StoreUnavailable("Redis store unavailable (ProtocolError)") from None
        if len(table) != SLOTS:
            raise StoreUnavailable("Redis store unavailable (ProtocolError)")
        return table

    def _install(self, table: list[Node | None]) -> None:
        self._slots = table
        self._stale = False
        primaries = set(table)
        for node in [node for node in self._wires if node not in primaries]:
            self._retire(self._wires.pop(node))

    def _retire(self, wire: _Wire) -> None:
        """A connection to a node that serves no slot now (a seed that is a replica, a primary
        demoted or emptied): closed once every reply it may still carry is overdue (10 timeouts,
        `_Wire`'s longest wait), or with the client."""
        if wire.failure is not None or self._closed:
            return
        self._retired.add(wire)

        def close() -> None:
            self._retired.discard(wire)
            wire.fail(StoreUnavailable("Redis store unavailable (closed)"))

        self._loop.call_later(10 * self._timeout_s + 1, close)


def _redirection(text: str, host: str) -> tuple[int, Node] | None:
    """The slot and node of `MOVED <slot> <host>:<port>` or `ASK ...` (an empty host: `host`,
    the node that answered); None when malformed."""
    parts = text.split(" ")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    named, _, port = parts[2].rpartition(":")
    if not port.isdigit() or not 0 <= int(parts[1]) < SLOTS:
        return None
    return int(parts[1]), (named or host, int(port))


def _quiet(future: asyncio.Future[Any]) -> None:
    """A reply nobody reads (ASKING's): its failure, if any, is retrieved (no warning)."""
    future.add_done_callback(lambda done: done.cancelled() or done.exception())
