"""Every check of a route's declaration, at decoration time, in one place, each failure a
`ConfigurationError` naming the setting, the value and the fix:

    RouteSettings   Guards.route's settings, each value's type and range (before the handler)
    check_route     the declaration as a whole: the handler's signature, the settings together,
                    the chain against the app's models and prices, the fallback against the
                    return type: one `CheckedRoute`

The route decorator (`guards.routes._route`) builds the route's spec (`GuardedRoute`, its
`Leg`s) and its endpoint from a `CheckedRoute`, and checks nothing itself; a chain it builds
later (effort tiers, the downgrade) is checked here too (`CheckedRoute.chain_of`).
`guards.contracts._settings` has the checks of one value; the settings types check their own.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, TypeAdapter, ValidationError

from ..contracts._errors import ConfigurationError
from ..contracts._output import Moderation, OutputGuard
from ..contracts._settings import UNSET, Unset, choice, number, whole
from ..contracts._tokens import MAX_TOKENS
from ..contracts._vocabulary import Level
from ..policies._budget import Budget, price_of
from ..policies._call import Retry
from ..policies._chain import (
    HINT_PREFIX,
    Limits,
    Model,
    ModelRef,
    check_limit,
    check_rate,
    entry_parts,
    flatten_chain,
)
from ..policies._hedge import Hedge
from ..policies._last_good import LastGood
from ..policies._price_table import fill_prices
from ..policies._tasks import Task
from ..stores._breaker import Breaker
from ..streams._event_stream import EventStream, StreamFormat
from ..streams._hold import StreamHold
from ..streams._kept import Resumable
from ._route_spec import NO_FALLBACK

if typing.TYPE_CHECKING:
    from ..contracts._tools import Tools
    from ._shared import Shared

__all__ = ["CheckedChain", "CheckedRoute", "HandlerShape", "RouteSettings", "check_route", "route_budgets"]


class EffortHints(Protocol):
    """What the checks read of an `Effort` (`guards.routes._effort`): the standard tier's hint,
    whose chain the route runs until a request picks its tier."""

    @property
    def standard(self) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteSettings:
    """`Guards.route`'s settings as given (see it for each), checked when built: each value's
    type and range, before anything is built from it (`ConfigurationError` naming the setting,
    the value and the fix). What depends on the handler is checked by `check_route`."""

    model: str | Model | None
    fallbacks: Sequence[str | Model]
    attempts: int | None
    timeout_s: float
    retry: Retry
    budget: Budget | Sequence[Budget] | None
    breaker: Breaker | None
    fallback: Any
    moderation: Moderation | None
    name: str | None
    max_tokens: int | None
    stream_max_s: float
    stream_max_chars: int
    stream_format: StreamFormat
    max_body_bytes: int | None
    effort: EffortHints | None
    shed_at: Literal["degraded", "minimal"] | None
    task: Task | None
    first_output_s: float | Unset | None
    stream_idle_s: float | None
    content_filter_fallback: bool
    on_rejected: Literal["fallback", "next_model", "reask"]
    tools: Mapping[str, type[BaseModel]] | None
    downgrade_to: str | Model | None
    stream_hold: StreamHold | None = None
    min_chars_per_s: float | None = None
    resumable: Resumable | None = None
    hedge: Hedge | None = None

    def __post_init__(self) -> None:
        _check_chain_entries(self.model, self.fallbacks, self.downgrade_to)
        whole("route: attempts", self.attempts, none="the chain's length plus one retry")
        number("route: timeout_s", self.timeout_s, above=0, unit="seconds")
        _check_policies(self)
        whole("route: max_tokens", self.max_tokens, most=MAX_TOKENS, none="the provider's default")
        number("route: stream_max_s", self.stream_max_s, above=0, unit="seconds")
        whole("route: stream_max_chars", self.stream_max_chars)
        whole("route: max_body_bytes", self.max_body_bytes, none="no limit")
        if not isinstance(self.content_filter_fallback, bool):
            raise ConfigurationError(
                f"route: content_filter_fallback must be True or False; got {self.content_filter_fallback!r}"
            )
        choice("route: on_rejected", self.on_rejected, ("fallback", "next_model", "reask"))
        choice("route: shed_at", self.shed_at, (Level.degraded, Level.minimal), none="never shed")
        _check_hold(self)
        if self.resumable is not None and not isinstance(self.resumable, Resumable):
            raise ConfigurationError(
                f"route: resumable must be a Resumable(...) or None; got {self.resumable!r}"
            )
        if self.hedge is not None and not isinstance(self.hedge, Hedge):
            raise ConfigurationError(f"route: hedge must be a Hedge(...) or None; got {self.hedge!r}")

    @property
    def level(self) -> Level | None:
        """The service level at which the route is shed (None: never)."""
        return Level(self.shed_at) if self.shed_at is not None else None

    @property
    def first_entry(self) -> str | Model:
        """The chain's first entry: the standard tier's hint when routing by effort, else `model`."""
        if self.effort is not None:
            return HINT_PREFIX + self.effort.standard
        return self.model if self.model is not None else ""


def _check_hold(settings: RouteSettings) -> None:
    """`stream_hold` is a `StreamHold` (its own values checked when it was made: at most
    `MAX_HOLD_CHARS` characters and `MAX_HOLD_S` seconds) that fits the route: its time below
    the route's deadline (which it never extends), its characters within `stream_max_chars`;
    `min_chars_per_s` a rate."""
    hold = settings.stream_hold
    check_rate("route: min_chars_per_s", settings.min_chars_per_s)
    if hold is None:
        return
    if not isinstance(hold, StreamHold):
        raise ConfigurationError(
            f"route: stream_hold must be a guards.StreamHold(chars=..., seconds=...) or None; got {hold!r}"
        )
    if hold.seconds is not None and hold.seconds >= settings.timeout_s:
        raise ConfigurationError(
            f"route: stream_hold's seconds ({hold.seconds:g}) must be below timeout_s "
            f"({settings.timeout_s:g}): the hold never extends the deadline, so a hold as long "
            "would end every request that reaches it as a timeout"
        )
    if hold.chars is not None and hold.chars > settings.stream_max_chars:
        raise ConfigurationError(
            f"route: stream_hold's chars ({hold.chars}) must not exceed stream_max_chars "
            f"({settings.stream_max_chars})"
        )


def _entry(setting: str, entry: object) -> None:
    if not isinstance(entry, str | Model):
        raise ConfigurationError(
            f"{setting} must be a chain entry (a model id, 'provider:model', 'hint:name' or a "
            f"profile name, or a guards.Model); got {entry!r} (a {type(entry).__name__})"
        )


def _check_chain_entries(model: object, fallbacks: object, downgrade_to: object) -> None:
    """`model`, `fallbacks` and `downgrade_to` are chain entries (a list of them for `fallbacks`)."""
    if isinstance(model, list | tuple):
        first = repr(model[0]) if model else "'...'"
        rest = repr(list(model[1:])) if len(model) > 1 else "[...]"
        raise ConfigurationError(
            f"route: model takes one chain entry, not {type(model).__name__}: the models to "
            f"try after it go in fallbacks=..., e.g. route(model={first}, fallbacks={rest})"
        )
    if model is not None:
        _entry("route: model", model)
    if isinstance(fallbacks, str | Model) or not isinstance(fallbacks, Sequence):
        raise ConfigurationError(
            f"route: fallbacks takes a list of chain entries, e.g. fallbacks=[{fallbacks!r}]; "
            f"got {fallbacks!r} (a {type(fallbacks).__name__})"
        )
    for entry in fallbacks:
        _entry("route: each of fallbacks", entry)
    if downgrade_to is not None:
        _entry("route: downgrade_to", downgrade_to)


def _check_policies(settings: RouteSettings) -> None:
    """The settings that take a settings type (`Retry`, `Breaker`, `Task`, `Budget`), a
    moderation hook and the route's name."""
    retry: object = settings.retry
    for setting, value, kind in (
        ("retry", retry, Retry),
        ("breaker", settings.breaker, Breaker),
        ("task", settings.task, Task),
    ):
        if value is not None and not isinstance(value, kind):
            raise ConfigurationError(
                f"route: {setting} must be a guards.{kind.__name__}(...)"
                + (" or None" if setting != "retry" else "")
                + f"; got {value!r}"
            )
    if retry is None:
        raise ConfigurationError(
            "route: retry must be a guards.Retry(...): Retry(attempts=1) retries nothing"
        )
    budget = settings.budget
    budgets = budget if isinstance(budget, list | tuple) else [budget] if budget is not None else []
    for each in budgets:
        if not isinstance(each, Budget):
            raise ConfigurationError(
                f"route: budget must be a guards.Budget(...), a list of them, or None; got {each!r}"
            )
    moderation, name = settings.moderation, settings.name
    if moderation is not None and not callable(moderation):
        raise ConfigurationError(
            f"route: moderation must be a function of the output, or None; got {moderation!r}"
        )
    if name is not None and not (isinstance(name, str) and name):
        raise ConfigurationError(f"route: name must be a name (or None: the handler's); got {name!r}")


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


@dataclass(frozen=True, slots=True)
class CheckedChain:
    """A chain flattened against the app's models: each model with its call limits on the
    route, the attempt budget, and what was removed or will never fire (logged as
    `chain_invalid`, once per route)."""

    models: tuple[ModelRef, ...]
    attempt_budget: int
    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HandlerShape:
    """What a guarded handler declares: its `AI[Output]` parameter, the parameters FastAPI sees
    (the others, their annotations resolved), its signature and its return type."""

    ai_name: str
    output_type: Any
    params: tuple[inspect.Parameter, ...]
    signature: inspect.Signature
    data_type: Any

    @property
    def streaming(self) -> bool:
        """True when the handler answers an `EventStream` (Server-Sent Events)."""
        return isinstance(self.data_type, type) and issubclass(self.data_type, EventStream)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckedRoute:
    """A route's declaration, checked whole (`check_route`): what its spec and endpoint are
    built from."""

    settings: RouteSettings
    #: The handler's qualified name (what errors name) and the route's name.
    where: str
    name: str
    handler: HandlerShape
    budgets: tuple[Budget, ...]
    scopes: tuple[str, ...]
    spend_capped: bool
    token_capped: bool
    #: Whether each budget has a soft limit.
    soft: tuple[bool, ...]
    #: The route's call limits (`first_output_s` when set, `stream_idle_s`, `min_chars_per_s`).
    limits: Limits
    #: The chain of the first entry (`RouteSettings.first_entry`).
    chain: CheckedChain
    #: What the handler's value is validated with (`Any` on a streaming route).
    data_adapter: TypeAdapter[Any]
    output: OutputGuard
    #: The fallback without `LastGood`: its value, validated, or its function.
    plain: Any
    #: The route's tools, checked (None: none).
    tools: Tools | None

    @property
    def degrading(self) -> bool:
        return self.settings.fallback is not NO_FALLBACK

    def chain_of(self, shared: Shared, first: str | Model) -> CheckedChain:
        """The chain `first, *fallbacks` (another chain of the route: an effort tier's, the
        downgrade's), checked as the route's own."""
        return _checked_chain(shared, self.settings, self.where, self.limits, self.spend_capped, first)


def check_route(
    shared: Shared, handler: Callable[..., Any], settings: RouteSettings, ai_type: type
) -> CheckedRoute:
    """`handler` declared with `settings` (checked already) on the app of `shared`, checked
    whole: the handler (`async def`, one `ai_type[Output]` parameter, its return type), the
    settings together (a model or effort, spend and token caps, the downgrade), the chain
    against the app's models and prices, the fallback against the return type, the tools.
    Raises `ConfigurationError` for the first problem found."""
    where = handler.__qualname__
    _check_model(handler, settings)
    limits = (
        None
        if isinstance(settings.first_output_s, Unset)
        else check_limit("route: first_output_s", settings.first_output_s),
        check_limit("route: stream_idle_s", settings.stream_idle_s),
        settings.min_chars_per_s,
    )
    name = settings.name or handler.__name__
    budgets, scopes = route_budgets(where, settings.budget, name)
    spend_capped, token_capped, soft = _check_caps(where, settings, budgets)
    chain = _checked_chain(shared, settings, where, limits, spend_capped, settings.first_entry)
    shape = _handler_shape(handler, ai_type)
    output = OutputGuard(shape.output_type, settings.moderation)
    _check_answer(where, settings, shape, output)
    data_adapter: TypeAdapter[Any] = TypeAdapter(Any if shape.streaming else shape.data_type)
    plain = _checked_fallback(where, settings.fallback, data_adapter)
    return CheckedRoute(
        settings=settings,
        where=where,
        name=name,
        handler=shape,
        budgets=budgets,
        scopes=scopes,
        spend_capped=spend_capped,
        token_capped=token_capped,
        soft=soft,
        limits=limits,
        chain=chain,
        data_adapter=data_adapter,
        output=output,
        plain=plain,
        tools=_checked_tools(where, settings.tools, output, shape.ai_name),
    )


def _check_model(handler: Callable[..., Any], settings: RouteSettings) -> None:
    """The handler is a coroutine function, and the route names a model or routes by effort."""
    if not inspect.iscoroutinefunction(handler):
        raise ConfigurationError(f"guarded route {handler.__qualname__} must be an `async def`")
    effort, model = settings.effort, settings.model
    if effort is not None and model is not None:
        raise ConfigurationError(
            f"{handler.__qualname__}: a route names its model or routes by effort, not both"
        )
    if effort is None and (model is None or not entry_parts(model)[0].strip()):
        raise ConfigurationError("a guarded route needs a model id")


def _check_caps(
    where: str, settings: RouteSettings, budgets: tuple[Budget, ...]
) -> tuple[bool, bool, tuple[bool, ...]]:
    """What the route's budgets cap (spend, tokens; each one's soft limit), with what each
    needs: `max_tokens` for a spend or token cap, a soft limit for `downgrade_to`."""
    spend_capped = any(each.spend_capped for each in budgets)
    if spend_capped and settings.max_tokens is None:
        raise ConfigurationError(f"{where} has a spend cap: declare max_tokens to bound its cost")
    token_capped = any(each.token_capped for each in budgets)
    soft = tuple(each.soft_limit is not None for each in budgets)
    if settings.downgrade_to is not None and not any(soft):
        raise ConfigurationError(
            f"{where}: downgrade_to needs a budget with a soft limit "
            "(Budget(soft_limit=...)), past which a caller's requests are downgraded"
        )
    if settings.downgrade_to is not None and settings.effort is not None:
        raise ConfigurationError(f"{where}: a route downgrades or routes by effort, not both")
    if token_capped and settings.max_tokens is None:
        raise ConfigurationError(
            f"{where} has a token limit: declare max_tokens to bound the tokens "
            "a request holds (its estimated input tokens plus max_tokens)"
        )
    return spend_capped, token_capped, soft


def _checked_chain(
    shared: Shared,
    settings: RouteSettings,
    where: str,
    limits: Limits,
    spend_capped: bool,
    first: str | Model,
) -> CheckedChain:
    """The chain `first, *fallbacks` flattened against the app's profiles, providers and hints,
    each model with the route's call limits where it has none of its own; raises when no model
    is left, for an attempt budget under 1, or for a spend cap with a model without a price
    (`Guards(prices=...)`, else the price table's: found prices are added to `prices`)."""
    chain = flatten_chain(
        [first, *settings.fallbacks], profiles=shared.profiles, providers=shared.providers, hints=shared.hints
    )
    models, never_fire = _call_limits(chain.models, settings, limits)
    if not chain.models:
        raise ConfigurationError(f"{where}: no model left in its chain ({'; '.join(chain.problems)})")
    attempts = settings.attempts
    attempt_budget = attempts if attempts is not None else len(chain.models) + settings.retry.attempts - 1
    if attempt_budget < 1:
        raise ConfigurationError("attempts must be at least 1")
    prices = shared.prices
    fill_prices(
        prices,
        shared.price_table,
        chain.models,
        {None: shared.binding} | dict(shared.providers.items()),
        shared.cost_unit_usd,
    )
    unpriced = [ref.key for ref in chain.models if price_of(prices, ref.key) is None]
    if spend_capped and unpriced:
        raise ConfigurationError(
            f"{where} has a spend cap: Guards(prices=...) has no price for "
            + ", ".join(unpriced)
            + ': add one under its key, or a price for every model without one under "*"'
        )
    return CheckedChain(models, attempt_budget, tuple(dict.fromkeys((*chain.problems, *never_fire))))


def _call_limits(
    models: tuple[ModelRef, ...], settings: RouteSettings, limits: Limits
) -> tuple[tuple[ModelRef, ...], tuple[str, ...]]:
    """Each model of a chain with the route's call limits where it has none of its own (unset
    `first_output_s`: a share of the deadline for each model but the last), and the limits
    that can never fire."""
    timeout_s = settings.timeout_s
    models = tuple(ref.limited(limits) for ref in models)
    if settings.first_output_s is UNSET and len(models) > 1:
        # A silent or slow model never holds a request another model could answer: each
        # model but the last, with no limit of its own or the route's, gets a share of
        # the deadline to start answering, which leaves the rest of the chain its room.
        share = (timeout_s / (len(models) + 1), None, None)
        models = (*(ref.limited(share) for ref in models[:-1]), models[-1])
    # Kept, though it never fires before the deadline: the same `Model` or profile may serve
    # routes with longer deadlines.
    never_fire = tuple(
        f"model {ref.key!r}: first_output_s {ref.first_output_s:g}s is not below the "
        f"route's timeout_s {timeout_s:g}s: it never fires (the deadline does first)"
        for ref in models
        if ref.first_output_s is not None and ref.first_output_s >= timeout_s
    )
    return models, never_fire


def _handler_shape(handler: Callable[..., Any], ai_type: type) -> HandlerShape:
    """The handler's `ai_type[Output]` parameter and the others (no `*args`, `**kwargs`), with
    their annotations resolved (at module level: a name that does not resolve is an error)."""
    where = handler.__qualname__
    try:
        hints = typing.get_type_hints(handler, include_extras=True)
    except NameError as exc:
        raise ConfigurationError(
            f"cannot resolve the annotations of {where} ({exc}): import the types it names at module level"
        ) from None
    signature = inspect.signature(handler)
    ai_name, output_type, params = None, Any, []
    for param in signature.parameters.values():
        annotation = hints.get(param.name, param.annotation)
        if annotation is ai_type or typing.get_origin(annotation) is ai_type:
            if annotation is ai_type:
                raise ConfigurationError(
                    f"guarded route {where}: `{param.name}: AI` does not say what the "
                    f"model must produce: write `{param.name}: AI[str]` for text, or "
                    f"`{param.name}: AI[YourModel]` (a pydantic model) for JSON"
                )
            ai_name = param.name
            output_type = typing.get_args(annotation)[0]
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigurationError(f"guarded route {where}: *args/**kwargs are not supported")
        params.append(param.replace(annotation=annotation))
    if ai_name is None:
        raise ConfigurationError(f"guarded route {where} must declare a parameter annotated `AI[OutputType]`")
    return HandlerShape(
        ai_name=ai_name,
        output_type=output_type,
        params=tuple(params),
        signature=signature,
        data_type=hints.get("return", Any),
    )


def _check_answer(where: str, settings: RouteSettings, shape: HandlerShape, output: OutputGuard) -> None:
    """What the route answers fits its settings: a degrading route annotates its return type;
    a streaming route has no fallback, answers text or JSON (a structured stream), and is
    neither a task nor checks its answers (`on_rejected`, tools)."""
    degrading = settings.fallback is not NO_FALLBACK
    if degrading and shape.data_type is Any:
        raise ConfigurationError(
            f"degrading route {where} must annotate its return type (the envelope's data)"
        )
    if not shape.streaming:
        if settings.stream_hold is not None or settings.min_chars_per_s is not None:
            raise ConfigurationError(
                f"{where}: stream_hold and min_chars_per_s are for streaming routes "
                "(`-> EventStream`, `return await ai.stream(...)`)"
            )
        if settings.resumable is not None:
            raise ConfigurationError(f"route {where} cannot be resumable: only a streaming route is")
        return
    if degrading:
        raise ConfigurationError(
            f"streaming route {where} cannot declare a fallback: it fails with a "
            "public error before its first event, and with an `error` event after it"
        )
    if shape.output_type not in (str, Any) and output.json_schema is None:
        raise ConfigurationError(
            f"streaming route {where} must declare `AI[str]`, or a JSON output type "
            "(`AI[YourModel]`: a structured stream)"
        )
    if settings.task is not None:
        raise ConfigurationError(f"streaming route {where} cannot run as a task: a stream is not replayed")
    if settings.on_rejected != "fallback" or settings.tools is not None:
        raise ConfigurationError(
            f"streaming route {where} cannot declare on_rejected or tools: a stream's "
            "output (its tool calls included) reaches the client as it comes, before any check"
        )


def _checked_fallback(where: str, fallback: Any, data_adapter: TypeAdapter[Any]) -> Any:
    """The fallback without `LastGood` (its `otherwise`): a value validated against the route's
    return type, or a function (called per request)."""
    plain = fallback.otherwise if isinstance(fallback, LastGood) else fallback
    if fallback is NO_FALLBACK or callable(plain):
        return plain
    try:
        return data_adapter.validate_python(plain)
    except ValidationError as exc:
        raise ConfigurationError(
            f"the fallback of {where} does not validate against its return type: {exc}"
        ) from None


def _checked_tools(
    where: str, tools: Mapping[str, type[BaseModel]] | None, output: OutputGuard, ai_name: str
) -> Tools | None:
    """The route's tools, each name and arguments' model checked; a route with tools answers
    text (`AI[str]`)."""
    if tools is None:
        return None
    if output.response_format is not None:
        raise ConfigurationError(
            f"{where} declares tools: its answer is text or tool calls, so declare "
            f"`{ai_name}: AI[str]` (a JSON-mode output cannot be both)"
        )
    from ..contracts._tools import Tools  # only for a route that declares tools (at start-up, once)

    return Tools(tools, where)
