"""`AI`: one request's guarded access to its route's models, the handle a handler is given.

`run`, `step` and `stream` compose the stages of the request path, each a module of this
package: the chain walk (`_chain_walk`), the store steps (`_store_steps`), accounting,
retries, the verdicts, the streaming tail and a task's checkpoints. The handle holds the
request's state (`RequestState`) and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from ..contracts._errors import ConfigurationError, GuardTripped
from ..contracts._output import INVALID_UNICODE, OutputGuard, output_guard
from ..contracts._stream import StreamEnd, TextDelta
from ..contracts._tokens import with_max_tokens
from ..contracts._vocabulary import Reason
from ..stores._breaker import Outcome
from ..streams._event_stream import EventStream
from ..streams._relay import Opened, no_events
from ._chain_walk import by_effort, walk
from ._checkpoints import resumed, task_of
from ._state import RequestState
from ._store_steps import finish_leg
from ._streaming import HoldCheck, kept, opener, recover, relayed

if TYPE_CHECKING:
    from ..contracts._tools import ToolCall

__all__ = ["AI"]

T = TypeVar("T")
S = TypeVar("S")
_ROUTE_OUTPUT: Any = object()
#: The longest name of a task's step (the handler's own text, kept in the store).
_MAX_STEP_NAME = 100


class AI(RequestState, Generic[T]):
    """One request's guarded access to its route's models.

    Declare it as a parameter of a guarded route (`ai: AI[OutputModel]`); the decorator fills it.
    `run` passes the budget, call and output guards and returns the validated output, or raises
    `GuardTripped`. After a call: `model` is the model that served (as the provider named it),
    `fallback_model` the chain entry that served when it was not the first (else None),
    `attempts` the provider calls made and `attempt_budget` the most it could make;
    `trace_id` is the request's trace id (also the `x-trace-id` header); `resumed_steps` the
    names of the steps `step` loaded from the request's task instead of calling, in order;
    `tool_calls` the last answer's validated tool calls, on a route that declares its tools;
    `usage` the tokens the request's calls reported, summed, and `cost` what its calls cost.
    A stream's calls are counted when it ends: read them in a `BackgroundTask` set on the
    stream (`stream.background`), which runs once it ended.
    """

    __slots__ = ()

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
    def cost(self) -> float | None:
        """What the request's calls cost so far, in the units of `Guards(prices=...)`: each
        call that reported its usage, by its model's price; one that reported none counts
        nothing, except under a spend cap, which charges it at its worst case when the provider
        may have billed it. None when the app prices no model."""
        return self._cost if self._shared.prices else None

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls of the last answer, on a route that declares its tools
        (`route(tools=...)`): each validated against its tool's model (`ToolCall.arguments` is
        an instance of it); () when the answer called none, or the route declares no tools."""
        answered = getattr(self, "_answered", None)
        return () if answered is None else answered.tool_calls

    @property
    def resumed_steps(self) -> tuple[str, ...]:
        """The steps `step` loaded from the request's task instead of calling, in order."""
        return resumed(self._request)

    async def run(self, inputs: Mapping[str, Any]) -> T:
        """Call the route's models with Workers-AI-shaped `inputs` (`messages` or `prompt`).

        Walks the chain: a model cooling down or behind an open breaker is skipped without a
        call; a failure moves to the next model (after a bounded retry of transient ones);
        the whole walk has one deadline (the request's first walk's counts from the request's
        arrival, a later one's from its start), and the request at most `attempt_budget` calls
        (shared by every `run` and `stream` of the request). JSON mode is
        requested from the output type when it is not a string. The call's `max_tokens` is
        the inputs' when it is a number of tokens (an integral float is sent as an int), at
        most 1,000,000 (a larger one is capped), else the route's: what is sent is what the
        budgets hold. Raises `GuardTripped` when a guard refuses the call
        or rejects its answer (on a route with `on_rejected`, when no model's answer was
        accepted: see `guards.walk._rejected`).
        """
        route = self._route
        if route.effort is not None:
            route = by_effort(self, inputs)
        elif route.downgrade is not None and not self._charged:
            route = route.downgrade.choose(self)
        if route.deployments is not None:  # each group's deployments, in this walk's order
            route = route.deployments.choose(self)
        if route.response_format is not None and "response_format" not in inputs:
            inputs = {**inputs, "response_format": route.response_format}
        inputs = with_max_tokens(inputs, route.max_tokens)
        if route.answers is not None:  # rejected answers move on, or tools (`_rejected`)
            checked: T = await route.answers.run(self, inputs, route.output)
            return checked
        leg, result, probe, record_success = await walk(self, inputs)
        if record_success or probe is not None or self._hold is not None:
            await finish_leg(self, leg, Outcome.success, probe, record_success)
        else:  # not reported: the next step about the model tells the store
            leg.last_success[0] = self._shared.success_clock()
        # `served`, inline: every request's path.
        self._served_leg = leg
        self.model = result.model or leg.ref.model
        if not leg.leads:  # (a deployment of the first entry's group leads too)
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
        task = task_of(self._request)
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
        if route.deployments is not None:
            route = route.deployments.choose(self)
        if output.response_format is not None and "response_format" not in inputs:
            inputs = {**inputs, "response_format": output.response_format}
        inputs = with_max_tokens(inputs, route.max_tokens)
        if route.answers is not None:
            return await route.answers.run(self, inputs, output)
        leg, result, probe, record_success = await walk(self, inputs)
        if record_success or probe is not None or self._hold is not None:
            await finish_leg(self, leg, Outcome.success, probe, record_success)
        else:  # not reported: the next step about the model tells the store
            leg.last_success[0] = self._shared.success_clock()
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
        deadline bounds the wait for the first output, and a model's `first_output_s` its own
        attempt's wait (then the next model is tried); after it, the binding's idle timeout
        (no complete event) and the model's `stream_idle_s` (no next part), and the route's
        `stream_max_s` (since the request began) and `stream_max_chars` (output characters),
        which end the stream with an `error` event. A lone surrogate in the events up to the
        first output rejects the answer (`schema_invalid`, `answer: invalid_unicode`), as in a
        whole answer; after it, one is sent as U+FFFD.

        On a route typed with a JSON output (`AI[YourModel]`: a structured stream), JSON mode
        is requested as `run` requests it, the JSON text is relayed as it comes, and the whole
        text is checked by the output guard once it completed: `done` carries the validated
        output (`object`), a rejected answer ends the stream with the guard's `error`
        (`schema_invalid`, `empty_response`).

        With the route's `stream_hold`, the commit point is the hold's end: the answer's start
        is read but not sent, the output guard checks it (an empty answer, the moderation hook,
        a provider's content filter), and a rejected one moves on to the next model, unseen.
        A model's `min_chars_per_s` (or the route's) moves a stream slower than it on to the
        next model before the commit, measured over the hold, else over the first second after
        its first output. See docs/streaming.md.
        """
        route = self._route
        if route.effort is not None:
            route = by_effort(self, inputs)
        elif route.downgrade is not None and not self._charged:
            route = route.downgrade.choose(self)
        if route.deployments is not None:  # each group's deployments, in this walk's order
            route = route.deployments.choose(self)
        if route.response_format is not None and "response_format" not in inputs:  # structured
            inputs = {**inputs, "response_format": route.response_format}
        inputs = with_max_tokens(inputs, route.max_tokens)
        check = HoldCheck(inputs) if route.stream_hold is not None else None
        leg, opened, probe, record_success = await walk(self, inputs, opener(self, route), check)
        if opened.committed:
            self._served(leg, opened.model)
            stream = relayed(self, leg, opened, probe, record_success, inputs=inputs)
            return stream if route.resumable is None else await kept(self, stream)
        if opened.invalid:  # its first output is not valid Unicode: rejected, as a whole answer
            await finish_leg(self, leg, Outcome.success, probe, record_success)
            self._served(leg, opened.model)
            raise GuardTripped(
                Reason.schema_invalid,
                "the stream's first output is not valid Unicode",
                model=leg.ref.key,
                problems=(f"answer: {INVALID_UNICODE}",),
            )
        # Complete, and nothing in it: the model answered, just not with anything.
        end = opened.end
        if end is not None and end.finish_reason == "content_filter":
            await finish_leg(self, leg, Outcome.success, probe, record_success)
            self._served(leg, opened.model)
            raise GuardTripped(
                Reason.moderation_blocked, "the provider filtered the stream", model=leg.ref.key
            )
        result = await recover(self, leg, inputs, probe, record_success)
        output = route.output
        value = await output.check(result)
        self._served(leg, result.model)
        recovered = Opened(
            iter_events=no_events(),
            # A structured stream's answer as its JSON text (checked again at the relay's end).
            first=[TextDelta(str(value) if output.json_schema is None else output.dump(value))],
            end=StreamEnd(finish_reason="stop", usage=result.usage, model=result.model),
            started=time.perf_counter(),
        )
        stream = relayed(self, leg, recovered, None, False, recorded=True)
        return stream if route.resumable is None else await kept(self, stream)
