"""A test-only ASGI app for `guards.serve`: it reports, from inside the worker that answers,
what the server did with the connection it came on.

- `GET /probe`: `{"pid", "nodelay", "frozen", "loop", "protocols"}`: the worker's process id,
  whether the accepted socket this request came on has `TCP_NODELAY` set (read with
  `getsockopt` on the worker's own descriptor, found by its peer address), how many objects
  the garbage collector leaves out for good (`gc.get_freeze_count()`), the module of the
  running event loop's class, and the names of the connection protocol classes alive in the
  worker (found among the garbage collector's objects);
- `GET /hold?s=...`: answers after `s` seconds, writing `held-<pid>-<n>` into `$PROBE_DIR`
  first;
- `GET /raise/<words>`: fails with an exception whose message quotes the client's `<words>` (the
  path, percent-decoded: it may carry any character);
- `GET /orphan`: starts a task that fails and that nobody awaits, and lets it be collected:
  asyncio logs "Task exception was never retrieved" (its own logger, with a traceback);
- the lifespan shutdown writes `shutdown-<pid>` into `$PROBE_DIR`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import os
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def accepted_socket_nodelay(client: tuple[str, int]) -> bool:
    """TCP_NODELAY of this process's socket whose peer is `client`."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.type == socket.SOCK_STREAM and sock.getpeername()[:2] == tuple(client):
                    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    raise LookupError(f"no socket connected to {client}")


_held = itertools.count()


def _mark(kind: str, suffix: str = "") -> None:
    folder = os.environ.get("PROBE_DIR")
    if folder:
        Path(folder, f"{kind}-{os.getpid()}{suffix}").touch()


async def _fail() -> None:
    raise RuntimeError("nobody awaits this task")


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                _mark("shutdown")
                await send({"type": "lifespan.shutdown.complete"})
                return
    body: dict[str, Any]
    if scope["path"] == "/probe":
        body = {
            "pid": os.getpid(),
            "nodelay": accepted_socket_nodelay(scope["client"]),
            "frozen": gc.get_freeze_count(),
            "loop": type(asyncio.get_running_loop()).__module__,
            "protocols": sorted(
                {type(o).__name__ for o in gc.get_objects() if type(o).__name__.endswith("Protocol")}
            ),
        }
    elif scope["path"].startswith("/raise/"):
        # A crash whose message quotes the client (its path): the traceback logged.
        said = scope["path"].removeprefix("/raise/")
        raise RuntimeError(f"the client said {said}")
    elif scope["path"] == "/orphan":
        task = asyncio.get_running_loop().create_task(_fail())
        await asyncio.sleep(0)  # the task runs, and fails
        del task
        gc.collect()  # asyncio logs its exception as it goes
        body = {"pid": os.getpid()}
    elif scope["path"] == "/hold":
        _mark("held", f"-{next(_held)}")
        await asyncio.sleep(float(scope["query_string"].decode().removeprefix("s=") or 1))
        body = {"pid": os.getpid()}
    else:
        body = {"ok": True}
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})
