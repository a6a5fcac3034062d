"""The request's limits in a walk: context windows and content filters, which rule out models
for this request rather than for their health.

A leg whose declared context window (`Guards(context_windows=...)`) cannot hold the request,
its estimated input tokens plus the `max_tokens` it asks for, is skipped without a call: noted
and told to the observers as a skip (`context_window`), like a cooldown's. The estimate
(`guards.contracts._tokens`) is made at the first leg with a window, once per request with the default
rule; a binding with its own `estimate_tokens` is asked per model.

After a call fails with `context_length_exceeded`, the request is known not to fit that model:
a later leg is tried only when its declared window is larger. A leg with no declared window is
tried only when no model that failed so had one either (nothing says it is smaller); after a
declared one, an undeclared one may well be smaller, and is skipped.

After a provider's content filter (`moderation_blocked`), the walk ends, unless the route says
`content_filter_fallback`: then it goes on to the next leg of another provider, the legs of
every provider whose filter refused skipped (`content_filter`). A filter is the provider's
error (Azure OpenAI's `content_filter`, AI Gateway's guardrails) or its answer flagged
(`AIResult.moderated`: Anthropic's `refusal`, Gemini's `SAFETY`, Bedrock's guardrail, OpenAI's
`content_filter` finish; `flagged`); without the fallback, a flagged answer is the output
guard's to reject, as any answer.

A walk whose route declares no window makes no `Limits` until such a failure: its requests pay
one comparison per leg for all this.
"""

from __future__ import annotations

from collections.abc import Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

from ..contracts._binding import AIResult
from ..contracts._errors import GuardTripped
from ..contracts._tokens import binding_estimate, estimate_tokens
from ..contracts._vocabulary import Kind, Reason
from ..stores._breaker import Outcome
from ._accounting import account
from ._known import skip
from ._store_steps import report
from ._verdicts import LIMIT_REASONS

if TYPE_CHECKING:
    from ..spec._route_spec import Leg
    from ..stores import Report
    from ._state import RequestState

__all__ = ["LIMIT_KINDS", "Limits", "flagged", "moved_by_filter", "reserved_tokens"]

#: The failures that say something about the request, not the model: never retried, and they
#: narrow the legs the walk may go on to.
LIMIT_KINDS = frozenset(LIMIT_REASONS)
#: A skip's reasons (`guards_skips_total`, the `skip` log line).
CONTEXT_WINDOW = "context_window"
CONTENT_FILTER = "content_filter"
_SKIPPED_WINDOW = f"skipped ({CONTEXT_WINDOW})"


def reserved_tokens(inputs: Mapping[str, Any]) -> int:
    """The answer's tokens a call reserves in the context window: the inputs' `max_tokens`
    (else `max_completion_tokens`; the route's `max_tokens` is in the inputs by now), or 0."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = inputs.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


def flagged(
    state: RequestState,
    leg: Leg,
    result: AIResult,
    started: float,
    probe: float | None,
    record_success: bool,
    limits: Limits,
) -> tuple[Report | None, GuardTripped]:
    """A call to `leg` answered `result`, which its provider flagged (`moderated`), on a route
    with `content_filter_fallback`: its content filter, as when it refuses with an error. The
    call is accounted (`moderation_blocked`, billed: it answered), the model reported as having
    answered (its breaker hears a success), and `limits` narrowed to other providers: (the
    report of the call, the content filter's `moderation_blocked`)."""
    state.attempts += 1
    kind = Kind.moderation_blocked
    served = result.model or leg.ref.model
    account(state, leg, kind.value, result.usage, served, perf_counter() - started, billed=True)
    leg.last_success[0] = state._shared.success_clock()
    made = (
        report(state, leg, Outcome.success, probe, settle=False)
        if record_success or probe is not None
        else None
    )
    state._note(leg, kind.value, None)
    limits.failed(leg, kind)
    tripped = GuardTripped(
        Reason.moderation_blocked,
        "the provider flagged the completion",
        kind=kind,
        attempts=state.attempts,
        model=leg.ref.key,
    )
    return made, tripped


class Limits:
    """One walk's limits (see the module's docstring)."""

    __slots__ = ("_default", "_state", "filtered", "floor", "inputs")

    def __init__(self, state: RequestState, inputs: Mapping[str, Any]) -> None:
        self._state = state
        self.inputs = inputs
        #: The default estimate plus the reserved tokens, once made.
        self._default: int | None = None
        #: None: no call failed for its context length; else the largest declared window of
        #: the models that did (0: none of them declared one).
        self.floor: int | None = None
        #: The providers (`provider_of`) whose content filter refused the request.
        self.filtered: frozenset[str | None] = frozenset()

    def need(self, leg: Leg) -> int:
        """The tokens a call to `leg` needs in its window: the input's estimate plus the
        reserved answer."""
        shared, provider = self._state._shared, leg.ref.provider
        estimate = binding_estimate(shared.binding if provider is None else shared.providers[provider])
        if estimate is estimate_tokens:  # the same for every model: made once
            if self._default is None:
                self._default = estimate_tokens(leg.ref.model, self.inputs) + reserved_tokens(self.inputs)
            return self._default
        return int(estimate(leg.ref.model, self.inputs)) + reserved_tokens(self.inputs)

    def provider_of(self, leg: Leg) -> str | None:
        """The provider `leg` calls: the one its chain entry names, else the main binding's
        own name (its `provider`), so that `anthropic:claude-...` and a main Anthropic binding
        are one provider."""
        provider = leg.ref.provider
        return provider if provider is not None else getattr(self._state._shared.binding, "provider", None)

    def unfit(self, leg: Leg) -> str | None:
        """Why `leg` may not be called for this request (a skip's reason), or None."""
        window, floor = leg.window, self.floor
        if floor is not None and (window <= floor if window is not None else floor > 0):
            return CONTEXT_WINDOW
        if self.filtered and self.provider_of(leg) in self.filtered:
            return CONTENT_FILTER
        if window is not None and window < self.need(leg):
            return CONTEXT_WINDOW
        return None

    def skip(self, start: int) -> int:
        """The first leg from `start` that may be called (`len(legs)`: none), each leg before
        it skipped: noted, and told to the observers."""
        legs = self._state._route.legs
        while start < len(legs):
            why = self.unfit(legs[start])
            if why is None:
                break
            skip(self._state, legs[start], why, None)
            start += 1
        return start

    def failed(self, leg: Leg, kind: Kind) -> bool:
        """A call to `leg` failed with `kind` (one of `LIMIT_KINDS`): whether the walk goes on."""
        if kind is Kind.context_length_exceeded:
            self.floor = max(self.floor or 0, leg.window or 0)
            return True
        if not self._state._route.content_filter_fallback:
            return False
        self.filtered |= {self.provider_of(leg)}
        return True

    def verdict(self, last: GuardTripped | None) -> GuardTripped | None:
        """How a walk that ended without an answer ends, when its limits decide: the limit a
        call hit (its own verdict), or, when every leg was skipped for its context window,
        `context_length_exceeded`. None: the usual verdict (`_verdicts.exhausted`)."""
        if last is not None:
            return last if last.kind in LIMIT_KINDS else None
        state = self._state
        notes = state._notes
        if not notes or any(what != _SKIPPED_WINDOW for _, what, _ in notes):
            return None  # some model was skipped for its health: it may hold it later
        detailed = state._shared.attribution == "detailed"
        return GuardTripped(
            Reason.context_length_exceeded,
            f"the input does not fit any model's context window: {state._summary(detailed)}",
            kind=Kind.context_length_exceeded,
            attempts=state.attempts,
            model=state._route.legs[0].ref.key,
        )


def moved_by_filter(
    state: RequestState,
    leg: Leg,
    index: int,
    result: Any,
    started: float,
    probe: float | None,
    record_success: bool,
    limits: Limits | None,
    inputs: Mapping[str, Any],
) -> tuple[Report | None, GuardTripped, int, Mapping[str, Any]] | None:
    """An answer its provider flagged (`moderated`), on a route with `content_filter_fallback`:
    the walk moves on as after its content filter's error (`_windows`; report, verdict, next
    start, inputs), before the route's own check of the answer (`_rejected`)."""
    if limits is None or not state._route.content_filter_fallback or type(result) is not AIResult:
        return None
    if not result.moderated:
        return None
    report, last = flagged(state, leg, result, started, probe, record_success, limits)
    return report, last, index + 1, inputs
