"""A worker of `python -m guards.serve`: a `uvicorn.Server` on a socket of its own, bound with
`SO_REUSEPORT` and created with `IPPROTO_TCP` (so every accepted connection has `TCP_NODELAY`),
its connections bounded as `guards.serving._connections` describes; it says when it is ready,
ends the streams it relays at the end of its graceful period, and stops when its supervisor is
gone. `Options` is what the supervisor hands each worker it starts."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import signal
import socket
from multiprocessing.connection import Connection

import uvicorn

from ..streams._relay import stop_streams
from ._connections import BoundedConfig, BoundedH11Protocol, Http, Loop
from ._logs import guard_uvicorn_logs

try:
    from ._connections_httptools import BoundedHttpToolsProtocol
except ImportError:  # httptools is not installed (it does not build everywhere): h11 only
    BoundedHttpToolsProtocol = None  # type: ignore[assignment,misc]

__all__ = ["STREAMS_STOP_S", "Options", "ServeError", "bound_socket", "run_worker"]

#: Seconds the streams told to stop at the end of the graceful period have to send their
#: `error` event and settle, before uvicorn cancels the requests still in flight.
STREAMS_STOP_S = 1


class ServeError(Exception):
    """The server cannot start as asked (bad option, open file limit, address in use)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """How each worker serves (`guards.serve.serve`'s options, checked and resolved)."""

    app: str
    host: str
    port: int
    limit_concurrency: int
    timeout_header_s: float
    timeout_body_s: float
    min_body_rate: int
    timeout_keep_alive_s: int
    timeout_graceful_shutdown_s: int
    backlog: int
    log_level: str
    access_log: bool
    forwarded_allow_ips: str | None
    loop: Loop
    http: Http


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT (and created with IPPROTO_TCP, so that asyncio sets
    TCP_NODELAY on the connections it accepts)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ServeError("guards.serve needs SO_REUSEPORT (Linux)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ServeError(f"cannot resolve host {host!r}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return sock


class _Worker(uvicorn.Server):
    """A worker: listens on a socket of its own once the app is imported, says when it is
    ready, and stops when its parent is gone."""

    def __init__(self, config: uvicorn.Config, options: Options, ready: Connection) -> None:
        super().__init__(config)
        self._options = options
        self._ready = ready
        self._parent = os.getppid()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        listener = bound_socket(self._options.host, self._options.port)
        await super().startup(sockets=[listener])
        if self.started:
            self._ready.send_bytes(b"ready")
            # The app is imported and started: what exists now lives as long as the worker.
            # Frozen, those objects are never traversed by the garbage collector again. Without
            # it, the objects of requests in flight (suspended on a store, a provider) survive
            # collections, and promote the worker to full collections that walk every module,
            # class and schema of the app: about 80 ms each, a tenth of a SQLite-backed
            # worker's CPU time under load. (No request is served before this returns.)
            gc.collect()
            gc.freeze()
        self._ready.close()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # At the end of the graceful period, the streams still relayed end with an `error`
        # event (`stop_streams`); uvicorn cancels what is left `STREAMS_STOP_S` later.
        timer = asyncio.get_running_loop().call_later(self._options.timeout_graceful_shutdown_s, stop_streams)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0 and os.getppid() != self._parent:
            self.should_exit = True  # orphaned: the supervisor died without stopping us
        return await super().on_tick(counter)


def run_worker(options: Options, ready: Connection) -> None:
    """A worker process's life: serve until stopped, saying on `ready` when it serves."""
    config = BoundedConfig(
        options.app,
        timeout_header_s=options.timeout_header_s,
        timeout_body_s=options.timeout_body_s,
        min_body_rate=options.min_body_rate,
        host=options.host,
        port=options.port,
        limit_concurrency=options.limit_concurrency,
        timeout_keep_alive=options.timeout_keep_alive_s,
        timeout_graceful_shutdown=options.timeout_graceful_shutdown_s + STREAMS_STOP_S,
        backlog=options.backlog,
        log_level=options.log_level,
        access_log=options.access_log,
        # Forwarded headers name the client only when they come from a trusted proxy.
        proxy_headers=options.forwarded_allow_ips is not None,
        forwarded_allow_ips=options.forwarded_allow_ips or "",
        loop=options.loop,
        protocol=BoundedH11Protocol if options.http == "h11" else BoundedHttpToolsProtocol,
    )
    guard_uvicorn_logs()  # after the config: it (re)configures uvicorn's loggers
    # uvicorn raises the stop signal again once it has stopped, to die of it: as an exception,
    # the worker exits as a process that returns does, through `atexit`, where the log writer
    # writes its last lines (for a second at most: `flush_logs`).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    _Worker(config, options, ready).run()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
