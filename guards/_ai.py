"""`AI`: one request's guarded access to its route's models.

`run` and `stream` walk the route's fallback chain under one deadline and one attempt budget:
cooldowns and open breakers skip a model without a call, the budget is charged once before the
first call, each call is classified (retry, next model, or stop), and every call is accounted
for (metrics, the usage ledger, the spend cap). `stream` relays a committed model's events as
Server-Sent Events (see `guards.EventStream`; the relay itself is `guards._relay`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar, overload

import anyio

from ._admission import never_admitted, waited_for_admission
from ._binding import AIResult, Binding, Usage
from ._breaker import CircuitState, Outcome
from ._budget import budget_refusal, input_tokens_bound
from ._call import CallFailed, call_model
from ._classify import Classification, classify
from ._deadline import Deadline
from ._errors import ConfigurationError, GuardTripped, ProviderError
from ._event_stream import EventStream, end_data
from ._ledger import Attempt
from ._log import emit, emit_warning, logger
from ._metrics import SKIPS, STORE_UNAVAILABLE, counter, flush_soon
from ._output import OutputGuard, output_guard
from ._relay import Opened, Relayed, no_events, open_stream, relay
from ._retry_budget import admit_retry
from ._route_spec import GuardedRoute, Leg
from ._stream import StreamEnd, StreamingBinding, TextDelta
from ._vocabulary import ErrorCode, Kind, Reason
from .stores import Charge, Passage, Report, Step, StoreUnavailable

if typing.TYPE_CHECKING:
    from starlette.requests import Request

    from ._guards import Guards
    from ._tasks import TaskRun
    from ._tracing import RequestTrace

__all__ = ["AI", "TASK_SCOPE", "finish_request", "walk_step"]

T = TypeVar("T")
S = TypeVar("S")
R = TypeVar("R")
#: One attempt on a leg: `call(model, inputs)`.
Call = Callable[[str, Mapping[str, Any]], Awaitable[R]]

#: Retry-After when a guard refuses calls because its store is unavailable.
STORE_RETRY_AFTER_S = 5.0
_COOLDOWN_KINDS = frozenset({Kind.model_rate_limited, Kind.model_quota_exhausted})
#: The longest attempt summary a detail or a log line carries.
_SUMMARY_MAX = 400
#: Where a task route's request keeps the task it holds (`guards._tasks.TaskRun`).
TASK_SCOPE = "guards.task"
_ROUTE_OUTPUT: Any = object()
#: The longest name of a task's step (the handler's own text, kept in the store).
_MAX_STEP_NAME = 100


class AI(Generic[T]):
    """One request's guarded access to its route's models.

    Declare it as a parameter of a guarded route (`ai: AI[OutputModel]`); the decorator fills it.
    `run` passes the budget, call and output guards and returns the validated output, or raises
    `GuardTripped`. After a call: `model` is the model that served (as the provider named it),
    `fallback_model` the chain entry that served when it was not the first (else None),
    `attempts` the provider calls made and `attempt_budget` the most it could make;
    `trace_id` is the request's trace id (also the `x-trace-id` header); `resumed_steps` the
    names of the steps `step` loaded from the request's task instead of calling, in order.
    """

    __slots__ = (
        "_charged",
        "_cost",
        "_first",
        "_gone",
        "_guards",
        "_hold",
        "_leg",
        "_notes",
        "_request",
        "_route",
        "_scope",
        "_served_leg",
        "_started",
        "_tokens",
        "_trace",
        "_waits",
        "_watch",
        "attempt_budget",
        "attempts",
        "fallback_model",
        "model",
        "trace_id",
    )

    def __init__(
        self,
        guards: Guards,
        route: GuardedRoute,
        first: Step | None,
        trace_id: str,
        request: Request | None = None,
        started: float | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        self._guards = guards
        self._started = time.perf_counter() if started is None else started
        self._route = route
        #: The walk's first store step, prepared by the route (`walk_step`), with what the
        #: request's budget charges (None outside a route); the charge's spend, when the route
        #: has a spend cap, is set at the first admission (`_step`).
        self._first = first
        #: The client's request (None outside a route), watched for a disconnect during calls.
        self._request = request
        self._watch: asyncio.Task[None] | None = None
        self._scope: Deadline | None = None
        self._gone = False
        self._charged = False
        #: The spend hold of this request (None without a spend cap) and the cost so far.
        self._hold: str | None = None
        self._cost = 0.0
        #: The leg being called, and what happened to each leg tried or skipped.
        self._leg: Leg = route.legs[0]
        self._notes: list[tuple[Leg, str, float | None]] = []
        self._tokens = 0
        #: Seconds of cooldown left per leg, as the last store step read them (None: unknown).
        self._waits: list[float] | None = None
        #: The request's spans when tracing is on (see `guards._tracing`), else None.
        self._trace = trace
        #: The leg whose answer the request was last given (`guards_served_total`).
        self._served_leg: Leg | None = None
        self.trace_id = trace_id
        self.model: str | None = None
        self.fallback_model: str | None = None
        self.attempts = 0
        self.attempt_budget = route.attempt_budget

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # Only FastAPI (through pydantic) asks for this, when it reads a handler that still
        # declares `ai`: one registered before `guards.route` wrapped it. Fail at import, saying
        # how to fix it, rather than with pydantic's unrelated "invalid field type".
        raise ConfigurationError(
            "a handler declaring `ai: AI[...]` reached FastAPI unguarded: the decorators are in "
            "the wrong order. Write @app.post(...) above @guards.route(...), so that the guarded "
            "route is what FastAPI registers"
        )

    @property
    def requested_model(self) -> str:
        """The chain's first model: what the route asks for before any fallback."""
        return self._route.model

    @property
    def resumed_steps(self) -> tuple[str, ...]:
        """The steps `step` loaded from the request's task instead of calling, in order."""
        task = self._task()
        return task.resumed if task is not None else ()

    def _task(self) -> TaskRun | None:
        """The task the request holds (see `guards._tasks`), if any."""
        task: TaskRun | None = self._request.scope.get(TASK_SCOPE) if self._request is not None else None
        return task

    async def run(self, inputs: Mapping[str, Any]) -> T:
        """Call the route's models with Workers-AI-shaped `inputs` (`messages` or `prompt`).

        Walks the chain: a model cooling down or behind an open breaker is skipped without a
        call; a failure moves to the next model (after a bounded retry of transient ones);
        the whole walk has one deadline, and the request at most `attempt_budget` calls
        (shared by every `run` and `stream` of the request). JSON mode is
        requested from the output type when it is not a string, and the route's `max_tokens`
        when the inputs do not set it. Raises `GuardTripped` when a guard refuses the call
        or rejects its answer.
        """
        route = self._route
        if route.effort is not None:
            route = self._by_effort(inputs)
        if route.response_format is not None and "response_format" not in inputs:
            inputs = {**inputs, "response_format": route.response_format}
        if route.max_tokens is not None and "max_tokens" not in inputs:
            inputs = {**inputs, "max_tokens": route.max_tokens}
        leg, result, probe, record_success = await self._walk(inputs)
        if record_success or probe is not None or self._hold is not None:
            await self._finish_leg(leg, Outcome.success, probe, record_success)
        else:  # not reported: the next step about the model tells the store (`_step`)
            leg.last_success[0] = self._guards.success_clock()
        # `_served`, inline: every request's path.
        self._served_leg = leg
        self.model = result.model or leg.ref.model
        if leg is not route.legs[0]:
            self.fallback_model = leg.ref.entry
        output = route.output
        value: T = output.check_shape(result) if output.moderation is None else await output.check(result)
        return value

    @overload
    async def step(self, name: str, inputs: Mapping[str, Any]) -> T: ...

    @overload
    async def step(self, name: str, inputs: Mapping[str, Any], *, output: type[S]) -> S: ...

    @overload
    async def step(self, name: str, inputs: Mapping[str, Any], *, output: Any) -> Any: ...

    async def step(self, name: str, inputs: Mapping[str, Any], *, output: Any = _ROUTE_OUTPUT) -> Any:
        """One named step of a multi-step task: `run(inputs)`, validated against `output` (a
        pydantic model, which requests JSON mode, or any type pydantic validates; default: the
        route's `AI[...]` type, with its moderation hook).

        On a route declared with `task=Task()` and a request with an `Idempotency-Key`, a step
        runs at most once per task: its result is saved when it completes, and a later request
        of the task gets it back (validated again; one that no longer validates runs again)
        with no provider call, no attempt and no budget charge, and its name joins
        `resumed_steps`. Otherwise this is `run`. `name`: 1 to 100 printable characters (else
        `ValueError`), unique within the task. Raises `GuardTripped` as `run` does.
        """
        if not 0 < len(name) <= _MAX_STEP_NAME or not name.isprintable():
            raise ValueError(f"a step's name is 1 to {_MAX_STEP_NAME} printable characters")
        guard = self._route.output if output is _ROUTE_OUTPUT else output_guard(output)
        task = self._task()
        if task is not None:
            saved = task.load(name, guard)
            if saved is not None:
                return saved[0]
        value = await self._run_checked(inputs, guard)
        if task is not None:
            await task.save(name, guard, value)
        return value

    async def _run_checked(self, inputs: Mapping[str, Any], output: OutputGuard) -> Any:
        """`run`, its answer validated by `output` (and JSON mode requested for its type).
        `run` keeps its own copy of these lines: it is every request's path, one frame less."""
        route = self._route
        if output.response_format is not None and "response_format" not in inputs:
            inputs = {**inputs, "response_format": output.response_format}
        if route.max_tokens is not None and "max_tokens" not in inputs:
            inputs = {**inputs, "max_tokens": route.max_tokens}
        leg, result, probe, record_success = await self._walk(inputs)
        if record_success or probe is not None or self._hold is not None:
            await self._finish_leg(leg, Outcome.success, probe, record_success)
        else:  # not reported: the next step about the model tells the store (`_step`)
            leg.last_success[0] = self._guards.success_clock()
        self._served(leg, result.model)
        return await output.check(result)

    async def stream(self, inputs: Mapping[str, Any]) -> EventStream:
        """Stream the answer of the route's models to the client (Server-Sent Events, see
        `guards.EventStream` for the events). Return the result from the route.

        Until the first output part (text, reasoning, tool arguments) arrives, this is `run`:
        the chain is walked, failures retry or fall back, and the failed attempts' preamble
        is dropped; when every model fails first, `GuardTripped` is raised (a strict route
        answers a real error status). A stream that completes empty gets one non-streaming
        recovery call to the same model, within the attempt budget. Once output arrives the
        model is fixed: a later failure ends the stream with an `error` event (`stream
        interrupted after output`), never another model and never a replay. The route's
        deadline bounds the wait for the first output; after it, the binding's idle timeout
        (no complete event), and the route's `stream_max_s` (since the request began) and
        `stream_max_chars` (output characters), which end the stream with an `error` event.
        """
        route = self._route
        if route.effort is not None:
            route = self._by_effort(inputs)
        if route.max_tokens is not None and "max_tokens" not in inputs:
            inputs = {**inputs, "max_tokens": route.max_tokens}
        leg, opened, probe, record_success = await self._walk(
            inputs, lambda leg: functools.partial(open_stream, self._streaming(leg))
        )
        if opened.committed:
            self._served(leg, opened.model)
            return self._relayed(leg, opened, probe, record_success)
        # Complete, and nothing in it: the model answered, just not with anything.
        end = opened.end
        if end is not None and end.finish_reason == "content_filter":
            await self._finish_leg(leg, Outcome.success, probe, record_success)
            self._served(leg, opened.model)
            raise GuardTripped(
                Reason.moderation_blocked, "the provider filtered the stream", model=leg.ref.key
            )
        result = await self._recover(leg, inputs, probe, record_success)
        text = await route.output.check(result)
        self._served(leg, result.model)
        recovered = Opened(
            iter_events=no_events(),
            first=[TextDelta(str(text))],
            end=StreamEnd(finish_reason="stop", usage=result.usage, model=result.model),
            started=time.perf_counter(),
        )
        return self._relayed(leg, recovered, None, False, recorded=True)

    @overload
    async def _walk(self, inputs: Mapping[str, Any]) -> tuple[Leg, AIResult, float | None, bool]: ...

    @overload
    async def _walk(
        self, inputs: Mapping[str, Any], call_for: Callable[[Leg], Call[R]]
    ) -> tuple[Leg, R, float | None, bool]: ...

    async def _walk(
        self, inputs: Mapping[str, Any], call_for: Callable[[Leg], Call[Any]] | None = None
    ) -> tuple[Leg, Any, float | None, bool]:
        """Walk the chain until a call succeeds: (its leg, its result, the leg's breaker probe
        ticket, whether its success must be recorded). `call_for(leg)` is what makes one
        attempt on a leg: `call(model, inputs)` (default: the leg's binding's `run`). The
        caller records the outcome and settles the spend; on failure this settles and raises
        `GuardTripped`."""
        route, trace = self._route, self._trace
        if self._notes:
            self._notes.clear()
        self._waits = None
        inflight: Leg | None = None  # the leg being called (its probe ticket: `probe`)
        probe: float | None = None
        last: GuardTripped | None = None
        spent = False  # the request's attempt budget ran out before a leg
        try:
            # One deadline for every leg, attempt and wait. When it passes, the task is
            # cancelled where it awaits: the provider request is aborted, its connection
            # closed, and no further leg is tried (cancellation never moves on). A walk that
            # outlasts MARK_AFTER_S starts watching for the client leaving, which ends it at
            # once the same way (`_start_watch`); quick walks never pay for the watcher.
            on_mark = self._start_watch if self._request is not None else None
            with Deadline(route.timeout_s, on_mark) as scope:
                self._scope = scope
                deadline = scope.when
                try:
                    legs, start, report = route.legs, 0, None
                    count = len(legs)
                    while True:
                        # One store operation: the last call's report, then the next admission.
                        if start < count and self.attempts >= self.attempt_budget:
                            spent, start = True, count  # no further call: report only
                        gone = start < count and self.attempts > 0 and await self._client_gone()
                        if gone or start >= count:
                            # The walk is over: the report settles the spend too.
                            await self._send(self._report_end(report))
                            if gone:
                                raise self._gone_tripped(legs[start])
                            break
                        step = self._step(start, report, inputs)
                        try:
                            passage: Passage | None = await self._guards.store.step(step)
                        except StoreUnavailable:
                            passage = None
                        admitted = self._admitted(start, step, passage)
                        if admitted is None:
                            break
                        index, probe, record_success = admitted
                        leg = legs[index]
                        inflight = leg
                        self._leg = leg
                        call: Call[Any]
                        if call_for is None:  # the leg's binding's `run` (`_binding`, inline)
                            provider = leg.ref.provider
                            guards = self._guards
                            call = (guards.binding if provider is None else guards.providers[provider]).run
                        else:
                            call = call_for(leg)
                        if trace is not None:
                            call = trace.traced(call, self, leg, self._binding(leg))
                        made = self.attempts  # the request's calls before this leg's
                        started = time.perf_counter()
                        try:
                            # The leg's first call, made here; `call_model` only retries a
                            # failure (one coroutine less on every request's path).
                            result = await call(leg.ref.model, inputs)
                        except Exception as error:
                            self._on_attempt(1, error, started)
                            try:
                                result, _ = await call_model(
                                    call,
                                    leg.ref.model,
                                    inputs,
                                    policy=route.retry,
                                    deadline=deadline,
                                    limit=(
                                        self._leg_limit(index, made)
                                        if index + 1 < count
                                        else self.attempt_budget - made  # the last leg's
                                    ),
                                    sleep=self._guards.sleep,
                                    on_attempt=self._on_attempt,
                                    on_retry=self._before_retry,
                                    failed=error,
                                )
                            except CallFailed as failed:
                                inflight = None
                                report, last = await self._leg_down(leg, failed, probe)
                                start = index + 1
                                continue
                        except BaseException as stopped:  # cancelled: it may still be billed
                            self._on_attempt(1, stopped, started)
                            raise
                        else:
                            self._on_attempt(1, result, started)
                        return leg, result, probe, record_success
                finally:
                    if self._watch is not None:
                        self._watch.cancel()
                        self._watch = None
        except TimeoutError as expired:
            leg = inflight if inflight is not None else self._leg
            if self._gone:  # the watcher ended the walk: no verdict on the model
                if inflight is not None:
                    await self._record(leg, Outcome.released, probe)
                await self._settle()
                raise self._gone_tripped(leg) from None
            # A call that spent its deadline waiting for a connection: no verdict on the model.
            queued = waited_for_admission(expired)
            if inflight is not None:
                await self._record(leg, Outcome.released if queued else Outcome.failure, probe)
            await self._settle()
            raise self._timed_out(leg, never_admitted(expired)) from None
        except GuardTripped:
            # A budget refusal (before any call) or the client gone: no verdict on the model.
            if inflight is not None:
                await self._record(inflight, Outcome.released, probe)
            await self._settle()
            raise
        except BaseException:
            # Cancelled from outside (server stopping): no verdict on the model, but a probe
            # slot must be freed and the spend settled, shielded from the cancellation.
            with anyio.CancelScope(shield=True):
                if inflight is not None:
                    await self._record(inflight, Outcome.released, probe)
                await self._settle()
            raise
        await self._settle()
        raise self._exhausted(last, spent)

    def _by_effort(self, inputs: Mapping[str, Any]) -> GuardedRoute:
        """Effort routing (`_effort.py`): the request's first call picks its tier's chain, which
        every later call of the request keeps."""
        assert self._route.effort is not None
        route = self._route = self._route.effort.choose(inputs, self._request, self.trace_id)
        self._leg, self.attempt_budget = route.legs[0], route.attempt_budget
        return route

    def _start_watch(self) -> None:
        """MARK_AFTER_S into a walk: watch the client."""
        assert self._scope is not None
        self._watch = asyncio.get_running_loop().create_task(self._watch_client(self._scope))

    async def _watch_client(self, scope: Deadline) -> None:
        """Wait for the client to disconnect, then end the walk now (see `_walk`)."""
        assert self._request is not None
        receive = self._request.receive
        while (await receive())["type"] != "http.disconnect":
            pass
        self._gone = True
        scope.expire()

    async def _client_gone(self) -> bool:
        """Whether the client disconnected (checked before a further model, without waiting)."""
        if not self._gone and self._request is not None:
            self._gone = await self._request.is_disconnected()
        return self._gone

    def _timed_out(self, leg: Leg, never_sent: bool = False) -> GuardTripped:
        waited = "no free connection to the provider" if never_sent else "no answer"
        return GuardTripped(
            Reason.timeout,
            f"{waited} within {self._route.timeout_s:g}s",
            kind=Kind.model_temporarily_unavailable,
            attempts=self.attempts,
            model=leg.ref.key,
        )

    def _gone_tripped(self, leg: Leg) -> GuardTripped:
        return GuardTripped(
            Reason.provider_error,
            "the client disconnected: the call was cancelled, no further model was tried",
            kind=Kind.cancelled,
            attempts=self.attempts,
            model=leg.ref.key,
        )

    async def _finish_leg(
        self, leg: Leg, outcome: Outcome, probe: float | None, record_success: bool
    ) -> None:
        """Record the serving leg's outcome and settle the request's spend."""
        if outcome is Outcome.success:
            leg.last_success[0] = self._guards.success_clock()
        if outcome is not Outcome.success or record_success or probe is not None:
            await self._record(leg, outcome, probe)
        if self._hold is not None:
            await self._settle()

    def _served(self, leg: Leg, model: str | None) -> None:
        self._served_leg = leg
        self.model = model or leg.ref.model
        if leg is not self._route.legs[0]:
            self.fallback_model = leg.ref.entry

    def _streaming(self, leg: Leg) -> StreamingBinding:
        binding = self._binding(leg)
        if not isinstance(binding, StreamingBinding):
            raise ConfigurationError(f"the binding for {leg.ref.key} cannot stream")
        return binding

    async def _recover(
        self, leg: Leg, inputs: Mapping[str, Any], probe: float | None, record_success: bool
    ) -> AIResult:
        """One non-streaming call to `leg` after an empty stream (within the attempt budget)."""
        if self.attempts >= self.attempt_budget:
            await self._finish_leg(leg, Outcome.success, probe, record_success)
            raise GuardTripped(Reason.empty_response, "the stream completed empty", model=leg.ref.key)
        call: Call[AIResult] = self._binding(leg).run
        if self._trace is not None:
            call = self._trace.traced(call, self, leg, self._binding(leg), retry=True)
        assert self._scope is not None  # the walk's
        deadline = self._scope.when
        try:
            async with asyncio.timeout_at(deadline):
                result, _ = await call_model(
                    call,
                    leg.ref.model,
                    inputs,
                    policy=self._route.retry,
                    deadline=deadline,
                    limit=1,
                    on_attempt=self._on_attempt,
                )
        except CallFailed as failed:
            await self._finish_leg(leg, Outcome.failure, probe, record_success)
            raise self._leg_failed(leg, failed) from None
        except TimeoutError:
            await self._finish_leg(leg, Outcome.failure, probe, record_success)
            raise self._timed_out(leg) from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._finish_leg(leg, Outcome.released, probe, record_success)
            raise
        await self._finish_leg(leg, Outcome.success, probe, record_success)
        return result

    def _relayed(
        self, leg: Leg, opened: Opened, probe: float | None, record_success: bool, *, recorded: bool = False
    ) -> EventStream:
        """The response relaying a committed attempt (see `guards._relay`); when it ends, the
        attempt (ledger, metrics), the breaker outcome, the spend and the request's outcome
        are recorded, however it ends."""

        async def ended(relayed: Relayed) -> None:
            self._stream_done(leg, opened, relayed.kind, relayed.end, relayed.delivered, recorded)
            await self._finish_leg(leg, relayed.outcome, probe, record_success)
            failure = relayed.failure
            if relayed.stopped:
                # Cut by the server stopping (`stop_streams`), not by its client leaving.
                finish_request(
                    self._route, self, self._started, "error", 200, tripped=failure, cut="shutdown"
                )
            elif relayed.outcome is Outcome.released:
                finish_request(self._route, self, self._started, "cancelled", 200)
            else:
                outcome = "error" if failure is not None else "ok"
                finish_request(self._route, self, self._started, outcome, 200, tripped=failure)

        route = self._route
        if self._trace is not None:
            self._trace.streaming = True  # the request's span ends with the stream
        # The stream's time limit counts from the request's start, in event-loop time.
        left_s = route.stream_max_s - (time.perf_counter() - self._started)
        return EventStream(
            relay(
                opened,
                provider=leg.ref.provider or "provider",
                model=leg.ref.key,
                deadline=asyncio.get_running_loop().time() + left_s,
                max_s=route.stream_max_s,
                max_chars=route.stream_max_chars,
                done=self._done_data,
                error=self._error_data,
                ended=ended,
                writer=route.stream_format.writer(),
            ),
            route.stream_format.headers,
        )

    def _stream_done(
        self, leg: Leg, opened: Opened, kind: str, end: StreamEnd | None, delivered: int, recorded: bool
    ) -> None:
        """Account for the committed stream attempt once it ended (its ledger record)."""
        if self._trace is not None:
            self._trace.stream_ended(opened, kind, end, delivered)
        if not recorded:
            usage = end.usage if end is not None else None
            served = (end.model if end is not None else None) or opened.model or leg.ref.model
            self._account(
                leg,
                kind,
                usage,
                served,
                time.perf_counter() - opened.started,
                billed=True,
                delivered=delivered,
            )

    def _done_data(self, end: StreamEnd | None) -> dict[str, Any]:
        if end is not None and end.model:
            self.model = end.model  # the provider names the model that served at the end
        detailed = self._guards.attribution == "detailed"
        data = end_data(end)
        data.update(
            model=self.model if detailed else None,
            fallback_model=(
                self.fallback_model
                if detailed
                else (self.fallback_model is not None if self._guards.attribution == "redacted" else None)
            ),
            attempts=self.attempts,
            trace_id=self.trace_id,
        )
        return data

    def _error_data(self, tripped: GuardTripped) -> dict[str, Any]:
        return {
            "guard": tripped.guard.value,
            "reason": tripped.reason.value,
            "detail": tripped.detail,
            "trace_id": self.trace_id,
        }

    def _binding(self, leg: Leg) -> Binding:
        provider = leg.ref.provider
        return self._guards.binding if provider is None else self._guards.providers[provider]

    def _leg_limit(self, index: int, made: int) -> int:
        """Calls a leg with later legs may make, when the request made `made` before it: what
        the budget has left, minus one for each later leg that is not cooling down (so a retry
        never starves the fallbacks)."""
        left = self.attempt_budget - made
        waits = self._waits
        if waits is None:
            reserved = len(self._route.legs) - index - 1
        else:
            reserved = sum(1 for wait in waits[index + 1 :] if wait <= 0)
        return max(1, left - reserved)

    def _skip(self, leg: Leg, why: str, wait_s: float | None) -> None:
        self._notes.append((leg, f"skipped ({why})", wait_s))
        counter(SKIPS, leg.ref.key, why).add()
        if self._trace is not None:
            self._trace.skipped(leg.ref.key, why, wait_s)
        emit(
            "skip",
            route=self._route.name,
            trace_id=self.trace_id,
            model=leg.ref.key,
            reason=why,
            retry_after_s=round(wait_s, 3) if wait_s is not None else None,
        )

    def _step(self, start: int, report: Report | None, inputs: Mapping[str, Any]) -> Step:
        """The walk's next store operation (`Store.step`): apply `report` (the last call's
        outcome), then admit the first leg from `start` that is not cooling down and whose
        breaker lets it through, charging the request's budget on its first admission."""
        route, first = self._route, self._first
        charge = None
        if first is not None and not self._charged:
            if not start and report is None and first.legs is route.step_legs and not route.spend_capped:
                return first  # the route's own, the same every request (of this caller)
            # What the request's first admission pays: rate, daily cap, and its worst-case spend.
            charge = first.charge
            if charge is not None and route.spend_capped:
                self._tokens = tokens = input_tokens_bound(inputs)
                legs = route.legs
                spend = max(_worst(leg, tokens, route.max_tokens) for leg in legs) * self.attempt_budget
                charge = dataclasses.replace(charge, spend=spend, hold_s=2 * route.timeout_s + 60)
        return walk_step(route, start, report, charge)

    def _admitted(
        self, start: int, step: Step, passage: Passage | None
    ) -> tuple[int, float | None, bool] | None:
        """What the store answered to `step` (`_step`; None: the store was unavailable). Logs
        each leg skipped. Returns (the admitted leg's index, its probe ticket, whether its
        success must be recorded), or None when no leg is admitted; raises `GuardTripped`
        when the budget refuses."""
        route = self._route
        legs = route.legs
        report, charge = step.report, step.charge
        if passage is None:
            self._report_lost(report)
            # Each guard its own failure mode: cooldowns only spare a provider that asked for a
            # pause (try the models); the breaker and the budget as configured (raises if closed).
            self._warn_store("cooldown", mode="open")
            STORE_UNAVAILABLE.labels(guard="cooldown", action="open").inc()
            if route.breaker is not None:
                self._store_failed("breaker", route.breaker.on_store_failure)
            if charge is not None and route.budget is not None:
                self._store_failed("budget", route.budget.on_store_failure)
                self._charged = True
            return start, None, False
        if passage.plain:  # the usual answer (`Passage.plain`): the first leg from `start`
            if charge is not None:
                self._charged = True
            if self._waits is not None:
                self._waits[start:] = passage.waits
            if route.breaker is not None and legs[start].last_state[0] is not CircuitState.closed:
                legs[start].saw(CircuitState.closed)
            return (start, None, False) if start else _FIRST_ADMITTED
        if passage.recorded is not None and report is not None:
            self._saw_report(report, passage.recorded.state)
        if passage.transitions:
            self._saw_transitions(passage.transitions)
        waits, decisions = passage.waits, passage.decisions
        if len(legs) > 1:  # only a leg with later legs reads the waits (`_leg_limit`)
            if self._waits is None:
                self._waits = [0.0] * len(legs)
            self._waits[start:] = waits
        for offset, wait in enumerate(waits):
            leg = legs[start + offset]
            if wait > 0:
                self._skip(leg, "cooldown", wait)
                continue
            decision = decisions[offset] if offset < len(decisions) else None
            if decision is not None:
                if decision.state is not leg.last_state[0]:
                    leg.saw(decision.state)
                if not decision.allowed:
                    self._skip(leg, "circuit_open", decision.retry_after_s)
                    continue
            break  # the leg admitted, or the one whose charge was refused
        if passage.refusal is not None:
            assert route.budget is not None
            raise budget_refusal(route.budget, passage.refusal)
        if charge is not None:
            self._charged = True
            self._hold = passage.reservation
        admitted = passage.admitted
        if admitted is None:
            return None
        decision = decisions[admitted] if admitted < len(decisions) else None
        if decision is None:
            return start + admitted, None, False
        return start + admitted, decision.probe, decision.record_success

    async def _settle(self) -> None:
        """Replace the spend hold by what the calls cost (see `_on_attempt`)."""
        await self._send(self._report_end(None))

    def _on_attempt(self, attempt: int, outcome: Any, started: float) -> None:
        """Count one provider call: attempts, metrics, the usage ledger and its cost. A stream
        that reached its first output is accounted for when it ends (see `_relayed`). A call
        cancelled while waiting for a connection never left: it is not one."""
        elapsed = time.perf_counter() - started
        leg = self._leg
        if type(outcome) is AIResult and leg.price is None and not self._guards.ledger_enabled():
            # The usual success, counted in place (what `_account` does with no price and no
            # ledger record): every request's path.
            self.attempts += 1
            leg.seconds.observe(elapsed)
            leg.attempts["ok"].count += 1
            usage = outcome.usage
            if usage is not None:
                leg.input_tokens.count += usage.prompt_tokens
                leg.output_tokens.count += usage.completion_tokens
            return
        if isinstance(outcome, BaseException) and never_admitted(outcome):
            return
        self.attempts += 1
        if isinstance(outcome, AIResult):
            self._account(leg, "ok", outcome.usage, outcome.model or leg.ref.model, elapsed, billed=True)
        elif isinstance(outcome, Opened):
            if not outcome.committed:  # complete and empty: accounted now
                end = outcome.end
                usage = end.usage if end is not None else None
                self._account(leg, "ok", usage, outcome.model or leg.ref.model, elapsed, billed=True)
        else:
            # Billed unless the provider refused the call: a timeout, a cancelled call, any
            # failure that is not a provider's error answer, JSON mode not met.
            provider_error = isinstance(outcome, ProviderError)
            billed = not provider_error or outcome.json_mode_failed
            self._account(
                leg,
                classify(outcome).kind.value,
                None,
                None,
                elapsed,
                billed=billed,
                status=outcome.status if provider_error else None,
                code=outcome.code if provider_error else None,
            )

    def _account(
        self,
        leg: Leg,
        kind: str,
        usage: Usage | None,
        served: str | None,
        elapsed: float,
        *,
        billed: bool,
        delivered: int | None = None,
        status: int | None = None,
        code: int | None = None,
    ) -> None:
        route = self._route
        leg.seconds.observe(elapsed)
        leg.attempts[kind].add()  # a failure kind's tally also stamps its time (the status page)
        # Plain tallies counted in place (`Tally.add` is this, a call dearer): every request's path.
        if usage is not None:
            leg.input_tokens.count += usage.prompt_tokens
            leg.output_tokens.count += usage.completion_tokens
        if leg.price is not None:
            # Usage when known; else (spend cap only) the worst case when the provider may
            # have billed. The cost metric counts reported usage only.
            if usage is not None:
                cost = leg.price.cost(usage.prompt_tokens, usage.completion_tokens)
                self._cost += cost
                if leg.cost_usd is not None:
                    leg.cost_usd.add(cost * self._guards.cost_unit_usd)
            elif billed and route.spend_capped:
                self._cost += _worst(leg, self._tokens, route.max_tokens)
        if self._guards.ledger_enabled():
            self._guards.ledger.record(
                Attempt(
                    trace_id=self.trace_id,
                    route=route.name,
                    attempt=self.attempts,
                    requested_model=route.model,
                    model=leg.ref.key,
                    entry=leg.ref.entry,
                    served_model=served,
                    outcome=kind,
                    latency_ms=round(elapsed * 1000, 2),
                    usage=usage,
                    delivered_chars=delivered,
                    status=status,
                    code=code,
                    resumed_steps=self.resumed_steps if route.task is not None else (),
                )
            )

    async def _leg_down(
        self, leg: Leg, failed: CallFailed, probe: float | None
    ) -> tuple[Report | None, GuardTripped]:
        """A leg gave up: what the next store step reports of it, and its failure."""
        tripped = self._leg_failed(leg, failed)
        await self._guards.credential_warnings.failed(self._guards.store, leg.ref.key, failed.error)
        # JSON mode not met: the model answered, just not in shape.
        json_mode = getattr(failed.error, "json_mode_failed", False)
        outcome = Outcome.success if json_mode else Outcome.failure
        cool_s, until = 0.0, None
        if failed.verdict.kind in _COOLDOWN_KINDS:
            cool_s = self._guards.cooldown_for(leg.ref.key).seconds(failed.error)
            # A provider's date ends it by the store's clock, not this worker's.
            until = getattr(failed.error, "retry_at", None)
        return self._report(leg, outcome, probe, cool_s, until, settle=False), tripped

    def _leg_failed(self, leg: Leg, failed: CallFailed) -> GuardTripped:
        error = failed.error
        what = error.describe() if isinstance(error, ProviderError) else type(error).__name__
        times = f" x{failed.attempts}" if failed.attempts > 1 else ""
        self._notes.append((leg, failed.verdict.kind.value + times, None))
        if isinstance(error, ProviderError) and error.json_mode_failed:
            self._served(leg, None)  # the model answered, just not in the shape asked for
            return GuardTripped(
                Reason.schema_invalid,
                f"JSON mode could not be met ({what})",
                attempts=self.attempts,
                model=leg.ref.key,
            )
        # The provider's wait, at most the model's `Cooldown.max_s`: never repeated as is.
        cooldown = self._guards.cooldown_for(leg.ref.key)
        wait = cooldown.wait(error.retry_after_s) if isinstance(error, ProviderError) else None
        if failed.verdict.kind in _COOLDOWN_KINDS:
            # A known wait is always sent: the model's cooldown (the provider's wait, capped,
            # else the default), or the provider's own wait when longer (see public_error).
            wait = max(wait or 0.0, cooldown.seconds(error))
        return GuardTripped(
            Reason.provider_error,
            f"{failed.verdict.kind.value} after {failed.attempts} attempt(s): {what}",
            kind=failed.verdict.kind,
            attempts=self.attempts,
            retry_after_s=wait,
            model=leg.ref.key,
        )

    def _exhausted(self, last: GuardTripped | None, spent: bool) -> GuardTripped:
        """No leg answered: the last failure; else the attempt budget, when an earlier call of
        the request spent it; else `circuit_open` (every leg was skipped)."""
        legs = self._route.legs
        if last is not None and len(legs) == 1:
            return last
        summary = self._summary(self._guards.attribution == "detailed")
        if last is None and spent:
            return GuardTripped(
                Reason.provider_error,
                f"the request's attempt budget of {self.attempt_budget} provider calls is spent",
                kind=Kind.model_unavailable,
                attempts=self.attempts,
                model=legs[0].ref.key,
            )
        if last is None:
            waits = [wait for _, _, wait in self._notes if wait is not None]
            return GuardTripped(
                Reason.circuit_open,
                f"every model was skipped: {summary}",
                retry_after_s=min(waits) if waits else None,
                model=legs[0].ref.key,
            )
        return GuardTripped(
            last.reason,
            f"every model failed: {summary}",
            kind=last.kind,
            attempts=self.attempts,
            retry_after_s=last.retry_after_s,
            model=last.model,
        )

    def _summary(self, detailed: bool) -> str:
        """Each model tried or skipped by the last `run`, and how it ended; model ids when
        `detailed` (else `model 1`, `model 2`...). Bounded, no provider text."""
        index = {id(leg): n for n, leg in enumerate(self._route.legs, 1)}
        parts = [
            f"{leg.ref.key if detailed else f'model {index[id(leg)]}'}: {what}"
            for leg, what, _ in self._notes
        ]
        text = "; ".join(parts)
        return text if len(text) <= _SUMMARY_MAX else text[: _SUMMARY_MAX - 3] + "..."

    def _report(
        self,
        leg: Leg,
        outcome: Outcome,
        probe: float | None,
        cool_s: float = 0.0,
        cool_until: float | None = None,
        *,
        settle: bool,
    ) -> Report | None:
        """What the next store step reports of a call to `leg`: its breaker outcome (a
        released call without a probe changes nothing), its cooldown, and (`settle`, at the
        walk's end) the spend. None when there is nothing to report."""
        breaker = self._route.breaker
        record = breaker is not None and (probe is not None or outcome is not Outcome.released)
        ended = leg.last_success[0] if record else None
        report: Report | None = Report(
            breaker_key=leg.breaker_key if record else None,
            breaker=breaker if record else None,
            outcome=outcome,
            probe=probe,
            success_age=None if ended is None else self._guards.success_clock() - ended,
            cooldown_key=leg.cooldown_key if cool_s > 0 else None,
            cooldown_s=cool_s,
            cooldown_until=cool_until if cool_s > 0 else None,
        )
        report = self._report_end(report) if settle else report
        if report is None or report.breaker_key is report.cooldown_key is report.spend_key is None:
            return None  # nothing to report
        return report

    def _report_end(self, report: Report | None) -> Report | None:
        """`report` with the spend settled too (the walk is over), if the request holds spend."""
        charge = self._first.charge if self._first is not None else None
        if self._hold is None or charge is None:
            return report
        reservation, self._hold = self._hold, None
        key = charge.key
        if report is None:
            return Report(spend_key=key, reservation=reservation, actual=self._cost)
        return dataclasses.replace(report, spend_key=key, reservation=reservation, actual=self._cost)

    async def _record(self, leg: Leg, outcome: Outcome, probe: float | None) -> None:
        """Report the end of a call to `leg` (and settle the spend) in one store operation."""
        await self._send(self._report(leg, outcome, probe, settle=True))

    async def _send(self, report: Report | None) -> None:
        """A step that only reports (nothing to report: no store operation)."""
        if report is None:
            return
        try:
            passage = await self._guards.store.step(Step(report=report))
        except StoreUnavailable:
            self._report_lost(report)
            return
        if passage.recorded is not None:
            self._saw_report(report, passage.recorded.state)
        if passage.transitions:
            self._saw_transitions(passage.transitions)

    def _saw_transitions(self, transitions: Sequence[tuple[str, CircuitState]]) -> None:
        """Count the breaker state changes a store step made (the store tells exactly one
        caller of each, so every worker together counts each once)."""
        for key, state in transitions:
            for leg in self._route.legs:
                if leg.breaker_key == key:
                    leg.transitions[state].add()
                    break

    def _saw_report(self, report: Report, state: CircuitState) -> None:
        """After a step's report: the breaker state it recorded, and the cooldown it started."""
        for leg in self._route.legs:
            if leg.breaker_key == report.breaker_key:
                leg.saw(state)
                break
        if report.cooldown_key is not None:
            model = next(leg.ref.key for leg in self._route.legs if leg.cooldown_key == report.cooldown_key)
            emit(
                "cooldown",
                route=self._route.name,
                trace_id=self.trace_id,
                model=model,
                seconds=round(report.cooldown_s, 3),
            )

    def _report_lost(self, report: Report | None) -> None:
        """The store did not take a report: each part is lost, and said so. A lost probe's
        slot is reclaimed after the reset timeout; a lost hold lapses by itself."""
        if report is None:
            return
        if report.breaker_key is not None:
            self._warn_store("breaker", op="breaker_record")
            STORE_UNAVAILABLE.labels(guard="breaker", action="breaker_record").inc()
        if report.cooldown_key is not None:
            self._warn_store("cooldown", op="start_cooldown")
            STORE_UNAVAILABLE.labels(guard="cooldown", action="start_cooldown").inc()
        if report.spend_key is not None:
            self._warn_store("budget", op="settle_spend")
            STORE_UNAVAILABLE.labels(guard="budget", action="settle_spend").inc()

    def _store_failed(self, guard: str, mode: str) -> None:
        """The store did not answer a guard's check: admit (fail open) or refuse (fail closed)."""
        self._warn_store(guard, mode=mode)
        STORE_UNAVAILABLE.labels(guard=guard, action=mode).inc()
        if mode == "closed":
            raise GuardTripped(
                Reason.circuit_open,
                f"the {guard} guard's store is unavailable: calls are paused",
                retry_after_s=STORE_RETRY_AFTER_S,
                model=self._route.model,
            )

    def _warn_store(self, guard: str, **fields: str) -> None:
        emit_warning(
            "store_unavailable", guard=guard, route=self._route.name, trace_id=self.trace_id, **fields
        )

    def _before_retry(self, attempt: int, verdict: Classification, delay_s: float) -> bool:
        """Before a retry the policy allows: False when the model's retry budget refuses it
        (`_retry_budget.py` logs the refusal), else log the retry."""
        route = self._route
        windows, budget = self._guards.retry_windows, route.retry.budget
        if not admit_retry(
            windows, self._leg, budget, verdict, attempt, route=route.name, trace_id=self.trace_id
        ):
            return False
        emit(
            "retry",
            route=self._route.name,
            trace_id=self.trace_id,
            model=self._leg.ref.key,
            attempt=attempt,
            kind=verdict.kind.value,
            delay_ms=round(delay_s * 1000, 1),
        )
        return True


def walk_step(route: GuardedRoute, start: int, report: Report | None, charge: Charge | None) -> Step:
    """A store step of `route`'s walk (see `Store.step`): `report` first, then the admission of
    the first leg from `start` that may be called, paying `charge` if any. Each step about a
    model carries how long ago this process's last success on it ended (`SuccessAges`), so a
    success that was not reported (a closed breaker's, admitted with no failure counted) still
    ends the failures counted while it ran: exactly within this process, at its next step for
    others."""
    ages = route.success_ages if route.breaker is not None else ()
    if start:
        return Step(report, route.step_legs[start:], route.breaker, charge, ages[start:])
    return Step(report, route.step_legs, route.breaker, charge, ages)


#: `_admitted`'s usual answer: the first leg, no probe, no success to record.
_FIRST_ADMITTED: tuple[int, float | None, bool] = (0, None, False)


def _worst(leg: Leg, input_tokens: int, max_tokens: int | None) -> float:
    """What one call to `leg` may cost at most."""
    return leg.price.cost(input_tokens, max_tokens or 0) if leg.price is not None else 0.0


def finish_request(
    route: GuardedRoute,
    ai: AI[Any],
    started: float,
    outcome: str,
    status: int,
    *,
    tripped: GuardTripped | None = None,
    error: ErrorCode | None = None,
    **extra: Any,
) -> None:
    """Count a request's outcome and latency, and write its one log line (skipped cheaply
    when INFO is off)."""
    now = time.perf_counter()
    elapsed = now - started
    metrics = route.metrics
    metrics.seconds.observe(elapsed)
    if outcome == "ok":
        metrics.ok.count += 1  # `Tally.add`, in place: every request's path
        served = ai._served_leg
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
    if ai._trace is not None:
        # The one place the request span learns its outcome, and the level it was served at.
        level = ai._guards.levels.view.level.value
        ai._trace.finish(outcome, status, tripped, error, ai.attempts, service_level=level)
    if not logger.isEnabledFor(logging.INFO):
        return
    emit(
        "request",
        route=route.name,
        trace_id=ai.trace_id,
        outcome=outcome,
        status=status,
        error=error.value if error is not None else None,
        guard=tripped.guard.value if tripped is not None else None,
        reason=tripped.reason.value if tripped is not None else None,
        kind=tripped.kind.value if tripped is not None and tripped.kind is not None else None,
        attempts=ai.attempts,
        attempt_budget=ai.attempt_budget,
        model=(tripped.model if tripped is not None else None) or ai.model,
        fallback_model=ai.fallback_model,
        legs=(ai._summary(True) or None) if tripped is not None and len(ai._route.legs) > 1 else None,
        resumed_steps=(list(ai.resumed_steps) or None) if route.task is not None else None,
        latency_ms=round(elapsed * 1000, 2),
        **extra,
    )
