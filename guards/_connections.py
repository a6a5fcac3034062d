"""Bounds on one worker's connections: a header-read timeout, and room kept for ready clients.

uvicorn accepts every connection and waits forever for a request head: a client that opens a
connection and sends its head a byte at a time (or never) holds a descriptor until the worker
has none left. `limit_concurrency` does not help, because uvicorn only checks it once a head is
complete. This module adds, on top of either of uvicorn's HTTP/1.1 protocols (h11, httptools):

- a header-read timeout: a request head must arrive whole within `timeout_header_s` of the
  connection's start (or of its first byte, on a kept-alive connection), else the connection is
  answered 408 (when it sent part of a head) and closed;
- room for clients that are ready: before a new connection would bring the open ones to
  `limit_concurrency` (where uvicorn answers every request 503), the connection waiting for a
  head (idle between requests, or slow with its head) that has been quiet longest is closed.
  A worker's open connections therefore stay below `limit_concurrency` whatever the clients
  do, and slow clients cannot keep ready ones out.

Invariant: a connection is in `Bounds.waiting` exactly while it has no request in progress
(no head received since its start or its last response); the dict is ordered by last activity,
quietest first. A request whose head arrives in one packet costs one dict insert (at its
connection's start, or at the previous response's end) and one delete.

The two protocols differ only in how a connection tells that it awaits a head (`_awaits_head`):
h11 says so by its state machine; the httptools one keeps a flag, set at the connection's start
and at each response's end (no pipelined request left), cleared when a head is complete.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any, Literal

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

logger = logging.getLogger("uvicorn.error")

#: A worker reports the connections it closed at most once per this many seconds (one line).
REPORT_INTERVAL_S = 10.0
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"

Http = Literal["h11", "httptools"]
Loop = Literal["asyncio", "uvloop"]


def installed(module: str) -> bool:
    """Whether `module` (uvloop, httptools) can be imported."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


class Bounds:
    """One server's connection bounds and the connections waiting for a request head."""

    def __init__(self, *, limit_concurrency: int | None, timeout_header_s: float) -> None:
        self.limit_concurrency = limit_concurrency
        self.timeout_header_s = timeout_header_s
        self.waiting: dict[_HeadBounds, None] = {}
        self.timed_out = 0
        self.evicted = 0
        self._report: asyncio.TimerHandle | None = None

    def make_room(self, open_connections: int) -> None:
        """Called before a new connection counts: keep the open ones below the limit (uvicorn
        answers 503 at the limit) by closing the quietest connection waiting for a head."""
        limit = self.limit_concurrency
        if limit is not None and open_connections >= limit - 1 and self.waiting:
            next(iter(self.waiting)).close_waiting(timed_out=False)

    def closed(self, *, timed_out: bool) -> None:
        if timed_out:
            self.timed_out += 1
        else:
            self.evicted += 1
        if self._report is None:
            self._report = asyncio.get_running_loop().call_later(REPORT_INTERVAL_S, self._log)

    def _log(self) -> None:
        logger.warning(
            "Closed %d connection(s) that sent no complete request head within %g s, and %d "
            "waiting for one to make room under limit_concurrency %s, in the last %g s.",
            self.timed_out,
            self.timeout_header_s,
            self.evicted,
            self.limit_concurrency,
            REPORT_INTERVAL_S,
        )
        self.timed_out = self.evicted = 0
        self._report = None


class BoundedConfig(uvicorn.Config):
    """`uvicorn.Config` serving HTTP/1.1 with a bounded `protocol` (`BoundedH11Protocol`, or
    `guards._connections_httptools`' one), on `loop`."""

    def __init__(
        self,
        app: str,
        *,
        timeout_header_s: float,
        protocol: type[asyncio.Protocol],
        loop: Loop,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, http=protocol, loop=loop, **kwargs)
        self.bounds = Bounds(limit_concurrency=self.limit_concurrency, timeout_header_s=timeout_header_s)


class _HeadBounds:
    """A connection's part in its server's `Bounds`: the helpers both protocols call from their
    own `connection_made`, `data_received`, `on_response_complete` and `connection_lost`."""

    # Set by the protocol class this is mixed into (uvicorn's).
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    connections: set[Any]

    def _init_bounds(self, config: uvicorn.Config) -> None:
        if not isinstance(config, BoundedConfig):
            raise TypeError(f"{type(self).__name__} needs a BoundedConfig")
        self._bounds = config.bounds
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # some bytes of the awaited head have arrived

    def _awaits_head(self) -> bool:
        """No request in progress: no head complete since the start or the last response."""
        raise NotImplementedError

    def _made(self) -> None:
        """Before the protocol counts the new connection."""
        self._bounds.make_room(len(self.connections))

    def _received(self) -> None:
        """After the protocol parsed what arrived."""
        if self._awaits_head() and not self.transport.is_closing():
            self._head_started = True
            self._wait_for_head(timed=True)
        elif self in self._bounds.waiting:
            self._stop_waiting()

    def _responded(self) -> None:
        """After a response's end: idle until the next head (uvicorn's keep-alive timeout
        runs), evictable, not timed."""
        if self._awaits_head() and not self.transport.is_closing():
            self._wait_for_head(timed=False)

    def close_waiting(self, *, timed_out: bool) -> None:
        """Close this connection, which is waiting for a head (408 if part of one came)."""
        started = self._head_started
        self._stop_waiting()
        self._bounds.closed(timed_out=timed_out)
        if started and timed_out:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()
        # Closed now, not when the loop reports it lost (a later turn of the loop): a request
        # read before then must not count it against `limit_concurrency` (uvicorn would answer
        # 503 with room made). uvicorn's own `connection_lost` discards it again, harmlessly.
        self.connections.discard(self)

    def _wait_for_head(self, *, timed: bool) -> None:
        waiting = self._bounds.waiting
        waiting.pop(self, None)
        waiting[self] = None  # last: the most recently active
        if timed and self._head_timer is None:
            self._head_timer = self.loop.call_later(self._bounds.timeout_header_s, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        self.close_waiting(timed_out=True)

    def _stop_waiting(self) -> None:
        self._bounds.waiting.pop(self, None)
        self._head_started = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


class BoundedH11Protocol(_HeadBounds, H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout and eviction of waiting connections."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._init_bounds(config)

    def _awaits_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._made()
        super().connection_made(transport)
        self._wait_for_head(timed=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._responded()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)
