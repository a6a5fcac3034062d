"""`GuardedEndpoint`: what FastAPI calls for each request of a guarded route.

The route decorator (`guards.routes._route`) checks a declaration and builds its `GuardedRoute` once, at
start-up; this is the per-request part. A request installs guards on its app if they are not (once
per app), gets its `AI` (with its caller's first store step: `_first_step`), passes the service
level's shedding, runs the handler, and ends in one of: the handler's value (validated against the
route's type, in the envelope on a degrading route), the fallback or the public error when a guard
tripped, or `application_failure` when the handler's own code failed: one `RequestEnded` each.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Awaitable, Callable, Mapping
from random import getrandbits
from time import perf_counter
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, TypeAdapter
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ..contracts._errors import GuardTripped
from ..contracts._responses import PublicError, error_response, public_error
from ..contracts._vocabulary import ErrorCode, Kind
from ..observe._log import emit_error, frames
from ..policies._budget import scoped_charge, scoped_keys
from ..policies._last_good import LastGoodCache
from ..stores import Charge, Step
from ..streams._event_stream import EventStream
from ..waits._arrival import ARRIVED
from ..walk import AI, TASK_SCOPE, Observers, walk_step
from ..walk._checkpoints import resumed
from ._attribution import add_attribution
from ._chat import note_chat
from ._prepared import FallbackAnswers

if TYPE_CHECKING:
    from ..spec._route_spec import GuardedRoute
    from ..spec._shared import Shared
    from ..walk._events import RequestEnded

__all__ = [
    "REQUEST_PARAMETER",
    "RESPONSE_PARAMETER",
    "GuardedEndpoint",
    "handler_entered",
    "request_trace_id",
]

#: The endpoint's parameters FastAPI fills with the request and its sub-response.
REQUEST_PARAMETER = "guards_request_"
RESPONSE_PARAMETER = "guards_response_"
_ENTERED = "guards.handler_entered"
_TRACE_ID = re.compile(r"^[A-Za-z0-9._-]{8,64}$")
#: The most first steps a route keeps (`GuardedEndpoint._first_steps`), and the longest caller
#: key kept.
_MAX_FIRST_STEPS = 1024
_MAX_KEPT_CALLER = 128


class GuardedEndpoint:
    """The endpoint of one guarded route (see the module's docstring): called by FastAPI with
    the handler's parameters, the request and the sub-response; `ai_name` is the handler's
    `AI` parameter, `plain` its fallback value or function (without `LastGood`), `data_type`
    what it returns and `envelope_type` the envelope of that (None on a strict route)."""

    # Slots, read on every request; `__dict__` for what `functools.update_wrapper` and FastAPI
    # set (the handler's name, docstring, signature).
    __slots__ = (
        "__dict__",
        "_ai_name",
        "_app",
        "_budget",
        "_budget_key",
        "_budget_prefix",
        "_data_adapter",
        "_data_class",
        "_enter_levels",
        "_envelope_type",
        "_fallback_answers",
        "_first_steps",
        "_handler",
        "_last_good",
        "_observers",
        "_plain",
        "_route",
        "_shared",
        "_unbudgeted",
    )

    def __init__(
        self,
        shared: Shared,
        route: GuardedRoute,
        handler: Callable[..., Awaitable[Any]],
        *,
        ai_name: str,
        data_type: Any,
        data_adapter: TypeAdapter[Any],
        envelope_type: Any,
        plain: Any,
        last_good: LastGoodCache | None,
        request_name: str | None = None,
        response_name: str | None = None,
    ) -> None:
        functools.update_wrapper(self, handler)
        #: The handler's own `Request` and `Response` parameters (`_route.declared`), else None:
        #: guards' own, added to the signature and taken out before the handler is called.
        self.request_name, self.response_name = request_name, response_name
        self._shared = shared
        self._route = route
        self._handler = handler
        self._ai_name = ai_name
        self._data_adapter = data_adapter
        # An instance of exactly the route's model class needs no second validation.
        self._data_class = (
            data_type if isinstance(data_type, type) and issubclass(data_type, BaseModel) else None
        )
        self._envelope_type = envelope_type
        self._plain = plain
        self._last_good = last_good
        #: The untraced requests' observers (a traced request gets its own, with its spans).
        self._observers = Observers(shared)
        self._budget = route.budget
        self._budget_prefix = f"guards:{route.scope}:"
        #: The caller's key per budget: the budget's own (one budget), else every budget's
        #: keys in a tuple (`scoped_keys`).
        self._budget_key: Callable[[Request], Any] | None = (
            None
            if route.budget is None
            else route.budget.key
            if len(route.budgets) == 1
            else scoped_keys(route.budgets)
        )
        # The walk's first store step: the route's own without a budget; else one per caller,
        # with their budget's charge (a spend cap's amount is set per request, in the walk),
        # each built once and kept, bounded (`_first_step`).
        self._unbudgeted = walk_step(route, 0, None, None)
        self._first_steps: dict[str, Step] = {}
        #: A degrading route's fallback envelopes, kept and prepared (`guards.routes._prepared`).
        self._fallback_answers = (
            None
            if envelope_type is None
            else FallbackAnswers(envelope_type, data_adapter, last_good is not None or callable(plain))
        )
        # Shedding, and counting requests in flight, cost nothing to a route that needs neither.
        self._enter_levels = route.shed_at is not None or shared.levels.max_in_flight is not None
        self._app: object = None  # the app it last served, guards installed there (`__call__`)

    async def __call__(self, **kwargs: Any) -> Any:
        request: Request = (
            kwargs.pop(REQUEST_PARAMETER) if (name := self.request_name) is None else kwargs[name]
        )
        response: Response = (
            kwargs.pop(RESPONSE_PARAMETER) if (name := self.response_name) is None else kwargs[name]
        )
        scope = request.scope
        scope[_ENTERED] = True
        if (app := scope.get("app")) is not self._app:  # once per app: guards installed there
            self._app = app
            self._shared._ensure_installed(app, self._route.name)
        started = scope.get(ARRIVED) or perf_counter()  # from its arrival (`guards.waits._arrival`)
        shared, route = self._shared, self._route
        # With tracing on, the request's span (its trace id is the `x-trace-id`), current
        # while the handler runs; ended with the request's outcome (`Observers.request_ended`).
        trace = (
            None
            if shared.tracing is None
            else shared.tracing.start(route.name, request, lambda: request_trace_id(request))
        )
        if trace is None:
            observe, trace_id = self._observers, request_trace_id(request)
        else:
            observe, trace_id = Observers(shared, trace), trace.trace_id
        budget_key = self._budget_key
        if budget_key is None:
            first = self._unbudgeted
        else:
            caller = budget_key(request)
            first = self._first_steps.get(caller) or self._first_step(caller)
        ai: AI[Any] = AI(shared, route, first, trace_id, request, started, observe)
        if route.resumable is not None:  # a chat's stream is resumed by its chat id
            note_chat(kwargs, scope)
        kwargs[ai_name := self._ai_name] = ai
        if route.task is not None and (run := request.scope.get(TASK_SCOPE)) is not None:
            run.called = ai  # what the request called decides what its task leaves (`TaskRun.release`)
        try:
            if trace is not None:
                trace.enter()
            if self._enter_levels and (shed := shared.levels.enter(route, request.scope)) is not None:
                raise shed  # answered at once, like an open breaker: no call, no charge
            value = await self._handler(**kwargs)
            if type(value) is not self._data_class and not isinstance(value, Response):
                value = self._data_adapter.validate_python(value)
            if (last_good := self._last_good) is not None and not isinstance(value, Response):
                # A validated success: remembered with the route's own arguments.
                arguments = {name: given for name, given in kwargs.items() if name != ai_name}
                await last_good.remember(shared.store, arguments, value, trace_id)
        except GuardTripped as tripped:
            del kwargs[ai_name]  # the fallback sees the route's own arguments
            return await self._tripped(ai, tripped, kwargs, request, response, observe)
        except HTTPException:
            raise  # the handler's own deliberate HTTP answer
        except Exception as exc:
            return _application_failure(ai, exc, shared.attribution)
        else:
            if not isinstance(value, EventStream):  # a stream counts its outcome when it ends
                observe.request_ended(_succeeded(route, ai, request))
        finally:
            if trace is not None:
                trace.leave()
        headers = (value if isinstance(value, Response) else response).raw_headers
        add_attribution(headers, ai, shared.attribution)
        headers.append((b"x-trace-id", trace_id.encode()))
        if self._envelope_type is not None and not isinstance(value, Response):
            return self._envelope_type(ok=True, data=value, fallback=None)
        return value

    async def _tripped(
        self,
        ai: AI[Any],
        tripped: GuardTripped,
        arguments: Mapping[str, Any],
        request: Request,
        response: Response,
        observe: Observers,
    ) -> Any:
        """The answer of a request a guard ended (`tripped`): the public error on a strict
        route; on a degrading one the envelope of its fallback (computed from the route's own
        `arguments`), with `response`'s headers and status: prepared once where FastAPI would
        render it as JSON (`guards.routes._prepared`), else the envelope for FastAPI."""
        shared, trace_id = self._shared, ai.trace_id
        outcome = "cancelled" if tripped.kind is Kind.cancelled else "error"
        if not self._route.degrading:
            error = public_error(tripped, shared.retry_after_s)
            observe.request_ended(ai._ended(outcome, error.status, tripped=tripped, error=error.error))
            answer = error_response(error, trace_id)
            add_attribution(answer.raw_headers, ai, shared.attribution)
            return answer
        if self._last_good is None and not callable(self._plain):
            data, detail = self._plain, tripped.detail  # `_fallback`'s plain value, inline
        else:
            try:
                data, detail = await self._fallback(arguments, tripped, trace_id)
            except Exception as exc:
                return _application_failure(ai, exc, shared.attribution)
        observe.request_ended(ai._ended("fallback" if outcome == "error" else outcome, 200, tripped=tripped))
        # A model that answered is named even when its answer was rejected.
        add_attribution(response.raw_headers, ai, shared.attribution)
        response.raw_headers.append((b"x-trace-id", trace_id.encode()))
        assert self._fallback_answers is not None
        return self._fallback_answers.answer(
            request.scope.get("route"), tripped.reason, detail, data, response
        )

    async def _fallback(
        self, arguments: Mapping[str, Any], tripped: GuardTripped, trace_id: str
    ) -> tuple[Any, str]:
        """The fallback's data, and the envelope's detail."""
        if self._last_good is not None:
            found = await self._last_good.recall(self._shared.store, arguments, tripped, trace_id)
            if found is not None:
                return found
        plain = self._plain
        if not callable(plain):
            return plain, tripped.detail
        value = plain(arguments, tripped)
        if type(value) is not self._data_class:  # exactly the route's model: validated already
            if inspect.isawaitable(value):
                value = await value
            if type(value) is not self._data_class:
                value = self._data_adapter.validate_python(value)
        return value, tripped.detail

    def _first_step(self, caller: Any) -> Step:
        """The walk's first store step for `caller` (a key, or a tuple of one key per budget),
        with their budget's charge, built and kept (emptied when full; a long caller key is
        not kept). Budget keys are scoped to the route (or the budget's scope):
        `guards:{scope}:{caller}`."""
        route = self._route
        budget = self._budget
        assert budget is not None
        hold_s = 2 * route.timeout_s + 60  # a hold outlives the walk
        if isinstance(caller, str) and budget.plain:
            charge = Charge(
                f"{self._budget_prefix}{caller}",
                budget.per_minute,
                budget.per_day,
                None,
                budget.spend_per_day or 0.0,
                hold_s,
            )
            kept = len(caller)
        else:
            callers = (caller,) if isinstance(caller, str) else caller
            charge = scoped_charge(route.budgets, route.scopes, callers, hold_s)
            kept = sum(len(key) for key in callers)
        step = walk_step(route, 0, None, charge)
        steps = self._first_steps
        if kept <= _MAX_KEPT_CALLER:
            if len(steps) >= _MAX_FIRST_STEPS:
                steps.clear()
            steps[caller] = step
        return step


def handler_entered(request: Request) -> bool:
    """True once the guarded endpoint started: errors after that are the handler's own."""
    return bool(request.scope.get(_ENTERED))


def request_trace_id(request: Request) -> str:
    """The request's `x-trace-id` when well formed, else a new random one."""
    # The raw ASGI headers (lower-case names), scanned once: cheaper than building `Headers`.
    for name, value in request.scope["headers"]:
        if name == b"x-trace-id":
            given: str = value.decode("latin-1")
            if _TRACE_ID.match(given):
                return given
            break
    # 128 random bits from the process's Mersenne Twister (reseeded in every forked worker):
    # a trace id must be unique, not secret. As bytes to hex: a third of `os.urandom`'s cost,
    # and half of formatting the number with `:032x`.
    return getrandbits(128).to_bytes(16, "big").hex()


def _succeeded(route: GuardedRoute, ai: AI[Any], request: Request) -> RequestEnded:
    """The record of a request its handler answered (`ai._ended("ok", 200)`, built inline on
    a route without a downgrade or deployments: every request's path)."""
    if route.downgrade is not None or route.deployments is not None:
        return ai._ended("ok", 200)  # (its line says `downgraded`, `deployment`)
    return (
        route,
        ai.trace_id,
        "ok",
        200,
        ai._started,
        ai.attempts,
        ai.attempt_budget,
        ai.model,
        ai.fallback_model,
        ai._served_leg,
        None,
        None,
        None,
        (resumed(request) or None) if route.task is not None else None,
        None if route.answers is None else route.answers.logged(ai),
        ai._held,
    )


def _application_failure(ai: AI[Any], exc: Exception, attribution: str) -> Response:
    # The exception's type and where it went; never its message or a local value (they may hold
    # user text). The request line says where it was raised; an error line has the frames.
    stack, omitted = frames(exc.__traceback__)
    where = f"{stack[-1]['file'].rsplit('/', 1)[-1]}:{stack[-1]['line']}" if stack else None
    error = ErrorCode.application_failure
    ai._observe.request_ended(
        ai._ended("error", 500, error=error, extra={"exc_type": type(exc).__name__, "where": where})
    )
    emit_error(
        "application_failure",
        route=ai._route.name,
        trace_id=ai.trace_id,
        exc_type=type(exc).__name__,
        frames=stack,
        frames_omitted=omitted or None,
    )
    answer = error_response(PublicError(500, error, False), ai.trace_id)
    add_attribution(answer.raw_headers, ai, attribution)
    return answer
