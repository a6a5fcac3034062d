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
import dataclasses
import logging
import resource
import sys
from collections.abc import Sequence
from typing import TypeVar

from .contracts._extras import missing_extra
from .observe._log import write_behind

try:
    import uvicorn

    from .serving._connections import Http, Loop, installed
    from .serving._logs import guard_uvicorn_logs
    from .serving._supervisor import Supervisor
    from .serving._worker import Options, ServeError, bound_socket
except ModuleNotFoundError as _error:  # the extra [serve]
    if (_error.name or "").partition(".")[0] != "uvicorn":
        raise
    _missing = missing_extra(
        _error, "serve", "python -m guards.serve" if __name__ == "__main__" else "guards.serve"
    )
    if __name__ == "__main__":
        sys.exit(str(_missing))
    raise _missing from None

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
#: `--loop` and `--http`: "auto" takes the first one installed (uvicorn's choice).
_LOOPS: tuple[Loop, ...] = ("uvloop", "asyncio")
_HTTPS: tuple[Http, ...] = ("httptools", "h11")
_Name = TypeVar("_Name", Loop, Http)


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
    guard_uvicorn_logs()
    options = Options(
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
    with bound_socket(host, port) as reserved:
        options = dataclasses.replace(options, port=reserved.getsockname()[1])
        return Supervisor(options, workers).run()


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


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `python -m guards.serve APP [options]` (see `--help`)."""
    args = _parser().parse_args(argv)
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


def _parser() -> argparse.ArgumentParser:
    """`main`'s options: `serve`'s, under their command-line names."""
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
    return parser


if __name__ == "__main__":
    sys.exit(main())
