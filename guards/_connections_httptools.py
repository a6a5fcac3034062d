"""`guards._connections`' bounds on uvicorn's httptools protocol (imported only when serving with
httptools, which the extra [serve] installs where it builds)."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from ._connections import _HeadBounds

__all__ = ["BoundedHttpToolsProtocol"]


class BoundedHttpToolsProtocol(_HeadBounds, HttpToolsProtocol):
    """uvicorn's httptools protocol with a header-read timeout and eviction of waiting
    connections. httptools has no state to ask: `_awaiting` is True from the connection's start,
    and from each response's end that starts no pipelined request, until a head is complete."""

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

    def _awaits_head(self) -> bool:
        return self._awaiting

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._made()
        super().connection_made(transport)
        self._wait_for_head(timed=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._received()

    def on_headers_complete(self) -> None:
        self._awaiting = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request started by uvicorn is the current cycle, still unanswered.
        self._awaiting = self.cycle.response_complete
        self._responded()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)
