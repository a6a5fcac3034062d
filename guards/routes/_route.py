"""The route decorator: where the guards meet FastAPI.

    @app.post("/summary")
    @guards.route(model="@cf/...", budget=Budget(per_day=20), fallback=keyword_summary)
    async def summary(body: SummaryIn, ai: AI[Summary]) -> Summary:
        return await ai.run({"messages": [...]})

The decorated function keeps its parameters (FastAPI still sees them and their dependencies);
the `ai` parameter is removed from what FastAPI sees and filled with a fresh `AI`
(`guards.walk`) per request. A route's declaration is checked and its chain flattened once, at
start-up, here; what runs per request is its `GuardedEndpoint` (`guards.routes._endpoint`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from ..contracts._envelope import Envelope, FallbackInfo
from ..contracts._errors import ConfigurationError, GuardTripped
from ..contracts._output import Moderation, OutputGuard, input_names
from ..contracts._settings import UNSET, Unset
from ..contracts._vocabulary import Level
from ..observe._log import emit_warning
from ..observe._metrics import RouteMetrics
from ..policies._budget import Budget, price_of
from ..policies._call import Retry
from ..policies._chain import HINT_PREFIX, Model, check_limit, entry_parts, flatten_chain
from ..policies._last_good import LastGood, LastGoodCache
from ..policies._price_table import fill_prices
from ..policies._tasks import Task, key_parameter
from ..spec._route_spec import NO_FALLBACK, GuardedRoute, Leg, SuccessAges
from ..stores._breaker import Breaker
from ..streams._event_stream import GUARDS_EVENTS, EventStream, StreamFormat
from ..streams._relay import DEFAULT_STREAM_MAX_CHARS, DEFAULT_STREAM_MAX_S
from ..walk import AI
from ._endpoint import REQUEST_PARAMETER, RESPONSE_PARAMETER, GuardedEndpoint, request_trace_id

if typing.TYPE_CHECKING:
    from ..spec._shared import Shared
    from ._effort import Effort

__all__ = ["FallbackFunction", "guard_route"]

T = TypeVar("T")

#: Computes a degrading route's fallback value from the route's arguments (as FastAPI resolved
#: them, by parameter name) and the tripped guard. May be sync or async.
FallbackFunction = Callable[[Mapping[str, Any], GuardTripped], Any]


def guard_route(
    guards: Shared,
    handler: Callable[..., Awaitable[Any]],
    *,
    model: str | Model | None,
    fallbacks: Sequence[str | Model],
    attempts: int | None,
    timeout_s: float,
    retry: Retry,
    budget: Budget | Sequence[Budget] | None,
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
    first_output_s: float | Unset | None = UNSET,
    stream_idle_s: float | None = None,
    content_filter_fallback: bool = False,
    on_rejected: str = "fallback",
    tools: Mapping[str, type[BaseModel]] | None = None,
    downgrade_to: str | Model | None = None,
) -> Callable[..., Awaitable[Any]]:
    """Build the FastAPI endpoint for a guarded handler (see `Guards.route`)."""
    if not inspect.iscoroutinefunction(handler):
        raise ConfigurationError(f"guarded route {handler.__qualname__} must be an `async def`")
    if effort is not None and model is not None:
        raise ConfigurationError(
            f"{handler.__qualname__}: a route names its model or routes by effort, not both"
        )
    if effort is None and (model is None or not entry_parts(model)[0].strip()):
        raise ConfigurationError("a guarded route needs a model id")
    # Unset: the default share below; None: the deadline alone.
    shared_first = first_output_s is UNSET
    limits = (
        None if isinstance(first_output_s, Unset) else check_limit("route: first_output_s", first_output_s),
        check_limit("route: stream_idle_s", stream_idle_s),
    )
    route_name = name or handler.__name__
    budgets, scopes = route_budgets(handler.__qualname__, budget, route_name)
    spend_capped = any(each.spend_capped for each in budgets)
    if spend_capped and max_tokens is None:
        raise ConfigurationError(
            f"{handler.__qualname__} has a spend cap: declare max_tokens to bound its cost"
        )
    token_capped = any(each.token_capped for each in budgets)
    soft = [each.soft_limit is not None for each in budgets]
    if downgrade_to is not None and not any(soft):
        raise ConfigurationError(
            f"{handler.__qualname__}: downgrade_to needs a budget with a soft limit "
            "(Budget(soft_limit=...)), past which a caller's requests are downgraded"
        )
    if downgrade_to is not None and effort is not None:
        raise ConfigurationError(f"{handler.__qualname__}: a route downgrades or routes by effort, not both")
    if token_capped and max_tokens is None:
        raise ConfigurationError(
            f"{handler.__qualname__} has a token limit: declare max_tokens to bound the tokens "
            "a request holds (its estimated input tokens plus max_tokens)"
        )
    problems: dict[str, None] = {}  # each logged once, whichever tier's chain has it

    def chain_of(first: str | Model) -> tuple[tuple[Leg, ...], int]:
        """The legs of the chain `first, *fallbacks`, and its attempt budget."""
        chain = flatten_chain(
            [first, *fallbacks], profiles=guards.profiles, providers=guards.providers, hints=guards.hints
        )
        problems.update(dict.fromkeys(chain.problems))
        models = tuple(ref.limited(limits) for ref in chain.models)
        if shared_first and len(models) > 1:
            # A silent or slow model never holds a request another model could answer: each
            # model but the last, with no limit of its own or the route's, gets a share of
            # the deadline to start answering, which leaves the rest of the chain its room.
            share = (timeout_s / (len(models) + 1), None)
            models = (*(ref.limited(share) for ref in models[:-1]), models[-1])
        for ref in models:
            if ref.first_output_s is not None and ref.first_output_s >= timeout_s:
                # Kept, though it never fires before the deadline: the same `Model` or
                # profile may serve routes with longer deadlines.
                problems[
                    f"model {ref.key!r}: first_output_s {ref.first_output_s:g}s is not below the "
                    f"route's timeout_s {timeout_s:g}s: it never fires (the deadline does first)"
                ] = None
        if not chain.models:
            raise ConfigurationError(
                f"{handler.__qualname__}: no model left in its chain ({'; '.join(chain.problems)})"
            )
        attempt_budget = attempts if attempts is not None else len(chain.models) + retry.attempts - 1
        if attempt_budget < 1:
            raise ConfigurationError("attempts must be at least 1")
        prices = guards.prices
        fill_prices(
            prices,
            guards.price_table,
            chain.models,
            {None: guards.binding} | dict(guards.providers.items()),
            guards.cost_unit_usd,
        )
        unpriced = [ref.key for ref in chain.models if price_of(prices, ref.key) is None]
        if spend_capped and unpriced:
            raise ConfigurationError(
                f"{handler.__qualname__} has a spend cap: Guards(prices=...) has no price for "
                + ", ".join(unpriced)
                + ': add one under its key, or a price for every model without one under "*"'
            )
        legs = tuple(
            Leg.of(
                ref,
                price_of(prices, ref.key),
                route_name,
                index == 0,
                guards.last_success,
                guards.known_refusals,
                guards.context_windows.get(ref.key),
            )
            for index, ref in enumerate(models)
        )
        return legs, attempt_budget

    legs, attempt_budget = chain_of(
        HINT_PREFIX + effort.standard if effort is not None else model if model is not None else ""
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
    if streaming and (on_rejected != "fallback" or tools is not None):
        raise ConfigurationError(
            f"streaming route {handler.__qualname__} cannot declare on_rejected or tools: a stream's "
            "output (its tool calls included) reaches the client as it comes, before any check"
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
    answers = None
    if on_rejected != "fallback" or tools is not None:
        # Only for a route that uses them (at start-up, once).
        from ..contracts._tools import Tools
        from ..walk._rejected import Answers

        if tools is not None and output.response_format is not None:
            raise ConfigurationError(
                f"{handler.__qualname__} declares tools: its answer is text or tool calls, so declare "
                f"`{ai_name}: AI[str]` (a JSON-mode output cannot be both)"
            )
        answers = Answers(on_rejected, Tools(tools, handler.__qualname__) if tools is not None else None)
    local_share = None
    if any(each.on_store_failure == "local" for each in budgets):
        # The local fallback's module, only for a budget that uses it (at start-up, once).
        from ..policies._local_budget import LocalShare

        local_share = LocalShare.of(budgets)
    route = GuardedRoute(
        input_names=input_names(params),
        name=route_name,
        model=legs[0].ref.key,
        legs=legs,
        step_legs=tuple((leg.cooldown_key, leg.breaker_key) for leg in legs),
        attempt_budget=attempt_budget,
        timeout_s=timeout_s,
        retry=retry,
        budget=budgets[0] if budgets else None,
        breaker=breaker,
        output=output,
        data_type=data_type,
        fallback=fallback,
        scope=scopes[0] if scopes else route_name,
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
        windowed=any(leg.window is not None for leg in legs),
        content_filter_fallback=content_filter_fallback,
        answers=answers,
        slow_call_s=breaker.slow_call_s if breaker is not None else None,
        local_share=local_share,
        budgets=budgets,
        scopes=scopes,
        holds=spend_capped or token_capped,
        token_capped=token_capped,
        soft_limited=any(soft),
    )
    if downgrade_to is not None:
        # The downgrade's module, only for a route that uses it (at start-up, once).
        from ._downgrade import Downgrade

        downgrade = Downgrade(soft)
        cheap, cheap_budget = chain_of(downgrade_to)
        route = dataclasses.replace(route, downgrade=downgrade)
        downgrade.route = dataclasses.replace(
            route,
            model=cheap[0].ref.key,
            legs=cheap,
            step_legs=tuple((leg.cooldown_key, leg.breaker_key) for leg in cheap),
            attempt_budget=cheap_budget,
            success_ages=route.success_ages.over(cheap),
            windowed=any(leg.window is not None for leg in cheap),
        )
    if effort is not None:
        # Effort routing's module, only for a route that uses it (at start-up, once).
        from ._effort import EffortRoutes

        route = EffortRoutes.attach(route, effort, lambda hint: chain_of(HINT_PREFIX + hint))
    for problem in problems:
        emit_warning("chain_invalid", route=route_name, problem=problem)
    envelope_type: Any = None
    if degrading:
        envelope_type = Envelope[data_type]  # type: ignore[valid-type]
        # Built now, at start-up, not by the route's first answer (see `guards.contracts._envelope`).
        envelope_type.model_rebuild(raise_errors=False)
        FallbackInfo.model_rebuild(raise_errors=False)
    endpoint = GuardedEndpoint(
        guards,
        route,
        handler,
        ai_name=ai_name,
        data_type=data_type,
        data_adapter=data_adapter,
        envelope_type=envelope_type,
        plain=plain,
        last_good=last_good,
    )

    params += [
        inspect.Parameter(REQUEST_PARAMETER, inspect.Parameter.KEYWORD_ONLY, annotation=Request),
        inspect.Parameter(RESPONSE_PARAMETER, inspect.Parameter.KEYWORD_ONLY, annotation=Response),
    ]
    guarded: Callable[..., Awaitable[Any]] = endpoint
    if task is not None:  # the Idempotency-Key header: validated and documented by FastAPI
        from ._task_endpoint import task_endpoint  # only for a route that runs tasks, at start-up

        params.append(key_parameter())
        guarded = task_endpoint(
            guards,
            route,
            endpoint,
            response_type=envelope_type or data_type,
            trace_id_of=request_trace_id,
            request_param=REQUEST_PARAMETER,
            response_param=RESPONSE_PARAMETER,
        )
    guarded.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=envelope_type if degrading else data_type
    )
    guarded.__guards_route__ = route  # type: ignore[attr-defined]
    return guarded


def route_budgets(
    where: str, budget: Budget | Sequence[Budget] | None, route_name: str
) -> tuple[tuple[Budget, ...], tuple[str, ...]]:
    """A route's budgets and their scopes (a budget's `scope`, else the route's name), each
    scope once."""
    budgets = () if budget is None else (budget,) if isinstance(budget, Budget) else tuple(budget)
    for each in budgets:
        if not isinstance(each, Budget):
            raise ConfigurationError(
                f"{where}: budget must be a Budget or a sequence of Budget, not {each!r}"
            )
    scopes = tuple(each.scope or route_name for each in budgets)
    if len(set(scopes)) < len(scopes):
        raise ConfigurationError(
            f"{where}: two budgets of the route have the scope {sorted(s for s in scopes if scopes.count(s) > 1)[0]!r}: "
            "give each its own `scope`"
        )
    return budgets, scopes
