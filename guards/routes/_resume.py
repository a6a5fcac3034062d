"""The resume route guards adds next to each resumable streaming route: `GET <path>/<id>/stream`
(`ResumeRoutes`, answered by the middleware `Guards.install` adds), the AI SDK's resume request
(`DefaultChatTransport.reconnectToStream`) and what an `EventSource` reconnects to.

`<id>` is a chat's id (the `id` of the route's `UIChatRequest`: its current stream) or a
stream's id (the `x-stream-id` header of the stream's response). A `Last-Event-ID` header
(`<stream id>:<n>`, an event's `id`) asks for the events after the n-th of that stream; without
it, the whole stream is sent again (the AI SDK replays a resumed stream from its start). The
stream is looked up for the same caller only (the route's budget keys of the request), so
another caller's id finds nothing.

Answers: 200 with the events (then the live rest, until the stream's last event); 204 when there
is nothing to resume (no such stream for this caller, past its TTL, or the client has its last
event already: the AI SDK then reads no stream, an `EventSource` stops reconnecting); 400
`invalid_request` for a `Last-Event-ID` that is not an event's id. Never a model call.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import Receive, Scope, Send

from ..contracts._envelope import Problem
from ..contracts._responses import PublicError, error_response
from ..contracts._vocabulary import ErrorCode
from ..observe._families import STREAM_RESUMES
from ..observe._log import emit, emit_warning
from ..observe._tallies import counter
from ..spec._route_spec import GuardedRoute, route_of
from ..stores._base import StoreUnavailable
from ..stores._kept import StreamKeeper
from ..streams._event_stream import EventStream
from ..streams._kept import caller, chat_name, numbered, resume_events, stream_key
from ._endpoint import request_trace_id

if TYPE_CHECKING:
    from ..spec._shared import Shared

__all__ = ["ResumeRoutes"]

#: An event's id: `<stream id>:<n>` (a stream id is 22 URL-safe characters).
_EVENT_ID = re.compile(r"([A-Za-z0-9_-]{1,64}):([0-9]{1,9})")
_ID = "guards_stream"


class ResumeRoutes:
    """The resume paths of an app's resumable routes (see the module docstring): guards'
    middleware (`guards.routes._middleware`) asks `answer` for each `GET .../stream` request,
    and passes on those it does not answer."""

    def __init__(self, guards: Shared) -> None:
        self._guards = guards
        self._table: list[tuple[re.Pattern[str], GuardedRoute]] = []
        self._seen: tuple[int, int] = (0, -1)  # (the app's id, its number of routes)

    async def answer(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer `scope` (a `GET` whose path ends in `/stream`) when it is a resume request of
        one of the app's resumable routes; False when it is not."""
        for pattern, route in self._routes(scope.get("app")):
            if (match := pattern.fullmatch(scope["path"])) is not None:
                response = await _resume(self._guards, route, Request(scope, receive), match[_ID])
                await response(scope, receive, send)
                return True
        return False

    def _routes(self, app: Any) -> list[tuple[re.Pattern[str], GuardedRoute]]:
        """The resume paths of `app`'s resumable routes (found again when its routes changed)."""
        routes = getattr(app, "routes", ())
        if self._seen != (id(app), len(routes)):
            table = []
            for each in routes:
                route = route_of(getattr(each, "endpoint", None))
                if (
                    route is not None
                    and route.resumable is not None
                    and "POST" in getattr(each, "methods", ())
                ):
                    table.append((compile_path(f"{each.path}/{{{_ID}}}/stream")[0], route))
            self._table, self._seen = table, (id(app), len(routes))
        return self._table


async def _resume(shared: Shared, route: GuardedRoute, request: Request, given: str) -> Response:
    trace_id = request_trace_id(request)
    store = shared.store
    last = request.headers.get("last-event-id")
    after, stream_id = 0, ""
    if last:
        found = _EVENT_ID.fullmatch(last)
        if found is None:
            _ended(route, "invalid", trace_id)
            problems = [Problem(field="header.last-event-id", problem="value_error")]
            return error_response(
                PublicError(400, ErrorCode.invalid_request, False), trace_id, problems=problems
            )
        stream_id, after = found[1], int(found[2])
    if not isinstance(store, StreamKeeper):
        return _none(route, trace_id)
    who = caller([budget.key for budget in route.budgets], request)
    spec = route.resumable
    assert spec is not None
    writer = route.stream_format.writer

    try:
        if not stream_id:
            stream_id = await store.kept_get(chat_name(route.name, who, given)) or given

        def end(reason: str, detail: str) -> Any:
            def event(n: int) -> bytes:
                data = {"guard": "call", "reason": reason, "detail": detail, "trace_id": trace_id}
                return numbered(writer().error(data), stream_id, n)

            return event

        events = await resume_events(
            store,
            stream_key(route.name, who, stream_id),
            after,
            max_s=route.stream_max_s,
            over=end(
                "provider_error",
                f"the stream passed what is kept of it ({spec.max_events} events or "
                f"{spec.max_bytes} bytes): its rest cannot be resumed",
            ),
            late=end(
                "timeout", f"the resumed stream did not end within its time limit ({route.stream_max_s:g}s)"
            ),
        )
    except StoreUnavailable:
        emit_warning("stream_not_resumed", route=route.name, reason="store")
        return _none(route, trace_id)
    if events is None:
        return _none(route, trace_id)
    _ended(route, "resumed", trace_id)
    response = EventStream(events, {**route.stream_format.headers, "x-stream-id": stream_id})
    response.raw_headers.append((b"x-trace-id", trace_id.encode()))
    return response


def _none(route: GuardedRoute, trace_id: str) -> Response:
    _ended(route, "none", trace_id)
    return Response(status_code=204, headers={"x-trace-id": trace_id})


def _ended(route: GuardedRoute, outcome: str, trace_id: str) -> None:
    counter(STREAM_RESUMES, route.name, outcome).add()
    emit("stream_resume", route=route.name, outcome=outcome, trace_id=trace_id)
