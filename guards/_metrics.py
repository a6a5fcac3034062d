"""Prometheus metrics guards counts (`prometheus-client`, default registry).

Labels come from closed sets only: route names, configured model keys, guard names, reasons,
kinds, outcomes. Never a user id, a route's input, a served-model string from a provider, or a
free-text detail. Serve them with `render_metrics()` (the exposition, right for one process or
several; see its docstring for several worker processes).

A 200 with a fallback is a successful request: `guards_requests_total{outcome="fallback"}`, and
`guards_fallbacks_total` says which guard and reason; `outcome="error"` counts public errors
and application failures.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from ._breaker import CircuitState

__all__ = [
    "ATTEMPTS",
    "ATTEMPT_SECONDS",
    "BREAKER_STATE",
    "FALLBACKS",
    "REQUESTS",
    "REQUEST_SECONDS",
    "SKIPS",
    "STORE_UNAVAILABLE",
    "RouteMetrics",
    "render_metrics",
]

STORE_UNAVAILABLE = Counter(
    "guards_store_unavailable",
    "Store operations that failed (store down or slower than its timeout), by guard and what the "
    "guard did: open (admitted), closed (refused), or the op that was lost after the call.",
    ["guard", "action"],
)
REQUESTS = Counter(
    "guards_requests",
    "Requests to guarded routes by outcome: ok (the model answered), fallback (200 with a "
    "fallback envelope), error (a public error or an application failure), cancelled (the "
    "client left before the answer).",
    ["route", "outcome"],
)
FALLBACKS = Counter(
    "guards_fallbacks",
    "Degraded or refused requests, by the guard that tripped and its reason.",
    ["route", "guard", "reason"],
)
ATTEMPTS = Counter(
    "guards_provider_attempts",
    "Provider calls by model (as configured in the chain) and outcome kind (ok or a failure kind).",
    ["model", "kind"],
)
SKIPS = Counter(
    "guards_model_skips",
    "Chain models skipped without a call, by reason: cooldown or circuit_open.",
    ["model", "reason"],
)
REQUEST_SECONDS = Histogram(
    "guards_request_duration_seconds",
    "Time spent in guarded routes, from the handler's start to its answer.",
    ["route"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
ATTEMPT_SECONDS = Histogram(
    "guards_provider_attempt_duration_seconds",
    "Latency of single provider calls, by model.",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
BREAKER_STATE = Gauge(
    "guards_breaker_state",
    "The breaker state a worker last saw per model: 0 closed, 1 half-open, 2 open.",
    ["model"],
    multiprocess_mode="mostrecent",
)
STATE_VALUE = {CircuitState.closed: 0, CircuitState.half_open: 1, CircuitState.open: 2}


class RouteMetrics:
    """The labelled children of one route, bound once at start-up (labels() per request costs)."""

    __slots__ = ("_fallbacks", "_route", "cancelled", "error", "fallback", "ok", "seconds")

    def __init__(self, route: str) -> None:
        self._route = route
        self.ok = REQUESTS.labels(route, "ok")
        self.fallback = REQUESTS.labels(route, "fallback")
        self.error = REQUESTS.labels(route, "error")
        self.cancelled = REQUESTS.labels(route, "cancelled")
        self.seconds = REQUEST_SECONDS.labels(route)
        self._fallbacks: dict[tuple[str, str], Counter] = {}

    def tripped(self, guard: str, reason: str) -> None:
        child = self._fallbacks.get((guard, reason))
        if child is None:
            child = self._fallbacks[guard, reason] = FALLBACKS.labels(self._route, guard, reason)
        child.inc()


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
    """
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
