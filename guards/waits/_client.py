"""`ClientWatch`: a server's word, by callback, that a request's client left.

A walk that outlasts its deadline's mark watches its client (`guards.walk._chain_walk`): on
any ASGI server, a task awaiting the request's `receive` until it says `http.disconnect`. At
thousands of long calls in flight, that task per call (its coroutines, its wait on the
connection's event, its cancellation when the walk ends) is a good share of the worker's CPU.
A server that knows its connections can say instead, by a callback, when the client leaves:
`guards.serve` puts its connection's `ClientWatch` in each request's scope, under `CLIENT_WATCH`.
The walk asks it first, and watches `receive` only where it is missing or cannot tell.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol

__all__ = ["CLIENT_WATCH", "ClientWatch", "Watching", "watch_client"]

#: The scope key of the request's `ClientWatch`, where its server offers one.
CLIENT_WATCH = "guards.client_watch"


class Watching(Protocol):
    """A callback registered with `ClientWatch.watch`."""

    def cancel(self) -> object:
        """Stop watching: the callback is not called after this."""
        ...


class ClientWatch(Protocol):
    """A connection's clients, as its server sees them."""

    def watch(
        self, scope: MutableMapping[str, Any], left: Callable[[Any], None], arg: Any
    ) -> Watching | bool:
        """Call `left(arg)` once, when the client of the request of `scope` leaves, or the
        request's response ends (what makes its `receive` say `http.disconnect`). Returns the
        watch; True: that happened already (nothing is called); False: this server cannot
        tell for this request (watch its `receive`)."""
        ...


class _Request(Protocol):
    """What `watch_client` reads of a request (a Starlette `Request`)."""

    @property
    def scope(self) -> MutableMapping[str, Any]: ...

    @property
    def receive(self) -> Callable[[], Awaitable[Mapping[str, Any]]]: ...


def watch_client(request: _Request, left: Callable[[Any], None], arg: Any) -> Watching | None:
    """Call `left(arg)` once `request`'s client leaves (from a running event loop): by its
    server's callback where it offers one, else by a task awaiting its `receive` until it says
    `http.disconnect`. Returns the watch (`cancel()` it when done watching); None: the client
    had left already, and `left(arg)` was called."""
    scope = request.scope
    client: ClientWatch | None = scope.get(CLIENT_WATCH)
    if client is not None:
        watching = client.watch(scope, left, arg)
        if not isinstance(watching, bool):
            return watching
        if watching:
            left(arg)
            return None
    return asyncio.get_running_loop().create_task(_watch_receive(request.receive, left, arg))


async def _watch_receive(
    receive: Callable[[], Awaitable[Mapping[str, Any]]], left: Callable[[Any], None], arg: Any
) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    left(arg)
