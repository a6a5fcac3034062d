"""The streaming tail: what makes a streamed attempt (`opener`: `open_stream`, with its window
when the route holds its streams or the model has a minimum rate), the output guard on a held
stream's start (`HoldCheck`), once a streamed attempt is committed the response relaying it
(`guards.streams._relay`), and what is recorded when it ends, however it ends: the attempt
(ledger, metrics), the breaker outcome, the spend and the request's outcome. And the one
non-streaming recovery call after a stream that completed empty.

`HoldCheck` is the walk's `check` of each attempt on a route with `stream_hold` (`walk(...,
check)`), given what the attempt's hold read (`guards.streams._hold`): the answer's start (its
whole, when it completed inside the hold). The route's output guard checks it
(`OutputGuard.check_held`: an empty answer, the moderation hook on the held text), and a
provider's content filter (`finish_reason: content_filter`) inside the hold is a rejection too.
A rejected stream is closed unsent, accounted as a rejected whole answer is on a route that
moves such answers on (`on_rejected="next_model"`: ledger outcome `rejected`, billed, its model
reported up to its breaker), counted (`guards_stream_hold_rejections_total`), and the walk
moves on to the next model; when none is left, the request ends with the last rejection. A
failure inside the hold is `open_stream`'s: raised, as one before the first output."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any

import anyio

from ..contracts._binding import AIResult, Usage
from ..contracts._errors import ConfigurationError, GuardTripped
from ..contracts._stream import StreamEnd, StreamingBinding, ToolCallDelta
from ..contracts._tokens import CHARS_PER_TOKEN, binding_estimate
from ..contracts._vocabulary import Reason
from ..policies._call import CallFailed, call_model
from ..policies._chain import DEFAULT_PROVIDER
from ..stores._breaker import Outcome
from ..stores._kept import StreamKeeper
from ..streams._event_stream import EventStream, end_data
from ..streams._hold import held_text, window
from ..streams._kept import caller, chat_name, keep, new_stream_id, stream_key
from ..streams._relay import REJECTED, Opened, Relayed, aclose, chars, open_stream, relay
from ..streams._structured import KeptText
from ..waits._first_output import idle_limited
from ._accounting import account, on_attempt
from ._chain_walk import Call, binding, first_output_limited, traced
from ._store_steps import finish_leg, gave_up, report
from ._verdicts import timed_out

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ..contracts._binding import Binding
    from ..spec._route_spec import GuardedRoute, Leg
    from ..stores import Report
    from ._state import RequestState

__all__ = ["HoldCheck", "kept", "opener", "recover", "relayed", "streaming"]

#: Where the endpoint of a resumable route puts the chat id of its `UIChatRequest` argument
#: (the AI SDK's resume asks for a chat's stream by it).
CHAT_ID = "guards.chat_id"


def streaming(state: RequestState, leg: Leg) -> StreamingBinding:
    """The binding of `leg`, which must stream."""
    found = binding(state, leg)
    if not isinstance(found, StreamingBinding):
        raise ConfigurationError(f"the binding for {leg.ref.key} cannot stream")
    return found


_FILTERED = ("answer: moderation_blocked",)


def opener(state: RequestState, route: GuardedRoute) -> Callable[[Leg], Call[Opened]]:
    """What makes one streaming attempt on a leg of `route` (the request's chain): `open_stream`
    on its binding, with the window of the route's hold and the leg's minimum rate, if any."""
    hold, moves_on = route.stream_hold, len(route.legs) > 1

    def call_for(leg: Leg) -> Call[Opened]:
        opens = functools.partial(open_stream, streaming(state, leg))
        held = window(hold, leg.min_chars_per_s, moves_on=moves_on, provider=leg.ref.provider or "provider")
        return opens if held is None else functools.partial(opens, window=held)

    return call_for


class HoldCheck:
    """One stream walk's check of its held attempts (`inputs`: the walk's, for the next model)."""

    __slots__ = ("_inputs",)

    def __init__(self, inputs: Mapping[str, Any]) -> None:
        self._inputs = inputs

    async def moved_on(
        self,
        state: RequestState,
        leg: Leg,
        index: int,
        result: Any,
        started: float,
        probe: float | None,
        record_success: bool,
    ) -> tuple[Report | None, GuardTripped, int, Mapping[str, Any]] | None:
        """After an attempt on `leg` (the chain's `index`th) held `result` (an `Opened`): None
        when it is accepted; else, closed and accounted as rejected, (the report of the call,
        the rejection, the leg to call next, its inputs)."""
        assert isinstance(result, Opened)
        if result.invalid:  # not valid Unicode: rejected whole, as today (`AI.stream`)
            return None
        try:
            rejection = await _rejection(state, result)
        except BaseException as stopped:  # the deadline, or the moderation hook's own failure
            with anyio.CancelScope(shield=True):
                await aclose(result.iter_events)
            on_attempt(state, stopped, started)
            raise
        if rejection is None:
            return None
        with anyio.CancelScope(shield=True):
            await aclose(result.iter_events)
        end, problems = result.end, rejection.problems
        usage = end.usage if end is not None else None
        estimate = None
        if usage is None and state._route.holds:  # cut unsent: charged as a stream ended early
            held = sum(map(chars, result.first))
            estimate = ended_early(binding(state, leg), leg.ref.model, self._inputs, held)
        state.attempts += 1
        if result.committed:  # its attempt span, open until its stream ends
            state._observe.stream_ended(result, "rejected", end, 0)
        account(
            state,
            leg,
            "rejected",
            usage,
            (end.model if end is not None else None) or result.model or leg.ref.model,
            time.perf_counter() - started,
            billed=True,
            delivered=0,
            problems=problems,
            estimate=estimate,
        )
        leg.last_success[0] = state._shared.success_clock()  # the model answered: it is up
        made = (
            report(state, leg, Outcome.success, probe, settle=False)
            if record_success or probe is not None
            else None
        )
        state._observe.hold_rejected(state._route, rejection.reason.value)
        state._note(leg, f"rejected in the hold ({'; '.join(problems) or rejection.reason.value})", None)
        last = GuardTripped(
            rejection.reason, rejection.detail, attempts=state.attempts, model=leg.ref.key, problems=problems
        )
        return made, last, index + 1, self._inputs


async def _rejection(state: RequestState, opened: Opened) -> GuardTripped | None:
    """Why the output guard rejects what `opened` held (None: it does not)."""
    end = opened.end
    if end is not None and end.finish_reason == "content_filter":
        return GuardTripped(Reason.moderation_blocked, "the provider filtered the stream", problems=_FILTERED)
    first = opened.first
    tool_calls = any(type(event) is ToolCallDelta for event in first)
    try:
        await state._route.output.check_held(held_text(first), end is not None, tool_calls=tool_calls)
    except GuardTripped as tripped:
        return tripped
    return None


async def recover(
    state: RequestState, leg: Leg, inputs: Mapping[str, Any], probe: float | None, record_success: bool
) -> AIResult:
    """One non-streaming call to `leg` after an empty stream (within the attempt budget)."""
    if state.attempts >= state.attempt_budget:
        await finish_leg(state, leg, Outcome.success, probe, record_success)
        raise GuardTripped(Reason.empty_response, "the stream completed empty", model=leg.ref.key)
    call: Call[AIResult] = binding(state, leg).run
    if leg.first_output_s is not None:
        call = first_output_limited(state, leg, call, signalled=True)
    if state._observe.trace is not None:
        call = traced(state, call, leg, retry=True)
    assert state._scope is not None  # the walk's
    deadline = state._scope.when
    try:
        async with asyncio.timeout_at(deadline):
            result, _ = await call_model(
                call,
                leg.ref.model,
                inputs,
                policy=state._route.retry,
                deadline=deadline,
                limit=1,
                on_attempt=lambda _, outcome, began: on_attempt(state, outcome, began),
            )
    except CallFailed as failed:
        await finish_leg(state, leg, Outcome.failure, probe, record_success)
        raise gave_up(state, leg, failed) from None
    except TimeoutError:
        await finish_leg(state, leg, Outcome.failure, probe, record_success)
        raise timed_out(state, leg) from None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await finish_leg(state, leg, Outcome.released, probe, record_success)
        raise
    await finish_leg(state, leg, Outcome.success, probe, record_success)
    return result


def relayed(
    state: RequestState,
    leg: Leg,
    opened: Opened,
    probe: float | None,
    record_success: bool,
    *,
    recorded: bool = False,
    inputs: Mapping[str, Any] | None = None,
) -> EventStream:
    """The response relaying a committed attempt (called with `inputs`); when it ends, the
    attempt (unless `recorded` already), the breaker outcome, the spend and the request's
    outcome are recorded, however it ends."""
    observe = state._observe

    async def on_end(relayed: Relayed) -> None:
        _stream_done(state, leg, opened, relayed, recorded, inputs)
        await finish_leg(state, leg, relayed.outcome, probe, record_success)
        failure = relayed.failure
        if relayed.stopped:
            # Cut by the server stopping (`stop_streams`), not by its client leaving.
            observe.request_ended(state._ended("error", 200, tripped=failure, extra={"cut": "shutdown"}))
        elif relayed.outcome is Outcome.released:
            observe.request_ended(state._ended("cancelled", 200))
        else:
            outcome = "error" if failure is not None else "ok"
            observe.request_ended(state._ended(outcome, 200, tripped=failure))

    route = state._route
    if leg.stream_idle_s is not None:  # the model's own idle limit, whatever its binding's
        opened.iter_events = idle_limited(
            opened.iter_events, leg.stream_idle_s, leg.ref.provider or DEFAULT_PROVIDER
        )
    observe.streaming()  # the request's span ends with the stream
    # The stream's time limit counts from the request's arrival, in event-loop time.
    left_s = route.stream_max_s - (time.perf_counter() - state._started)
    writer = route.stream_format.writer()
    done = functools.partial(_done_data, state)
    if route.output.json_schema is not None:  # a structured stream: its text checked at the end
        writer = kept = KeptText(writer)
        done = functools.partial(_structured_done, state, leg, kept)
    return EventStream(
        relay(
            opened,
            provider=leg.ref.provider or "provider",
            model=leg.ref.key,
            deadline=asyncio.get_running_loop().time() + left_s,
            max_s=route.stream_max_s,
            max_chars=route.stream_max_chars,
            done=done,
            error=lambda tripped: _error_data(state, tripped),
            ended=on_end,
            writer=writer,
        ),
        route.stream_format.headers,
    )


def _structured_done(state: RequestState, leg: Leg, kept: KeptText, end: StreamEnd | None) -> dict[str, Any]:
    """The `done` data of a structured stream whose whole text (`kept`, as sent) passed the
    route's output guard (the checks of `run`'s answer but the moderation hook: empty,
    Unicode, schema), with `object`: the validated output, as JSON data. Else the guard's
    `GuardTripped` (never the model's text: field paths and error types, the keys the model
    wrote told as `<key>`), naming the model: the relay ends the stream with its `error`."""
    output = state._route.output
    try:
        value = output.check_shape(AIResult(response=kept.kept(), model=leg.ref.model))
    except GuardTripped as tripped:
        raise GuardTripped(
            tripped.reason, tripped.detail, model=leg.ref.key, problems=tripped.problems
        ) from None
    return {**_done_data(state, end), "object": output.plain(value)}


async def kept(state: RequestState, stream: EventStream) -> EventStream:
    """`stream` (a resumable route's) produced by a task of its own and kept in the store
    (`guards.streams._kept`), under a new stream id (the `x-stream-id` header) and, when the
    request is a chat's (`CHAT_ID`), as that chat's current stream; returned once its first
    events are kept."""
    route, request = state._route, state._request
    spec = route.resumable
    assert spec is not None
    store = state._shared.store
    if not isinstance(store, StreamKeeper):  # replaced since the route was declared
        raise ConfigurationError(f"route {route.name}: the store cannot keep resumable streams")
    stream_id = new_stream_id()
    who = "" if request is None else caller([budget.key for budget in route.budgets], request)
    live_ttl_s = route.stream_max_s + spec.ttl_s
    chat = None if request is None else request.scope.get(CHAT_ID)

    async def background() -> None:
        if stream.background is not None:
            await stream.background()

    stream.kept = True  # its background task runs when the stream ends, not when its client leaves
    stream._body = await keep(
        state._shared,
        store,
        stream_key(route.name, who, stream_id),
        stream_id,
        stream._body,
        spec,
        live_ttl_s=live_ttl_s,
        route=route.name,
        after=background,
        chat=chat_name(route.name, who, chat) if chat else None,
    )
    stream.raw_headers.append((b"x-stream-id", stream_id.encode()))
    return stream


def _stream_done(
    state: RequestState,
    leg: Leg,
    opened: Opened,
    relayed: Relayed,
    recorded: bool,
    inputs: Mapping[str, Any] | None,
) -> None:
    """Account for the committed stream attempt once it ended (its ledger record, with the
    problems of a structured answer the output guard rejected). A stream that ended early (its
    client gone, or cut) with no usage from the provider is charged, under a spend cap or a
    token limit, an estimate (`ended_early`)."""
    kind, end, delivered, failure = relayed.kind, relayed.end, relayed.delivered, relayed.failure
    problems = failure.problems if kind == REJECTED and failure is not None else None
    state._observe.stream_ended(opened, kind, end, delivered)
    if not recorded:
        usage = end.usage if end is not None else None
        served = (end.model if end is not None else None) or opened.model or leg.ref.model
        estimate = None
        if usage is None and kind not in ("ok", REJECTED) and state._route.holds and inputs is not None:
            estimate = ended_early(binding(state, leg), leg.ref.model, inputs, delivered)
        account(
            state,
            leg,
            kind,
            usage,
            served,
            time.perf_counter() - opened.started,
            billed=True,
            delivered=delivered,
            estimate=estimate,
            problems=problems,
        )


def ended_early(found: Binding, model: str, inputs: Mapping[str, Any], delivered: int) -> Usage | None:
    """What a stream through `found` that ended early, with no usage reported, is charged: its
    input tokens as estimated for the token limits (`binding_estimate`) and the characters
    of output delivered over `CHARS_PER_TOKEN`, rounded up; None (the hold stands: the worst
    case, the tokens held) when the binding says its provider bills such a stream in full
    (`bills_cancelled_streams_in_full = True`), or when its own estimate fails."""
    if getattr(found, "bills_cancelled_streams_in_full", False):
        return None
    try:
        prompt = binding_estimate(found)(model, inputs)
    except Exception:  # the binding's own estimate: the hold stands, the settlement goes on
        return None
    completion = -(-delivered // CHARS_PER_TOKEN)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _done_data(state: RequestState, end: StreamEnd | None) -> dict[str, Any]:
    if end is not None and end.model:
        state.model = end.model  # the provider names the model that served at the end
    attribution = state._shared.attribution
    data = end_data(end)
    data.update(
        model=state.model if attribution == "detailed" else None,
        fallback_model=(
            state.fallback_model
            if attribution == "detailed"
            else (state.fallback_model is not None if attribution == "redacted" else None)
        ),
        attempts=state.attempts,
        trace_id=state.trace_id,
    )
    return data


def _error_data(state: RequestState, tripped: GuardTripped) -> dict[str, Any]:
    return {
        "guard": tripped.guard.value,
        "reason": tripped.reason.value,
        "detail": tripped.detail,
        "trace_id": state.trace_id,
    }
