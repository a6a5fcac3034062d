"""The route decorator: where the guards meet FastAPI.

    @app.post("/summary")
    @guards.route(model="@cf/...", budget=Budget(per_day=20), fallback=keyword_summary)
    async def summary(body: SummaryIn, ai: AI[Summary]) -> Summary:
        return await ai.run({"messages": [...]})

The decorated function keeps its parameters (FastAPI still sees them and their dependencies);
the `ai` parameter is removed from what FastAPI sees and filled with a fresh `AI` (`_ai.py`)
per request. A route's declaration is checked and its chain flattened once, at start-up.
"""

from __future__ import annotations

import functools
import inspect
import re
import time
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from random import getrandbits
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ._ai import AI, TASK_SCOPE, finish_request, walk_step
from ._breaker import Breaker
from ._budget import Budget
from ._call import Retry
from ._chain import HINT_PREFIX, flatten_chain
from ._effort import Effort, EffortRoutes
from ._envelope import Envelope, FallbackInfo
from ._errors import ConfigurationError, GuardTripped
from ._event_stream import GUARDS_EVENTS, EventStream, StreamFormat
from ._last_good import LastGood, LastGoodCache
from ._log import emit_error, emit_warning, frames
from ._metrics import RouteMetrics
from ._output import Moderation, OutputGuard
from ._relay import DEFAULT_STREAM_MAX_CHARS, DEFAULT_STREAM_MAX_S
from ._responses import PublicError, error_response, public_error
from ._route_spec import NO_FALLBACK, GuardedRoute, Leg, SuccessAges
from ._tasks import Task, key_parameter, task_endpoint
from ._vocabulary import ErrorCode, Kind, Level
from .stores import Charge, Step

if typing.TYPE_CHECKING:
    from ._guards import Guards

__all__ = ["FallbackFunction", "guard_route", "handler_entered", "request_trace_id"]

T = TypeVar("T")

#: Computes a degrading route's fallback value from the route's arguments (as FastAPI resolved
#: them, by parameter name) and the tripped guard. May be sync or async.
FallbackFunction = Callable[[Mapping[str, Any], GuardTripped], Any]

_REQUEST = "guards_request_"
_RESPONSE = "guards_response_"
_ENTERED = "guards.handler_entered"
_TRACE_ID = re.compile(r"^[A-Za-z0-9._-]{8,64}$")
_UNSAFE_HEADER = re.compile(r"[^\x21-\x7e]")


def guard_route(
    guards: Guards,
    handler: Callable[..., Awaitable[Any]],
    *,
    model: str | None,
    fallbacks: Sequence[str],
    attempts: int | None,
    timeout_s: float,
    retry: Retry,
    budget: Budget | None,
    breaker: Breaker | None,
    fallback: Any,
    moderation: Moderation | None,
    name: str | None,
    max_tokens: int | None,
    stream_max_s: float = DEFAULT_STREAM_MAX_S,
    stream_max_chars: int = DEFAULT_STREAM_MAX_CHARS,
    stream_format: StreamFormat = GUARDS_EVENTS,
    max_body_bytes: int | None,
    effort: Effort | None = None,
    shed_at: str | None = None,
    task: Task | None = None,
) -> Callable[..., Awaitable[Any]]:
    """Build the FastAPI endpoint for a guarded handler (see `Guards.route`)."""
    if not inspect.iscoroutinefunction(handler):
        raise ConfigurationError(f"guarded route {handler.__qualname__} must be an `async def`")
    if timeout_s <= 0:
        raise ConfigurationError("timeout_s must be positive")
    if effort is not None and model is not None:
        raise ConfigurationError(
            f"{handler.__qualname__}: a route names its model or routes by effort, not both"
        )
    if effort is None and (model is None or not model.strip()):
        raise ConfigurationError("a guarded route needs a model id")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigurationError("max_tokens must be at least 1")
    if not stream_max_s > 0 or stream_max_chars < 1:
        raise ConfigurationError("stream_max_s must be positive and stream_max_chars at least 1")
    if max_body_bytes is not None and max_body_bytes < 1:
        raise ConfigurationError("max_body_bytes must be at least 1 (or None: no limit)")
    if shed_at not in (None, Level.degraded, Level.minimal):
        raise ConfigurationError('shed_at must be "degraded", "minimal" or None (never shed)')
    route_name = name or handler.__name__
    spend_capped = budget is not None and budget.spend_per_day is not None
    if spend_capped and max_tokens is None:
        raise ConfigurationError(
            f"{handler.__qualname__} has a spend cap: declare max_tokens to bound its cost"
        )
    problems: dict[str, None] = {}  # each logged once, whichever tier's chain has it

    def chain_of(first: str) -> tuple[tuple[Leg, ...], int]:
        """The legs of the chain `first, *fallbacks`, and its attempt budget."""
        chain = flatten_chain(
            [first, *fallbacks], profiles=guards.profiles, providers=guards.providers, hints=guards.hints
        )
        problems.update(dict.fromkeys(chain.problems))
        if not chain.models:
            raise ConfigurationError(
                f"{handler.__qualname__}: no model left in its chain ({'; '.join(chain.problems)})"
            )
        attempt_budget = attempts if attempts is not None else len(chain.models) + retry.attempts - 1
        if attempt_budget < 1:
            raise ConfigurationError("attempts must be at least 1")
        unpriced = [ref.key for ref in chain.models if guards.prices.get(ref.key) is None]
        if spend_capped and unpriced:
            raise ConfigurationError(
                f"{handler.__qualname__} has a spend cap: Guards(prices=...) has no price for "
                + ", ".join(unpriced)
            )
        legs = tuple(
            Leg.of(ref, guards.prices.get(ref.key), route_name, index == 0, guards.last_success)
            for index, ref in enumerate(chain.models)
        )
        return legs, attempt_budget

    legs, attempt_budget = chain_of(HINT_PREFIX + effort.standard if effort is not None else str(model))
    try:
        hints = typing.get_type_hints(handler, include_extras=True)
    except NameError as exc:
        raise ConfigurationError(
            f"cannot resolve the annotations of {handler.__qualname__} ({exc}): "
            "import the types it names at module level"
        ) from None
    signature = inspect.signature(handler)
    ai_name, output_type, params = None, Any, []
    for param in signature.parameters.values():
        annotation = hints.get(param.name, param.annotation)
        if annotation is AI or typing.get_origin(annotation) is AI:
            if annotation is AI:
                raise ConfigurationError(
                    f"guarded route {handler.__qualname__}: `{param.name}: AI` does not say what the "
                    f"model must produce: write `{param.name}: AI[str]` for text, or "
                    f"`{param.name}: AI[YourModel]` (a pydantic model) for JSON"
                )
            ai_name = param.name
            output_type = typing.get_args(annotation)[0]
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigurationError(
                f"guarded route {handler.__qualname__}: *args/**kwargs are not supported"
            )
        params.append(param.replace(annotation=annotation))
    if ai_name is None:
        raise ConfigurationError(
            f"guarded route {handler.__qualname__} must declare a parameter annotated `AI[OutputType]`"
        )
    data_type = hints.get("return", Any)
    degrading = fallback is not NO_FALLBACK
    if degrading and data_type is Any:
        raise ConfigurationError(
            f"degrading route {handler.__qualname__} must annotate its return type (the envelope's data)"
        )
    streaming = isinstance(data_type, type) and issubclass(data_type, EventStream)
    if streaming:
        if degrading:
            raise ConfigurationError(
                f"streaming route {handler.__qualname__} cannot declare a fallback: it fails with a "
                "public error before its first event, and with an `error` event after it"
            )
        if output_type not in (str, Any):
            raise ConfigurationError(f"streaming route {handler.__qualname__} must declare `AI[str]`")
        if task is not None:
            raise ConfigurationError(
                f"streaming route {handler.__qualname__} cannot run as a task: a stream is not replayed"
            )
    data_adapter: TypeAdapter[Any] = TypeAdapter(Any if streaming else data_type)
    last_good = None
    if isinstance(fallback, LastGood):
        last_good = LastGoodCache(fallback, route_name, data_adapter)
        plain = fallback.otherwise
    else:
        plain = fallback
    if degrading and not callable(plain):
        try:
            plain = data_adapter.validate_python(plain)
        except ValidationError as exc:
            raise ConfigurationError(
                f"the fallback of {handler.__qualname__} does not validate against its return type: {exc}"
            ) from None
    output = OutputGuard(output_type, moderation)
    route = GuardedRoute(
        name=route_name,
        model=legs[0].ref.key,
        legs=legs,
        step_legs=tuple((leg.cooldown_key, leg.breaker_key) for leg in legs),
        attempt_budget=attempt_budget,
        timeout_s=timeout_s,
        retry=retry,
        budget=budget,
        breaker=breaker,
        output=output,
        data_type=data_type,
        fallback=fallback,
        scope=budget.scope if budget is not None and budget.scope else route_name,
        response_format=(
            {"type": "json_schema", "json_schema": output.json_schema}
            if output.json_schema is not None
            else None
        ),
        max_tokens=max_tokens,
        spend_capped=spend_capped,
        streaming=streaming,
        max_body_bytes=max_body_bytes,
        metrics=RouteMetrics(route_name),
        success_ages=SuccessAges(legs, guards.success_clock),
        stream_max_s=stream_max_s,
        stream_max_chars=stream_max_chars,
        stream_format=stream_format,
        shed_at=Level(shed_at) if shed_at is not None else None,
        task=task,
    )
    if effort is not None:
        route = EffortRoutes.attach(route, effort, lambda hint: chain_of(HINT_PREFIX + hint))
    for problem in problems:
        emit_warning("chain_invalid", route=route_name, problem=problem)
    envelope_type: Any = Envelope[data_type] if degrading else None  # type: ignore[valid-type]

    async def compute_fallback(
        arguments: Mapping[str, Any], tripped: GuardTripped, trace_id: str
    ) -> tuple[Any, str]:
        """The fallback's data, and the envelope's detail."""
        if last_good is not None:
            found = await last_good.recall(guards.store, arguments, tripped, trace_id)
            if found is not None:
                return found
        if not callable(plain):
            return plain, tripped.detail
        value = plain(arguments, tripped)
        if inspect.isawaitable(value):
            value = await value
        return data_adapter.validate_python(value), tripped.detail

    budget_prefix = f"guards:{route.scope}:"
    # The walk's first store step: the route's own without a budget; else one per caller, with
    # their budget's charge (a spend cap's amount is set per request, in the walk), each built
    # once and kept, bounded (`_first_step`).
    unbudgeted = walk_step(route, 0, None, None)
    first_steps: dict[str, Step] = {}
    # An instance of exactly the route's model class needs no second validation.
    data_class = data_type if isinstance(data_type, type) and issubclass(data_type, BaseModel) else None
    levels = guards.levels
    # Shedding, and counting requests in flight, cost nothing to a route that needs neither.
    enter_levels = route.shed_at is not None or levels.max_in_flight is not None

    @functools.wraps(handler)
    async def endpoint(**kwargs: Any) -> Any:
        request: Request = kwargs.pop(_REQUEST)
        response: Response = kwargs.pop(_RESPONSE)
        request.scope[_ENTERED] = True
        started = time.perf_counter()
        # With tracing on, the request's span (its trace id is the `x-trace-id`), current
        # while the handler runs; ended with the request's outcome (`finish_request`).
        trace = (
            None
            if guards.tracing is None
            else guards.tracing.start(route.name, request, lambda: request_trace_id(request))
        )
        trace_id = request_trace_id(request) if trace is None else trace.trace_id
        if budget is None:
            first = unbudgeted
        else:
            caller = budget.key(request)
            first = first_steps.get(caller) or _first_step(first_steps, caller, route, budget_prefix)
        ai: AI[Any] = AI(guards, route, first, trace_id, request, started, trace)
        kwargs[ai_name] = ai
        if task is not None and (run := request.scope.get(TASK_SCOPE)) is not None:
            run.ai = ai  # what the request called decides what its task leaves (`TaskRun.release`)
        try:
            if trace is not None:
                trace.enter()
            if enter_levels and (shed := levels.enter(route, request.scope)) is not None:
                raise shed  # answered at once, like an open breaker: no call, no charge
            value = await handler(**kwargs)
            if type(value) is not data_class and not isinstance(value, Response):
                value = data_adapter.validate_python(value)
            if last_good is not None and not isinstance(value, Response):  # a validated success
                await last_good.remember(guards.store, _arguments(kwargs, ai_name), value, trace_id)
        except GuardTripped as tripped:
            del kwargs[ai_name]  # the fallback sees the route's own arguments
            outcome = "cancelled" if tripped.kind is Kind.cancelled else "error"
            if not route.degrading:
                error = public_error(tripped, guards.retry_after_s)
                finish_request(route, ai, started, outcome, error.status, tripped=tripped, error=error.error)
                answer = error_response(error, trace_id)
                _attribution(answer.raw_headers, ai, guards.attribution)
                return answer
            try:
                data, detail = await compute_fallback(kwargs, tripped, trace_id)
            except Exception as exc:
                return _application_failure(route, ai, started, exc, guards.attribution)
            finish_request(
                route, ai, started, "fallback" if outcome == "error" else outcome, 200, tripped=tripped
            )
            # A model that answered is named even when its answer was rejected.
            _attribution(response.raw_headers, ai, guards.attribution)
            response.raw_headers.append((b"x-trace-id", trace_id.encode()))
            info = FallbackInfo(guard=tripped.guard, reason=tripped.reason, detail=detail)
            return envelope_type(ok=True, data=data, fallback=info)
        except HTTPException:
            raise  # the handler's own deliberate HTTP answer
        except Exception as exc:
            return _application_failure(route, ai, started, exc, guards.attribution)
        else:
            if not isinstance(value, EventStream):  # a stream counts its outcome when it ends
                finish_request(route, ai, started, "ok", 200)
        finally:
            if trace is not None:
                trace.leave()
        headers = (value if isinstance(value, Response) else response).raw_headers
        _attribution(headers, ai, guards.attribution)
        headers.append((b"x-trace-id", trace_id.encode()))
        if degrading and not isinstance(value, Response):
            return envelope_type(ok=True, data=value, fallback=None)
        return value

    params += [
        inspect.Parameter(_REQUEST, inspect.Parameter.KEYWORD_ONLY, annotation=Request),
        inspect.Parameter(_RESPONSE, inspect.Parameter.KEYWORD_ONLY, annotation=Response),
    ]
    guarded: Callable[..., Awaitable[Any]] = endpoint
    if task is not None:  # the Idempotency-Key header: validated and documented by FastAPI
        params.append(key_parameter())
        guarded = task_endpoint(
            guards,
            route,
            endpoint,
            response_type=envelope_type or data_type,
            trace_id_of=request_trace_id,
            request_param=_REQUEST,
            response_param=_RESPONSE,
        )
    guarded.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=envelope_type if degrading else data_type
    )
    guarded.__guards_route__ = route  # type: ignore[attr-defined]
    return guarded


#: The most first steps a route keeps (`first_steps` in `guard_route`), and the longest caller
#: key kept.
_MAX_FIRST_STEPS = 1024
_MAX_KEPT_CALLER = 128


def _first_step(steps: dict[str, Step], caller: str, route: GuardedRoute, prefix: str) -> Step:
    """The walk's first store step for `caller`, with their budget's charge, built and kept in
    `steps` (emptied when full; a long caller key is not kept). Budget keys are scoped to the
    route (or the budget's scope): `guards:{scope}:{caller}`."""
    budget = route.budget
    assert budget is not None
    charge = Charge(
        f"{prefix}{caller}",
        budget.per_minute,
        budget.per_day,
        None,
        budget.spend_per_day or 0.0,
        2 * route.timeout_s + 60,  # a spend hold outlives the walk
    )
    step = walk_step(route, 0, None, charge)
    if len(caller) <= _MAX_KEPT_CALLER:
        if len(steps) >= _MAX_FIRST_STEPS:
            steps.clear()
        steps[caller] = step
    return step


def _arguments(kwargs: Mapping[str, Any], ai_name: str) -> dict[str, Any]:
    """The route's own arguments (without its `AI`), as a fallback function sees them."""
    return {name: value for name, value in kwargs.items() if name != ai_name}


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


def _attribution(headers: list[tuple[bytes, bytes]], ai: AI[Any], mode: str) -> None:
    """Add which model answered to response `headers`: `x-ai-model` (the model the provider
    says served) and `x-ai-fallback` (the chain entry that served, when not the first) in
    `detailed` mode; only `x-ai-fallback: true` in `redacted` mode; nothing when `off`, or
    when no model answered. A model whose answer the output guard rejected answered too."""
    model = ai.model
    if mode == "off" or model is None:
        return
    if mode == "redacted":
        if ai.fallback_model is not None:
            headers.append((b"x-ai-fallback", b"true"))
        return
    headers.append((b"x-ai-model", _header_values.get(model) or _header_value(model)))
    if ai.fallback_model is not None:
        headers.append((b"x-ai-fallback", _header_value(ai.fallback_model)))


def _header_value(text: str) -> bytes:
    # A served-model name comes from the provider: keep it a short, printable ASCII token.
    # The same few names come back on every request: each is cleaned once (bounded cache).
    text = text[:200]  # all that is sent: the cache keys on it alone, whatever the name's size
    value = _header_values.get(text)
    if value is None:
        clean = text
        if not (clean.isascii() and clean.isprintable() and " " not in clean):
            clean = _UNSAFE_HEADER.sub("?", clean)
        if len(_header_values) >= 256:
            _header_values.clear()
        value = _header_values[text] = clean.encode("ascii")
    return value


_header_values: dict[str, bytes] = {}


def _application_failure(
    route: GuardedRoute, ai: AI[Any], started: float, exc: Exception, attribution: str
) -> Response:
    # The exception's type and where it went; never its message or a local value (they may hold
    # user text). The request line says where it was raised; an error line has the frames.
    stack, omitted = frames(exc.__traceback__)
    where = f"{stack[-1]['file'].rsplit('/', 1)[-1]}:{stack[-1]['line']}" if stack else None
    error = ErrorCode.application_failure
    finish_request(route, ai, started, "error", 500, error=error, exc_type=type(exc).__name__, where=where)
    emit_error(
        "application_failure",
        route=route.name,
        trace_id=ai.trace_id,
        exc_type=type(exc).__name__,
        frames=stack,
        frames_omitted=omitted or None,
    )
    answer = error_response(PublicError(500, error, False), ai.trace_id)
    _attribution(answer.raw_headers, ai, attribution)
    return answer
