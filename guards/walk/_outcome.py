"""A request's outcome: its metrics, its span's end and its one log line, from a
`RequestEnded` record (what every ending of a guarded request reports, through `Observers`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .._log import emit, logger
from .._metrics import flush_soon
from ._events import RequestEnded

if TYPE_CHECKING:
    from .._tracing import RequestTrace

__all__ = ["request_ended"]


def request_ended(event: RequestEnded, trace: RequestTrace | None) -> None:
    """Count a request's outcome and latency, end its span (when traced), and write its one
    log line (skipped cheaply when INFO is off)."""
    now = time.perf_counter()
    elapsed = now - event.started
    route = event.route
    metrics = route.metrics
    metrics.seconds.observe(elapsed)
    outcome, tripped = event.outcome, event.tripped
    if outcome == "ok":
        metrics.ok.count += 1  # `Tally.add`, in place: every request's path
        served = event.served_leg
        if served is not None:  # a model's answer served (not the handler's own value)
            served.served.count += 1
    elif outcome == "fallback":
        metrics.fallback.add()
    elif outcome == "cancelled":  # the client left: neither the model's fault nor a fallback
        metrics.cancelled.add()
    else:
        metrics.error.add()
    if tripped is not None and outcome != "cancelled":
        metrics.tripped(tripped.guard.value, tripped.reason.value)
    flush_soon(now)
    if trace is not None:
        # The one place the request span learns its outcome, and the level it was served at.
        trace.finish(
            outcome, event.status, tripped, event.error, event.attempts, service_level=event.service_level
        )
    if not logger.isEnabledFor(logging.INFO):
        return
    error = event.error
    extra = event.extra or {}
    emit(
        "request",
        route=route.name,
        trace_id=event.trace_id,
        outcome=outcome,
        status=event.status,
        error=error.value if error is not None else None,
        guard=tripped.guard.value if tripped is not None else None,
        reason=tripped.reason.value if tripped is not None else None,
        kind=tripped.kind.value if tripped is not None and tripped.kind is not None else None,
        attempts=event.attempts,
        attempt_budget=event.attempt_budget,
        model=(tripped.model if tripped is not None else None) or event.model,
        fallback_model=event.fallback_model,
        legs=event.legs,
        resumed_steps=event.resumed_steps,
        latency_ms=round(elapsed * 1000, 2),
        **extra,
    )
