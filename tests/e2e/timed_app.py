"""The example app (`app.main:app`) under an outermost ASGI wrapper that times each answer in the
server: from the request's arrival at the app to its response's last body message sent, so a
test bounds what the server itself took, apart from its clients' own costs.

`GET /_timings` (answered by the wrapper itself, untimed) gives the timings so far as JSON:
`[[method, path, status, seconds], ...]`, oldest first, at most `MAX_TIMINGS`.
"""

from __future__ import annotations

import json
from time import perf_counter

from starlette.types import Message, Receive, Scope, Send

from app.main import app as example_app

__all__ = ["app"]

#: The most timings kept (a burst is 1,000 requests, plus its neighbours).
MAX_TIMINGS = 10_000
_timings: list[tuple[str, str, int, float]] = []


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        await example_app(scope, receive, send)
        return
    arrived = perf_counter()
    if scope["path"] == "/_timings":
        body = json.dumps(_timings).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    status = 0

    async def timed_send(message: Message) -> None:
        nonlocal status
        await send(message)
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            seconds = perf_counter() - arrived
            if len(_timings) < MAX_TIMINGS:
                _timings.append((scope["method"], scope["path"], status, seconds))

    await example_app(scope, receive, timed_send)
