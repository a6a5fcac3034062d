"""The `400 invalid_request` of input that never reached a guarded handler: invalid (FastAPI's
`RequestValidationError`), unreadable (a body FastAPI could not parse) or over the route's
`max_body_bytes` (`BodyTooLarge`). Answered with what to fix (`problems`: field paths and
pydantic error types, never what was sent), counted, logged and traced, with no model call.
`Guards.install` registers `invalid_input_handler`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from ..contracts._envelope import MAX_PROBLEMS, Problem
from ..contracts._responses import PublicError, error_response
from ..contracts._vocabulary import ErrorCode
from ..observe._log import emit
from ..observe._metrics import flush_soon
from ..spec._route_spec import GuardedRoute, route_of
from ._body_limit import BodyTooLarge
from ._endpoint import handler_entered, request_trace_id

if TYPE_CHECKING:
    from ..spec._tracing import Tracing

__all__ = ["invalid_input_handler"]

#: The longest field path (or problem token) a 400 reports; a longer one is cut.
_FIELD_MAX = 200


def invalid_input_handler(
    previous: Any, tracing: Tracing | None
) -> Callable[[Request, Exception], Awaitable[Response]]:
    """The exception handler `Guards.install` registers for FastAPI's
    `RequestValidationError` and Starlette's `HTTPException`: input that never reached a guarded
    handler (invalid, or a body FastAPI could not parse) is answered `400 invalid_request`;
    everything else goes to `previous`, the handler registered before (None: raised again)."""

    async def handle(request: Request, exc: Exception) -> Response:
        route = route_of(request.scope.get("endpoint"))
        before_handler = route is not None and not handler_entered(request)
        if before_handler and (isinstance(exc, RequestValidationError) or _is_bad_request(exc)):
            assert route is not None
            return _invalid_request(route, request, exc, tracing)
        if previous is None:
            raise exc
        response: Response = await previous(request, exc)
        return response

    return handle


def _is_bad_request(exc: Exception) -> bool:
    # FastAPI raises HTTPException(400) for a body it cannot parse at all.
    return isinstance(exc, StarletteHTTPException) and exc.status_code == 400


def _invalid_request(
    route: GuardedRoute, request: Request, exc: Exception, tracing: Tracing | None
) -> Response:
    """The 400 of input that never reached the guarded handler (unreadable, invalid, or a body
    over the route's limit): counted as `outcome="invalid"`, logged (and traced), no model call."""
    if tracing is None:
        trace_id = request_trace_id(request)
    else:
        trace = tracing.start(route.name, request, lambda: request_trace_id(request))
        trace.finish("invalid", 400, None, ErrorCode.invalid_request, 0, requested=route.model)
        trace_id = trace.trace_id
    found = _problems(exc, route.input_names)
    route.metrics.invalid.add()
    flush_soon(time.perf_counter())
    emit(
        "request",
        route=route.name,
        trace_id=trace_id,
        outcome="error",
        status=400,
        error=ErrorCode.invalid_request.value,
        problems=[f"{p.field}:{p.problem}" for p in found],
        attempts=0,
    )
    return error_response(PublicError(400, ErrorCode.invalid_request, False), trace_id, problems=found)


#: Where FastAPI says an invalid input came from: the first element of its location.
_SOURCES = frozenset({"body", "query", "path", "header", "cookie"})


def _problems(exc: Exception, names: frozenset[str]) -> list[Problem]:
    """What to fix: each field path and pydantic error type, in pydantic's order, without
    duplicates, at most `MAX_PROBLEMS`. Never the input, its `msg` or its `ctx`, nor a key the
    client wrote (a `dict` field's, an unknown field's): a path holds where the input came
    from (`body`, `query`...), list indices and the names the route declares (`names`), and
    `<key>` for anything else."""
    if isinstance(exc, BodyTooLarge):  # over the route's `max_body_bytes`, never read whole
        return [Problem(field="body", problem="too_long")]
    if not isinstance(exc, RequestValidationError):
        # FastAPI could not read the body at all (e.g. bytes that are not UTF-8 JSON).
        return [Problem(field="body", problem="json_invalid")]
    found: dict[tuple[str, str], None] = {}
    for error in exc.errors():
        loc = tuple(error.get("loc", ()))
        kind = str(error.get("type", "invalid"))
        if kind == "json_invalid":
            loc = loc[:1]  # (body, character offset): the offset is not a field
        told = [
            part if isinstance(part, int) or part in names or (at == 0 and part in _SOURCES) else "<key>"
            for at, part in enumerate(loc)
        ]
        field = ".".join(str(part) for part in told)[:_FIELD_MAX] or "body"
        found[(field, kind[:_FIELD_MAX])] = None
        if len(found) == MAX_PROBLEMS:
            break
    return [Problem(field=field, problem=problem) for field, problem in found]
