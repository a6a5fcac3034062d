"""What the status page shows, and where each number comes from (`StatusPage.report`, the
`StatusReport` pydantic model that is the JSON answer and its OpenAPI schema):

- **the level, and each model's breaker and cooldown**: one `Store.health` read per view of the
  page (the page's own read, never a guarded request's), so every worker and machine sharing
  the store shows the same. When the store does not answer, the worker's last reading of the
  level (`Guards.service_level`) instead, and no breaker or cooldown;
- **each model's last failure**: the kind (a classifier token) and time of the newest failed
  call this worker made to it, kept by the failure tallies themselves (`StampedTally`);
- **recent rates**: the counts `/metrics` exports: every worker's in prometheus-client's
  multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`: the sums of the workers' files, read in a
  thread), else the answering worker's tallies; copied every `window_s / 30` seconds by a task
  of the event loop (`History`, in `_history.py`, started with the app's lifespan, or by the
  first view); a rate is the difference between the counts now and the oldest copy at most
  `window_s` old, over the time between them;
- **each model's latency**: the time to first output and to the whole answer, p50 and p95 over
  the recent window, and their trend over the last hour, from the latency histograms' counts
  copied with the rest (`_latency.py`);
- **spend today**: the same counts of `guards_cost_usd_total` since the UTC day began (to
  within one copy's interval), or since the worker started when that was later; the spend caps
  are the routes' `Budget(spend_per_day=...)`, each applying to each budget key on its own.
  A key's own spend lives in the store under that key: the page never reads or shows one.

Nothing the page shows comes from a request or a provider's answer: route names and model
names come from configuration (models named as `Guards(attribution=...)` allows), guards,
reasons and kinds from closed sets.
"""

from __future__ import annotations

import os
import time
import typing
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..contracts._vocabulary import Kind, Level
from ..observe._log import emit_warning
from ..observe._metrics import (
    ATTEMPTS,
    BUDGET_SETTLED,
    COST,
    FALLBACKS,
    REQUESTS,
    SERVED,
    Metric,
    StampedTally,
    multiprocess,
    peek,
)
from ..policies._budget import Price as Rates
from ..policies._budget import price_of
from ..spec._levels import ServiceLevel, WatchedModel, down_for, level_of
from ..stores import Health, StoreUnavailable
from ..stores._epoch import Epoch
from ._history import History, grown
from ._latency import NO_LATENCY, Latency, latencies

if typing.TYPE_CHECKING:
    from ..spec._route_spec import GuardedRoute
    from ..spec._shared import Shared

__all__ = [
    "BudgetStatus",
    "History",
    "ModelStatus",
    "RouteStatus",
    "StatusPage",
    "StatusProblem",
    "StatusReport",
]

_FAILURES = tuple(kind for kind in Kind if kind is not Kind.cancelled)
_OUTCOMES = ("ok", "fallback", "error", "cancelled", "invalid")


# --- the JSON answer (its schema is the OpenAPI one, and the README's) -------------------------


class LastFailure(BaseModel):
    kind: Kind = Field(description="The classifier's kind of the newest failed call (this worker's).")
    at: float = Field(description="When it failed: seconds since the epoch (this worker's clock).")


class Price(BaseModel):
    input_usd_per_mtok: float = Field(description="US dollars per million input tokens.")
    output_usd_per_mtok: float = Field(description="US dollars per million output tokens.")
    call_usd: float = Field(description="US dollars per call.")
    cached_input_usd_per_mtok: float | None = Field(
        default=None,
        description="US dollars per million input tokens read from the provider's prompt cache; "
        "null: billed as input tokens.",
    )
    cache_write_usd_per_mtok: float | None = Field(
        default=None,
        description="US dollars per million input tokens written to the prompt cache; null: billed "
        "as input tokens.",
    )
    long_context_above_tokens: int | None = Field(
        default=None,
        description="A request with more input tokens than this is billed whole at `long_context`'s "
        "rates; null: one tier.",
    )
    long_context: Price | None = Field(
        default=None, description="The rates above `long_context_above_tokens`."
    )


def _price(price: Rates, unit: float) -> Price:
    """A `guards.Price` (in cost units: `unit` US dollars each) as the status page shows it."""
    per_mtok = unit * 1e6
    return Price(
        input_usd_per_mtok=price.input_token * per_mtok,
        output_usd_per_mtok=price.output_token * per_mtok,
        call_usd=price.call * unit,
        cached_input_usd_per_mtok=None
        if price.cached_input_token is None
        else price.cached_input_token * per_mtok,
        cache_write_usd_per_mtok=None
        if price.cache_write_token is None
        else price.cache_write_token * per_mtok,
        long_context_above_tokens=price.long_context_above,
        long_context=None if price.long_context is None else _price(price.long_context, unit),
    )


class ModelStatus(BaseModel):
    model: str = Field(description="The model, named as Guards(attribution=...) allows.")
    down: bool = Field(description="True while the walk would skip it (open breaker or cooldown).")
    down_for_s: float = Field(description="Seconds until it may be called again (0: it is up).")
    breaker: Literal["closed", "open", "half_open"] | None = Field(
        description="Its breaker's state as the store holds it; null when no route calls it with a "
        "breaker, or when the store did not answer."
    )
    breaker_wait_s: float | None = Field(
        description="Seconds until its breaker lets a call through (0: it does now); null as `breaker`."
    )
    cooldown_s: float | None = Field(
        description="Seconds left on its cooldown (0: none); null when the store did not answer."
    )
    last_failure: LastFailure | None = Field(description="Its newest failed call on this worker.")
    calls: int = Field(
        description="Provider calls in the recent window (see recent.counts), retries included."
    )
    failures: int = Field(description="Those that failed (any classifier kind but cancelled).")
    cost_usd_today: float | None = Field(
        description="What its calls cost today (see today.counts), US dollars; null without a price."
    )
    price: Price | None = Field(description="Its price (Guards(prices=...)), when it has one.")
    latency: Latency = Field(
        description="Its calls' time to first output and to the whole answer (see recent.counts): "
        "the figures latency-based routing reads."
    )


class Outcomes(BaseModel):
    ok: int
    fallback: int
    error: int
    cancelled: int
    invalid: int


class Trip(BaseModel):
    guard: str
    reason: str
    count: int


class SpendCap(BaseModel):
    usd_per_key_per_day: float = Field(description="Budget(spend_per_day=...), in US dollars.")
    scope: str = Field(description="The budget's scope: routes of one scope share each key's spend.")


class BudgetStatus(BaseModel):
    scope: str = Field(description="The budget's scope: its routes share each key's counts.")
    routes: list[str] = Field(description="The routes that charge it.")
    limits: dict[str, float] = Field(
        description="Its limits by name (per_minute, per_day, per_month, tokens_per_minute, "
        "tokens_per_day, tokens_per_month; spend_per_day and spend_per_month in US dollars), "
        "each applying to each key on its own; only those set."
    )
    soft_limit: float | None = Field(
        description="Budget(soft_limit=...): the fraction past which a key is near."
    )
    spent_usd_today: float = Field(
        description="What its spend holds settled to today, every key together, in US dollars "
        "(since today.since; 0 without a spend cap)."
    )
    tokens_today: int = Field(
        description="The tokens its holds settled to today, every key together (0 without a token limit)."
    )


class RouteStatus(BaseModel):
    route: str
    requests: int = Field(description="Requests in the recent window (see recent.counts), every outcome.")
    per_minute: float
    outcomes: Outcomes
    error_rate: float | None = Field(description="error / (requests - invalid); null without such requests.")
    fallback_rate: float | None = Field(
        description="fallback (the envelope's) / (requests - invalid); null without such requests."
    )
    fallback_model_rate: float | None = Field(
        description="Answers served by a fallback model / answers served by a model; null without any."
    )
    trips: list[Trip] = Field(
        description="Guards that tripped in the window, by guard and reason, most first."
    )
    cost_usd_today: float
    spend_cap: SpendCap | None


#: Whose counts the rates and the spend are: every worker's (prometheus-client's multiprocess
#: mode, `PROMETHEUS_MULTIPROC_DIR`), or only the answering worker's.
CountsOf = Literal["all_workers", "this_worker"]


class Recent(BaseModel):
    seconds: float = Field(description="The window the rates cover, in seconds.")
    counts: CountsOf = Field(
        description="all_workers (PROMETHEUS_MULTIPROC_DIR set: the workers' summed counts) or "
        "this_worker (the answering worker's own)."
    )
    worker: int = Field(description="The process id of the worker that answered.")


class Today(BaseModel):
    day: str = Field(description="The UTC day, YYYY-MM-DD.")
    since: float = Field(
        description="Counted since: the day's start, or the answering worker's start when later."
    )
    cost_usd: float = Field(description="What the priced provider calls cost since then, US dollars.")
    counts: CountsOf = Field(description="As recent.counts.")
    worker: int = Field(description="The process id of the worker that answered.")


class StoreResets(BaseModel):
    count: int = Field(
        description="Times the answering worker found its store had forgotten its state (the "
        "store's epoch marker gone: a flush, a restart without persistence, a file replaced)."
    )
    last: float | None = Field(
        description="When it last noticed, seconds since the epoch; null: never since it started."
    )
    worker: int = Field(description="The process id of the worker that answered.")


class StatusProblem(BaseModel):
    """What `GET /status` answers as JSON when it cannot show the page (401, 406)."""

    detail: str


class StatusReport(BaseModel):
    """What `GET /status` answers as JSON."""

    level: Level
    time: float = Field(description="The store's time of the reading, seconds since the epoch.")
    store: Literal["ok", "unavailable"]
    store_resets: StoreResets | None = Field(
        description="The store's resets the answering worker noticed; null when its store keeps "
        "no epoch marker (memory, or a store of your own)."
    )
    refresh_s: float = Field(description="How often the HTML page reloads itself.")
    models: list[ModelStatus]
    routes: list[RouteStatus]
    recent: Recent
    today: Today
    budgets: list[BudgetStatus] = Field(
        description="Each budget scope of the routes, once: its limits and what every key "
        "together settled today. A key's own counts live in the store: never read or shown."
    )


def _resets(store: object) -> StoreResets | None:
    """The resets of a store that keeps an epoch marker (SQLite, Redis)."""
    epoch = getattr(store, "epoch", None)
    if not isinstance(epoch, Epoch):
        return None
    return StoreResets(count=epoch.resets, last=epoch.last_reset_at, worker=os.getpid())


# --- the page --------------------------------------------------------------------------------------


class StatusPage:
    """One app's status page: what its requests share (`Shared`), its counts' history, and its
    settings."""

    def __init__(self, shared: Shared, *, refresh_s: float, window_s: float) -> None:
        self.shared = shared
        self.refresh_s = refresh_s
        self.history = History(window_s)

    async def report(self) -> StatusReport:
        """Read the store once and the counts, and put them together."""
        shared = self.shared
        reading = await self.history.read()
        health, store = await self._health()
        recent = {m: grown(reading, reading.recent, m) for m in (REQUESTS, SERVED, FALLBACKS, ATTEMPTS)}
        spent = grown(reading, reading.today, COST)
        unit = shared.cost_unit_usd
        wall = time.time()
        # When the store did not answer: the level as this worker last read it.
        seen = shared.service_level() if health is None else None
        models = self._models(recent[ATTEMPTS], spent, health, seen, wall, latencies(reading))
        if seen is None:
            level, now = level_of(sum(m.down for m in models), len(models)), health.now if health else wall
        else:
            level, now = seen.level, wall
        seconds = reading.recent_s
        whose: CountsOf = "all_workers" if multiprocess() else "this_worker"
        return StatusReport(
            level=level,
            time=now,
            store=store,
            store_resets=_resets(shared.store),
            refresh_s=self.refresh_s,
            models=models,
            routes=[self._route(route, recent, spent, seconds) for route in _routes(shared)],
            recent=Recent(seconds=round(seconds, 1), counts=whose, worker=os.getpid()),
            today=Today(
                day=reading.day,
                since=reading.since,
                cost_usd=_usd(sum(spent.values())),
                counts=whose,
                worker=os.getpid(),
            ),
            budgets=_budgets(shared, grown(reading, reading.today, BUDGET_SETTLED), unit),
        )

    async def _health(self) -> tuple[Health | None, Literal["ok", "unavailable"]]:
        """The store's one reading of the watched models' breakers and cooldowns: None when no
        route watches a model, or when the store did not answer ("unavailable")."""
        watched = self.shared.levels.models
        if not watched:
            return None, "ok"
        try:
            legs = [(m.cooldown_key, m.breaker_key) for m in watched.values()]
            return await self.shared.store.health(legs), "ok"
        except StoreUnavailable:
            emit_warning("store_unavailable", guard="status", op="health")
            return None, "unavailable"

    def _models(
        self,
        attempts: dict[tuple[str, ...], float],
        spent: dict[tuple[str, ...], float],
        health: Health | None,
        seen: ServiceLevel | None,
        wall: float,
        latency: dict[str, Latency],
    ) -> list[ModelStatus]:
        """Each watched model: its calls, failures and spend, and whether it is down, as the
        store's reading (`health`) says, or else as this worker last read it (`seen`)."""
        shared = self.shared
        seen_down = {model.model: model.until for model in seen.down} if seen is not None else {}
        models = []
        for index, (key, model) in enumerate(shared.levels.models.items()):
            calls = {kind: n for (k, kind), n in attempts.items() if k == key}
            price = price_of(shared.prices, key)
            entry: dict[str, Any] = {
                "model": model.name,
                "last_failure": _last_failure(key),
                "calls": round(sum(calls.values())),
                "failures": round(sum(calls.get(kind.value, 0.0) for kind in _FAILURES)),
                "cost_usd_today": None
                if price is None
                else _usd(sum(n for (_, k), n in spent.items() if k == key)),
                "price": None if price is None else _price(price, shared.cost_unit_usd),
                "latency": latency.get(key, NO_LATENCY),
            }
            if health is not None:
                entry.update(_stored_state(model, health, index))
            else:
                entry.update(_seen_state(seen_down.get(model.name), wall))
            models.append(ModelStatus(**entry))
        return models

    def _route(
        self,
        route: GuardedRoute,
        recent: dict[Metric, dict[tuple[str, ...], float]],
        spent: dict[tuple[str, ...], float],
        seconds: float,
    ) -> RouteStatus:
        name = route.name
        outcomes = {o: round(n) for (r, o), n in recent[REQUESTS].items() if r == name}
        counted = Outcomes(**{o: outcomes.get(o, 0) for o in _OUTCOMES})
        requests = sum(outcomes.values())
        judged = requests - counted.invalid
        served = {position: 0.0 for position in ("first", "fallback")}
        for (r, _, position), n in recent[SERVED].items():
            if r == name:
                served[position] += n
        trips = sorted(
            (
                Trip(guard=g, reason=why, count=round(n))
                for (r, g, why), n in recent[FALLBACKS].items()
                if r == name
            ),
            key=lambda trip: (-trip.count, trip.guard, trip.reason),
        )
        budget = route.budget
        cap = None
        if budget is not None and budget.spend_per_day is not None:
            cap = SpendCap(
                usd_per_key_per_day=budget.spend_per_day * self.shared.cost_unit_usd, scope=route.scope
            )
        return RouteStatus(
            route=name,
            requests=requests,
            # Over at least a minute: a few requests in a young window are not a rate.
            per_minute=round(requests * 60 / max(seconds, 60.0), 2),
            outcomes=counted,
            error_rate=_share(counted.error, judged),
            fallback_rate=_share(counted.fallback, judged),
            fallback_model_rate=_share(served["fallback"], sum(served.values())),
            trips=trips,
            cost_usd_today=_usd(sum(n for (r, _), n in spent.items() if r == name)),
            spend_cap=cap,
        )


#: A budget's limits as the page names them, and whether each is spend (cost units).
_LIMITS = (
    ("per_minute", False),
    ("per_day", False),
    ("per_month", False),
    ("spend_per_day", True),
    ("spend_per_month", True),
    ("tokens_per_minute", False),
    ("tokens_per_day", False),
    ("tokens_per_month", False),
)


def _budgets(shared: Shared, settled: dict[tuple[str, ...], float], unit: float) -> list[BudgetStatus]:
    """Each budget scope of the routes, once (the first route's budget of that scope), with
    what its holds settled to today (`guards_budget_settled_total`, by scope: never by key)."""
    found: dict[str, tuple[Any, list[str]]] = {}
    for route in _routes(shared):
        for budget, scope in zip(route.budgets, route.scopes, strict=False):
            found.setdefault(scope, (budget, []))[1].append(route.name)
    return [
        BudgetStatus(
            scope=scope,
            routes=names,
            limits={
                name: value * unit if spend else value
                for name, spend in _LIMITS
                if (value := getattr(budget, name)) is not None
            },
            soft_limit=budget.soft_limit,
            spent_usd_today=_usd(settled.get((scope, "spend"), 0.0) * unit),
            tokens_today=round(settled.get((scope, "tokens"), 0.0)),
        )
        for scope, (budget, names) in found.items()
    ]


def _routes(shared: Shared) -> list[GuardedRoute]:
    """The guarded routes, once per name, in declaration order."""
    return list({route.name: route for route in reversed(shared.routes)}.values())[::-1]


def _last_failure(model_key: str) -> LastFailure | None:
    newest: tuple[float, Kind] | None = None
    for kind in _FAILURES:
        tally = peek(ATTEMPTS, model_key, kind.value)
        if (
            isinstance(tally, StampedTally)
            and tally.last_at
            and (newest is None or tally.last_at > newest[0])
        ):
            newest = (tally.last_at, kind)
    return None if newest is None else LastFailure(kind=newest[1], at=round(newest[0], 3))


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def _seconds(value: float) -> float:
    return round(max(0.0, value), 1)


def _usd(value: float) -> float:
    return round(value, 6)


def _stored_state(model: WatchedModel, health: Health, index: int) -> dict[str, Any]:
    """A model's state as the store holds it (`health`, where it is the `index`th leg)."""
    breaker, cooldown_s = health.breakers[index], health.cooldowns[index]
    wait = down_for(breaker, cooldown_s, model.policies, health.now)
    guarded = bool(model.policies)
    return {
        "down": wait > 0,
        "down_for_s": _seconds(wait),
        "breaker": breaker.state.value if guarded else None,
        "breaker_wait_s": _seconds(down_for(breaker, 0.0, model.policies, health.now)) if guarded else None,
        "cooldown_s": _seconds(cooldown_s),
    }


def _seen_state(until: float | None, wall: float) -> dict[str, Any]:
    """A model's state when the store did not answer: down `until` (None: up) as this worker
    last read it, no breaker or cooldown."""
    return {
        "down": until is not None,
        "down_for_s": _seconds(max(0.0, (until or 0.0) - wall)),
        "breaker": None,
        "breaker_wait_s": None,
        "cooldown_s": None,
    }
