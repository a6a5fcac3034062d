"""The streaming tail: once a streamed attempt is committed (its first output arrived), the
response relaying it (`guards.streams._relay`), and what is recorded when it ends, however it ends:
the attempt (ledger, metrics), the breaker outcome, the spend and the request's outcome. And
the one non-streaming recovery call after a stream that completed empty."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import anyio

from ..contracts._binding import AIResult, Usage
from ..contracts._errors import ConfigurationError, GuardTripped
from ..contracts._stream import StreamEnd, StreamingBinding
from ..contracts._tokens import CHARS_PER_TOKEN, binding_estimate
from ..contracts._vocabulary import Reason
from ..policies._call import CallFailed, call_model
from ..policies._chain import DEFAULT_PROVIDER
from ..stores._breaker import Outcome
from ..stores._kept import StreamKeeper
from ..streams._event_stream import EventStream, end_data
from ..streams._kept import caller, chat_name, keep, new_stream_id, stream_key
from ..streams._relay import Opened, Relayed, relay
from ..waits._first_output import idle_limited
from ._accounting import account, on_attempt
from ._chain_walk import Call, binding, first_output_limited, traced
from ._store_steps import finish_leg, gave_up
from ._verdicts import timed_out

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..contracts._binding import Binding
    from ..spec._route_spec import Leg
    from ._state import RequestState

__all__ = ["kept", "recover", "relayed", "streaming"]

#: Where the endpoint of a resumable route puts the chat id of its `UIChatRequest` argument
#: (the AI SDK's resume asks for a chat's stream by it).
CHAT_ID = "guards.chat_id"


def streaming(state: RequestState, leg: Leg) -> StreamingBinding:
    """The binding of `leg`, which must stream."""
    found = binding(state, leg)
    if not isinstance(found, StreamingBinding):
        raise ConfigurationError(f"the binding for {leg.ref.key} cannot stream")
    return found


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
        _stream_done(state, leg, opened, relayed.kind, relayed.end, relayed.delivered, recorded, inputs)
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
    return EventStream(
        relay(
            opened,
            provider=leg.ref.provider or "provider",
            model=leg.ref.key,
            deadline=asyncio.get_running_loop().time() + left_s,
            max_s=route.stream_max_s,
            max_chars=route.stream_max_chars,
            done=lambda end: _done_data(state, end),
            error=lambda tripped: _error_data(state, tripped),
            ended=on_end,
            writer=route.stream_format.writer(),
        ),
        route.stream_format.headers,
    )


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
    kind: str,
    end: StreamEnd | None,
    delivered: int,
    recorded: bool,
    inputs: Mapping[str, Any] | None,
) -> None:
    """Account for the committed stream attempt once it ended (its ledger record). A stream
    that ended early (its client gone, or cut) with no usage from the provider is charged,
    under a spend cap or a token limit, an estimate (`ended_early`)."""
    state._observe.stream_ended(opened, kind, end, delivered)
    if not recorded:
        usage = end.usage if end is not None else None
        served = (end.model if end is not None else None) or opened.model or leg.ref.model
        estimate = None
        if usage is None and kind != "ok" and state._route.holds and inputs is not None:
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
