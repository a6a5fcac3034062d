"""Service levels: what the app offers while some of its models are down, and what it sheds.

One level for the whole app, from the health of every model its guarded routes use, as the
store holds it (so every worker and machine agrees):

    full      no model down
    degraded  at least one model down, at least one up
    minimal   every model down

A model is down while the walk would skip it: its breaker refuses calls (open, or half-open
with every probe slot taken) or it is cooling down. Each worker reads the health of all its
models in one store operation (`Store.health`) at most once per `REFRESH_S`, in a task of its
own that the first request after that starts: a request never waits for the store, and finds
the level in an attribute. Between reads, a model whose wait has passed (its breaker
half-opens, its cooldown ends) counts as up again.

A route declared `shed_at="degraded"` (or `"minimal"`) is shed at that level or a lower one:
it answers at once like an open breaker (`circuit_open`, no provider call, no charge), so the
reasons stay a closed set. Overload sheds the same routes: with `Guards(max_in_flight=N)`, a
request of such a route that finds more than N guarded requests in flight on its worker is
shed too. While the level is not `full`, every guarded response carries `x-service-level`; a
change is logged once per worker (`service_level`) and set on the gauge `guards_service_level`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import typing
from dataclasses import dataclass

from starlette.types import Message, Scope, Send

from ..contracts._errors import GuardTripped
from ..contracts._vocabulary import Attribution, Level, Reason
from ..observe._log import emit, emit_warning
from ..observe._metrics import SERVICE_LEVEL, STORE_UNAVAILABLE, gauge
from ..stores import Store, StoreUnavailable
from ..stores._breaker import Breaker, BreakerState, CircuitState
from ..stores._breaker import admit as breaker_admit
from ._route_spec import GuardedRoute, route_of

__all__ = [
    "REFRESH_S",
    "IN_FLIGHT",
    "Levels",
    "ModelDown",
    "ServiceLevel",
    "WatchedModel",
    "down_for",
    "level_of",
]

#: A worker reads its models' health at most this often (seconds).
REFRESH_S = 1.0
#: `Retry-After` of a request shed for overload.
OVERLOAD_RETRY_AFTER_S = 1.0
#: Marks the ASGI scope of a request that counts as in flight: False when guards' middleware
#: (`guards.routes._middleware`) will count it out, True once `Levels.enter` counted it in.
IN_FLIGHT = "guards.in_flight"


#: Each level's rank: the gauge's value, and the order shedding compares in.
RANK = {Level.full: 0, Level.degraded: 1, Level.minimal: 2}
#: `guards_service_level`: this process's series of it.
_LEVEL_GAUGE = gauge(SERVICE_LEVEL)


@dataclass(frozen=True, slots=True)
class ModelDown:
    """A model that is down, named as `Guards(attribution=...)` allows (its chain key when
    `detailed`, else `model 1`, `model 2`... in the order routes first named them), and when
    it may come back (seconds since the epoch, the store's time)."""

    model: str
    until: float


@dataclass(frozen=True, slots=True)
class ServiceLevel:
    """The service level as this worker last read it: the level, and the models down."""

    level: Level
    down: tuple[ModelDown, ...] = ()


_FULL = ServiceLevel(Level.full)


@dataclass(slots=True, eq=False)
class WatchedModel:
    """A model the level counts: its name as attribution allows, its store keys, and the
    breaker policies of the routes that call it."""

    name: str
    cooldown_key: str
    breaker_key: str
    #: The breaker policies of the routes that call it (none: only its cooldown counts).
    policies: list[Breaker]


def level_of(down: int, models: int) -> Level:
    """The level with `down` of `models` models down."""
    if not down:
        return Level.full
    return Level.minimal if down >= models else Level.degraded


def down_for(breaker: BreakerState, cooldown_s: float, policies: list[Breaker], now: float) -> float:
    """Seconds until a model may be called again (0.0: it is up now): its cooldown, and its
    breaker when every policy it is called with refuses a call now (the most lenient one
    decides when it comes back)."""
    wait = max(0.0, cooldown_s)
    if policies and breaker.state is not CircuitState.closed:
        refusals = []
        for policy in policies:
            _, decision = breaker_admit(breaker, policy, now)
            if decision.allowed:
                return wait
            refusals.append(decision.retry_after_s or 0.0)
        wait = max(wait, min(refusals))
    return wait


class StoreHolder(typing.Protocol):
    """What the levels read of their app (`Guards` is one): its store, read again at every
    refresh since a test may replace it, and how pages name the models down."""

    @property
    def store(self) -> Store: ...

    @property
    def attribution(self) -> Attribution: ...


class Levels:
    """One app's service level (per worker), and its requests in flight."""

    def __init__(self, guards: StoreHolder, max_in_flight: int | None) -> None:
        self._guards = guards
        self._models: dict[str, WatchedModel] = {}
        #: The current view, and the models down with when each comes back (perf_counter time).
        self.view = _FULL
        self._down: list[tuple[float, ModelDown]] = []
        #: `(b"x-service-level", level)` while the level is not full, else None.
        self.header: tuple[bytes, bytes] | None = None
        self._refresh_at = 0.0
        self._recheck_at = math.inf
        self._refreshing: asyncio.Task[None] | None = None
        self._gauge_set = False
        self.max_in_flight = max_in_flight
        #: Guarded requests in flight on this worker (counted only with `max_in_flight`).
        self.in_flight = 0

    def watch(self, route: GuardedRoute) -> None:
        """Count `route`'s models in the level (at start-up, once per route): its chain, each
        effort tier's chain when it routes by effort, and its downgrade chain."""
        tiers = route.effort.tiers.values() if route.effort is not None else ()
        chains = [tier[0] for tier in tiers]
        if route.downgrade is not None and route.downgrade.route is not None:
            chains.append(route.downgrade.route)
        legs = dict.fromkeys((*route.legs, *(leg for chain in chains for leg in chain.legs)))
        for leg in legs:
            model = self._models.get(leg.ref.key)
            if model is None:
                detailed = self._guards.attribution == "detailed"
                name = leg.ref.key if detailed else f"model {len(self._models) + 1}"
                model = self._models[leg.ref.key] = WatchedModel(name, leg.cooldown_key, leg.breaker_key, [])
            if route.breaker is not None and route.breaker not in model.policies:
                model.policies.append(route.breaker)

    @property
    def models(self) -> dict[str, WatchedModel]:
        """Every model the level counts, by its chain key, in the order routes first named them."""
        return dict(self._models)

    def tick(self, now: float) -> None:
        """Called per request (`now`: `time.perf_counter()`): start a health read when the view
        is `REFRESH_S` old (in the background), and let models whose wait passed come back."""
        if now >= self._refresh_at:
            self._refresh(now)
        if now >= self._recheck_at:
            self._set([item for item in self._down if item[0] > now])

    def enter(self, route: GuardedRoute, scope: Scope) -> GuardTripped | None:
        """A guarded request starts: count it in flight (with `max_in_flight`, when the
        middleware will count it out), and say why it is shed, if it is."""
        over = False
        if self.max_in_flight is not None and IN_FLIGHT in scope:
            scope[IN_FLIGHT] = True
            self.in_flight += 1
            over = self.in_flight > self.max_in_flight
        shed_at = route.shed_at
        if shed_at is None:
            return None
        if over:
            return GuardTripped(
                Reason.circuit_open,
                f"shed: more than {self.max_in_flight} requests in flight on this worker",
                retry_after_s=OVERLOAD_RETRY_AFTER_S,
            )
        level = self.view.level
        if RANK[level] < RANK[shed_at]:
            return None
        return GuardTripped(
            Reason.circuit_open,
            f"shed at service level {level.value}: {len(self.view.down)} of {len(self._models)} models down",
            retry_after_s=max(0.0, self._recheck_at - time.perf_counter()),
        )

    def reset(self) -> None:
        """Forget the level read so far (the store was replaced): full, read again on the next
        request. A read in flight from the old store is dropped when it ends."""
        self._set([])
        self._refresh_at = 0.0

    def close(self) -> None:
        """Stop a health read in flight on this event loop (the app shuts down, and its store
        with it)."""
        reading = self._refreshing
        with contextlib.suppress(RuntimeError):  # no running loop: nothing of ours runs
            if reading is not None and reading.get_loop() is asyncio.get_running_loop():
                reading.cancel()

    def _refresh(self, now: float) -> None:
        self._refresh_at = now + REFRESH_S
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside an event loop: no read now
            return
        reading = self._refreshing
        # One read at a time (a slow store is not read again meanwhile); a read left pending by
        # an event loop that has stopped never ends, and does not count.
        if not self._models or (reading is not None and not reading.done() and reading.get_loop() is loop):
            return
        self._refreshing = loop.create_task(self._read())

    async def _read(self) -> None:
        """One store operation: every model's breaker and cooldown."""
        models = list(self._models.values())
        store = self._guards.store
        try:
            health = await store.health([(m.cooldown_key, m.breaker_key) for m in models])
        except StoreUnavailable:
            # The level stays as last read; each guard meets the outage on its own terms.
            emit_warning("store_unavailable", guard="service_level", op="health")
            STORE_UNAVAILABLE.labels(guard="service_level", action="stale").inc()
            return
        if store is not self._guards.store:  # replaced meanwhile (`Guards.replace_store`)
            return
        local = time.perf_counter()
        down = []
        for model, breaker, cooldown_s in zip(models, health.breakers, health.cooldowns, strict=True):
            wait = down_for(breaker, cooldown_s, model.policies, health.now)
            if wait > 0:
                down.append((local + wait, ModelDown(model.name, health.now + wait)))
        self._set(down)

    def _set(self, down: list[tuple[float, ModelDown]]) -> None:
        """Take `down` as the models down now; log and export a change of level."""
        self._down = down
        self._recheck_at = min((until for until, _ in down), default=math.inf)
        models = tuple(model for _, model in down)
        level = level_of(len(models), len(self._models))
        before = self.view.level
        self.view = ServiceLevel(level, models) if models else _FULL
        if level is not before:
            self.header = None if level is Level.full else (b"x-service-level", level.value.encode())
            emit("service_level", **{"from": before.value, "to": level.value}, down=[m.model for m in models])
        if level is not before or not self._gauge_set:
            self._gauge_set = True
            _LEVEL_GAUGE.set(RANK[level])

    def with_header(self, scope: Scope, send: Send) -> Send:
        """`send` adding `x-service-level` to a guarded route's response while the level is not
        full (guards' middleware: `guards.routes._middleware`)."""

        async def send_with_level(message: Message) -> None:
            header = self.header
            guarded = route_of(scope.get("endpoint")) is not None  # guarded routes only
            if message["type"] == "http.response.start" and header is not None and guarded:
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        return send_with_level
