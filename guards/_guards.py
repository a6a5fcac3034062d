"""`Guards`: one per app. Holds the binding, the store and the clock the guarded routes share."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .contracts._binding import Binding
from .contracts._clock import SystemClock
from .contracts._errors import ConfigurationError
from .contracts._output import Moderation
from .contracts._settings import UNSET, Unset, keywords_checked
from .contracts._vocabulary import Attribution
from .observe._ledger import Ledger, LogLedger
from .observe._log import emit_warning, flush_logs, logger, show_logs
from .observe._metrics import flush_metrics
from .policies._budget import Budget, Price
from .policies._call import Retry
from .policies._chain import DEFAULT_PROVIDER, HINT_PREFIX, Model, Profile, check_hints
from .policies._cooldown import Cooldown, checked_cooldowns
from .policies._credentials import CredentialWarnings
from .policies._deployments import Balance
from .policies._hedge import Hedge
from .policies._price_table import PriceTable, check_table
from .policies._retry_budget import RetryWindows
from .policies._tasks import Task
from .routes._body_limit import DEFAULT_MAX_BODY_BYTES
from .routes._invalid_input import invalid_input_handler
from .routes._middleware import GuardsMiddleware
from .routes._route import guard_route
from .spec._levels import Levels, ServiceLevel
from .spec._route_checks import RouteSettings
from .spec._route_spec import NO_FALLBACK, GuardedRoute, KnownRefusal, route_of
from .stores import MemoryStore, Store
from .stores._breaker import Breaker
from .streams._event_stream import GUARDS_EVENTS, StreamFormat
from .streams._hold import StreamHold
from .streams._kept import Resumable, stop_kept_streams
from .streams._relay import DEFAULT_STREAM_MAX_CHARS, DEFAULT_STREAM_MAX_S, settled

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from pydantic import BaseModel

    from .routes._effort import Effort
    from .spec._shared import Shared
    from .spec._tracing import Tracing

__all__ = ["Guards"]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

#: `app.state`'s flag: its `Guards` were installed by a guarded route's first request, not by
#: `install` (which may then still be called).
_AUTOMATIC = "guards_installed_automatically"


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
    `provider:model`) to their `Price`, for spend caps and `guards_cost_usd_total` (`"*"`: the
    price of every model without one of its own; a spend-capped route calling a model with
    no price is refused at start-up); `cost_unit_usd` is what one unit of those prices is
    worth in US dollars (default 1.0: prices in dollars; 0.01 for prices in cents); `price_table`
    prices the models `prices` does not, from a maintained table (`GenAIPrices()`, the `prices`
    extra; see docs/guards/budget.md, "Prices from a table"). `cooldown` says how long a rate-limited
    model is skipped, and the longest wait a provider may ask for (`Cooldown.max_s`, 10
    minutes by default); `cooldowns` says it per model key (`model` or `provider:model`),
    for the models that differ; `context_windows` declares models' context windows in tokens,
    per model key: the walk skips, without a call, a model whose window cannot hold a request's
    estimated input tokens plus its `max_tokens`, and after a `context_length_exceeded` moves
    only to a model with a larger window (see `estimate_tokens`; a model not listed is never
    skipped for its window); `attribution` how responses name the model that served
    (`x-ai-model`, `x-ai-fallback` headers); `ledger` receives one record per provider call (default: JSON log).
    `log_attempts` says which provider calls the default ledger writes an `attempt` line for:
    `"retries"` (default) those of requests that made more than one (a request's only call is
    on its `request` line), `"all"` every one. `log_sample` is the share of successful requests
    that write their `request` line (default 1.0: all; a request that fell back, failed or was
    cancelled always does).
    `tracing` turns on OpenTelemetry traces (GenAI semantic conventions; needs `route-guards[otel]`):
    True traces with OpenTelemetry's global tracer provider, a `TracerProvider` with that one;
    False (default) imports nothing of OpenTelemetry and costs nothing.
    `max_in_flight` (default None: no limit) is how many requests of guarded routes one worker
    serves at once before it sheds the routes declared with `shed_at` (see `route`).
    `seed` seeds the random choices of groups of deployments (`Deployments`, strategy
    `"weighted"`) of this instance: the same seed, the same sequence of choices (default None:
    seeded from the system).

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
        cooldowns: Mapping[str, Cooldown] | None = None,
        attribution: Attribution = "detailed",
        ledger: Ledger | None = None,
        cost_unit_usd: float = 1.0,
        price_table: PriceTable | None = None,
        tracing: bool | TracerProvider = False,
        hints: Mapping[str, str] | None = None,
        max_in_flight: int | None = None,
        log_attempts: Literal["retries", "all"] = "retries",
        log_sample: float = 1.0,
        context_windows: Mapping[str, int] | None = None,
        seed: int | None = None,
    ) -> None:
        if attribution not in ("off", "redacted", "detailed"):
            raise ConfigurationError('attribution must be "off", "redacted" or "detailed"')
        if not cost_unit_usd > 0:
            raise ConfigurationError("cost_unit_usd must be positive (US dollars per cost unit)")
        if log_attempts not in ("retries", "all"):
            raise ConfigurationError('log_attempts must be "retries" or "all"')
        if not 0.0 <= log_sample <= 1.0:
            raise ConfigurationError("log_sample must be between 0.0 and 1.0 (the share of successes logged)")
        if max_in_flight is not None and max_in_flight < 1:
            raise ConfigurationError("max_in_flight must be at least 1 (or None: no limit)")
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
        self.cooldowns: Mapping[str, Cooldown] = checked_cooldowns(cooldown, cooldowns or {})
        self.context_windows: Mapping[str, int] = _checked_windows(context_windows or {})
        self.attribution: Attribution = attribution
        self.ledger: Ledger = ledger if ledger is not None else LogLedger()
        self.log_attempts: Literal["retries", "all"] = log_attempts
        self.log_sample = log_sample
        self.store: Store = store if store is not None else MemoryStore()
        self.sleep, self.retry_after_s = sleep, retry_after_s
        self.prices: dict[str, Price] = dict(prices or {})
        check_table(price_table)
        self.price_table: PriceTable | None = price_table
        self.cost_unit_usd = cost_unit_usd
        #: The tracer when tracing is on (see `guards.spec._tracing`), else None.
        self.tracing: Tracing | None = None
        if tracing is not False:
            from .spec._tracing import Tracing  # only when tracing is on

            self.tracing = Tracing(None if tracing is True else tracing)
        self.credential_warnings = CredentialWarnings()
        #: When this worker's last success on each model ended, by breaker key, on
        #: `success_clock`: each step about a model tells the store how long ago (see
        #: `guards.stores.Step.success_ages`). One cell per model its routes call.
        self.last_success: dict[str, list[float | None]] = {}
        self.success_clock = _success_clock(self.store)
        #: What this worker last heard from the store refusing each model (its breaker open,
        #: a cooldown), until when on `success_clock`: a request refused by it makes no store
        #: operation (see `guards.walk._known`). One per model its routes call.
        self.known_refusals: dict[str, KnownRefusal] = {}
        #: The service level of this worker, and its guarded requests in flight.
        self.levels = Levels(self, max_in_flight)
        #: Every route guarded by this instance, in the order they were declared.
        self.routes: list[GuardedRoute] = []
        self.balance = Balance(seed)  # what groups of deployments balance by (`Deployments`)

    __init__ = keywords_checked(__init__, "Guards")  # a misspelled keyword names the closest one

    def cooldown_for(self, model: str) -> Cooldown:
        """The cooldown policy of the model keyed `model` (`model` or `provider:model`)."""
        return self.cooldowns.get(model, self.cooldown)

    def service_level(self) -> ServiceLevel:
        """The service level as this worker last read it from the store (at most a second old
        while requests arrive; reading it starts a fresh read when it is older): the level
        (`full`, `degraded`, `minimal`) and the models down, each with the time (seconds since
        the epoch) it may come back. For an app's health route."""
        self.levels.tick(time.perf_counter())
        return self.levels.view

    def status_router(
        self,
        *,
        path: str = "/status",
        token: str | None = None,
        dependencies: Sequence[Any] = (),
        refresh_s: float = 5.0,
        window_s: float = 300.0,
        include_in_schema: bool = True,
    ) -> APIRouter:
        """A router with the status page, `GET {path}`, for an app to mount
        (`app.include_router(guards.status_router(token=...))`): JSON for machines (the
        `StatusReport` schema; also when `Accept` is absent or `*/*`) and one self-contained
        HTML page for a browser (`text/html` preferred), reloading itself every `refresh_s`
        seconds; 406 when `Accept` allows neither. It shows the service level and every
        model's breaker and cooldown (read from the store per view: every worker shows the
        same), each model's last failure kind, the requests, fallback and error rates of each
        route over the last `window_s` seconds and the spend of the UTC day (every worker's
        counts with `PROMETHEUS_MULTIPROC_DIR` set, else the answering worker's), and the
        routes' spend caps. Never a budget key, a user id, a
        prompt, an answer or a provider's message. Read-only.

        `token`: the operator token; then the page answers 401 (`WWW-Authenticate: Bearer`)
        unless the request carries `Authorization: Bearer <token>` (compared in constant time),
        and a browser without it gets a page that asks for it. None: open to whoever reaches
        it (keep it behind a proxy). `dependencies` run first (e.g. an auth of the app's own).
        Raises `ConfigurationError` for a path that does not start with `/`, an empty token,
        `refresh_s` under 1 or `window_s` under 1."""
        from .status import status_router  # the status page's modules, only for an app that mounts it

        return status_router(
            self,
            path=path,
            token=token,
            dependencies=dependencies,
            refresh_s=refresh_s,
            window_s=window_s,
            include_in_schema=include_in_schema,
        )

    def ledger_enabled(self) -> bool:
        """False when records would be dropped anyway (the default log ledger with INFO off),
        so the hot path skips building them."""
        return not isinstance(self.ledger, LogLedger) or logger.isEnabledFor(logging.INFO)

    def route(
        self,
        *,
        model: str | Model | None = None,
        fallbacks: Sequence[str | Model] = (),
        attempts: int | None = None,
        timeout_s: float = 8.0,
        retry: Retry = Retry(),
        budget: Budget | Sequence[Budget] | None = None,
        breaker: Breaker | None = Breaker(),
        fallback: Any = NO_FALLBACK,
        moderation: Moderation | None = None,
        name: str | None = None,
        max_tokens: int | None = None,
        stream_max_s: float = DEFAULT_STREAM_MAX_S,
        stream_max_chars: int = DEFAULT_STREAM_MAX_CHARS,
        stream_format: StreamFormat = GUARDS_EVENTS,
        max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
        effort: Effort | None = None,
        shed_at: Literal["degraded", "minimal"] | None = None,
        task: Task | None = None,
        first_output_s: float | Unset | None = UNSET,
        stream_idle_s: float | None = None,
        content_filter_fallback: bool = False,
        on_rejected: Literal["fallback", "next_model", "reask"] = "fallback",
        tools: Mapping[str, type[BaseModel]] | None = None,
        downgrade_to: str | Model | None = None,
        stream_hold: StreamHold | None = None,
        min_chars_per_s: float | None = None,
        resumable: Resumable | None = None,
        hedge: Hedge | None = None,
    ) -> Callable[[F], F]:
        """Guard a FastAPI path operation. Put it under `@app.get/post(...)`.

        The handler must be `async def` and declare a parameter `ai: AI[Output]`, through which
        it calls the model (`await ai.run(inputs)`); `Output` is what the model must produce
        (a pydantic model requests JSON mode; `str` plain text).

        - `model`: the model (a model id, `"provider:model"`, `"hint:name"` or a `Profile`
          name, or a `Model` giving it call limits of its own); `fallbacks`: the models to try
          after it, in order (same forms). The chain is flattened now; invalid entries are
          logged (`chain_invalid`) and removed.
        - `effort`: instead of `model`, route each request by its estimated effort to the
          routing hint of its tier (see `Effort`), then to `fallbacks`.
        - `attempts`: the most provider calls one request makes across the whole chain, every
          `ai.run` / `ai.stream` of the request together (default: the chain's length plus
          `retry.attempts - 1`, i.e. one retry in total).
        - `timeout_s`: one deadline for the whole call: every model, retry and wait, counted
          from the request's arrival at the app for its first call (a later `ai.run` of the
          request: from its start).
        - `first_output_s`, `stream_idle_s`: call limits for each model of the chain that sets
          none of its own (`Model`). `stream_idle_s` default None. `first_output_s` unset (the
          default): `timeout_s / (N + 1)` for each model of a chain of N > 1 models but the
          last, none for the last and on a one-model route (the deadline alone); None: none
          for any model. An attempt with
          no first output within `first_output_s` (a stream's first output part; a whole
          answer's first byte, when the binding says when it came) is cancelled and the walk
          moves to the next model, the deadline permitting; a stream that sent output fails
          with its `error` event after `stream_idle_s` without its next part.
        - `retry`: bounded retry of transient failures (`retry.attempts` calls per model at
          most); `budget`: per-key limits, or several budgets of different scopes (a user's,
          a tenant's, a global one) admitted together, all or nothing; `breaker`: circuit
          breaker policy, one breaker per model (None to disable).
        - `downgrade_to`: a cheaper model (as `model` is named) that replaces `model` for the
          callers a budget's soft limit (`Budget(soft_limit=...)`) found near their cap at
          their last admission on this worker, followed by `fallbacks` as usual; such an
          answer carries `x-ai-downgraded` (see docs/guards/budget.md). Needs a budget with a
          soft limit; not with `effort`.
        - `fallback`: makes the route *degrading*: it answers `Envelope[ReturnType]`, with this
          value (or, if callable, `fallback(arguments, tripped)`, or the route's last good
          answer: `LastGood`) as `data` when a guard trips. Without it the route is *strict*
          and answers public errors.
        - `moderation`: a hook given the validated output; returning True blocks it.
        - `max_tokens`: 1 to 1,000,000, sent with each call unless the inputs set a number of
          tokens (theirs is capped to 1,000,000; see docs/guards/budget.md); required with a
          spend cap or a token limit.
        - `stream_max_s`, `stream_max_chars`: a streamed answer (`ai.stream`) ends with the
          `error` event once this long has passed since the request began (`call`/`timeout`),
          or before its output (text, reasoning, tool calls) would pass this many characters
          (`call`/`provider_error`); the provider's stream is closed at that moment. Defaults:
          300 s and 1 MiB (1,048,576) characters, the body cap of a whole answer.
        - `stream_hold`: `StreamHold(chars=..., seconds=...)` holds the start of a streamed
          answer before its commit point (at most 65,536 characters and 30 s, the seconds below
          `timeout_s`; default None: commit at the first output): it is read but not sent, the
          output guard checks it (an empty answer, `moderation` on the held text, a provider's
          content filter), and a rejected answer moves on to the next model, unseen by the
          client; then it is sent at once, and the rest as it comes. The hold ends early when
          the answer completes inside it, and never extends the deadline.
        - `min_chars_per_s`: the slowest a stream may be before its commit point, for each model
          of the chain that sets none of its own (`Model`; default None: no minimum), measured
          over the hold, else over the first second after the first output (which then is
          held). A slower model is cancelled before the commit and the walk moves on, as for
          `first_output_s` (ledger kind `model_temporarily_unavailable`); never after it.
        - `stream_format`: how a streamed answer is written: guards' own events
          (`GUARDS_EVENTS`, the default) or `UI_MESSAGE_STREAM`, the Vercel AI SDK's UI
          message stream that `useChat` reads.
        - `max_body_bytes`: the most request body the route reads (default 1 MiB; None: no
          limit). A longer body is answered `400 invalid_request` as soon as its declared
          length or its bytes pass the limit, never read whole (`install` sets this up).
        - `shed_at`: the service level (`"degraded"` or `"minimal"`) at which the route is shed
          (default None: never): at that level or a lower one, and when the worker has more
          than `max_in_flight` guarded requests in flight, it answers at once with no provider
          call and no charge, like an open breaker (`circuit_open`: the envelope's fallback,
          or 503 with `Retry-After`).
        - `task`: `Task(...)` runs requests that carry an `Idempotency-Key` header as
          multi-step tasks: `ai.step(name, ...)` saves each step's result, a retry resumes
          after the steps that completed, and a completed task replays its answer (see
          `AI.step` and `Task`). Not for streaming routes.
        - `content_filter_fallback`: when a provider's content filter refuses a call
          (`moderation_blocked`, never retried), move on to the chain's next model of another
          provider (default False: the request ends with `moderation_blocked`).
        - `on_rejected`: what an answer the output guard rejects (schema, empty, moderation, a
          tool call that does not validate) does: `"fallback"` (default) ends the request (the
          fallback, or 502 `incompatible_model_response`); `"next_model"` moves on to the next
          model of the chain; `"reask"` asks the same model once more, the problems (field
          paths and problem tokens, never the rejected text) appended as a user turn, then
          moves on. Within the attempt budget and the deadline; not for streaming routes.
        - `tools`: the route's tools, `{"name": ArgumentsModel}` (pydantic models): each tool
          call of an answer is validated against its tool's model (an unknown tool, or
          arguments that do not validate, reject the answer: `schema_invalid`), and handed to
          the handler as `ai.tool_calls`; sent as the `tools` input unless a call sets it.
          The route declares `AI[str]`: an answer with tool calls returns its text ("" when
          none). Not for streaming routes.
        - `resumable`: `Resumable(...)` keeps a streaming route's streams in the store, so
          that a client that lost its connection resumes one (`GET <path>/<id>/stream`, with
          `Last-Event-ID`; the AI SDK's `useChat({resume: true})`): every event then carries
          an `id`, and a client leaving no longer cancels the stream (see
          docs/streaming.md, "Resuming a stream"). Default None: not resumable.
        - `hedge`: `Hedge(after_s=...)` or `Hedge(after="p95")` starts a second attempt on the next
          model when a call (a stream before its commit point) has not answered after the delay;
          the first answer wins (see `Hedge`, docs/fallback-chains.md). Default None: never.

        Raises `ConfigurationError` at decoration time for a route declared wrong.
        """

        settings = RouteSettings(
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
            stream_max_s=stream_max_s,
            stream_max_chars=stream_max_chars,
            stream_format=stream_format,
            max_body_bytes=max_body_bytes,
            effort=effort,
            shed_at=shed_at,
            task=task,
            first_output_s=first_output_s,
            stream_idle_s=stream_idle_s,
            content_filter_fallback=content_filter_fallback,
            on_rejected=on_rejected,
            tools=tools,
            downgrade_to=downgrade_to,
            stream_hold=stream_hold,
            min_chars_per_s=min_chars_per_s,
            resumable=resumable,
            hedge=hedge,
        )  # checked now, before the handler is seen

        def decorate(handler: F) -> F:
            endpoint = guard_route(self, handler, settings)
            route = route_of(endpoint)
            assert route is not None
            self.levels.watch(route)
            self.routes.append(route)
            return endpoint  # type: ignore[return-value]

        return decorate

    route = keywords_checked(route, "route")  # a misspelled keyword names the closest one

    def install(self, app: FastAPI) -> None:
        """Attach to `app`: answer invalid input on guarded routes with `400 invalid_request`,
        stop reading a guarded route's request body past its `max_body_bytes`, keep the
        service level fresh (`x-service-level` on guarded responses, `max_in_flight`), document every
        status a guarded route can answer in OpenAPI, and make `Guards.of(app)` find this
        instance. Call once, when building the app: then all of it holds from the first request.

        Also makes guards' log lines visible without any logging set-up: JSON lines on stderr
        (INFO and up, unless the app set a level on the `guards` logger) until the app
        configures a handler of its own for them (on `guards` or the root logger).

        An app that never calls it is installed by the first request one of its guarded routes
        serves, for the requests after it, with an `install_missing` warning (invalid input
        sent before then got FastAPI's 422); calling it after that is no error. Raises
        `ConfigurationError` when `Guards` were installed on `app` by a call already."""
        installed = getattr(app.state, "guards", None)
        if installed is self and getattr(app.state, _AUTOMATIC, False):
            setattr(app.state, _AUTOMATIC, False)  # installed now on purpose: nothing left to do
            return
        if installed is not None:
            raise ConfigurationError("Guards are already installed on this app")
        self._attach(app)

    def _ensure_installed(self, app: object, route: str) -> None:
        """Install on `app` unless `Guards` are installed there already: what a guarded route
        does at the first request it serves on an app (once per app; then one attribute check
        per request). A forgotten `install` is so made good from the next request on: invalid
        input before it got FastAPI's own 422, as the middleware the app built at its start had
        none of guards'. Logs one `install_missing` warning that names the fix. An app that is
        not a FastAPI app is left as it is."""
        if not isinstance(app, FastAPI) or getattr(app.state, "guards", None) is not None:
            return
        self._attach(app)
        setattr(app.state, _AUTOMATIC, True)
        # A document built before now lacks guards' statuses: the next one asked for has them.
        app.openapi_schema = None
        emit_warning(
            "install_missing",
            route=route,
            detail="guards.install(app) was not called: installed at this route's first request. "
            "Call guards.install(app) where the app is built: invalid input sent before this "
            "request was answered 422, not 400 invalid_request",
        )

    def _attach(self, app: FastAPI) -> None:
        """What `install` does (see it), on an app that may have started already: its
        middleware stack is then built again, from the next request on (a request in flight
        keeps the one it started with)."""
        app.state.guards = self
        app.middleware_stack = None  # built on the app's next call, with guards' middleware
        show_logs()
        app.add_middleware(GuardsMiddleware, guards=self)
        # Input that never reached a guarded handler (unparseable or invalid) is answered
        # `400 invalid_request`; everything else goes to the handlers registered before.
        for exc_class in (RequestValidationError, StarletteHTTPException):
            previous = app.exception_handlers.get(exc_class)
            app.add_exception_handler(exc_class, invalid_input_handler(previous, self.tracing))
        original_openapi = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                from .routes._openapi import (
                    document_guarded_routes,  # once, when the document is first asked for
                )

                document_guarded_routes(app, original_openapi(), self.attribution)
            assert app.openapi_schema is not None
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]

    def replace_store(self, store: Store) -> Store:
        """Make `store` the store of every route of this instance from now on, and forget what
        this worker kept from the old one: the service level, the retry budget's windows, the
        last success on each model, the refusals it knew of (open breakers, cooldowns) and the
        credential warnings already logged. Returns the old
        store (not closed). For tests: `guards.testing`'s `use_fake_ai` gives each test a fresh
        `MemoryStore` this way. Raises `ConfigurationError` when `store` reads another clock
        than the old one (the routes measure success ages on it)."""
        if _success_clock(store) != self.success_clock:
            raise ConfigurationError("replace_store: the new store must read the same clock as the old one")
        old, self.store = self.store, store
        self.retry_windows = RetryWindows()
        self.credential_warnings = CredentialWarnings()
        for cell in self.last_success.values():  # the routes' legs hold these cells
            cell[0] = None
        for known in self.known_refusals.values():
            known.until = 0.0
        self.levels.reset()
        return old

    @staticmethod
    def of(app: FastAPI) -> Guards:
        """The `Guards` installed on `app` (by `install`, or by the first request one of its
        guarded routes served). Raises `ConfigurationError` when none is (yet)."""
        guards = getattr(app.state, "guards", None)
        if not isinstance(guards, Guards):
            raise ConfigurationError(
                "no Guards installed on this app (yet): call guards.install(app) where the app is built"
            )
        return guards

    async def aclose(self) -> None:
        """Close the bindings and the store, and write this process's metrics and log lines,
        once the streams still relayed have ended and settled (for a second at most: see
        `guards.streams._relay.settled`); resumable streams still produced end first, with
        their `error` event, kept."""
        await stop_kept_streams(self)
        await settled()
        flush_metrics()
        await anyio.to_thread.run_sync(flush_logs)
        self.levels.close()
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


def _success_clock(store: Store) -> Callable[[], float]:
    """What measures how long ago a success ended: the store's own clock when it was given one
    (a test's `ManualClock`: the ages then agree with the store's time), else `time.monotonic`,
    which no step of the wall clock can make run backwards (only the age travels, never a time,
    so the worker's clock need not agree with the store's)."""
    clock = getattr(store, "clock", None)
    return time.monotonic if clock is None or type(clock) is SystemClock else clock.time


def _checked_windows(windows: Mapping[str, int]) -> dict[str, int]:
    """`Guards(context_windows=...)` as kept; raises `ConfigurationError` for a key that is not
    a model key or a window that is not a positive number of tokens."""
    for model, tokens in windows.items():
        if not isinstance(model, str) or not model.strip():
            raise ConfigurationError(
                f"context_windows: {model!r} is not a model key (`model` or `provider:model`)"
            )
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise ConfigurationError(
                f"context_windows[{model!r}] must be a positive number of tokens (an int), not {tokens!r}"
            )
    return dict(windows)


if TYPE_CHECKING:

    def _satisfies_shared(guards: Guards) -> Shared:
        return guards  # mypy checks that `Guards` is what the lower modules are typed against
