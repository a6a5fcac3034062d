"""`LimitedReceive`: a guarded route stops reading a request body past its `max_body_bytes`.

FastAPI reads a route's whole body into memory before any of the route's code runs (a 100 MB
body cost a worker 386 MB before it was refused), so the limit sits under the request's ASGI
`receive`: the middleware `Guards.install` adds (`guards.routes._middleware`) hands the app
this `receive`, which on its first call (by then the router has put the route's endpoint in
the scope) looks up the guarded route's limit. A declared `Content-Length` over the limit is
refused before a byte of the body is read; a body without one (chunked) is counted as it
arrives and refused once it passes the limit. Either way the read stops there: the rest is
never buffered (the server reads ahead only a small window) and the connection is closed after
the answer.

Refusing is raising `BodyTooLarge`, a 400 `HTTPException`: FastAPI lets it through its body
parsing, and the guards' handler answers it like any unreadable input (`400
invalid_request`, with the request's log line). Routes that are not guarded are not limited.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope

from ..spec._route_spec import route_of

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodyTooLarge", "LimitedReceive"]

#: A guarded route's request body limit unless it declares one (`route(max_body_bytes=...)`).
DEFAULT_MAX_BODY_BYTES = 1 << 20


class BodyTooLarge(HTTPException):
    """The request body passed the route's limit (answered as `400 invalid_request`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(400, f"request body over {limit} bytes")
        self.limit = limit


_UNKNOWN = -2
_UNLIMITED = -1


class LimitedReceive:
    """One request's `receive`, counting the body against its guarded route's limit."""

    __slots__ = ("_left", "_limit", "_receive", "_scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._scope = scope
        self._receive = receive
        self._limit = _UNKNOWN
        #: Body bytes the route may still read.
        self._left = 0

    async def __call__(self) -> Message:
        limit = self._limit if self._limit != _UNKNOWN else self._start()
        if limit < 0:
            return await self._receive()
        message = await self._receive()
        if message["type"] == "http.request":
            self._left -= len(message.get("body", b""))
            if self._left < 0:
                raise BodyTooLarge(limit)
        return message

    def _start(self) -> int:
        """The first read: find the route's limit (`_UNLIMITED` for a route that is not
        guarded, `_UNKNOWN` before routing), and check the declared length against it."""
        if "endpoint" not in self._scope:
            return _UNKNOWN  # read before routing (by another middleware): not the route's read
        route = route_of(self._scope["endpoint"])
        limit = route.max_body_bytes if route is not None else None
        if limit is None:
            self._limit = _UNLIMITED
            return _UNLIMITED
        self._limit = self._left = limit
        for name, value in self._scope["headers"]:
            if name == b"content-length":
                # More than 18 digits is over any limit (and too long to convert cheaply).
                if value.isdigit() and (len(value) > 18 or int(value) > limit):
                    raise BodyTooLarge(limit)
                break
        return limit
