"""Prometheus metrics guards counts (`prometheus-client`, default registry).

Labels come from closed sets only: route names, configured model keys, guard names, reasons,
kinds, outcomes. Never a user id, a route's input, a served-model string from a provider, or a
free-text detail. Serve them with `render_metrics()` (the exposition, right for one process or
several; see its docstring for several worker processes).

A 200 with a fallback is a successful request: `guards_requests_total{outcome="fallback"}`, and
`guards_fallbacks_total` says which guard and reason; `outcome="error"` counts public errors
and application failures, `outcome="invalid"` the 400s answered before the handler ran.

The counts of every request are tallied in plain process memory (`Tally`, `HistogramTally`:
an integer increment, a bucket search) and written to prometheus-client at most
`FLUSH_INTERVAL_S` later, by a timer of the event loop: prometheus-client's own update path
(locks, and in multiprocess mode a write to a shared file per update) costs more than all of a
request's guards. `render_metrics()` writes this process's tallies first, so a scrape of one
process is exact; with several workers, another worker's last `FLUSH_INTERVAL_S` of requests
shows in the next scrape. `Guards.aclose()` (app shutdown) writes the rest.

Tallies are updated from event-loop threads and only grow; a flush (under a lock, from any
thread) adds what grew since the last one, so an update racing a flush is written by the next.

prometheus-client itself is imported, and guards' metrics made in its default registry, when
first needed (`Metric`): by the first flush (`FLUSH_INTERVAL_S` after a process's first
request), `render_metrics()`, the status page, or a store failure counted at once. `import
guards` and building an app import none of it; until then a tally only counts, and a gauge
(`GaugeTally`) keeps its value and the time it was set, which the first flush writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from ..contracts._vocabulary import CircuitState, Reason
from ._log import dropped_lines, emit_warning

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

    #: What a tally counts into: one of guards' metrics, or a prometheus-client metric.
    Source: TypeAlias = "Metric | Counter | Gauge | Histogram"

__all__ = [
    "ATTEMPTS",
    "ATTEMPT_SECONDS",
    "BREAKER_STATE",
    "BREAKER_TRANSITIONS",
    "BUDGET_HELD",
    "BUDGET_NEAR",
    "BUDGET_SETTLED",
    "COST",
    "EFFORT_DECISIONS",
    "FALLBACKS",
    "REQUESTS",
    "REQUEST_SECONDS",
    "RETRY_BUDGET_EXHAUSTED",
    "SERVED",
    "SERVICE_LEVEL",
    "SKIPS",
    "TOKENS",
    "FLUSH_INTERVAL_S",
    "STORE_RESETS",
    "STORE_UNAVAILABLE",
    "TASK_STEPS",
    "GaugeTally",
    "HistogramTally",
    "Metric",
    "RouteMetrics",
    "StampedTally",
    "Tally",
    "counter",
    "counts",
    "flush_metrics",
    "flush_soon",
    "gauge",
    "histogram",
    "multiprocess",
    "peek",
    "render_metrics",
    "stamped_counter",
    "totals",
]

#: The longest a request's counts wait in this process before prometheus-client sees them.
FLUSH_INTERVAL_S = 1.0

#: Every metric declared here, in order: `render_metrics()` makes them all.
_METRICS: list[Metric] = []
_make_lock = threading.Lock()


class Metric:
    """One of guards' metrics: declared at import, made in prometheus-client's default
    registry (a `Counter`, `Gauge` or `Histogram` of the same name, help, labels and options)
    the first time it is needed (`made()`), so that importing guards does not import
    prometheus-client. Tallies (`counter`, `histogram`, `gauge`) take one of these or a
    prometheus-client metric of the kind."""

    __slots__ = ("_documentation", "_kind", "_labelnames", "_made", "_name", "_options")

    def __init__(
        self,
        kind: Literal["Counter", "Gauge", "Histogram"],
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        **options: Any,
    ) -> None:
        self._kind = kind
        #: As prometheus-client names it (a counter's without `_total`), and its label names.
        self._name = name
        self._labelnames = tuple(labelnames)
        self._documentation = documentation
        self._options = options
        self._made: Any = None
        _METRICS.append(self)

    def made(self) -> Any:
        """The prometheus-client metric (imported, made and registered by the first call)."""
        made = self._made
        if made is None:
            with _make_lock:
                if self._made is None:
                    import prometheus_client

                    kind = getattr(prometheus_client, self._kind)
                    self._made = kind(self._name, self._documentation, self._labelnames, **self._options)
                made = self._made
        return made

    def labels(self, *values: object, **labels: object) -> Any:
        """The prometheus-client child of these label values, made now (prometheus-client is
        imported then if no flush did it yet): for rare events, a store failure counted at once;
        a request's counts go through tallies."""
        return self.made().labels(*values, **labels)

    def upper_bounds(self) -> tuple[float, ...]:
        """A histogram's bucket bounds as prometheus-client keeps them: +Inf last."""
        bounds = [float(bound) for bound in self._options["buckets"]]
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        return tuple(bounds)


STORE_UNAVAILABLE = Metric(
    "Counter",
    "guards_store_unavailable",
    "Store operations that failed (store down or slower than its timeout), by guard and what the "
    "guard did: open (admitted), closed (refused), or the op that was lost after the call.",
    ["guard", "action"],
)
STORE_RESETS = Metric(
    "Counter",
    "guards_store_reset",
    "Times this worker found its store had forgotten its state (the store's epoch marker missing "
    "or changed: a flush, a restart without persistence, an empty replica promoted, a SQLite "
    "file replaced; or Redis keys evicted under memory pressure), by store: redis or sqlite. "
    "Each worker counts each reset once.",
    ["store"],
)
REQUESTS = Metric(
    "Counter",
    "guards_requests",
    "Requests to guarded routes by outcome: ok (the model answered), fallback (200 with a "
    "fallback envelope), error (a public error or an application failure), cancelled (the "
    "client left before the answer), invalid (400 invalid_request: no handler ran, no call).",
    ["route", "outcome"],
)
FALLBACKS = Metric(
    "Counter",
    "guards_fallbacks",
    "Degraded or refused requests, by the guard that tripped and its reason.",
    ["route", "guard", "reason"],
)
ATTEMPTS = Metric(
    "Counter",
    "guards_provider_attempts",
    "Provider calls by model (as configured in the chain) and outcome kind (ok or a failure kind).",
    ["model", "kind"],
)
SERVED = Metric(
    "Counter",
    "guards_served",
    "Requests answered (outcome ok) by a model, by route, the chain entry whose answer served "
    "(as configured) and its position in the chain: first (the route's model) or fallback.",
    ["route", "model", "position"],
)
TOKENS = Metric(
    "Counter",
    "guards_tokens",
    "Tokens the providers reported using, by model (as configured in the chain) and type: "
    "input or output. Calls that report no usage add nothing.",
    ["model", "type"],
)
COST = Metric(
    "Counter",
    "guards_cost_usd",
    "What provider calls cost in US dollars, by route and model: the reported usage priced by "
    "Guards(prices=...) (times Guards(cost_unit_usd=...)). Models without a price, and calls "
    "that report no usage, add nothing.",
    ["route", "model"],
)
BUDGET_HELD = Metric(
    "Counter",
    "guards_budget_held",
    "What requests held against their budgets before their first call, by budget scope and "
    "unit: tokens (the estimated input tokens plus max_tokens), or spend (the worst-case cost, "
    "in the cost units of Guards(prices=...)). Only budgets with token limits or spend caps hold.",
    ["scope", "unit"],
)
BUDGET_SETTLED = Metric(
    "Counter",
    "guards_budget_settled",
    "What the holds of guards_budget_held settled to when their request ended, by budget "
    "scope and unit: the tokens the providers reported (a billed call that reported none: its "
    "hold), or the cost of the calls.",
    ["scope", "unit"],
)
BUDGET_NEAR = Metric(
    "Counter",
    "guards_budget_near",
    "Requests admitted past a budget's soft limit (Budget(soft_limit=...)), by budget scope: "
    "some limit of the scope was past that fraction of itself once the request was charged.",
    ["scope"],
)
BREAKER_TRANSITIONS = Metric(
    "Counter",
    "guards_breaker_transitions",
    "Breaker state changes by model and the state entered: open, half_open, closed. Each change "
    "is counted once, by the worker whose store operation made it.",
    ["model", "to"],
)
SKIPS = Metric(
    "Counter",
    "guards_model_skips",
    "Chain models skipped without a call, by reason: cooldown, circuit_open, context_window or content_filter.",
    ["model", "reason"],
)
EFFORT_DECISIONS = Metric(
    "Counter",
    "guards_effort_decisions",
    "Effort routing decisions, by route, the tier the request was given (simple, standard, "
    "complex) and the routing hint it was sent to.",
    ["route", "tier", "hint"],
)
RETRY_BUDGET_EXHAUSTED = Metric(
    "Counter",
    "guards_retry_budget_exhausted",
    "Retryable failures not retried because the model's retry budget (in this worker) was spent.",
    ["model"],
)
REQUEST_SECONDS = Metric(
    "Histogram",
    "guards_request_duration_seconds",
    "Time spent in guarded routes, from the handler's start to its answer.",
    ["route"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
ATTEMPT_SECONDS = Metric(
    "Histogram",
    "guards_provider_attempt_duration_seconds",
    "Latency of single provider calls, by model.",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
BREAKER_STATE = Metric(
    "Gauge",
    "guards_breaker_state",
    "The breaker state a worker last saw per model: 0 closed, 1 half-open, 2 open.",
    ["model"],
    multiprocess_mode="mostrecent",
)
STATE_VALUE = {CircuitState.closed: 0, CircuitState.half_open: 1, CircuitState.open: 2}
#: Every worker reads the same store, so the value a worker set last is the freshest reading
#: (`mostrecent`): a worker that has been idle keeps an older one, and `max` or `min` would
#: hold on to it.
SERVICE_LEVEL = Metric(
    "Gauge",
    "guards_service_level",
    "The service level a worker last read: 0 full, 1 degraded (some model down), 2 minimal "
    "(every model down).",
    multiprocess_mode="mostrecent",
)
TASK_STEPS = Metric(
    "Counter",
    "guards_task_steps",
    "Multi-step tasks by outcome: saved and resumed (steps), replayed (requests answered with a "
    "completed task's response), conflict (requests refused 409 task_in_progress, 422 "
    "idempotency_key_reused, or 429 rate_limited for too many live tasks).",
    ["route", "outcome"],
)
LOG_LINES_DROPPED = Metric(
    "Counter",
    "guards_log_lines_dropped",
    "Log lines dropped because the writer of guards' lines (and, under guards.serve, of "
    "uvicorn's and asyncio's) was behind (a stderr, stdout or log handler that does not keep "
    "up): never waited for (see docs/operating/logs.md).",
)


class Tally:
    """This process's count of one counter series (`counter(metric, *labels)`): `add()` on the
    request path; `flush_metrics()` adds what is new to the prometheus-client series (bound
    to it by the first flush)."""

    __slots__ = ("_child", "_flushed", "_labels", "_metric", "count")

    def __init__(self, metric: Metric | Counter, labels: tuple[str, ...]) -> None:
        self._metric = metric
        self._labels = labels
        self._child: Counter | None = None
        #: Only ever grows; `_flushed` is what prometheus-client has of it.
        self.count: float = 0
        self._flushed: float = 0

    def add(self, amount: float = 1) -> None:
        self.count += amount

    def _flush(self) -> None:
        child = self._child
        if child is None:
            child = self._child = _child(self._metric, self._labels)
        count, flushed = self.count, self._flushed
        if count != flushed:
            self._flushed = count  # first: an amount prometheus-client refuses is dropped
            child.inc(count - flushed)


class StampedTally(Tally):
    """A tally that also keeps when it was last added to (`last_at`, seconds since the epoch,
    0.0: never): a model's failure kinds, for the status page's last failure of each model.
    Only failures pay for the clock read; a model's successes count in a plain `Tally`."""

    __slots__ = ("last_at",)

    def __init__(self, metric: Metric | Counter, labels: tuple[str, ...]) -> None:
        super().__init__(metric, labels)
        self.last_at = 0.0

    def add(self, amount: float = 1) -> None:
        self.count += amount
        self.last_at = time.time()


class HistogramTally:
    """This process's observations of one histogram series (`histogram(metric, *labels)`):
    per bucket (the first bound >= the value, as prometheus-client counts) and their sum."""

    __slots__ = ("_bounds", "_child", "_counts", "_flushed", "_flushed_sum", "_labels", "_metric", "_sum")

    def __init__(self, metric: Metric | Histogram, labels: tuple[str, ...]) -> None:
        self._metric = metric
        self._labels = labels
        self._child: Histogram | None = None
        # prometheus-client's bounds of this histogram, +Inf last.
        self._bounds: tuple[float, ...] = (
            metric.upper_bounds() if isinstance(metric, Metric) else tuple(metric._upper_bounds)
        )
        self._counts = [0] * len(self._bounds)
        self._flushed = [0] * len(self._bounds)
        self._sum = 0.0
        self._flushed_sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def _flush(self) -> None:
        # prometheus-client has no public "add n observations": its histogram child keeps one
        # value per bucket (`_buckets`, non-cumulative) and `_sum`, which this adds to.
        child = self._child
        if child is None:
            child = self._child = _child(self._metric, self._labels)
            if not all(hasattr(child, name) for name in ("_upper_bounds", "_buckets", "_sum")) or (
                tuple(child._upper_bounds) != self._bounds
            ):
                raise RuntimeError(
                    "this prometheus-client's Histogram has no _upper_bounds/_buckets/_sum, or "
                    "other bounds: guards needs a release that keeps them (0.26 does)"
                )
        for index, count in enumerate(self._counts):
            if count != (flushed := self._flushed[index]):
                self._flushed[index] = count
                child._buckets[index].inc(count - flushed)
        total, flushed_sum = self._sum, self._flushed_sum
        if total != flushed_sum:
            self._flushed_sum = total  # first, as `Tally._flush`
            child._sum.inc(total - flushed_sum)


class GaugeTally:
    """One gauge series (`gauge(metric, *labels)`), `set()` when its value changes: at once
    once prometheus-client is loaded; before that, the value waits here with the time it was
    set (what a `mostrecent` gauge of several workers compares), and a flush, scheduled
    now, writes it."""

    __slots__ = ("_child", "_labels", "_metric", "_pending")

    def __init__(self, metric: Metric | Gauge, labels: tuple[str, ...]) -> None:
        self._metric = metric
        self._labels = labels
        self._child: Gauge | None = None
        #: The value set before the series was bound, and when (seconds since the epoch).
        self._pending: tuple[float, float] | None = None

    def set(self, value: float) -> None:
        child = self._child
        if child is None:
            with _flush_lock:  # a flush in another thread may be binding it
                child = self._child
                if child is None:
                    self._pending = (float(value), time.time())
            if child is None:
                _flush_later()
                return
        child.set(value)

    def _flush(self) -> None:
        child = self._child
        if child is None:
            child = self._child = _child(self._metric, self._labels)
            if not hasattr(child, "_value"):
                raise RuntimeError("this prometheus-client's Gauge has no _value: guards needs 0.26's")
        pending = self._pending
        if pending is not None:
            self._pending = None
            # What `Gauge.set` writes (a `mostrecent` gauge's value with its time), at its time.
            child._value.set(pending[0], timestamp=pending[1])


AnyTally: TypeAlias = "Tally | HistogramTally | GaugeTally"
_tallies: dict[tuple[Source, tuple[str, ...]], AnyTally] = {}
_flush_lock = threading.Lock()
#: The metrics whose flush failed, each said once (`flush_metrics`): at most one per metric.
_failed_metrics: set[str] = set()
#: When the scheduled flush is overdue (`time.perf_counter()`); 0.0: none scheduled.
_flush_due = 0.0


def _child(metric: Source, labels: tuple[str, ...]) -> Any:
    """The prometheus-client series of `metric` with `labels` (the metric itself without)."""
    made = metric.made() if isinstance(metric, Metric) else metric
    return made.labels(*labels) if labels else made


def counter(metric: Metric | Counter, *labels: str) -> Tally:
    """The process's tally of `metric`'s series with `labels` (one per series, kept)."""
    tally = _tally(metric, labels, Tally)
    assert isinstance(tally, Tally)
    return tally


def stamped_counter(metric: Metric | Counter, *labels: str) -> StampedTally:
    """The process's tally of `metric`'s series with `labels`, keeping when it last grew."""
    tally = _tally(metric, labels, StampedTally)
    assert isinstance(tally, StampedTally)
    return tally


def gauge(metric: Metric | Gauge, *labels: str) -> GaugeTally:
    """The process's value of `metric`'s series with `labels` (one per series, kept)."""
    tally = _tally(metric, labels, GaugeTally)
    assert isinstance(tally, GaugeTally)
    return tally


def peek(metric: Metric | Counter, *labels: str) -> Tally | None:
    """The process's tally of `metric`'s series with `labels` if one was made (never makes one:
    reading must not add a series to the exposition)."""
    tally = _tallies.get((metric, labels))
    return tally if isinstance(tally, Tally) else None


def counts(*metrics: Metric) -> dict[tuple[Metric, tuple[str, ...]], float]:
    """This process's count so far of every series of the counters `metrics` that has a
    tally, by `(metric, labels)` (call it from the event loop that updates them)."""
    wanted = set(metrics)
    return {
        (metric, labels): tally.count
        for (metric, labels), tally in list(_tallies.items())
        if metric in wanted and isinstance(tally, Tally)
    }


def multiprocess() -> bool:
    """True in prometheus-client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set)."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ


def totals(*metrics: Metric) -> dict[tuple[Metric, tuple[str, ...]], float]:
    """Every worker's count so far of each series of the counters `metrics`, by `(metric,
    labels)`: in multiprocess mode the sums of the files all workers wrote (this process's
    tallies written first; the others' at most `FLUSH_INTERVAL_S` old), else this process's
    own. Reads files: call it off the event loop."""
    if not multiprocess():
        return counts(*metrics)
    flush_metrics()
    by_sample = {f"{metric._name}_total": metric for metric in metrics}
    found: dict[tuple[Metric, tuple[str, ...]], float] = {}
    for family in _worker_files().collect():
        for sample in family.samples:
            metric = by_sample.get(sample.name)
            if metric is not None:
                labels = tuple(sample.labels.get(name, "") for name in metric._labelnames)
                found[metric, labels] = found.get((metric, labels), 0.0) + sample.value
    return found


def histogram(metric: Metric | Histogram, *labels: str) -> HistogramTally:
    """The process's tally of `metric`'s series with `labels` (one per series, kept)."""
    tally = _tally(metric, labels, HistogramTally)
    assert isinstance(tally, HistogramTally)
    return tally


def _tally(metric: Any, labels: tuple[str, ...], make: Callable[[Any, tuple[str, ...]], AnyTally]) -> Any:
    tally = _tallies.get((metric, labels))
    if tally is None:
        tally = _tallies[metric, labels] = make(metric, labels)
    return tally


def flush_metrics() -> None:
    """Write this process's new counts to prometheus-client (any thread); the first flush
    imports it and binds every tally to its series (a series counted 0 included).

    An amount prometheus-client refuses (one no float holds, a negative one: a binding of the
    app's own may report any usage) is dropped from its series, which counts on from there,
    and said once per metric (`metrics_flush_failed`, never the amount): one series never
    stops the others."""
    with _flush_lock:
        _dropped_lines.count = dropped_lines()  # counted by `guards.observe._log`'s writer
        for tally in list(_tallies.values()):
            try:
                tally._flush()
            except (ArithmeticError, TypeError, ValueError) as error:
                name = getattr(tally._metric, "_name", "")
                if name not in _failed_metrics:
                    _failed_metrics.add(name)
                    emit_warning("metrics_flush_failed", metric=name, error=type(error).__name__)


def _flush_later() -> None:
    """`flush_soon` from a loop's thread; nothing outside one (the next request's does it)."""
    with contextlib.suppress(RuntimeError):  # no running event loop
        flush_soon(time.perf_counter())


def flush_soon(now: float) -> None:
    """Make sure a flush runs within FLUSH_INTERVAL_S (called once per request, in a loop;
    `now` is `time.perf_counter()`). While one is scheduled, this reads no event loop: only
    when the scheduled flush is overdue (its loop stopped before it ran, or lags) is another
    scheduled, on the running loop."""
    global _flush_due
    if now >= _flush_due:
        _flush_due = now + 2 * FLUSH_INTERVAL_S
        asyncio.get_running_loop().call_later(FLUSH_INTERVAL_S, _timed_flush)


def _timed_flush() -> None:
    global _flush_due
    _flush_due = 0.0
    flush_metrics()


#: The log lines this process dropped (`guards.observe._log`), as a series.
_dropped_lines = counter(LOG_LINES_DROPPED)


class RouteMetrics:
    """The tallies of one route's series, bound once at start-up."""

    __slots__ = ("_route", "_tripped", "cancelled", "error", "fallback", "invalid", "ok", "seconds")

    def __init__(self, route: str) -> None:
        self._route = route
        self.ok = counter(REQUESTS, route, "ok")
        self.fallback = counter(REQUESTS, route, "fallback")
        self.error = counter(REQUESTS, route, "error")
        self.cancelled = counter(REQUESTS, route, "cancelled")
        self.invalid = counter(REQUESTS, route, "invalid")
        self.seconds = histogram(REQUEST_SECONDS, route)
        #: `guards_fallbacks_total` by reason (its guard follows), each bound at its first count.
        self._tripped: dict[Reason, Tally] = {}

    def tripped(self, reason: Reason) -> None:
        tally = self._tripped.get(reason)
        if tally is None:
            tally = self._tripped[reason] = counter(FALLBACKS, self._route, reason.guard.value, reason.value)
        tally.count += 1


def render_metrics() -> tuple[bytes, str]:
    """The Prometheus exposition of every metric, and its content type: `(body, content_type)`.

    In one process, the default `REGISTRY` (guards' metrics, plus the process and platform
    collectors). With `PROMETHEUS_MULTIPROC_DIR` in the environment, prometheus-client's
    multiprocess mode: a fresh `CollectorRegistry` with a `MultiProcessCollector` that sums the
    files every worker wrote, so any worker answers a scrape with the totals of all of them
    (counters and histograms summed; `guards_breaker_state` is the value last set by any worker,
    `multiprocess_mode="mostrecent"`). For several worker processes (`uvicorn --workers N`,
    gunicorn):

    - set `PROMETHEUS_MULTIPROC_DIR` in the server's environment, so it is there before any
      worker imports prometheus-client (its value class is chosen at import time, and this
      function must see the same setting);
    - the directory must exist, and be emptied before the server starts (not between worker
      restarts): files left by an earlier run would be added to this run's counts;
    - `prometheus_client.multiprocess.mark_process_dead(pid)` on worker exit only removes the
      files of `live*` gauges (`livesum`, `livemostrecent`...). guards has none (its gauge is
      `mostrecent`, and a dead worker's counts must stay in the totals), so the example app does
      not call it; an app that adds `live*` gauges should, from its lifespan shutdown (uvicorn)
      or gunicorn's `child_exit` hook.

    In multiprocess mode the per-process collectors (`process_*`, `python_gc_*`) and the
    `*_created` samples are not exported.

    This process's tallies are written first; other workers write theirs every
    `FLUSH_INTERVAL_S` (see the module's docstring).
    """
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

    for metric in _METRICS:  # every family, those no series of has been counted yet too
        metric.made()
    flush_metrics()
    if multiprocess():
        registry = CollectorRegistry()
        registry.register(_worker_files())
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class _WorkerFiles:
    """prometheus-client's `MultiProcessCollector`, minus the files no worker has written yet.

    A worker creates its file, then sizes it: for a moment it is empty, and prometheus-client
    fails the whole merge on it (`struct.error`, every worker's metrics lost with it). A worker
    killed in that moment leaves the empty file for good, and every scrape and status page
    after it would fail (prometheus/client_python issue 1199). An empty file holds no count:
    it is left out."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Any:
        from prometheus_client.multiprocess import MultiProcessCollector

        with os.scandir(self.directory) as entries:
            files = [entry.path for entry in entries if entry.name.endswith(".db") and _holds_counts(entry)]
        return MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]


def _holds_counts(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file() and entry.stat().st_size > 0
    except OSError:  # removed meanwhile (`mark_process_dead`)
        return False


def _worker_files() -> _WorkerFiles:
    """The collector of every worker's file in the multiprocess directory."""
    # The lower-case name is the deprecated one prometheus-client still reads.
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ["prometheus_multiproc_dir"]  # noqa: SIM112
    return _WorkerFiles(directory)
