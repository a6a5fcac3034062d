"""`Guards`: one per app. Holds the binding, the store and the clock the guarded routes share."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from ._binding import Binding
from ._breaker import Breaker
from ._budget import Budget, Price
from ._call import Retry
from ._chain import DEFAULT_PROVIDER, HINT_PREFIX, Profile, check_hints
from ._cooldown import Cooldown
from ._effort import Effort
from ._envelope import ErrorCode
from ._errors import ConfigurationError
from ._ledger import Ledger, LogLedger
from ._log import emit, logger
from ._metrics import flush_metrics
from ._openapi import document_guarded_routes
from ._output import Moderation
from ._responses import PublicError, error_response
from ._retry_budget import RetryWindows
from ._route import _NO_FALLBACK, guard_route, handler_entered, request_trace_id, route_of
from .stores import MemoryStore, Store

__all__ = ["Guards"]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

#: How responses name the model that served: `detailed` (model ids), `redacted` (a fallback
#: flag only) or `off`.
Attribution = Literal["off", "redacted", "detailed"]


class Guards:
    """The guards of one app: the model bindings, the store and the timing they share.

    `binding` is the main binding (provider name `"default"`); `providers` names more bindings,
    reached from chains as `"name:model"`. Bindings may be swapped at any time (tests swap in
    fakes). `profiles` names models with their own fallbacks (see `Profile`); `hints` names
    routing hints, reached from chains as `"hint:name"` and resolved at start-up, each to a
    chain entry (a model spec or a profile name: `{"fast": "openai:gpt-4o-mini"}`). `store` holds
    budget, breaker and cooldown state (default: a `MemoryStore`, one process). `sleep` is what
    retries wait with (inject a no-op in tests). `retry_after_s` is the `Retry-After` a strict
    route sends with `model_temporarily_unavailable`. `prices` maps model keys (`model` or
    `provider:model`) to their `Price`, for spend caps. `cooldown` says how long a rate-limited
    model is skipped; `attribution` how responses name the model that served (`x-ai-model`,
    `x-ai-fallback` headers); `ledger` receives one record per provider call (default: JSON log).

    Use it as an async context manager (or call `aclose`) to close the binding's connections and
    the store on shutdown.
    """

    def __init__(
        self,
        binding: Binding,
        *,
        store: Store | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        retry_after_s: float = 30.0,
        prices: Mapping[str, Price] | None = None,
        providers: Mapping[str, Binding] | None = None,
        profiles: Mapping[str, Profile] | None = None,
        cooldown: Cooldown = Cooldown(),
        attribution: Attribution = "detailed",
        ledger: Ledger | None = None,
        hints: Mapping[str, str] | None = None,
    ) -> None:
        if attribution not in ("off", "redacted", "detailed"):
            raise ConfigurationError('attribution must be "off", "redacted" or "detailed"')
        if DEFAULT_PROVIDER in (providers or {}):
            raise ConfigurationError(
                f"{DEFAULT_PROVIDER!r} names the main binding: pick another provider name"
            )
        if HINT_PREFIX[:-1] in (providers or {}):
            raise ConfigurationError(f"{HINT_PREFIX!r} starts routing hints: pick another provider name")
        self.binding = binding
        self.providers: dict[str, Binding] = dict(providers or {})
        self.profiles: Mapping[str, Profile] = dict(profiles or {})
        self.hints: Mapping[str, str] = check_hints(hints or {})
        #: The retry budget's counts in this worker (see `RetryBudget`).
        self.retry_windows = RetryWindows()
        self.cooldown = cooldown
        self.attribution: Attribution = attribution
        self.ledger: Ledger = ledger if ledger is not None else LogLedger()
        self.store: Store = store if store is not None else MemoryStore()
        self.sleep = sleep
        self.retry_after_s = retry_after_s
        self.prices: Mapping[str, Price] = dict(prices or {})

    def ledger_enabled(self) -> bool:
        """False when records would be dropped anyway (the default log ledger with INFO off),
        so the hot path skips building them."""
        return not isinstance(self.ledger, LogLedger) or logger.isEnabledFor(logging.INFO)

    def route(
        self,
        *,
        model: str | None = None,
        fallbacks: Sequence[str] = (),
        attempts: int | None = None,
        timeout_s: float = 8.0,
        retry: Retry = Retry(),
        budget: Budget | None = None,
        breaker: Breaker | None = Breaker(),
        fallback: Any = _NO_FALLBACK,
        moderation: Moderation | None = None,
        name: str | None = None,
        max_tokens: int | None = None,
        effort: Effort | None = None,
    ) -> Callable[[F], F]:
        """Guard a FastAPI path operation. Put it under `@app.get/post(...)`.

        The handler must be `async def` and declare a parameter `ai: AI[Output]`, through which
        it calls the model (`await ai.run(inputs)`); `Output` is what the model must produce
        (a pydantic model requests JSON mode; `str` plain text).

        - `model`: the model (a model id, `"provider:model"`, `"hint:name"` or a `Profile`
          name); `fallbacks`: the models to try after it, in order (same forms). The chain is
          flattened now; invalid entries are logged (`chain_invalid`) and removed.
        - `effort`: instead of `model`, route each request by its estimated effort to the
          routing hint of its tier (see `Effort`), then to `fallbacks`.
        - `attempts`: the most provider calls one request makes across the whole chain, every
          `ai.run` / `ai.stream` of the request together (default: the chain's length plus
          `retry.attempts - 1`, i.e. one retry in total).
        - `timeout_s`: one deadline for the whole call: every model, retry and wait.
        - `retry`: bounded retry of transient failures (`retry.attempts` calls per model at
          most); `budget`: per-key limits; `breaker`: circuit breaker policy, one breaker per
          model (None to disable).
        - `fallback`: makes the route *degrading*: it answers `Envelope[ReturnType]`, with this
          value (or, if callable, `fallback(arguments, tripped)`, or the route's last good
          answer: `LastGood`) as `data` when a guard trips. Without it the route is *strict*
          and answers public errors.
        - `moderation`: a hook given the validated output; returning True blocks it.
        - `max_tokens`: sent with each call unless the inputs set it; required with a spend cap.

        Raises `ConfigurationError` at decoration time for a route declared wrong.
        """

        def decorate(handler: F) -> F:
            endpoint = guard_route(
                self,
                handler,
                model=model,
                fallbacks=fallbacks,
                attempts=attempts,
                timeout_s=timeout_s,
                retry=retry,
                budget=budget,
                breaker=breaker,
                fallback=fallback,
                moderation=moderation,
                name=name,
                max_tokens=max_tokens,
                effort=effort,
            )
            return endpoint  # type: ignore[return-value]

        return decorate

    def install(self, app: FastAPI) -> None:
        """Attach to `app`: answer invalid input on guarded routes with `400 invalid_request`,
        document every status a guarded route can answer in OpenAPI, and make `Guards.of(app)`
        find this instance. Call once, when building the app."""
        if getattr(app.state, "guards", None) is not None:
            raise ConfigurationError("Guards are already installed on this app")
        app.state.guards = self
        # Input that never reached a guarded handler (unparseable or invalid) is answered
        # `400 invalid_request`; everything else goes to the handlers registered before.
        for exc_class in (RequestValidationError, StarletteHTTPException):
            previous = app.exception_handlers.get(exc_class)
            app.add_exception_handler(exc_class, _invalid_input_handler(previous))
        original_openapi = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                document_guarded_routes(app, original_openapi(), self.attribution)
            assert app.openapi_schema is not None
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]

    @staticmethod
    def of(app: FastAPI) -> Guards:
        """The `Guards` installed on `app`."""
        guards = getattr(app.state, "guards", None)
        if not isinstance(guards, Guards):
            raise ConfigurationError("no Guards installed on this app: call guards.install(app)")
        return guards

    async def aclose(self) -> None:
        """Close the bindings and the store, and write this process's metrics."""
        flush_metrics()
        try:
            # A binding may serve under several names: close each once.
            for binding in {id(b): b for b in (self.binding, *self.providers.values())}.values():
                await binding.aclose()
        finally:
            await self.store.aclose()

    async def __aenter__(self) -> Guards:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _invalid_input_handler(previous: Any) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def handle(request: Request, exc: Exception) -> Response:
        route = route_of(request.scope.get("endpoint"))
        before_handler = route is not None and not handler_entered(request)
        if before_handler and (isinstance(exc, RequestValidationError) or _is_bad_request(exc)):
            assert route is not None
            return _invalid_request(route.name, request, exc)
        if previous is None:
            raise exc
        response: Response = await previous(request, exc)
        return response

    return handle


def _is_bad_request(exc: Exception) -> bool:
    # FastAPI raises HTTPException(400) for a body it cannot parse at all.
    return isinstance(exc, StarletteHTTPException) and exc.status_code == 400


def _invalid_request(route_name: str, request: Request, exc: Exception) -> Response:
    trace_id = request_trace_id(request)
    problems = []
    if isinstance(exc, RequestValidationError):
        # Where the input was wrong and how, never the input itself.
        problems = sorted(
            {".".join(map(str, e.get("loc", ()))) + ":" + str(e.get("type")) for e in exc.errors()}
        )
    emit(
        "request",
        route=route_name,
        trace_id=trace_id,
        outcome="error",
        status=400,
        error=ErrorCode.invalid_request.value,
        problems=problems[:10] or None,
        attempts=0,
    )
    return error_response(PublicError(400, ErrorCode.invalid_request, False), trace_id)
