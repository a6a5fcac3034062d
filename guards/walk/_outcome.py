"""A request's outcome: its metrics, its span's end and its one log line, from a
`RequestEnded` record (what every ending of a guarded request reports, through `Observers`)."""

from __future__ import annotations

from logging import INFO
from random import random
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

from ..observe._log import emit_line, logger
from ..observe._metrics import FLUSH_DUE, flush_soon
from ._events import RequestEnded

if TYPE_CHECKING:
    from ..contracts._errors import GuardTripped
    from ..spec._tracing import RequestTrace
    from ._events import AttemptEnded

__all__ = ["Traced", "request_ended"]


class Traced(Protocol):
    """The observers of one request (`Observers`): its spans, when it is traced, and the
    service level it was served at."""

    trace: RequestTrace | None
    #: The share of successful requests that write their `request` line (`Guards(log_sample)`).
    log_sample: float

    def service_level(self) -> str: ...


def request_ended(observers: Traced, event: RequestEnded) -> None:
    """Count a request's outcome and latency, end its span (when traced), and write its one
    log line (skipped cheaply when INFO is off). `Observers.request_ended` is this."""
    (
        route,
        trace_id,
        outcome,
        status,
        started,
        attempts,
        attempt_budget,
        model,
        fallback_model,
        served,
        tripped,
        error,
        legs,
        resumed_steps,
        extra,
        held,
    ) = event
    now = perf_counter()
    elapsed = now - started
    metrics = route.metrics
    metrics.seconds.observe(elapsed)
    if outcome == "ok":
        metrics.ok.count += 1  # `Tally.add`, in place: every request's path
        if served is not None:  # a model's answer served (not the handler's own value)
            served.served.count += 1
    elif outcome == "fallback":
        metrics.fallback.count += 1  # `Tally.add`, in place: every refused request's path
    elif outcome == "cancelled":  # the client left: neither the model's fault nor a fallback
        metrics.cancelled.add()
    else:
        metrics.error.add()
    if tripped is not None and outcome != "cancelled":
        metrics.tripped(tripped.reason)
    if now >= FLUSH_DUE[0]:  # `flush_soon`'s check, without its call on every request
        flush_soon(now)
    trace = observers.trace
    if trace is not None:
        # The one place the request span learns its outcome, and the level it was served at.
        trace.finish(
            outcome,
            status,
            tripped,
            error,
            attempts,
            service_level=observers.service_level(),
            requested=route.model,
            effective=served,
            served=model,
        )
    if not logger.isEnabledFor(INFO):
        return
    if outcome == "ok" and observers.log_sample < 1.0 and random() >= observers.log_sample:
        return  # sampled out: a success (every other outcome keeps its line)
    # Built here in its fields' order, without its None fields (`emit` would build them all, then drop them).
    line: dict[str, Any] = {"event": "request", "route": route.name, "trace_id": trace_id, "outcome": outcome}
    if status is not None:
        line["status"] = status
    if error is not None:  # (`StrEnum`s are written as their values: no slow `.value` read)
        line["error"] = error
    if tripped is not None:
        line["guard"], line["reason"] = (reason := tripped.reason).guard, reason
        if tripped.kind is not None:
            line["kind"] = tripped.kind
        model = tripped.model or model
    for name, value in (
        ("attempts", attempts),
        ("attempt_budget", attempt_budget),
        ("model", model),
        ("fallback_model", fallback_model),
        ("legs", legs),
        ("resumed_steps", resumed_steps),
    ):
        if value is not None:
            line[name] = value
    line["latency_ms"] = _ms(elapsed)
    if held is not None or extra is not None or (tripped is not None and tripped.scope is not None):
        _extra(line, extra, held, tripped)
    emit_line(line)


def _ms(seconds: float) -> float:
    """`seconds` in milliseconds to 2 decimals: `round(seconds * 1000, 2)` but for its ties,
    at a tenth of its cost (no decimal string made and parsed)."""
    return round(seconds * 100_000) / 100


def _extra(
    line: dict[str, Any],
    extra: dict[str, Any] | None,
    held: AttemptEnded | None,
    tripped: GuardTripped | None,
) -> None:
    """The request line's `extra` fields added to `line`, after those of the request's only
    attempt (`held`: no `attempt` line was written for it), then the budget scope that refused
    it."""
    if held is not None:
        usage, elapsed_s, delivered, provider_status, provider_code = (
            held[5],
            held[7],
            held[9],
            held[10],
            held[11],
        )
        if usage is not None:
            if usage.prompt_tokens is not None:
                line["prompt_tokens"] = usage.prompt_tokens
            if usage.completion_tokens is not None:
                line["completion_tokens"] = usage.completion_tokens
        line["call_ms"] = _ms(elapsed_s)
        for name, value in (
            ("delivered_chars", delivered),
            ("provider_status", provider_status),
            ("provider_code", provider_code),
        ):
            if value is not None:
                line[name] = value
    if extra is not None:
        for name, value in extra.items():
            if value is not None:
                line[name] = value
            else:  # (a None of `extra` leaves out the attempt's field of that name, as before)
                line.pop(name, None)
    if tripped is not None and tripped.scope is not None:  # the budget scope that refused
        line["scope"] = tripped.scope
