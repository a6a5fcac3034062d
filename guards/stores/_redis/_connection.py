"""The store's connections (`Connections`, one set per store): a connection belongs to one
event loop, so the store keeps one per running loop (on Redis Cluster, one cluster client per
loop, `guards.stores._cluster.Cluster`, with one connection per primary), made on first use
there and closed when that loop shuts down (or by `aclose`): a store used from two event loops
(an app's and a test's, or a worker's and a thread's) never shares a connection between them.
One connection carries every operation of its loop: the operations a loop starts in one turn
are written together at the turn's end, in one write, and Redis answers a connection's
commands in order, so a burst costs a few round trips, not one each, and nothing waits for a
free connection (`Wire`); the requests' steps of one turn go in one script call (`step`). A
new connection's first write also carries its handshake (AUTH, SELECT, ROLE behind Sentinel,
and the SCRIPT LOAD if the script may be missing): no round trip of its own. Connecting and each reply are bounded by `timeout_s`, with no client-side retries; a
connection that failed fails the operations waiting on it, and the next operation dials again,
so the store is back as soon as Redis is.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import cast

from .._base import StoreUnavailable
from .._cluster import Cluster, Node
from ._address import Address
from ._checks import Checks
from ._protocol import Bound, ReplyError, Wire, unavailable
from ._scripts import LOAD_SCRIPT, pack, reloaded

__all__ = ["Connections"]


@dataclass(slots=True)
class _Link:
    """The store's connection in one event loop (replaced when it breaks), and what closes it
    when that loop shuts down."""

    wire: Wire
    keeper: AsyncGenerator[None, None] = field(init=False)


@dataclass(slots=True)
class _ClusterLink:
    """On Redis Cluster, the store's client in one event loop, and what closes it when that
    loop shuts down."""

    cluster: Cluster
    keeper: AsyncGenerator[None, None] = field(init=False)


class Connections:
    """A store's connections to `address` (see the module docstring): `timeout_s` bounds
    connecting and each reply; `checks` reads each new connection's server settings, and says
    what an error reply raises."""

    def __init__(self, address: Address, timeout_s: float, checks: Checks) -> None:
        self._address = address
        self._timeout_s = timeout_s
        self._checks = checks
        self._cluster = bool(address.cluster)
        #: The connection per event loop; on Redis Cluster the client per loop instead (and
        #: `links` stays empty).
        self.links: dict[asyncio.AbstractEventLoop, _Link] = {}
        self.clusters: dict[asyncio.AbstractEventLoop, _ClusterLink] = {}
        #: Whether the script is in the server's cache as far as we know (NOSCRIPT says
        #: otherwise); on Redis Cluster, the nodes that were sent it (a node's first connection
        #: sends it).
        self._loaded = False
        self._scripted: set[Node] = set()

    async def call(self, command: bytes, slot: int | None = None) -> list[str]:
        """One packed EVALSHA, sent on this loop's connection with every other command of the
        loop's turn (see `Wire`); its reply. The script reloaded once if the server lost it
        (restarted, or its script cache flushed). Any failure raises `StoreUnavailable`.

        On a cluster, sent to the primary of `slot` (that of every key of the command; None:
        any node, which redirects a keyed command once): see `_cluster_call`. Else `slot` is
        ignored."""
        if self._cluster:
            return await self._cluster_call(command, slot)
        loop = asyncio.get_running_loop()
        link = self.links.get(loop)
        if link is None:
            link = await self._open(loop)
        wire = link.wire
        if wire.failure is not None:  # broken: the next operation dials again
            wire = link.wire = self._dial(loop)
        loads = wire.loads
        reply = await wire.send(command)
        if reply.__class__ is list:
            return reply
        if isinstance(reply, ReplyError) and str(reply).startswith("NOSCRIPT"):
            reply = await reloaded(wire, loads, command)  # behind a load, on the same connection
            if reply.__class__ is list:
                return reply
        raise self._checks.refused(wire, reply)

    async def step(self, keys: list[str], args: tuple[str, ...], now: str) -> list[str]:
        """One `step` of the script (not on a cluster), its KEYS and fields: the steps this loop
        starts in one turn travel in one script call (`Wire.send_step`), a lone one as its own
        EVALSHA; its reply, as `call`'s (reloaded the same way, alone)."""
        loop = asyncio.get_running_loop()
        link = self.links.get(loop)
        if link is None:
            link = await self._open(loop)
        wire = link.wire
        if wire.failure is not None:  # broken: the next operation dials again
            wire = link.wire = self._dial(loop)
        loads = wire.loads
        reply = await wire.send_step(pack, keys, args, now)
        if reply.__class__ is list:
            return cast(list[str], reply)
        if isinstance(reply, ReplyError) and str(reply).startswith("NOSCRIPT"):
            reply = await reloaded(wire, loads, pack("step", keys, now, args))
            if reply.__class__ is list:
                return cast(list[str], reply)
        raise self._checks.refused(wire, reply)

    async def _cluster_call(self, command: bytes, slot: int | None) -> list[str]:
        """`call` on a cluster: through this loop's `Cluster` client (which follows redirections
        and reloads the script on `NOSCRIPT`)."""
        loop = asyncio.get_running_loop()
        link = self.clusters.get(loop)
        if link is None:
            link = await self._open_cluster(loop)
        reply = await link.cluster.send(slot, command)
        if reply.__class__ is list:
            return cast(list[str], reply)
        raise self._checks.refused(None, reply)

    def wires(self) -> list[Wire]:
        """This loop's connections: its one, or on a cluster one to each primary (dialed where
        there is none, or it failed); none before the loop's first operation."""
        loop = asyncio.get_running_loop()
        if self._cluster:
            cluster = self.clusters.get(loop)
            return [] if cluster is None else cast(list[Wire], cluster.cluster.primaries())
        link = self.links.get(loop)
        return [] if link is None else [link.wire]

    async def aclose(self) -> None:
        """Close the connections: this loop's now, other running loops' in their own loop.
        Those of loops that already shut down were closed then. They stay usable (the next
        operation dials again)."""
        running = asyncio.get_running_loop()
        links: dict[asyncio.AbstractEventLoop, _Link | _ClusterLink] = {**self.links, **self.clusters}
        self.links, self.clusters = {}, {}
        for loop, link in links.items():
            if loop is running:
                await link.keeper.aclose()
            elif not loop.is_closed():
                with suppress(RuntimeError):  # that loop closed meanwhile
                    asyncio.run_coroutine_threadsafe(_close(link), loop)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Link:
        """This loop's link, made on its first operation."""
        for other in [other for other in self.links if other.is_closed()]:
            del self.links[other]  # shut down without running its async generators' cleanup
        link = _Link(self._dial(loop))
        link.keeper = self._keep(loop, link)
        self.links[loop] = link  # before awaiting: concurrent first calls share it
        await anext(link.keeper)  # its first iteration registers it with the loop
        return link

    async def _open_cluster(self, loop: asyncio.AbstractEventLoop) -> _ClusterLink:
        """This loop's cluster client, made on its first operation (as `_open`)."""
        for other in [other for other in self.clusters if other.is_closed()]:
            del self.clusters[other]
        dial = functools.partial(self._dial, loop)
        link = _ClusterLink(Cluster(loop, self._address.cluster, dial, LOAD_SCRIPT, self._timeout_s))
        link.keeper = self._keep(loop, link)
        self.clusters[loop] = link
        await anext(link.keeper)
        return link

    def _dial(self, loop: asyncio.AbstractEventLoop, node: Node | None = None) -> Wire:
        """A new connection (on a cluster, to `node`), usable at once: commands wait in it
        until it is connected. Its handshake (AUTH, SELECT, SCRIPT LOAD: whichever it needs; on
        a cluster, the SCRIPT LOAD on each node's first connection) goes first, in the same
        write as the first commands."""
        wire = Wire(loop, self._timeout_s)
        handshake = self._address.handshake()
        if node is None:
            if not self._loaded:
                handshake.append(LOAD_SCRIPT)
                self._loaded = True
        elif node not in self._scripted:
            handshake.append(LOAD_SCRIPT)
            self._scripted.add(node)
        wire.begin(handshake, loop.create_task(self._connect(wire, node)))
        # Its server's settings, read behind this turn's operations (see `Checks.check_settings`).
        wire.checking = loop.create_task(self._checks.check_settings(wire))
        return wire

    async def _connect(self, wire: Wire, node: Node | None = None) -> None:
        try:
            # Behind Sentinel: one timeout to ask the sentinels, one to connect to the primary.
            with Bound(self._timeout_s * (2 if self._address.master is not None else 1)):
                await self._address.connect(wire, self._timeout_s, node)
        except (OSError, TimeoutError) as exc:  # refused, unreachable, TLS refused, too slow
            wire.fail(unavailable(exc))
        except BaseException:  # cancelled (its loop shutting down)
            wire.fail(StoreUnavailable("Redis store unavailable (cancelled)"))
            raise

    async def _keep(
        self, loop: asyncio.AbstractEventLoop, link: _Link | _ClusterLink
    ) -> AsyncGenerator[None, None]:
        """Suspended for the link's life in its loop. An event loop closes its unfinished async
        generators when it shuts down (`asyncio.run` does), which closes the connection (or the
        cluster client's) in the loop that owns it."""
        try:
            yield
        finally:
            if isinstance(link, _Link):
                if self.links.get(loop) is link:
                    del self.links[loop]
                await link.wire.close()
            else:
                if self.clusters.get(loop) is link:
                    del self.clusters[loop]
                await link.cluster.close()


async def _close(link: _Link | _ClusterLink) -> None:
    await link.keeper.aclose()
