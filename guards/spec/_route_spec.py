"""What a guarded route declared: `GuardedRoute` and its `Leg`s, built once at start-up by the
route decorator (`guards.routes._route`) and read by everything that serves a request (the walk in
`guards.walk`, the OpenAPI document, service levels, tasks, tracing).

This module is the description only: it imports none of the modules that read it, so the walk
depends on what a route is, not on the decorator that builds it (and no import circle runs
through the request path).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

from ..contracts._vocabulary import Kind
from ..observe._metrics import (
    ANSWER_SECONDS,
    ATTEMPT_SECONDS,
    ATTEMPTS,
    BREAKER_STATE,
    BREAKER_TRANSITIONS,
    COST,
    FIRST_OUTPUT_SECONDS,
    SERVED,
    STATE_VALUE,
    TOKENS,
    GaugeTally,
    HistogramTally,
    RouteMetrics,
    Tally,
    counter,
    gauge,
    histogram,
    stamped_counter,
)
from ..stores._breaker import CircuitState
from ..streams._event_stream import GUARDS_EVENTS, StreamFormat
from ..streams._kept import Resumable
from ..streams._relay import DEFAULT_STREAM_MAX_CHARS, DEFAULT_STREAM_MAX_S

if typing.TYPE_CHECKING:
    from starlette.requests import Request

    from ..contracts._output import OutputGuard
    from ..contracts._vocabulary import Level
    from ..policies._budget import Budget, Price
    from ..policies._call import Retry
    from ..policies._chain import ModelRef
    from ..policies._hedge import Hedge
    from ..policies._local_budget import LocalShare
    from ..policies._tasks import Task
    from ..stores import Charge
    from ..stores._breaker import Breaker
    from ..streams._hold import StreamHold

__all__ = [
    "NO_FALLBACK",
    "AnswerPolicy",
    "DeploymentChoice",
    "EffortChoice",
    "GuardedRoute",
    "KnownRefusal",
    "Leg",
    "SuccessAges",
    "route_of",
]

#: A route declared without `fallback=`: a strict route.
NO_FALLBACK: Any = object()


class KnownRefusal:
    """What this worker last heard from its store that refuses a model without a call: its
    breaker open (`why`: `circuit_open`) or a cooldown (`cooldown`), until `until` (on
    `Guards.success_clock`; 0.0: nothing known). One per model (`Guards.known_refusals`),
    shared by every route of the instance that calls it; written and read by
    `guards.walk._known`."""

    __slots__ = ("until", "why")

    def __init__(self) -> None:
        self.until = 0.0
        self.why = "cooldown"


@dataclass(frozen=True, slots=True, eq=False)
class Leg:
    """One model of a route's chain, with its keys and metric children bound at start-up."""

    ref: ModelRef
    breaker_key: str
    cooldown_key: str
    #: The model's price (`Guards(prices=...)`), when known.
    price: Price | None
    seconds: HistogramTally
    #: Its calls' time to first output and to the whole answer (the status page's latency).
    first_output: HistogramTally
    answered: HistogramTally
    breaker_state: GaugeTally
    attempts: dict[str, Tally]
    #: The breaker state this process last saw (the gauge is set only when it changes).
    last_state: list[CircuitState | None]
    #: Requests this leg's answer served (`guards_served_total`: its route and position).
    served: Tally
    #: Reported usage (`guards_tokens_total`), and its cost on this route when priced.
    input_tokens: Tally
    output_tokens: Tally
    cost_usd: Tally | None
    #: Breaker state changes this process's store operations made, by the state entered.
    transitions: dict[CircuitState, Tally]
    #: When this process's last success on the model ended (`Guards.last_success`: one cell
    #: per model, shared by every route that calls it), None before the first.
    last_success: list[float | None]
    #: The store's last word refusing the model, while it holds (`KnownRefusal`: one per
    #: model, shared by every route that calls it).
    known: KnownRefusal
    #: Skips of the model by reason (`guards_skips_total`), each bound at its first skip.
    skips: dict[str, Tally] = field(default_factory=dict)
    #: The model's call limits on this route (`guards.Model`, else the route's; None: none),
    #: read by the walk: the first output of an attempt, the gaps of a stream after it.
    first_output_s: float | None = None
    stream_idle_s: float | None = None
    #: The slowest a stream of the model may be before its commit point, in characters of
    #: output per second (`guards.streams._hold`; None: no minimum).
    min_chars_per_s: float | None = None
    #: The model's declared context window in tokens (`Guards(context_windows=...)`), if any.
    window: int | None = None
    #: The model is a deployment with `rpm` or `tpm`: each call to it takes a store step of
    #: its own first (`guards.walk._known.deployment_refused`).
    limited: bool = False
    #: The model is the chain's first entry (or a deployment of its first entry's group): its
    #: answer is no fallback.
    leads: bool = False

    @classmethod
    def of(
        cls,
        ref: ModelRef,
        price: Price | None,
        route: str,
        first: bool,
        successes: dict[str, list[float | None]],
        known: dict[str, KnownRefusal],
        window: int | None = None,
    ) -> Leg:
        breaker_key = f"guards:breaker:{ref.key}"
        return cls(
            ref=ref,
            breaker_key=breaker_key,
            cooldown_key=f"guards:cooldown:{ref.key}",
            price=price,
            seconds=histogram(ATTEMPT_SECONDS, ref.key),
            first_output=histogram(FIRST_OUTPUT_SECONDS, ref.key),
            answered=histogram(ANSWER_SECONDS, ref.key),
            breaker_state=gauge(BREAKER_STATE, ref.key),
            attempts={
                "ok": counter(ATTEMPTS, ref.key, "ok"),
                **{k: stamped_counter(ATTEMPTS, ref.key, k) for k in Kind},
                # An answer the output guard rejected, on a route that moves such answers on.
                "rejected": stamped_counter(ATTEMPTS, ref.key, "rejected"),
            },
            last_state=[None],
            served=counter(SERVED, route, ref.key, "first" if first else "fallback"),
            input_tokens=counter(TOKENS, ref.key, "input"),
            output_tokens=counter(TOKENS, ref.key, "output"),
            cost_usd=counter(COST, route, ref.key) if price is not None else None,
            transitions={state: counter(BREAKER_TRANSITIONS, ref.key, state.value) for state in CircuitState},
            last_success=successes.setdefault(breaker_key, [None]),
            known=known.get(ref.key) or known.setdefault(ref.key, KnownRefusal()),
            first_output_s=ref.first_output_s,
            stream_idle_s=ref.stream_idle_s,
            min_chars_per_s=ref.min_chars_per_s,
            window=window,
            leads=first,
            limited=ref.deployment is not None and ref.deployment.limited,
        )

    def saw(self, state: CircuitState) -> None:
        """Report the breaker state a store answered, to the gauge when it changed."""
        if self.last_state[0] is not state:
            self.last_state[0] = state
            self.breaker_state.set(STATE_VALUE[state])


class SuccessAges(Sequence[float | None]):
    """How many seconds ago, by `clock`, this process's last success on each leg's model ended
    (None: none yet), read when the store reads it: a route's steps carry this one view
    (`guards.stores.Step.success_ages`) rather than a list built on every request, and a
    store that never reads it (a breaker counting no failure) costs nothing."""

    __slots__ = ("_cells", "clock")

    def __init__(self, legs: Sequence[Leg], clock: Callable[[], float]) -> None:
        self._cells: tuple[list[float | None], ...] = tuple(leg.last_success for leg in legs)
        self.clock = clock

    def over(self, legs: Sequence[Leg]) -> SuccessAges:
        """The same clock's view of other legs (another chain of the route)."""
        return SuccessAges(legs, self.clock)

    def __len__(self) -> int:
        return len(self._cells)

    @overload
    def __getitem__(self, index: int) -> float | None: ...

    @overload
    def __getitem__(self, index: slice) -> SuccessAges: ...

    def __getitem__(self, index: int | slice) -> float | SuccessAges | None:
        if isinstance(index, slice):
            view = SuccessAges((), self.clock)
            view._cells = self._cells[index]
            return view
        ended = self._cells[index][0]
        return None if ended is None else self.clock() - ended

    def __iter__(self) -> Iterator[float | None]:
        now = self.clock()
        for cell in self._cells:
            ended = cell[0]
            yield None if ended is None else now - ended


class DowngradeChoice(Protocol):
    """A route's downgrade chain near a cap (`guards.routes._downgrade.Downgrade`, at start-up)."""

    #: The route with the downgrade chain.
    route: GuardedRoute | None

    def choose(self, state: Any) -> GuardedRoute:
        """The route whose chain a request (its `RequestState`) runs, before its first call."""
        ...

    def saw(self, charge: Charge, scopes: Sequence[str], near: Sequence[int]) -> None:
        """A request's charge was admitted, past the soft limits of its budgets `near`."""
        ...


class DeploymentChoice(Protocol):
    """A route's groups of deployments (`guards.routes._balance.Balancer`, attached at start-up)."""

    def choose(self, state: Any) -> GuardedRoute:
        """The route whose chain a walk of a request (its `RequestState`) runs: the same legs,
        each group's deployments in the order its strategy chose for this walk."""
        ...


class EffortChoice(Protocol):
    """A route's chain per effort tier (`guards.routes._effort.EffortRoutes`, attached at start-up)."""

    @property
    def tiers(self) -> Mapping[Any, tuple[GuardedRoute, str, bool, Tally]]:
        """Per tier: the route with that tier's chain, its hint, whether it escalated, its count."""
        ...

    def choose(self, inputs: Mapping[str, Any], request: Request | None, trace_id: str) -> GuardedRoute:
        """The route whose chain a request runs (at its first call)."""
        ...


class AnswerPolicy(Protocol):
    """What a route does with the answers its output guard rejects, and its tools' calls
    (`guards.walk._rejected.Answers`, attached at start-up to a route that declares
    `on_rejected` other than "fallback", or tools). `state` is the request's `RequestState`."""

    @property
    def on_rejected(self) -> str:
        """`fallback`, `next_model` or `reask`."""
        ...

    async def run(self, state: Any, inputs: Mapping[str, Any], output: OutputGuard) -> Any:
        """`AI.run` (and `AI.step`) on the route: the walk and its answer's check."""
        ...

    def logged(self, state: Any) -> dict[str, Any] | None:
        """The request line's fields about rejected answers (None: none was)."""
        ...

    def rejected_header(self, state: Any, mode: str) -> str | None:
        """`x-ai-rejected` in attribution `mode` (None: no header)."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class GuardedRoute:
    """What a guarded route declared. Attached to the endpoint as `__guards_route__`."""

    name: str
    #: The first model of the chain (its key: `model` or `provider:model`).
    model: str
    #: The flattened fallback chain, first model first.
    legs: tuple[Leg, ...]
    #: Each leg's (cooldown key, breaker key): the legs of a store step (`guards.stores.Step`).
    step_legs: tuple[tuple[str, str], ...]
    #: Provider calls one guarded call may make, across the whole chain (stated up front).
    attempt_budget: int
    timeout_s: float
    retry: Retry
    budget: Budget | None
    breaker: Breaker | None
    output: OutputGuard
    data_type: Any
    fallback: Any
    #: Budget counters are shared by routes of the same scope.
    scope: str
    #: Added to the inputs to request JSON mode; None for a plain-text route.
    response_format: dict[str, Any] | None
    #: Added to the inputs when they do not set it; bounds the cost a spend cap holds.
    max_tokens: int | None
    #: True when the route has a spend cap, daily or monthly (every leg then has a price).
    spend_capped: bool
    #: True when the route answers an `EventStream` (Server-Sent Events).
    streaming: bool
    #: The most request body the route reads (None: no limit; see `guards.routes._body_limit`).
    max_body_bytes: int | None
    metrics: RouteMetrics
    #: The legs' success ages (see `SuccessAges`), for the walk's store steps.
    success_ages: SuccessAges
    #: A streamed answer's limits: seconds since the request began, characters of output.
    stream_max_s: float = DEFAULT_STREAM_MAX_S
    stream_max_chars: int = DEFAULT_STREAM_MAX_CHARS
    #: How a streamed answer is written (guards' own events by default).
    stream_format: StreamFormat = GUARDS_EVENTS
    #: The hold before a streamed answer's commit point (`route(stream_hold=...)`; None: none).
    stream_hold: StreamHold | None = None
    #: Its streams are kept in the store for resuming (None: not resumable).
    resumable: Resumable | None = None
    #: A route that routes by effort: its chain per tier (the route itself runs the standard
    #: tier's chain until a request's first call picks one). None: the chain is pinned.
    effort: EffortChoice | None = None
    #: The service level at which the route is shed (and shed under overload); None: never.
    shed_at: Level | None = None
    #: Requests with an `Idempotency-Key` run as multi-step tasks (see `guards.policies._tasks`).
    task: Task | None = None
    #: Some leg declares a context window: the walk checks requests against it
    #: (`guards.walk._windows`); a route with none pays nothing for it.
    windowed: bool = False
    #: A content filter's refusal moves on to the next model of another provider.
    content_filter_fallback: bool = False
    #: What the route does with rejected answers and its tools' calls; None: a rejected answer
    #: ends the request and tool calls pass as they came (`on_rejected="fallback"`, no tools).
    answers: AnswerPolicy | None = None
    #: The breaker's `slow_call_s` (None: no breaker, or one that counts no slow call): the
    #: walk then reports every success, slow or not (`RequestState._slow`).
    slow_call_s: float | None = None
    #: The budget's share per worker while the store is down (`on_store_failure="local"`).
    local_share: LocalShare | None = None
    #: Every budget of the route, admitted together, and each one's scope (`budget` and
    #: `scope` are the first's).
    budgets: tuple[Budget, ...] = ()
    scopes: tuple[str, ...] = ()
    #: True when a request's charge holds spend or tokens, set per request and settled after.
    holds: bool = False
    #: True when a budget of the route limits tokens.
    token_capped: bool = False
    #: True when a budget of the route has a soft limit: a request admitted past it says so
    #: (`RequestState._near`, the `x-ai-budget` header).
    soft_limited: bool = False
    #: The route's downgrade chain near a cap (`route(downgrade_to=...)`), on the route and on
    #: its downgraded copy alike; None: none.
    downgrade: DowngradeChoice | None = None
    #: The route is its downgrade's chain (`downgrade.route`, or a copy of it with its
    #: deployments reordered): its calls' ledger records say `downgraded`.
    downgraded: bool = False
    #: When a call starts a second attempt on the next model (`route(hedge=...)`; None: never).
    hedge: Hedge | None = None
    #: The route's groups of deployments (`guards.Deployments`), ordered per walk; None: none.
    deployments: DeploymentChoice | None = None
    #: What a location of the route's invalid input may name (`guards.contracts._output.input_names`):
    #: any other string in it is a key the client wrote, never told (`<key>`).
    input_names: frozenset[str] = frozenset()

    @property
    def degrading(self) -> bool:
        """A degrading route answers the envelope; a strict one answers public errors."""
        return self.fallback is not NO_FALLBACK

    @property
    def chain(self) -> tuple[str, ...]:
        """The chain's model keys, in call order."""
        return tuple(leg.ref.key for leg in self.legs)


def route_of(endpoint: Any) -> GuardedRoute | None:
    """The `GuardedRoute` of a guarded endpoint, or None."""
    route = getattr(endpoint, "__guards_route__", None)
    return route if isinstance(route, GuardedRoute) else None
