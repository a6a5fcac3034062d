"""The route decorator and the per-request `AI` handle: where the guards meet FastAPI.

    @app.post("/summary")
    @guards.route(model="@cf/...", budget=Budget(per_day=20), fallback=keyword_summary)
    async def summary(body: SummaryIn, ai: AI[Summary]) -> Summary:
        return await ai.run({"messages": [...]})

The decorated function keeps its parameters (FastAPI still sees them and their dependencies);
the `ai` parameter is removed from what FastAPI sees and filled with a fresh `AI` per request.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import re
import time
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import anyio
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ._binding import AIResult
from ._breaker import Breaker, Outcome
from ._budget import Budget, Price, charge_budget, hold_spend, input_tokens_bound
from ._call import CallFailed, Retry, call_model
from ._classify import Classification, Kind
from ._envelope import Envelope, ErrorCode, FallbackInfo, GuardName, Reason
from ._errors import ConfigurationError, GuardTripped, ProviderError
from ._log import emit, emit_warning, logger
from ._metrics import STORE_UNAVAILABLE
from ._output import Moderation, OutputGuard
from ._responses import PublicError, error_response, public_error
from .stores import StoreUnavailable

if typing.TYPE_CHECKING:
    from ._guards import Guards

__all__ = ["AI", "FallbackFunction", "GuardedRoute"]

T = TypeVar("T")

#: Computes a degrading route's fallback value from the route's arguments (as FastAPI resolved
#: them, by parameter name) and the tripped guard. May be sync or async.
FallbackFunction = Callable[[Mapping[str, Any], GuardTripped], Any]

_NO_FALLBACK: Any = object()
#: Retry-After when a guard refuses calls because its store is unavailable.
STORE_RETRY_AFTER_S = 5.0
_OUTCOME_OF = {GuardName.call: Outcome.failure, GuardName.output: Outcome.success}
_REQUEST = "guards_request_"
_RESPONSE = "guards_response_"
_ENTERED = "guards.handler_entered"
_TRACE_ID = re.compile(r"^[A-Za-z0-9._-]{8,64}$")


@dataclass(frozen=True, slots=True, eq=False)
class GuardedRoute:
    """What a guarded route declared. Attached to the endpoint as `__guards_route__`."""

    name: str
    model: str
    timeout_s: float
    retry: Retry
    budget: Budget | None
    breaker: Breaker | None
    output: OutputGuard
    data_type: Any
    fallback: Any
    #: Budget counters are shared by routes of the same scope.
    scope: str
    breaker_key: str
    #: Added to the inputs to request JSON mode; None for a plain-text route.
    response_format: dict[str, Any] | None
    #: Added to the inputs when they do not set it; bounds the cost a spend cap holds.
    max_tokens: int | None
    #: The model's price, when the route has a spend cap.
    price: Price | None

    @property
    def degrading(self) -> bool:
        """A degrading route answers the envelope; a strict one answers public errors."""
        return self.fallback is not _NO_FALLBACK


class AI(Generic[T]):
    """One request's guarded access to its route's model.

    Declare it as a parameter of a guarded route (`ai: AI[OutputModel]`); the decorator fills it.
    `run` passes the budget, call and output guards and returns the validated output, or raises
    `GuardTripped`. After a call, `model` is the model that served and `attempts` the number of
    provider calls made; `trace_id` is the request's trace id (also the `x-trace-id` header).
    """

    __slots__ = (
        "_budget_key",
        "_charged",
        "_guards",
        "_hold",
        "_route",
        "attempts",
        "model",
        "trace_id",
    )

    def __init__(self, guards: Guards, route: GuardedRoute, *, budget_key: str | None, trace_id: str) -> None:
        self._guards = guards
        self._route = route
        self._budget_key = budget_key
        self._charged = False
        #: The spend hold of this request and what one attempt may cost at worst.
        self._hold: tuple[str, float] | None = None
        self.trace_id = trace_id
        self.model: str | None = None
        self.attempts = 0

    async def run(self, inputs: Mapping[str, Any]) -> T:
        """Call the route's model with Workers-AI-shaped `inputs` (`messages` or `prompt`).

        JSON mode is requested from the output type when it is not a string, and the route's
        `max_tokens` when the inputs do not set it. Raises `GuardTripped` when a guard refuses
        the call or rejects its answer.
        """
        route = self._route
        if route.response_format is not None and "response_format" not in inputs:
            inputs = {**inputs, "response_format": route.response_format}
        if route.max_tokens is not None and "max_tokens" not in inputs:
            inputs = {**inputs, "max_tokens": route.max_tokens}
        probe, record_success = await self._admit() if route.breaker is not None else (None, False)
        try:
            if not self._charged and route.budget is not None:
                await self._charge(inputs)
            self._charged = True
            result = await self._call(inputs)
        except GuardTripped as tripped:
            # A call failure counts against the model; an output failure here (JSON mode not
            # met) means the model answered; a budget refusal says nothing about it.
            await self._record(_OUTCOME_OF.get(tripped.guard, Outcome.released), probe)
            await self._settle(None, billed=tripped.reason is not Reason.provider_error)
            raise
        except BaseException:
            # Cancelled from outside (client gone, server stopping): no verdict on the model,
            # but a probe slot must be freed and the spend settled, shielded from the
            # cancellation under way.
            with anyio.CancelScope(shield=True):
                await self._record(Outcome.released, probe)
                await self._settle(None, billed=True)
            raise
        if record_success or probe is not None:
            await self._record(Outcome.success, probe)
        await self._settle(result, billed=True)
        value = await route.output.check(result)
        return cast(T, value)

    async def _admit(self) -> tuple[float | None, bool]:
        """The breaker's verdict: (probe ticket, whether a success must be recorded)."""
        route = self._route
        if route.breaker is None:
            return None, False
        try:
            decision = await self._guards.store.breaker_admit(route.breaker_key, route.breaker)
        except StoreUnavailable:
            self._store_failed("breaker", route.breaker.on_store_failure)
            return None, False
        if not decision.allowed:
            raise GuardTripped(
                Reason.circuit_open,
                f"circuit {decision.state.value}: calls to the model are paused",
                retry_after_s=decision.retry_after_s,
                model=route.model,
            )
        return decision.probe, decision.record_success

    async def _charge(self, inputs: Mapping[str, Any]) -> None:
        """Charge the request's budget once (rate, daily cap), and hold its worst-case spend."""
        route, key = self._route, self._budget_key
        budget = route.budget
        if budget is None or key is None:
            return
        store = self._guards.store
        try:
            await charge_budget(store, budget, key)
            if budget.spend_per_day is not None and route.price is not None:
                worst = route.price.cost(input_tokens_bound(inputs), route.max_tokens or 0)
                reservation = await hold_spend(
                    store, budget, key, worst * route.retry.attempts, hold_s=2 * route.timeout_s + 60
                )
                self._hold = (reservation, worst)
        except StoreUnavailable:
            self._store_failed("budget", budget.on_store_failure)

    async def _settle(self, result: AIResult | None, *, billed: bool) -> None:
        """Replace the spend hold by the cost: the usage of `result` when known; else one
        attempt's worst case when the provider may have billed (a timeout, a cancelled call, an
        answer without usage), or nothing (the provider refused the call)."""
        if self._hold is None or self._budget_key is None:
            return
        route = self._route
        reservation, worst = self._hold
        self._hold = None
        usage = result.usage if result is not None else None
        if usage is not None and route.price is not None:
            actual = route.price.cost(usage.prompt_tokens, usage.completion_tokens)
        else:
            actual = worst if billed else 0.0
        try:
            await self._guards.store.settle_spend(self._budget_key, reservation, actual=actual)
        except StoreUnavailable:
            # The hold lapses by itself; the cost it stood for stays unrecorded.
            self._warn_store("budget", op="settle_spend")
            STORE_UNAVAILABLE.labels(guard="budget", action="settle_spend").inc()

    def _store_failed(self, guard: str, mode: str) -> None:
        """The store did not answer a guard's check: admit (fail open) or refuse (fail closed)."""
        self._warn_store(guard, mode=mode)
        STORE_UNAVAILABLE.labels(guard=guard, action=mode).inc()
        if mode == "closed":
            raise GuardTripped(
                Reason.circuit_open,
                f"the {guard} guard's store is unavailable: calls are paused",
                retry_after_s=STORE_RETRY_AFTER_S,
                model=self._route.model,
            )

    async def _call(self, inputs: Mapping[str, Any]) -> Any:
        route, guards = self._route, self._guards
        loop = asyncio.get_running_loop()
        deadline = loop.time() + route.timeout_s
        try:
            # One deadline for every attempt and the waits between them. When it passes, the
            # task is cancelled where it awaits: the provider request is aborted, its
            # connection closed, and the retry loop never sees it (cancellation is not retried).
            async with asyncio.timeout_at(deadline):
                result, _ = await call_model(
                    guards.binding,
                    route.model,
                    inputs,
                    policy=route.retry,
                    deadline=deadline,
                    sleep=guards.sleep,
                    on_attempt=self._count_attempt,
                    on_retry=self._log_retry,
                )
        except CallFailed as failed:
            raise self._call_failure(failed) from None
        except TimeoutError:
            raise GuardTripped(
                Reason.timeout,
                f"no answer within {route.timeout_s:g}s",
                kind=Kind.model_temporarily_unavailable,
                attempts=self.attempts,
                model=route.model,
            ) from None
        self.model = result.model or route.model
        return result

    def _call_failure(self, failed: CallFailed) -> GuardTripped:
        error, model = failed.error, self._route.model
        what = error.describe() if isinstance(error, ProviderError) else type(error).__name__
        if isinstance(error, ProviderError) and error.json_mode_failed:
            return GuardTripped(
                Reason.schema_invalid,
                f"JSON mode could not be met ({what})",
                attempts=self.attempts,
                model=model,
            )
        return GuardTripped(
            Reason.provider_error,
            f"{failed.verdict.kind.value} after {self.attempts} attempt(s): {what}",
            kind=failed.verdict.kind,
            attempts=self.attempts,
            retry_after_s=error.retry_after_s if isinstance(error, ProviderError) else None,
            model=model,
        )

    async def _record(self, outcome: Outcome, probe: float | None) -> None:
        route = self._route
        if route.breaker is not None and (probe is not None or outcome is not Outcome.released):
            try:
                await self._guards.store.breaker_record(
                    route.breaker_key, route.breaker, outcome, probe=probe
                )
            except StoreUnavailable:
                # The outcome is lost; a lost probe's slot is reclaimed after the reset timeout.
                self._warn_store("breaker", op="breaker_record")
                STORE_UNAVAILABLE.labels(guard="breaker", action="breaker_record").inc()

    def _warn_store(self, guard: str, **fields: str) -> None:
        emit_warning(
            "store_unavailable", guard=guard, route=self._route.name, trace_id=self.trace_id, **fields
        )

    def _count_attempt(self) -> None:
        self.attempts += 1

    def _log_retry(self, attempt: int, verdict: Classification, delay_s: float) -> None:
        emit(
            "retry",
            route=self._route.name,
            trace_id=self.trace_id,
            model=self._route.model,
            attempt=attempt,
            kind=verdict.kind.value,
            delay_ms=round(delay_s * 1000, 1),
        )


def guard_route(
    guards: Guards,
    handler: Callable[..., Awaitable[Any]],
    *,
    model: str,
    timeout_s: float,
    retry: Retry,
    budget: Budget | None,
    breaker: Breaker | None,
    fallback: Any,
    moderation: Moderation | None,
    name: str | None,
    max_tokens: int | None,
    price: Price | None,
) -> Callable[..., Awaitable[Any]]:
    """Build the FastAPI endpoint for a guarded handler (see `Guards.route`)."""
    if not inspect.iscoroutinefunction(handler):
        raise ConfigurationError(f"guarded route {handler.__qualname__} must be an `async def`")
    if timeout_s <= 0:
        raise ConfigurationError("timeout_s must be positive")
    if not model:
        raise ConfigurationError("a guarded route needs a model id")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigurationError("max_tokens must be at least 1")
    if budget is not None and budget.spend_per_day is not None:
        if max_tokens is None:
            raise ConfigurationError(
                f"{handler.__qualname__} has a spend cap: declare max_tokens to bound its cost"
            )
        if price is None:
            raise ConfigurationError(
                f"{handler.__qualname__} has a spend cap: Guards(prices=...) has no price for {model}"
            )
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
            ai_name = param.name
            output_type = (typing.get_args(annotation) or (Any,))[0]
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
    degrading = fallback is not _NO_FALLBACK
    if degrading and data_type is Any:
        raise ConfigurationError(
            f"degrading route {handler.__qualname__} must annotate its return type (the envelope's data)"
        )
    data_adapter: TypeAdapter[Any] = TypeAdapter(data_type)
    if degrading and not callable(fallback):
        try:
            fallback = data_adapter.validate_python(fallback)
        except ValidationError as exc:
            raise ConfigurationError(
                f"the fallback of {handler.__qualname__} does not validate against its return type: {exc}"
            ) from None
    route_name = name or handler.__name__
    output = OutputGuard(output_type, moderation)
    route = GuardedRoute(
        name=route_name,
        model=model,
        timeout_s=timeout_s,
        retry=retry,
        budget=budget,
        breaker=breaker,
        output=output,
        data_type=data_type,
        fallback=fallback,
        scope=budget.scope if budget is not None and budget.scope else route_name,
        breaker_key=f"guards:breaker:{model}",
        response_format=(
            {"type": "json_schema", "json_schema": output.json_schema}
            if output.json_schema is not None
            else None
        ),
        max_tokens=max_tokens,
        price=price if budget is not None and budget.spend_per_day is not None else None,
    )
    envelope_type: Any = Envelope[data_type] if degrading else None  # type: ignore[valid-type]

    async def compute_fallback(arguments: Mapping[str, Any], tripped: GuardTripped) -> Any:
        if not callable(route.fallback):
            return route.fallback
        value = route.fallback(arguments, tripped)
        if inspect.isawaitable(value):
            value = await value
        return data_adapter.validate_python(value)

    budget_prefix = f"guards:{route.scope}:"
    # An instance of exactly the route's model class needs no second validation.
    data_class = data_type if isinstance(data_type, type) and issubclass(data_type, BaseModel) else None

    @functools.wraps(handler)
    async def endpoint(**kwargs: Any) -> Any:
        request: Request = kwargs.pop(_REQUEST)
        response: Response = kwargs.pop(_RESPONSE)
        request.scope[_ENTERED] = True
        started = time.perf_counter()
        trace_id = request_trace_id(request)
        # Budget keys are scoped to the route (or the budget's scope): guards:{scope}:{caller}.
        budget_key = f"{budget_prefix}{budget.key(request)}" if budget is not None else None
        ai: AI[Any] = AI(guards, route, budget_key=budget_key, trace_id=trace_id)
        kwargs[ai_name] = ai
        try:
            value = await handler(**kwargs)
            if type(value) is not data_class and not isinstance(value, Response):
                value = data_adapter.validate_python(value)
        except GuardTripped as tripped:
            del kwargs[ai_name]  # the fallback sees the route's own arguments
            if not route.degrading:
                error = public_error(tripped, guards.retry_after_s)
                _log_request(route, ai, started, "error", error.status, tripped=tripped, error=error.error)
                return error_response(error, trace_id)
            try:
                data = await compute_fallback(kwargs, tripped)
            except Exception as exc:
                return _application_failure(route, ai, started, exc)
            _log_request(route, ai, started, "fallback", 200, tripped=tripped)
            response.raw_headers.append((b"x-trace-id", trace_id.encode()))
            info = FallbackInfo(guard=tripped.guard, reason=tripped.reason, detail=tripped.detail)
            return envelope_type(ok=True, data=data, fallback=info)
        except HTTPException:
            raise  # the handler's own deliberate HTTP answer
        except Exception as exc:
            return _application_failure(route, ai, started, exc)
        _log_request(route, ai, started, "ok", 200)
        if isinstance(value, Response):
            value.headers["x-trace-id"] = trace_id
            return value
        response.raw_headers.append((b"x-trace-id", trace_id.encode()))
        return envelope_type(ok=True, data=value, fallback=None) if degrading else value

    params += [
        inspect.Parameter(_REQUEST, inspect.Parameter.KEYWORD_ONLY, annotation=Request),
        inspect.Parameter(_RESPONSE, inspect.Parameter.KEYWORD_ONLY, annotation=Response),
    ]
    endpoint.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=envelope_type if degrading else data_type
    )
    endpoint.__guards_route__ = route  # type: ignore[attr-defined]
    return endpoint


def route_of(endpoint: Any) -> GuardedRoute | None:
    """The `GuardedRoute` of a guarded endpoint, or None."""
    route = getattr(endpoint, "__guards_route__", None)
    return route if isinstance(route, GuardedRoute) else None


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
    return os.urandom(16).hex()


def _application_failure(route: GuardedRoute, ai: AI[Any], started: float, exc: Exception) -> Response:
    # The exception's type and where it was raised; never its message (it may hold user text).
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f"{tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}" if tb else None
    error = ErrorCode.application_failure
    _log_request(route, ai, started, "error", 500, error=error, exc_type=type(exc).__name__, where=where)
    return error_response(PublicError(500, error, False), ai.trace_id)


def _log_request(
    route: GuardedRoute,
    ai: AI[Any],
    started: float,
    outcome: str,
    status: int,
    *,
    tripped: GuardTripped | None = None,
    error: ErrorCode | None = None,
    **extra: Any,
) -> None:
    """The one log line of a request's outcome (skipped cheaply when INFO is off)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    emit(
        "request",
        route=route.name,
        trace_id=ai.trace_id,
        outcome=outcome,
        status=status,
        error=error.value if error is not None else None,
        guard=tripped.guard.value if tripped is not None else None,
        reason=tripped.reason.value if tripped is not None else None,
        kind=tripped.kind.value if tripped is not None and tripped.kind is not None else None,
        attempts=ai.attempts,
        model=(tripped.model if tripped is not None else None) or ai.model,
        latency_ms=round((time.perf_counter() - started) * 1000, 2),
        **extra,
    )
