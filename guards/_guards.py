"""`Guards`: one per app. Holds the binding, the store and the clock the guarded routes share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

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
from ._envelope import ErrorCode
from ._errors import ConfigurationError
from ._log import emit
from ._openapi import document_guarded_routes
from ._output import Moderation
from ._responses import PublicError, error_response
from ._route import _NO_FALLBACK, guard_route, handler_entered, request_trace_id, route_of
from .stores import MemoryStore, Store

__all__ = ["Guards"]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class Guards:
    """The guards of one app: the model binding, the store and the timing they share.

    `binding` may be swapped at any time (tests swap in a fake). `store` holds budget and
    breaker state (default: a `MemoryStore`, one process). `sleep` is what retries wait with
    (inject a no-op in tests). `retry_after_s` is the `Retry-After` a strict route sends with
    `model_temporarily_unavailable`. `prices` maps model ids to their `Price`, for spend caps.

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
    ) -> None:
        self.binding = binding
        self.store: Store = store if store is not None else MemoryStore()
        self.sleep = sleep
        self.retry_after_s = retry_after_s
        self.prices: Mapping[str, Price] = dict(prices or {})

    def route(
        self,
        *,
        model: str,
        timeout_s: float = 8.0,
        retry: Retry = Retry(),
        budget: Budget | None = None,
        breaker: Breaker | None = Breaker(),
        fallback: Any = _NO_FALLBACK,
        moderation: Moderation | None = None,
        name: str | None = None,
        max_tokens: int | None = None,
    ) -> Callable[[F], F]:
        """Guard a FastAPI path operation. Put it under `@app.get/post(...)`.

        The handler must be `async def` and declare a parameter `ai: AI[Output]`, through which
        it calls the model (`await ai.run(inputs)`); `Output` is what the model must produce
        (a pydantic model requests JSON mode; `str` plain text).

        - `model`: the model id; `timeout_s`: one deadline for the call and its retries.
        - `retry`: bounded retry of transient failures; `budget`: per-key limits;
          `breaker`: circuit breaker policy for this model (None to disable).
        - `fallback`: makes the route *degrading*: it answers `Envelope[ReturnType]`, with this
          value (or, if callable, `fallback(arguments, tripped)`) as `data` when a guard trips.
          Without it the route is *strict* and answers public errors.
        - `moderation`: a hook given the validated output; returning True blocks it.
        - `max_tokens`: sent with each call unless the inputs set it; required with a spend cap.

        Raises `ConfigurationError` at decoration time for a route declared wrong.
        """

        def decorate(handler: F) -> F:
            endpoint = guard_route(
                self,
                handler,
                model=model,
                timeout_s=timeout_s,
                retry=retry,
                budget=budget,
                breaker=breaker,
                fallback=fallback,
                moderation=moderation,
                name=name,
                max_tokens=max_tokens,
                price=self.prices.get(model),
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
                document_guarded_routes(app, original_openapi())
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
        """Close the binding and the store."""
        try:
            await self.binding.aclose()
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
