"""`Observers`: the one seam between the request path and what watches it.

The walk calls no metric, logger or tracer: it hands each event of a request (an attempt that
ended, a model skipped, a retry, a store that did not answer, a cooldown started, a breaker
moved, the request's end) to `Observers` as a frozen record (`guards.walk._events`). Each
method below is where that event's subscribers are listed, in the order they run:

    event             metrics                      log line      ledger    trace
    attempt started                                                        attempt span opens
    first output      first output seconds (a stream's)
    attempt ended     attempts, seconds, tokens,                 record    an answered call's
                      cost, answer seconds                                  span ends (a failed
                                                                            one's ended with it)
    skipped           guards_skips_total           skip (1/s)              skip span
    hold rejected     stream hold rejections
    hedged            guards_hedges_total
    slow stream       stream slow models
    retried           retry budget exhausted       retry                   skip span (refused)
    store failed      guards_store_unavailable     store_unavailable
    cooldown started                               cooldown
    breaker moved     breaker transitions
    step checkpointed task steps
    budget counted    budget held / settled
    request ended     requests, seconds, fallbacks request                  route span ends

The default ledger is the `attempt` lines, and a request's only attempt has none: its fields are
on the `request` line (`attempt_ended` hands the record back for the request to hold). `skip`
lines are summarized per route, reason and second by the log writer (`guards.observe._log`).

One `Observers` serves every untraced request of an app; a traced request gets its own, with
its `RequestTrace`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from logging import INFO
from typing import TYPE_CHECKING, Any, TypeVar

from ..observe._ledger import Attempt, LogLedger
from ..observe._log import emit, emit_skip, emit_warning, logger
from ..observe._metrics import (
    BUDGET_HELD,
    BUDGET_NEAR,
    BUDGET_SETTLED,
    HEDGES,
    HOLD_REJECTIONS,
    RETRY_BUDGET_EXHAUSTED,
    SKIPS,
    SLOW_STREAMS,
    STORE_UNAVAILABLE,
    TASK_STEPS,
    counter,
)
from ._events import (
    AttemptEnded,
    BreakerMoved,
    BudgetCounted,
    BudgetNear,
    Checkpointed,
    CooldownStarted,
    Retried,
    Skipped,
    StoreFailed,
)
from ._outcome import request_ended

if TYPE_CHECKING:
    from ..contracts._binding import Binding
    from ..contracts._stream import StreamEnd
    from ..spec._route_spec import GuardedRoute, Leg
    from ..spec._shared import Shared
    from ..spec._tracing import RequestTrace
    from ..streams._relay import Opened

__all__ = ["Observers"]

R = TypeVar("R")


class Observers:
    """Where a request's events go (see the module's table). `shared`: the app's ledger and
    cost unit; `trace`: the request's spans, when it is traced."""

    __slots__ = ("_shared", "log_sample", "trace")

    def __init__(self, shared: Shared, trace: RequestTrace | None = None) -> None:
        self._shared = shared
        self.trace = trace
        #: The share of successful requests that write their `request` line.
        self.log_sample = shared.log_sample

    def traced(
        self,
        call: Callable[[str, Mapping[str, Any]], Awaitable[R]],
        leg: Leg,
        binding: Binding,
        *,
        fallback: bool,
        attempts: Callable[[], int],
        retry: bool = False,
        hedge: bool = False,
    ) -> Callable[[str, Mapping[str, Any]], Awaitable[R]]:
        """`call`, each attempt of it in a span of its own when the request is traced."""
        trace = self.trace
        if trace is None:
            return call
        return trace.traced(
            call, leg, binding, fallback=fallback, attempts=attempts, retry=retry, hedge=hedge
        )

    def attempt_ended(self, event: AttemptEnded, held: AttemptEnded | None) -> AttemptEnded | None:
        """An attempt ended: its metrics, and its ledger record. `held`: the request's record
        not written yet. Returns the record the request holds now: the default ledger (log
        lines) writes no `attempt` line for a request's first attempt, whose fields ride on its
        `request` line, unless a second attempt follows (then both are written) or the app
        asked for every attempt (`Guards(log_attempts="all")`)."""
        (
            _,
            _,
            leg,
            attempt,
            outcome,
            usage,
            _,
            elapsed_s,
            cost,
            delivered,
            _,
            _,
            _,
            _,
            _,
        ) = event
        if self.trace is not None:  # an answered call's span ends with its verdict
            self.trace.attempt_ended(outcome)
        if outcome == "ok":  # a whole answer's first output is its arrival
            leg.seconds.observe_answer(
                leg.answered, leg.first_output if delivered is None else None, elapsed_s
            )
            leg.attempts["ok"].count += 1  # `Tally.add`, in place: every request's path
        else:
            leg.seconds.observe(elapsed_s)
            leg.attempts[outcome].add()  # a failure kind's tally also stamps its time
        if usage is not None:
            leg.input_tokens.count += usage.prompt_tokens
            leg.output_tokens.count += usage.completion_tokens
        shared = self._shared
        if cost is not None and leg.cost_usd is not None:
            leg.cost_usd.add(cost * shared.cost_unit_usd)
        ledger = shared.ledger
        if type(ledger) is not LogLedger:  # the app's ledger: every record, as it ends
            ledger.record(_attempt(event))
            return None
        if attempt == 1 and held is None and shared.log_attempts != "all":
            return event  # the request's line carries it, unless another attempt follows
        if not logger.isEnabledFor(INFO):  # lines off: no record to build
            return None
        if held is not None:
            ledger.record(_attempt(held))
        ledger.record(_attempt(event))
        return None

    def hedged(self, route: GuardedRoute, leg: Leg, outcome: str) -> None:
        """A call to `leg` was hedged: `outcome` is `started`, `won`, `lost` or `skipped`."""
        counter(HEDGES, route.name, leg.ref.key, outcome).add()

    def first_output(self, leg: Leg, elapsed_s: float) -> None:
        """A streamed call produced its first output part `elapsed_s` after it started (its
        whole answer is timed when it ends, with its record)."""
        leg.first_output.observe(elapsed_s)

    def stream_ended(self, opened: Opened, kind: str, end: StreamEnd | None, delivered: int) -> None:
        """A committed stream ended (its attempt span ends; its record follows)."""
        if self.trace is not None:
            self.trace.stream_ended(opened, kind, end, delivered)

    def hold_rejected(self, route: GuardedRoute, reason: str) -> None:
        """The output guard rejected a stream inside its hold (`reason`: its output reason)."""
        counter(HOLD_REJECTIONS, route.name, reason).add()

    def slow_stream(self, route: GuardedRoute, leg: Leg) -> None:
        """A stream was cancelled before its commit point, below its model's minimum rate."""
        counter(SLOW_STREAMS, route.name, leg.ref.key).add()

    def streaming(self) -> None:
        """The request answers with a stream: its span ends when the stream does."""
        if self.trace is not None:
            self.trace.streaming = True

    def skipped(self, event: Skipped) -> None:
        route, trace_id, leg, reason, wait_s = event
        key = leg.ref.key
        tally = leg.skips.get(reason)  # bound at the leg's first skip for `reason`
        if tally is None:
            tally = leg.skips[reason] = counter(SKIPS, key, reason)
        tally.count += 1  # `Tally.add`, in place: every refused request's path
        if self.trace is not None:
            self.trace.skipped(leg, reason, wait_s, fallback=not leg.leads)
        if logger.isEnabledFor(INFO):
            emit_skip(
                route.name,
                reason,
                trace_id=trace_id,
                model=key,
                retry_after_s=round(wait_s, 3) if wait_s is not None else None,
            )

    def retried(self, event: Retried) -> None:
        model, delay_s = event.leg.ref.key, event.delay_s
        if event.skipped is not None:
            counter(RETRY_BUDGET_EXHAUSTED, model).add()
            if self.trace is not None:  # the retry not made: a skipped attempt
                leg = event.leg
                self.trace.skipped(leg, event.skipped, None, fallback=not leg.leads)
        emit(
            "retry",
            route=event.route.name,
            trace_id=event.trace_id,
            model=model,
            attempt=event.attempt,
            kind=event.kind,
            delay_ms=round(delay_s * 1000, 1) if delay_s is not None else None,
            skipped=event.skipped,
        )

    def store_failed(self, event: StoreFailed) -> None:
        guard, mode, op = event.guard, event.mode, event.op
        fields = {"mode": mode} if mode is not None else {"op": op}
        emit_warning(
            "store_unavailable", guard=guard, route=event.route.name, trace_id=event.trace_id, **fields
        )
        STORE_UNAVAILABLE.labels(guard=guard, action=mode if mode is not None else op).inc()

    def cooldown_started(self, event: CooldownStarted) -> None:
        emit(
            "cooldown",
            route=event.route.name,
            trace_id=event.trace_id,
            model=event.model,
            seconds=round(event.seconds, 3),
        )

    def budget_counted(self, event: BudgetCounted) -> None:
        counter(BUDGET_HELD if event.stage == "held" else BUDGET_SETTLED, event.scope, event.unit).add(
            event.amount
        )

    def budget_near(self, event: BudgetNear) -> None:
        # One line per request admitted past a soft limit (never more: a request is admitted
        # once), naming the scopes, never the keys (a key is a caller's identity).
        emit_warning(
            "budget_near", route=event.route.name, trace_id=event.trace_id, scope=",".join(event.scopes)
        )
        for scope in event.scopes:
            counter(BUDGET_NEAR, scope).add()

    def checkpointed(self, event: Checkpointed) -> None:
        counter(TASK_STEPS, event.route.name, event.action).add()

    def breaker_moved(self, event: BreakerMoved) -> None:
        event.leg.transitions[event.state].add()

    def service_level(self) -> str:
        """The app's service level now (for a traced request's span)."""
        return self._shared.levels.view.level.value

    #: `request_ended(event)`: the request's metrics, span end and log line (`_outcome`).
    request_ended = request_ended


def _attempt(event: AttemptEnded) -> Attempt:
    """The ledger's record of an attempt."""
    (
        route,
        trace_id,
        leg,
        attempt,
        outcome,
        usage,
        served,
        elapsed_s,
        _,
        delivered,
        status,
        code,
        steps,
        problems,
        hedge,
    ) = event
    return Attempt(
        trace_id=trace_id,
        route=route.name,
        attempt=attempt,
        requested_model=route.model,
        model=leg.ref.key,
        entry=leg.ref.entry,
        served_model=served,
        outcome=outcome,
        latency_ms=round(elapsed_s * 1000, 2),
        usage=usage,
        delivered_chars=delivered,
        status=status,
        code=code,
        resumed_steps=steps,
        problems=problems or (),
        downgraded=route.downgraded,
        hedge=hedge,
    )
