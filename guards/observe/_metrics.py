"""Prometheus metrics guards counts (`prometheus-client`, default registry).

Labels come from closed sets only: route names, configured model keys, guard names, reasons,
kinds, outcomes. Never a user id, a route's input, a served-model string from a provider, or a
free-text detail. Serve them with `render_metrics()` (the exposition, right for one process or
several; see its docstring for several worker processes).

A 200 with a fallback is a successful request: `guards_requests_total{outcome="fallback"}`, and
`guards_fallbacks_total` says which guard and reason; `outcome="error"` counts public errors
and application failures, `outcome="invalid"` the 400s answered before the handler ran.

The counts of every request are tallied in plain process memory and written to
prometheus-client at most `FLUSH_INTERVAL_S` later (see `guards.observe._tallies`).
`render_metrics()` writes this process's tallies first, so a scrape of one process is exact;
with several workers, another worker's last `FLUSH_INTERVAL_S` of requests shows in the next
scrape. `Guards.aclose()` (app shutdown) writes the rest.

Where each part lives (every name importable from here): the metrics' declarations in
`guards.observe._families`; the tallies and their flush in `guards.observe._tallies`;
prometheus-client, imported on first use, and its multiprocess files in
`guards.observe._prometheus`; here, a route's series (`RouteMetrics`) and the exposition
(`render_metrics`).
"""

from __future__ import annotations

from ..contracts._vocabulary import Reason
from ._families import (
    ANSWER_SECONDS,
    ATTEMPT_SECONDS,
    ATTEMPTS,
    BREAKER_STATE,
    BREAKER_TRANSITIONS,
    BUDGET_HELD,
    BUDGET_NEAR,
    BUDGET_SETTLED,
    COST,
    EFFORT_DECISIONS,
    FALLBACKS,
    FIRST_OUTPUT_SECONDS,
    HEDGES,
    HOLD_REJECTIONS,
    REQUEST_SECONDS,
    REQUESTS,
    RETRY_BUDGET_EXHAUSTED,
    SERVED,
    SERVICE_LEVEL,
    SKIPS,
    SLOW_STREAMS,
    STATE_VALUE,
    STORE_RESETS,
    STORE_UNAVAILABLE,
    TASK_STEPS,
    TOKENS,
)
from ._prometheus import METRICS, Metric, multiprocess, worker_files
from ._tallies import (
    FLUSH_DUE,
    FLUSH_INTERVAL_S,
    GaugeTally,
    HistogramTally,
    StampedTally,
    Tally,
    counter,
    counts,
    flush_metrics,
    flush_soon,
    gauge,
    histogram,
    peek,
    stamped_counter,
    totals,
)

__all__ = [
    "ANSWER_SECONDS",
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
    "FIRST_OUTPUT_SECONDS",
    "HEDGES",
    "HOLD_REJECTIONS",
    "REQUESTS",
    "REQUEST_SECONDS",
    "RETRY_BUDGET_EXHAUSTED",
    "SERVED",
    "SERVICE_LEVEL",
    "SKIPS",
    "SLOW_STREAMS",
    "TOKENS",
    "FLUSH_DUE",
    "FLUSH_INTERVAL_S",
    "STORE_RESETS",
    "STATE_VALUE",
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

    for metric in METRICS:  # every family, those no series of has been counted yet too
        metric.made()
    flush_metrics()
    if multiprocess():
        registry = CollectorRegistry()
        registry.register(worker_files())
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
