"""The verdicts: every way a walk ends without an answer, as a `GuardTripped`. Pure: each
reads the request's state and returns the verdict, changing nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..contracts._errors import GuardTripped, ProviderError
from ..contracts._vocabulary import Kind, Reason

if TYPE_CHECKING:
    from ..policies._call import CallFailed
    from ..policies._cooldown import Cooldown
    from ..spec._route_spec import Leg
    from ._state import RequestState

__all__ = ["COOLDOWN_KINDS", "LIMIT_REASONS", "exhausted", "failed", "gone", "timed_out"]

#: The failures after which a model cools down (the provider asked for a pause).
COOLDOWN_KINDS = frozenset({Kind.model_rate_limited, Kind.model_quota_exhausted})
#: The failures that are the request's limits, not the model's (see `_windows`), each with the
#: reason it trips: a content filter is moderation, whoever moderated.
LIMIT_REASONS = {
    Kind.context_length_exceeded: Reason.context_length_exceeded,
    Kind.moderation_blocked: Reason.moderation_blocked,
}


def timed_out(state: RequestState, leg: Leg, never_sent: bool = False) -> GuardTripped:
    """The walk's deadline passed (`never_sent`: waiting for a connection to the provider)."""
    waited = "no free connection to the provider" if never_sent else "no answer"
    return GuardTripped(
        Reason.timeout,
        f"{waited} within {state._route.timeout_s:g}s",
        kind=Kind.model_temporarily_unavailable,
        attempts=state.attempts,
        model=leg.ref.key,
    )


def gone(state: RequestState, leg: Leg) -> GuardTripped:
    """The client left: the call was cancelled, and no further model tried."""
    return GuardTripped(
        Reason.provider_error,
        "the client disconnected: the call was cancelled, no further model was tried",
        kind=Kind.cancelled,
        attempts=state.attempts,
        model=leg.ref.key,
    )


def failed(state: RequestState, leg: Leg, call: CallFailed, cooldown: Cooldown) -> GuardTripped:
    """A leg gave up after its retries: JSON mode not met (`schema_invalid`), else the
    provider's failure with the wait to send (the provider's, at most `cooldown.max_s`; a
    cooldown's when the model cools down)."""
    error = call.error
    what = error.describe() if isinstance(error, ProviderError) else type(error).__name__
    if isinstance(error, ProviderError) and error.json_mode_failed:
        return GuardTripped(
            Reason.schema_invalid,
            f"JSON mode could not be met ({what})",
            attempts=state.attempts,
            model=leg.ref.key,
        )
    # The provider's wait, at most the model's `Cooldown.max_s`: never repeated as is.
    wait = cooldown.wait(error.retry_after_s) if isinstance(error, ProviderError) else None
    if call.verdict.kind in COOLDOWN_KINDS:
        # A known wait is always sent: the model's cooldown (the provider's wait, capped,
        # else the default), or the provider's own wait when longer (see public_error).
        wait = max(wait or 0.0, cooldown.seconds(error))
    return GuardTripped(
        LIMIT_REASONS.get(call.verdict.kind, Reason.provider_error),
        f"{call.verdict.kind.value} after {call.attempts} attempt(s): {what}",
        kind=call.verdict.kind,
        attempts=state.attempts,
        retry_after_s=wait,
        model=leg.ref.key,
    )


#: `exhausted`'s detail when one model was skipped, by (model, note, detailed): the same text
#: for every request refused alike, made once (a model and reason of the routes: bounded).
_ONE_SKIP: dict[tuple[str, str, bool], str] = {}
_MAX_ONE_SKIP = 256


def exhausted(state: RequestState, last: GuardTripped | None, spent: bool, detailed: bool) -> GuardTripped:
    """No leg answered: the last failure; else the attempt budget, when an earlier call of
    the request spent it; else `circuit_open` (every leg was skipped)."""
    legs = state._route.legs
    if last is not None and len(legs) == 1:
        return last
    notes = state._notes
    if last is None and len(notes) == 1 and not spent:  # an outage's usual refusal: one skip
        leg, what, wait = notes[0]
        detail = _ONE_SKIP.get((leg.ref.key, what, detailed))
        if detail is None:
            if len(_ONE_SKIP) >= _MAX_ONE_SKIP:
                _ONE_SKIP.clear()
            detail = _ONE_SKIP[leg.ref.key, what, detailed] = (
                f"every model was skipped: {state._summary(detailed)}"
            )
        return GuardTripped(Reason.circuit_open, detail, retry_after_s=wait, model=legs[0].ref.key)
    text = state._summary(detailed)
    if last is None and spent:
        return GuardTripped(
            Reason.provider_error,
            f"the request's attempt budget of {state.attempt_budget} provider calls is spent",
            kind=Kind.model_unavailable,
            attempts=state.attempts,
            model=legs[0].ref.key,
        )
    if last is None:
        waits = [wait for _, _, wait in state._notes if wait is not None]
        return GuardTripped(
            Reason.circuit_open,
            f"every model was skipped: {text}",
            retry_after_s=min(waits) if waits else None,
            model=legs[0].ref.key,
        )
    return GuardTripped(
        last.reason,
        f"every model failed: {text}",
        kind=last.kind,
        attempts=state.attempts,
        retry_after_s=last.retry_after_s,
        model=last.model,
    )
