"""The route decorator: where the guards meet FastAPI.

    @app.post("/summary")
    @guards.route(model="@cf/...", budget=Budget(per_day=20), fallback=keyword_summary)
    async def summary(body: SummaryIn, ai: AI[Summary]) -> Summary:
        return await ai.run({"messages": [...]})

The decorated function keeps its parameters (FastAPI still sees them and their dependencies);
the `ai` parameter is removed from what FastAPI sees and filled with a fresh `AI`
(`guards.walk`) per request. Once, at start-up: the declaration is checked whole
(`guards.spec._route_checks`, where every check of it lives), then its spec (`GuardedRoute`, its
`Leg`s) and its endpoint are built here from what passed. What runs per request is its
`GuardedEndpoint` (`guards.routes._endpoint`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any

from starlette.requests import Request
from starlette.responses import Response

from ..contracts._envelope import Envelope, FallbackInfo
from ..contracts._errors import ConfigurationError, GuardTripped
from ..contracts._output import input_names
from ..observe._log import emit_warning
from ..observe._metrics import RouteMetrics
from ..policies._budget import Budget, price_of
from ..policies._chain import HINT_PREFIX, Model
from ..policies._last_good import LastGood, LastGoodCache
from ..policies._tasks import key_parameter
from ..spec._route_checks import CheckedChain, CheckedRoute, RouteSettings, check_route
from ..spec._route_spec import GuardedRoute, Leg, SuccessAges
from ..stores._kept import StreamKeeper
from ..walk import AI
from ._balance import balanced, on_chain
from ._endpoint import REQUEST_PARAMETER, RESPONSE_PARAMETER, GuardedEndpoint, request_trace_id

if typing.TYPE_CHECKING:
    from ..policies._local_budget import LocalShare
    from ..spec._route_spec import AnswerPolicy
    from ..spec._shared import Shared
    from ._effort import Effort

__all__ = ["FallbackFunction", "guard_route"]

#: Computes a degrading route's fallback value from the route's arguments (as FastAPI resolved
#: them, by parameter name) and the tripped guard. May be sync or async.
FallbackFunction = Callable[[Mapping[str, Any], GuardTripped], Any]


def guard_route(
    guards: Shared, handler: Callable[..., Awaitable[Any]], settings: RouteSettings
) -> Callable[..., Awaitable[Any]]:
    """The FastAPI endpoint for a guarded `handler` declared with `settings` (see
    `Guards.route`): the declaration checked whole (`check_route`), its spec built from that."""
    checked = check_route(guards, handler, settings, AI)
    if settings.resumable is not None and not isinstance(guards.store, StreamKeeper):
        raise ConfigurationError(
            f"route {checked.name}: resumable streams are kept in the store, and {guards.store!r} "
            "cannot keep them (MemoryStore, SQLiteStore and RedisStore can)"
        )
    problems = dict.fromkeys(checked.chain.problems)  # each logged once, whichever chain has it

    def chain_of(first: str | Model) -> tuple[tuple[Leg, ...], int]:
        """The legs of another chain of the route (`first, *fallbacks`), and its attempt budget."""
        chain = checked.chain_of(guards, first)
        problems.update(dict.fromkeys(chain.problems))
        return _legs(guards, checked.name, chain), chain.attempt_budget

    route = _spec(guards, checked, _legs(guards, checked.name, checked.chain))
    if settings.downgrade_to is not None:
        route = _with_downgrade(route, checked.soft, chain_of(settings.downgrade_to))
    if settings.effort is not None:
        # Effort routing's module, only for a route that uses it (at start-up, once).
        from ._effort import EffortRoutes

        effort = typing.cast("Effort", settings.effort)
        route = EffortRoutes.attach(route, effort, lambda hint: chain_of(HINT_PREFIX + hint))
    route = balanced(route)
    for problem in problems:
        emit_warning("chain_invalid", route=checked.name, problem=problem)
    return _endpoint(guards, handler, checked, route)


def _legs(guards: Shared, route_name: str, chain: CheckedChain) -> tuple[Leg, ...]:
    """The legs of a checked chain: each model with its price, window and shared cells."""
    prices = guards.prices
    return tuple(
        Leg.of(
            ref,
            price_of(prices, ref.key),
            route_name,
            index == 0 or (ref.group is not None and ref.group is chain.models[0].group),
            guards.last_success,
            guards.known_refusals,
            guards.context_windows.get(ref.key),
        )
        for index, ref in enumerate(chain.models)
    )


def _spec(guards: Shared, checked: CheckedRoute, legs: tuple[Leg, ...]) -> GuardedRoute:
    """The route's description, as the request path reads it (its first chain: `legs`)."""
    settings, name, budgets = checked.settings, checked.name, checked.budgets
    output, breaker = checked.output, settings.breaker
    return GuardedRoute(
        input_names=input_names(checked.handler.params),
        name=name,
        model=legs[0].ref.key,
        legs=legs,
        step_legs=tuple((leg.cooldown_key, leg.breaker_key) for leg in legs),
        attempt_budget=checked.chain.attempt_budget,
        timeout_s=settings.timeout_s,
        retry=settings.retry,
        budget=budgets[0] if budgets else None,
        breaker=breaker,
        output=output,
        data_type=checked.handler.data_type,
        fallback=settings.fallback,
        scope=checked.scopes[0] if checked.scopes else name,
        response_format=(
            {"type": "json_schema", "json_schema": output.json_schema}
            if output.json_schema is not None
            else None
        ),
        max_tokens=settings.max_tokens,
        spend_capped=checked.spend_capped,
        streaming=checked.handler.streaming,
        max_body_bytes=settings.max_body_bytes,
        metrics=RouteMetrics(name),
        success_ages=SuccessAges(legs, guards.success_clock),
        stream_max_s=settings.stream_max_s,
        stream_max_chars=settings.stream_max_chars,
        stream_format=settings.stream_format,
        stream_hold=settings.stream_hold,
        resumable=settings.resumable,
        shed_at=settings.level,
        task=settings.task,
        windowed=any(leg.window is not None for leg in legs),
        content_filter_fallback=settings.content_filter_fallback,
        answers=_answers(checked),
        slow_call_s=breaker.slow_call_s if breaker is not None else None,
        local_share=_local_share(budgets),
        budgets=budgets,
        scopes=checked.scopes,
        holds=checked.spend_capped or checked.token_capped,
        token_capped=checked.token_capped,
        soft_limited=any(checked.soft),
        hedge=settings.hedge,
    )


def _answers(checked: CheckedRoute) -> AnswerPolicy | None:
    """What the route does with rejected answers and its tools' calls (None: the default)."""
    on_rejected = checked.settings.on_rejected
    if on_rejected == "fallback" and checked.tools is None:
        return None
    from ..walk._rejected import Answers  # only for a route that uses them (at start-up, once)

    return Answers(on_rejected, checked.tools)


def _local_share(budgets: tuple[Budget, ...]) -> LocalShare | None:
    """The budgets' share per worker while the store is down, when one falls back to it."""
    if not any(each.on_store_failure == "local" for each in budgets):
        return None
    # The local fallback's module, only for a budget that uses it (at start-up, once).
    from ..policies._local_budget import LocalShare

    return LocalShare.of(budgets)


def _with_downgrade(
    route: GuardedRoute, soft: Sequence[bool], cheap: tuple[tuple[Leg, ...], int]
) -> GuardedRoute:
    """`route` with its downgrade near a cap attached: the same route on the chain `cheap`."""
    # The downgrade's module, only for a route that uses it (at start-up, once).
    from ._downgrade import Downgrade

    downgrade = Downgrade(soft)
    legs, attempt_budget = cheap
    route = dataclasses.replace(route, downgrade=downgrade)
    downgrade.route = on_chain(dataclasses.replace(route, downgraded=True), legs, attempt_budget)
    return route


def _endpoint(
    guards: Shared, handler: Callable[..., Awaitable[Any]], checked: CheckedRoute, route: GuardedRoute
) -> Callable[..., Awaitable[Any]]:
    """The endpoint FastAPI calls: the handler inside its guards, with the signature FastAPI
    reads (the handler's parameters but `ai`, the request and sub-response; the envelope or
    data it answers) and the route's spec attached (`route_of`)."""
    shape, settings = checked.handler, checked.settings
    envelope_type: Any = None
    if checked.degrading:
        envelope_type = Envelope[shape.data_type]  # type: ignore[name-defined]
        # Built now, at start-up, not by the route's first answer (see `guards.contracts._envelope`).
        envelope_type.model_rebuild(raise_errors=False)
        FallbackInfo.model_rebuild(raise_errors=False)
    fallback = settings.fallback
    endpoint = GuardedEndpoint(
        guards,
        route,
        handler,
        ai_name=shape.ai_name,
        data_type=shape.data_type,
        data_adapter=checked.data_adapter,
        envelope_type=envelope_type,
        plain=checked.plain,
        last_good=(
            LastGoodCache(fallback, checked.name, checked.data_adapter)
            if isinstance(fallback, LastGood)
            else None
        ),
        request_name=declared(shape.params, Request),
        response_name=declared(shape.params, Response),
    )
    params = [*shape.params]
    if endpoint.request_name is None:
        params.append(
            inspect.Parameter(REQUEST_PARAMETER, inspect.Parameter.KEYWORD_ONLY, annotation=Request)
        )
    if endpoint.response_name is None:
        params.append(
            inspect.Parameter(RESPONSE_PARAMETER, inspect.Parameter.KEYWORD_ONLY, annotation=Response)
        )
    guarded: Callable[..., Awaitable[Any]] = endpoint
    if settings.task is not None:  # the Idempotency-Key header: validated and documented by FastAPI
        from ._task_endpoint import task_endpoint  # only for a route that runs tasks, at start-up

        params.append(key_parameter())
        guarded = task_endpoint(
            guards,
            route,
            endpoint,
            response_type=envelope_type or shape.data_type,
            trace_id_of=request_trace_id,
            request_param=endpoint.request_name or REQUEST_PARAMETER,
            response_param=endpoint.response_name or RESPONSE_PARAMETER,
        )
    guarded.__signature__ = shape.signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=envelope_type if checked.degrading else shape.data_type
    )
    guarded.__guards_route__ = route  # type: ignore[attr-defined]
    return guarded


def declared(params: Iterable[inspect.Parameter], kind: type) -> str | None:
    """The name of the handler's parameter FastAPI fills with `kind` (`Request`, `Response`),
    if it declares one (the last, as FastAPI fills the last): FastAPI fills one parameter of
    each kind per endpoint, so a second one, guards' own, would leave the handler's unfilled."""
    found = None
    for param in params:
        annotation = param.annotation
        if typing.get_origin(annotation) is Annotated:
            annotation = typing.get_args(annotation)[0]
        if isinstance(annotation, type) and issubclass(annotation, kind):
            found = param.name
    return found
