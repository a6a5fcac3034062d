"""`guards.serving._connections`' bounds on uvicorn's httptools protocol (imported only when serving with
httptools, which the extra [serve] installs where it builds)."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from ._connections import _ConnectionBounds

__all__ = ["BoundedHttpToolsProtocol"]


class BoundedHttpToolsProtocol(_ConnectionBounds, HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body read bounds, and eviction of slow
    connections. httptools has no state to ask: `_awaiting` is True from the connection's start,
    and from each response's end that starts no pipelined request, until a head is complete;
    `_in_body` from a head's end to its message's end."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._init_bounds(config)
        self._awaiting = True
        self._in_body = False

    def _awaits_head(self) -> bool:
        # A response may end before its request's body (an app that does not read it).
        return self._awaiting and not self._in_body

    def _receives_body(self) -> bool:
        return self._in_body

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._made()
        super().connection_made(transport)
        self._wait_for_head(timed=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._received(len(data))

    def on_headers_complete(self) -> None:
        self._awaiting = False
        self._in_body = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request started by uvicorn is the current cycle, still unanswered.
        self._awaiting = self.cycle.response_complete
        self._responded()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()
        super().connection_lost(exc)
