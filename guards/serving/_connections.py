"""Bounds on one worker's connections: header and body read timeouts, and room kept for ready
clients.

uvicorn accepts every connection and waits forever for a request head, and for a request body:
a client that opens a connection and sends its head (or its body) a byte at a time, or never,
holds a descriptor until the worker has none left. `limit_concurrency` does not help, because
uvicorn only checks it once a head is complete, and a request mid-body counts against it. This
module adds, on top of either of uvicorn's HTTP/1.1 protocols (h11, httptools):

- a header-read timeout: a request head must arrive whole within `timeout_header_s` of the
  connection's start (or of its first byte, on a kept-alive connection), else the connection is
  answered 408 (when it sent part of a head) and closed;
- a body-read bound: once its head is complete, a request body must arrive whole within
  `timeout_body_s`, plus one second per `min_body_rate` bytes received (the body may slow down
  for a while, but on average it keeps up with the minimum rate after its first seconds), else
  the connection is answered 408 (unless its response has begun) and closed. The bound counts
  only while the server reads: when uvicorn pauses reading (its app has not taken what came),
  the slowness is the server's, and the bound starts again;
- room for clients that are ready: before a new connection would bring the open ones to
  `limit_concurrency` (where uvicorn answers every request 503), the connection waiting for a
  head (idle between requests, or slow with its head) that has been quiet longest is closed;
  when none waits for a head, the connection receiving a body that has been quiet longest is
  closed (408) if its body is behind the minimum rate (fewer bytes than `min_body_rate` per
  second since its head). A worker's open connections therefore stay below `limit_concurrency`
  whatever slow clients do, and they cannot keep ready ones out.

Invariant: a connection is in `Bounds.waiting` exactly while it has no request in progress
(no head received since its start or its last response), and in `Bounds.receiving` exactly
while its request's body is arriving (a head complete, the body not); both dicts are ordered by
last activity, quietest first. A request whose head and body arrive in one packet costs one dict
insert (at its connection's start, or at the previous response's end) and one delete; a body
that comes in later packets costs an insert, a timer, and a dict move per packet.

The two protocols differ only in how a connection tells that it awaits a head (`_awaits_head`)
or receives a body (`_receives_body`): h11 says so by its state machine; the httptools one keeps
flags, `_awaiting` set at the connection's start and at each response's end (no pipelined
request left), cleared when a head is complete, and `_in_body` set when a head is complete,
cleared when its message is.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, MutableMapping
from typing import Any, Literal

import h11
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from ..waits._client import CLIENT_WATCH

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
    """One server's connection bounds, and its connections waiting for a request head or
    receiving a request body."""

    def __init__(
        self,
        *,
        limit_concurrency: int | None,
        timeout_header_s: float,
        timeout_body_s: float,
        min_body_rate: int,
    ) -> None:
        self.limit_concurrency = limit_concurrency
        self.timeout_header_s = timeout_header_s
        self.timeout_body_s = timeout_body_s
        self.min_body_rate = min_body_rate
        self.waiting: dict[_ConnectionBounds, None] = {}
        self.receiving: dict[_ConnectionBounds, None] = {}
        #: Connections closed since the last report, by (phase, timed out).
        self.counts = dict.fromkeys([("head", True), ("head", False), ("body", True), ("body", False)], 0)
        self._report: asyncio.TimerHandle | None = None

    def make_room(self, open_connections: int) -> None:
        """Called before a new connection counts: keep the open ones below the limit (uvicorn
        answers 503 at the limit) by closing the quietest connection waiting for a head, or
        else the quietest receiving a body, if it is behind the minimum rate."""
        limit = self.limit_concurrency
        if limit is None or open_connections < limit - 1:
            return
        if self.waiting:
            next(iter(self.waiting)).close_waiting(timed_out=False)
        elif self.receiving:
            quietest = next(iter(self.receiving))
            if quietest.behind_rate():
                quietest.close_receiving(timed_out=False)

    def closed(self, phase: Literal["head", "body"], *, timed_out: bool) -> None:
        self.counts[phase, timed_out] += 1
        if self._report is None:
            self._report = asyncio.get_running_loop().call_later(REPORT_INTERVAL_S, self._log)

    def _log(self) -> None:
        counts = self.counts
        if counts["head", True] or counts["head", False]:
            logger.warning(
                "Closed %d connection(s) that sent no complete request head within %g s, and %d "
                "waiting for one to make room under limit_concurrency %s, in the last %g s.",
                counts["head", True],
                self.timeout_header_s,
                counts["head", False],
                self.limit_concurrency,
                REPORT_INTERVAL_S,
            )
        if counts["body", True] or counts["body", False]:
            logger.warning(
                "Closed %d connection(s) whose request body did not arrive within %g s plus 1 s "
                "per %d bytes, and %d receiving one behind that rate to make room under "
                "limit_concurrency %s, in the last %g s.",
                counts["body", True],
                self.timeout_body_s,
                self.min_body_rate,
                counts["body", False],
                self.limit_concurrency,
                REPORT_INTERVAL_S,
            )
        self.counts = dict.fromkeys(counts, 0)
        self._report = None


class BoundedConfig(uvicorn.Config):
    """`uvicorn.Config` serving HTTP/1.1 with a bounded `protocol` (`BoundedH11Protocol`, or
    `guards.serving._connections_httptools`' one), on `loop`."""

    def __init__(
        self,
        app: str,
        *,
        timeout_header_s: float,
        timeout_body_s: float,
        min_body_rate: int,
        protocol: type[asyncio.Protocol],
        loop: Loop,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, http=protocol, loop=loop, **kwargs)
        self.bounds = Bounds(
            limit_concurrency=self.limit_concurrency,
            timeout_header_s=timeout_header_s,
            timeout_body_s=timeout_body_s,
            min_body_rate=min_body_rate,
        )


class _Tasks:
    """The server's set of request tasks as one connection sees it: uvicorn adds and counts
    them through the protocol's `tasks`, so the connection knows the task of its request."""

    __slots__ = ("_last", "_tasks")

    def __init__(self, tasks: set[asyncio.Task[None]]) -> None:
        self._tasks = tasks
        self._last: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, task: asyncio.Task[None]) -> None:
        self._last = task
        self._tasks.add(task)

    def discard(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)

    def forget_last(self) -> None:
        """The connection's latest request no longer counts (its task's end discards it again,
        harmlessly)."""
        if self._last is not None:
            self._tasks.discard(self._last)


class _ConnectionBounds:
    """A connection's part in its server's `Bounds`: the helpers both protocols call from their
    own `connection_made`, `data_received`, `on_response_complete` and `connection_lost`."""

    # Set by the protocol class this is mixed into (uvicorn's).
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    connections: set[Any]
    tasks: Any  # the server's request tasks: `_Tasks` once `_init_bounds` ran
    flow: FlowControl
    cycle: Any  # the request's RequestResponseCycle (h11's or httptools'), None before one

    def _init_bounds(self, config: uvicorn.Config) -> None:
        if not isinstance(config, BoundedConfig):
            raise TypeError(f"{type(self).__name__} needs a BoundedConfig")
        self._bounds = config.bounds
        self.tasks = _Tasks(self.tasks)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # some bytes of the awaited head have arrived
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_since = 0.0  # the loop's time the body bound counts from
        self._body_bytes = 0  # received since then
        self._client = _ClientWatch(self)

    def _awaits_head(self) -> bool:
        """No request in progress: no head complete since the start or the last response."""
        raise NotImplementedError

    def _receives_body(self) -> bool:
        """A request's head is complete, its body is not."""
        raise NotImplementedError

    def _made(self) -> None:
        """Before the protocol counts the new connection."""
        self._bounds.make_room(len(self.connections))

    def _received(self, size: int) -> None:
        """After the protocol parsed what arrived (`size` bytes)."""
        if (cycle := self.cycle) is not None:  # its task runs later: the app sees its watch
            cycle.scope[CLIENT_WATCH] = self._client
        if self.transport.is_closing():
            self._stop_waiting()
            self._stop_receiving()
        elif self._awaits_head():
            if self in self._bounds.receiving:
                self._stop_receiving()  # the body ended: what else came is not known to be a head
            else:
                self._head_started = True
            self._wait_for_head(timed=True)
        elif self._receives_body():
            self._stop_waiting()
            self._receive_body(size)
        else:
            self._stop_waiting()
            self._stop_receiving()

    def _responded(self) -> None:
        """After a response's end: idle until the next head (uvicorn's keep-alive timeout
        runs), evictable, not timed; or receiving a body (the request's own, when the app
        answered before reading it all, or a pipelined request's, parsed from what was
        buffered)."""
        if self._client.watching:  # a response's end, as its `receive` says it
            self._client.left()
        if self.transport.is_closing():
            return
        if self._awaits_head():
            self._wait_for_head(timed=False)
        elif self._receives_body() and self not in self._bounds.receiving:
            self._receive_body(0)

    def _lost(self) -> None:
        """Before the protocol forgets the connection."""
        self._stop_waiting()
        self._stop_receiving()
        self._client.left()

    def close_waiting(self, *, timed_out: bool) -> None:
        """Close this connection, which is waiting for a head (408 if part of one came)."""
        started = self._head_started
        self._stop_waiting()
        self._bounds.closed("head", timed_out=timed_out)
        if started and timed_out:
            self.transport.write(_REQUEST_TIMEOUT)
        self._close()

    def close_receiving(self, *, timed_out: bool) -> None:
        """Close this connection, which is receiving a body (408 if no response began)."""
        self._stop_receiving()
        self._bounds.closed("body", timed_out=timed_out)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.response_started:
                self.transport.write(_REQUEST_TIMEOUT)
            # As uvicorn's `connection_lost` will: the app's next `receive` says the client
            # left, and nothing the app sends from now on is written.
            cycle.disconnected = True
            cycle.message_event.set()
            self._client.left()
            # Its request is over for the server (its task ends at that `receive`, a turn or
            # two of the loop later): a request read before then must not count it against
            # `limit_concurrency` either.
            self.tasks.forget_last()
        self._close()

    def behind_rate(self) -> bool:
        """Whether the body received is behind the minimum rate since its head (no grace)."""
        elapsed = self.loop.time() - self._body_since
        return self._body_bytes < elapsed * self._bounds.min_body_rate and not self.flow.read_paused

    def _close(self) -> None:
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

    def _receive_body(self, size: int) -> None:
        receiving = self._bounds.receiving
        if self in receiving:
            self._body_bytes += size
            del receiving[self]
        else:  # the head is complete: the bound starts
            self._body_since = self.loop.time()
            self._body_bytes = 0
            self._body_timer = self.loop.call_later(self._bounds.timeout_body_s, self._body_deadline)
        receiving[self] = None  # last: the most recently active

    def _body_deadline(self) -> None:
        """At the body's deadline as it was: later if bytes came since, else 408."""
        bounds = self._bounds
        now = self.loop.time()
        if self.flow.read_paused:  # the server is not reading: the bound starts again
            self._body_since, self._body_bytes = now, 0
        deadline = self._body_since + bounds.timeout_body_s + self._body_bytes / bounds.min_body_rate
        if now < deadline:
            self._body_timer = self.loop.call_at(deadline, self._body_deadline)
        else:
            self._body_timer = None
            self.close_receiving(timed_out=True)

    def _stop_receiving(self) -> None:
        self._bounds.receiving.pop(self, None)
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None


class _ClientWatch:
    """A connection's `ClientWatch` (`guards.waits._client`), in each of its requests' scopes:
    the walks watching its client, called back when it leaves (the connection lost, or closed
    behind its body's rate) or when the response ends: what makes uvicorn's `receive` say
    `http.disconnect`. A request whose body still arrives, or that is not the connection's
    current one (pipelined behind it), is watched by its `receive`, as on any server."""

    __slots__ = ("_connection", "watching")

    def __init__(self, connection: _ConnectionBounds) -> None:
        self._connection = connection
        self.watching: dict[_Watching, None] = {}

    def watch(
        self, scope: MutableMapping[str, Any], left: Callable[[Any], None], arg: Any
    ) -> _Watching | bool:
        connection = self._connection
        cycle = connection.cycle
        if cycle is None or cycle.scope is not scope or connection._receives_body():
            return False
        if cycle.disconnected or cycle.response_complete:
            return True
        watching = _Watching(self, left, arg)
        self.watching[watching] = None
        return watching

    def left(self) -> None:
        """Call every watch back, once."""
        watching = self.watching
        if watching:
            self.watching = {}
            for each in watching:
                each.left(each.arg)


class _Watching:
    """One walk watching its client (`_ClientWatch.watch`)."""

    __slots__ = ("arg", "client", "left")

    def __init__(self, client: _ClientWatch, left: Callable[[Any], None], arg: Any) -> None:
        self.client, self.left, self.arg = client, left, arg

    def cancel(self) -> None:
        self.client.watching.pop(self, None)


class BoundedH11Protocol(_ConnectionBounds, H11Protocol):
    """uvicorn's h11 protocol with header and body read bounds, and eviction of slow
    connections."""

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

    def _receives_body(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._made()
        super().connection_made(transport)
        self._wait_for_head(timed=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._received(len(data))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._responded()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()
        super().connection_lost(exc)
