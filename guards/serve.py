"""Serve an ASGI app with uvicorn in n worker processes: `python -m guards.serve`.

    python -m guards.serve app.main:app --host 0.0.0.0 --port 8000 --workers 4

Why not `uvicorn --workers n`: uvicorn binds its shared listening socket without `IPPROTO_TCP`,
so asyncio never sets `TCP_NODELAY` on the connections it accepts and every keep-alive response
waits for the client's delayed ACK (about 40 ms on Linux; uvicorn issue 3149); the shared socket
also hands most keep-alive connections to one worker; and uvicorn has no header or body read
timeout, so slow clients can hold every descriptor a worker has.

Here each worker listens on a socket of its own, bound with `SO_REUSEPORT` and created with
`IPPROTO_TCP`: the kernel spreads connections across the workers, and every accepted connection
has `TCP_NODELAY`. Each worker is a `uvicorn.Server` (HTTP/1.1) bounded as
`guards.serving._connections` describes: header and body read timeouts, and at most about
`limit_concurrency` open connections, with 503 past it. As uvicorn does, a worker runs on
uvloop and parses HTTP with httptools when they are installed (the extra [serve] installs them
where they build), else on asyncio's loop with h11; `--loop` and `--http` choose, and the
start-up line says which. The open file limit is checked, and raised up to its hard limit,
before any worker starts.

The parent process supervises: SIGINT or SIGTERM stops the workers gracefully (uvicorn finishes
the requests in flight, for at most `timeout_graceful_shutdown_s`: then every stream still
relayed ends with an `error` event, `call`/`timeout`, its spend settled and its request logged
with `"cut": "shutdown"`, and a second later what is left is cancelled; a second signal forces
them),
a worker that dies is replaced, and a worker that fails while starting stops the server (exit
status 3). Linux: other systems do not balance `SO_REUSEPORT` sockets.

What the workers and the supervisor log through uvicorn's loggers (the access log included) or
logging's last resort (asyncio's records) is written by guards' log writer, never on the event
loop nor between the supervisor's signals: a stderr or stdout that nobody reads drops lines
(counted), and holds up no request and no stop (`guards.observe._log.write_behind`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import multiprocessing
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TypeVar

from .contracts._extras import missing_extra
from .observe._log import write_behind
from .streams._relay import stop_streams

try:
    import uvicorn

    from .serving._connections import BoundedConfig, BoundedH11Protocol, Http, Loop, installed
except ModuleNotFoundError as _error:  # the extra [serve]
    if (_error.name or "").partition(".")[0] != "uvicorn":
        raise
    _missing = missing_extra(
        _error, "serve", "python -m guards.serve" if __name__ == "__main__" else "guards.serve"
    )
    if __name__ == "__main__":
        sys.exit(str(_missing))
    raise _missing from None

try:
    from .serving._connections_httptools import BoundedHttpToolsProtocol
except ImportError:  # httptools is not installed (it does not build everywhere): h11 only
    BoundedHttpToolsProtocol = None  # type: ignore[assignment,misc]

__all__ = [
    "DEFAULT_LIMIT_CONCURRENCY",
    "DEFAULT_MIN_BODY_RATE",
    "DEFAULT_TIMEOUT_BODY_S",
    "DEFAULT_TIMEOUT_HEADER_S",
    "RESERVED_FILES",
    "ServeError",
    "main",
    "serve",
]

logger = logging.getLogger("uvicorn.error")

#: Connections per worker (open, or requests in flight) past which uvicorn answers 503.
DEFAULT_LIMIT_CONCURRENCY = 1000
#: Seconds for a request head to arrive whole.
DEFAULT_TIMEOUT_HEADER_S = 10.0
#: Seconds for a request body to arrive whole once its head has, plus one second per
#: `DEFAULT_MIN_BODY_RATE` bytes received.
DEFAULT_TIMEOUT_BODY_S = 10.0
#: Bytes per second a request body keeps up with on average, past `DEFAULT_TIMEOUT_BODY_S`.
DEFAULT_MIN_BODY_RATE = 1000
#: Descriptors a worker needs besides its connections: the listening socket, the connections
#: asyncio accepts in one turn of the loop before any of them counts (`backlog`), and the app's
#: own (the provider connection pool of 100, the store, log and metric files, the interpreter's).
RESERVED_FILES = 256
#: The least `limit_concurrency` the default is lowered to when the open file limit is small.
_MIN_LIMIT_CONCURRENCY = 64
_STARTUP_FAILURE = 3
#: Seconds the streams told to stop at the end of the graceful period have to send their
#: `error` event and settle, before uvicorn cancels the requests still in flight.
_STREAMS_STOP_S = 1
#: `--loop` and `--http`: "auto" takes the first one installed (uvicorn's choice).
_LOOPS: tuple[Loop, ...] = ("uvloop", "asyncio")
_HTTPS: tuple[Http, ...] = ("httptools", "h11")
_Name = TypeVar("_Name", Loop, Http)


class ServeError(Exception):
    """The server cannot start as asked (bad option, open file limit, address in use)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
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


def serve(
    app: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 1,
    limit_concurrency: int | None = None,
    timeout_header_s: float = DEFAULT_TIMEOUT_HEADER_S,
    timeout_body_s: float = DEFAULT_TIMEOUT_BODY_S,
    min_body_rate: int = DEFAULT_MIN_BODY_RATE,
    timeout_keep_alive_s: int = 5,
    timeout_graceful_shutdown_s: int = 30,
    backlog: int = 128,
    log_level: str = "info",
    access_log: bool = True,
    forwarded_allow_ips: str | None = None,
    loop: str = "auto",
    http: str = "auto",
) -> int:
    """Serve `app` ("module:attribute", imported by each worker) until SIGINT or SIGTERM
    (from the main thread: it handles those signals while it runs).

    `limit_concurrency` is per worker; by default `DEFAULT_LIMIT_CONCURRENCY`, lowered (with a
    warning) when the open file limit cannot hold it plus `backlog` and `RESERVED_FILES`. Returns
    the exit status: 0 after a graceful stop, 1 when a worker had to be killed, 3 when a worker
    failed to start. Raises `ServeError` before any worker starts when the options cannot work.

    `forwarded_allow_ips`: the proxies (comma-separated addresses or networks, `*` for any)
    whose `X-Forwarded-For` and `X-Forwarded-Proto` name the client and its scheme. None (the
    default) trusts no one: the client is the connection's peer, whatever headers it sends.
    Whatever the workers and the supervisor log through uvicorn's loggers is escaped: no raw
    control character of a client's (a header, a path) reaches the log.

    `timeout_header_s`: seconds for a request head to arrive whole, else 408 and the connection
    closed. `timeout_body_s` and `min_body_rate`: a request body must arrive whole within
    `timeout_body_s` of its head plus one second per `min_body_rate` bytes received, else 408
    and the connection closed; a connection receiving a body behind `min_body_rate` (bytes per
    second since its head) is closed (408) when a new one needs room under `limit_concurrency`.

    `loop` ("auto", "uvloop", "asyncio") and `http` ("auto", "httptools", "h11"): the event
    loop and HTTP parser of the workers; "auto" takes uvloop and httptools when they are
    installed, asyncio and h11 otherwise.
    """
    if workers < 1 or backlog < 1 or timeout_header_s <= 0 or timeout_keep_alive_s < 1:
        raise ServeError("workers, backlog, timeout_header_s and timeout_keep_alive_s must be positive")
    if timeout_body_s <= 0 or min_body_rate < 1:
        raise ServeError("timeout_body_s and min_body_rate must be positive")
    if limit_concurrency is not None and limit_concurrency < 2:
        raise ServeError("limit_concurrency must be at least 2")
    chosen_loop, chosen_http = _stack(loop, http)
    uvicorn.Config(app, log_level=log_level)  # configures uvicorn's loggers in this process too
    _guard_uvicorn_logs()
    options = _Options(
        app=app,
        host=host,
        port=port,
        limit_concurrency=_fit_open_files(limit_concurrency, backlog),
        timeout_header_s=timeout_header_s,
        timeout_body_s=timeout_body_s,
        min_body_rate=min_body_rate,
        timeout_keep_alive_s=timeout_keep_alive_s,
        timeout_graceful_shutdown_s=timeout_graceful_shutdown_s,
        backlog=backlog,
        log_level=log_level,
        access_log=access_log,
        forwarded_allow_ips=forwarded_allow_ips or None,
        loop=chosen_loop,
        http=chosen_http,
    )
    # Held (bound, never listening) for the server's lifetime: it fixes the port when 0 is
    # asked and keeps it ours while workers come and go; the kernel routes no connection to it.
    with _bound_socket(host, port) as reserved:
        options = dataclasses.replace(options, port=reserved.getsockname()[1])
        return _Supervisor(options, workers).run()


def _stack(loop: str, http: str) -> tuple[Loop, Http]:
    """The event loop and HTTP parser asked, "auto" resolved as uvicorn resolves it."""
    return _choose("loop", loop, _LOOPS), _choose("http", http, _HTTPS)


def _choose(option: str, asked: str, known: tuple[_Name, ...]) -> _Name:
    """`asked` among `known` (the fast one first, then the one uvicorn always has)."""
    fast, fallback = known
    if asked == "auto":
        return fast if installed(fast) else fallback
    if asked == fallback:
        return fallback
    if asked != fast:
        raise ServeError(f"{option} must be auto, {fast} or {fallback}, not {asked!r}")
    if not installed(fast):
        raise ServeError(f"--{option} {fast} needs {fast}: pip install 'route-guards[serve]'")
    return fast


def _fit_open_files(limit: int | None, backlog: int) -> int:
    """`limit_concurrency` within the open file limit, raising the soft limit as needed."""
    wanted = limit if limit is not None else DEFAULT_LIMIT_CONCURRENCY
    need = wanted + backlog + RESERVED_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(hard, need)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    room = soft - backlog - RESERVED_FILES
    if limit is not None or room < _MIN_LIMIT_CONCURRENCY:
        raise ServeError(
            f"limit_concurrency {wanted} needs an open file limit of {need} (connections, backlog "
            f"{backlog}, {RESERVED_FILES} for the app) but the limit is {soft}: raise it "
            f"(ulimit -n) or lower limit_concurrency"
        )
    logger.warning("Open file limit %d: limit_concurrency lowered to %d per worker.", soft, room)
    return room


def _bound_socket(host: str, port: int) -> socket.socket:
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

    def __init__(self, config: uvicorn.Config, options: _Options, ready: Connection) -> None:
        super().__init__(config)
        self._options = options
        self._ready = ready
        self._parent = os.getppid()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        listener = _bound_socket(self._options.host, self._options.port)
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
        # event (`stop_streams`); uvicorn cancels what is left `_STREAMS_STOP_S` later.
        timer = asyncio.get_running_loop().call_later(self._options.timeout_graceful_shutdown_s, stop_streams)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0 and os.getppid() != self._parent:
            self.should_exit = True  # orphaned: the supervisor died without stopping us
        return await super().on_tick(counter)


def _run_worker(options: _Options, ready: Connection) -> None:
    config = BoundedConfig(
        options.app,
        timeout_header_s=options.timeout_header_s,
        timeout_body_s=options.timeout_body_s,
        min_body_rate=options.min_body_rate,
        host=options.host,
        port=options.port,
        limit_concurrency=options.limit_concurrency,
        timeout_keep_alive=options.timeout_keep_alive_s,
        timeout_graceful_shutdown=options.timeout_graceful_shutdown_s + _STREAMS_STOP_S,
        backlog=options.backlog,
        log_level=options.log_level,
        access_log=options.access_log,
        # Forwarded headers name the client only when they come from a trusted proxy.
        proxy_headers=options.forwarded_allow_ips is not None,
        forwarded_allow_ips=options.forwarded_allow_ips or "",
        loop=options.loop,
        protocol=BoundedH11Protocol if options.http == "h11" else BoundedHttpToolsProtocol,
    )
    _guard_uvicorn_logs()  # after the config: it (re)configures uvicorn's loggers
    # uvicorn raises the stop signal again once it has stopped, to die of it: as an exception,
    # the worker exits as a process that returns does, through `atexit`, where the log writer
    # writes its last lines (for a second at most: `flush_logs`).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    _Worker(config, options, ready).run()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@dataclasses.dataclass
class _Slot:
    process: BaseProcess
    ready: Connection | None  # None once the worker said it is ready (or closed the pipe)
    started: bool = False


class _Supervisor:
    def __init__(self, options: _Options, workers: int) -> None:
        self.options = options
        self.workers = workers
        self.context = multiprocessing.get_context("spawn")
        self.slots: list[_Slot] = []
        self.signals = 0

    def run(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
        old_wakeup = signal.set_wakeup_fd(wake_w)  # a signal's number is written there
        try:
            logger.info(
                "guards.serve: http://%s:%d, %d worker(s), %s + %s, limit_concurrency %d, "
                "timeout_header %g s, timeout_body %g s + 1 s per %d bytes (Press CTRL+C to quit)",
                self.options.host,
                self.options.port,
                self.workers,
                self.options.loop,
                self.options.http,
                self.options.limit_concurrency,
                self.options.timeout_header_s,
                self.options.timeout_body_s,
                self.options.min_body_rate,
            )
            self.slots = [self._start() for _ in range(self.workers)]
            status = self._supervise(wake_r)
            return self._stop(wake_r, status)
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(wake_r)
            os.close(wake_w)

    def _start(self) -> _Slot:
        reader, writer = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_run_worker, args=(self.options, writer), name="guards-worker")
        process.start()
        writer.close()  # the worker holds the only writer: its exit closes the pipe
        return _Slot(process, reader)

    def _supervise(self, wake_r: int) -> int | None:
        """Until a signal (None) or a worker that fails to start (its exit status)."""
        while True:
            events = wait([wake_r, *self._watched()])
            if wake_r in events:
                self.signals += len(os.read(wake_r, 64))
                return None
            for index, slot in enumerate(self.slots):
                if slot.ready is not None and slot.ready in events:
                    slot.started = _said_ready(slot.ready)
                    slot.ready.close()
                    slot.ready = None
                if slot.process.sentinel in events and slot.ready is None:
                    slot.process.join()
                    code = slot.process.exitcode
                    if not slot.started:
                        logger.error("Worker [%d] failed to start (exit status %s).", slot.process.pid, code)
                        return _STARTUP_FAILURE
                    logger.warning(
                        "Worker [%d] died (exit status %s): starting another.", slot.process.pid, code
                    )
                    self.slots[index] = self._start()

    def _watched(self) -> list[Connection | int]:
        # A worker's death is handled once its ready pipe is read (it closes with the worker).
        return [slot.ready if slot.ready is not None else slot.process.sentinel for slot in self.slots]

    def _stop(self, wake_r: int, status: int | None) -> int:
        """Stop every worker gracefully (SIGTERM), forcing them (SIGINT) on a second signal and
        killing what is left after the graceful timeout."""
        self._signal_workers(signal.SIGTERM)  # first: nothing may delay it, not even a log line
        logger.info("Stopping %d worker(s).", len(self.slots))
        deadline = time.monotonic() + self.options.timeout_graceful_shutdown_s + _STREAMS_STOP_S + 5
        give_up = False
        while (alive := [s.process.sentinel for s in self.slots if s.process.is_alive()]) and not give_up:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            events = wait([wake_r, *alive], timeout=remaining)
            if wake_r in events:
                self.signals += len(os.read(wake_r, 64))
                self._signal_workers(signal.SIGINT)
                give_up = self.signals > 2  # a third signal: kill what is left now
        killed = False
        for slot in self.slots:
            if slot.process.is_alive():
                logger.error("Worker [%d] did not stop in time: killed.", slot.process.pid)
                slot.process.kill()
                killed = True
            slot.process.join()
            if slot.ready is not None:
                slot.ready.close()
        if status is not None:
            return status
        return 1 if killed else 0

    def _signal_workers(self, sig: signal.Signals) -> None:
        for slot in self.slots:
            if slot.process.is_alive() and slot.process.pid is not None:
                os.kill(slot.process.pid, sig)


#: C0 and C1 control characters and DEL, each as `\xNN`.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
#: The same but the newline, which separates a traceback's lines.
_CONTROLS_BUT_NEWLINE = {c: text for c, text in _CONTROLS.items() if c != 0x0A}


_TRACEBACK = logging.Formatter()


class _EscapeControls(logging.Filter):
    """What a client sends cannot move a terminal's cursor, clear it, color it or start a log
    line of its own. Escapes a record's arguments (a client's address, path, header: every control
    character) and its message (all but the newlines of the code's own text) in place, before
    any formatter sees them (a traceback too); uvicorn's access formatter reads the arguments
    as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = record.msg.translate(_CONTROLS_BUT_NEWLINE)
        args = record.args
        if isinstance(args, tuple) and any(isinstance(arg, str) for arg in args):
            record.args = tuple(arg.translate(_CONTROLS) if isinstance(arg, str) else arg for arg in args)
        if record.exc_info and not record.exc_text:
            # A traceback's last line repeats its exception's message, which may quote a client.
            record.exc_text = _TRACEBACK.formatException(record.exc_info).translate(_CONTROLS_BUT_NEWLINE)
        return True


def _guard_uvicorn_logs() -> None:
    """Put guards' log writer behind uvicorn's loggers and logging's last resort (asyncio's
    records reach it): a full stderr or stdout never blocks the event loop, nor the
    supervisor's signals, and what the writer cannot take is dropped and counted
    (`guards.observe._log.write_behind`); and escape what every handler of uvicorn's loggers writes
    (see `_EscapeControls`)."""
    names = ("uvicorn", "uvicorn.error", "uvicorn.access")
    write_behind(*names)
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _EscapeControls) for f in handler.filters):
                handler.addFilter(_EscapeControls())


def _said_ready(ready: Connection) -> bool:
    try:
        return ready.recv_bytes() == b"ready"
    except (EOFError, OSError):
        return False  # the worker exited before it was ready


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `python -m guards.serve APP [options]` (see `--help`)."""
    parser = argparse.ArgumentParser(
        prog="python -m guards.serve",
        description="Serve an ASGI app with uvicorn in n worker processes, each on a SO_REUSEPORT "
        "socket of its own (TCP_NODELAY on every connection), with header and body read "
        "timeouts and a bounded number of connections per worker.",
    )
    parser.add_argument("app", help='the ASGI app, as "module:attribute"')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port (logged)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help=f"per worker: past it, 503 (default {DEFAULT_LIMIT_CONCURRENCY}, lowered to fit the "
        "open file limit)",
    )
    parser.add_argument(
        "--timeout-header",
        type=float,
        default=DEFAULT_TIMEOUT_HEADER_S,
        help="seconds for a request head to arrive whole (default %(default)s)",
    )
    parser.add_argument(
        "--timeout-body",
        type=float,
        default=DEFAULT_TIMEOUT_BODY_S,
        help="seconds for a request body to arrive whole once its head has, plus 1 s per "
        "--min-body-rate bytes received (default %(default)s)",
    )
    parser.add_argument(
        "--min-body-rate",
        type=int,
        default=DEFAULT_MIN_BODY_RATE,
        help="bytes per second a request body keeps up with past --timeout-body; a connection "
        "behind it makes room for new ones under the limit (default %(default)s)",
    )
    parser.add_argument("--timeout-keep-alive", type=int, default=5, help="default %(default)s")
    parser.add_argument("--timeout-graceful-shutdown", type=int, default=30, help="default %(default)s")
    parser.add_argument("--backlog", type=int, default=128, help="default %(default)s")
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    parser.add_argument("--no-access-log", dest="access_log", action="store_false")
    parser.add_argument(
        "--forwarded-allow-ips",
        default=None,
        metavar="ADDRESSES",
        help="the proxies (comma-separated addresses or networks, * for any) trusted to name the "
        "client in X-Forwarded-For and X-Forwarded-Proto (default: none; the client is the peer)",
    )
    parser.add_argument(
        "--loop",
        default="auto",
        choices=["auto", *_LOOPS],
        help="the event loop (default auto: uvloop when installed, else asyncio)",
    )
    parser.add_argument(
        "--http",
        default="auto",
        choices=["auto", *_HTTPS],
        help="the HTTP/1.1 parser (default auto: httptools when installed, else h11)",
    )
    args = parser.parse_args(argv)
    write_behind()  # a `ServeError` before uvicorn's loggers are set up reaches the last resort
    try:
        return serve(
            args.app,
            host=args.host,
            port=args.port,
            workers=args.workers,
            limit_concurrency=args.limit_concurrency,
            timeout_header_s=args.timeout_header,
            timeout_body_s=args.timeout_body,
            min_body_rate=args.min_body_rate,
            timeout_keep_alive_s=args.timeout_keep_alive,
            timeout_graceful_shutdown_s=args.timeout_graceful_shutdown,
            backlog=args.backlog,
            log_level=args.log_level,
            access_log=args.access_log,
            forwarded_allow_ips=args.forwarded_allow_ips,
            loop=args.loop,
            http=args.http,
        )
    except ServeError as exc:
        logger.error("guards.serve: %s", exc)  # behind the writer: a full stderr cannot hold the exit
        return 2


if __name__ == "__main__":
    sys.exit(main())
