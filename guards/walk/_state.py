"""`RequestState`: what one guarded request keeps while its handler runs, in one object.

The stages of the request path are functions over this state (one module each, see
`guards.walk`); each field is written by the stage named beside it and only read by the others.
Keeping the fields in one slotted object, rather than one object per stage, keeps the success
path to one allocation (`make bench-instructions` is the guard).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._checkpoints import resumed

if TYPE_CHECKING:
    from starlette.requests import Request

    from ..contracts._binding import Usage
    from ..contracts._errors import GuardTripped
    from ..contracts._tools import ToolCall
    from ..contracts._vocabulary import ErrorCode
    from ..spec._route_spec import GuardedRoute, Leg
    from ..spec._shared import Shared
    from ..stores import Charge, Step
    from ..waits._client import Watching
    from ..waits._deadline import Deadline
    from ._events import AttemptEnded, RequestEnded
    from ._observers import Observers

__all__ = ["Answered", "Note", "RequestState"]

#: What happened to one leg of the walk: (the leg, how it ended, its wait when skipped).
Note = tuple["Leg", str, "float | None"]
#: The notes of a request whose walk skipped and lost no leg: shared, never written to.
_NO_NOTES: list[Note] = []
#: The longest attempt summary a detail or a log line carries.
SUMMARY_MAX = 400


class Answered:
    """What a request's answers were, on a route with `on_rejected` or tools: each rejected
    answer's chain entry and problems, in order, and the last answer's validated tool calls
    (`AI.tool_calls`)."""

    __slots__ = ("rejected", "tool_calls")

    def __init__(self) -> None:
        self.rejected: list[tuple[str, tuple[str, ...]]] = []
        self.tool_calls: tuple[ToolCall, ...] = ()


class RequestState:
    """One request's state on the request path (see the module's docstring)."""

    __slots__ = (  # noqa: RUF023 (grouped by the stage that writes them)
        # The handle (`_handle.AI`): the request and what it shares; what served it.
        "_shared",
        "_route",
        "_request",
        "_started",
        "_observe",
        "_served_leg",
        "trace_id",
        "model",
        "fallback_model",
        "attempt_budget",
        # The chain walk (`_chain_walk`): the leg being called, the leg a hedge of the walk
        # runs or answered on (`_retries`), what happened to each leg, the walk's deadline,
        # the client watcher.
        "_leg",
        "_hedge",
        "_notes",
        "_scope",
        "_watch",
        "_gone",
        # The store steps (`_store_steps`): the first step, whether the budget was charged,
        # the spend hold, each leg's cooldown left as the last step read it.
        "_first",
        "_charged",
        "_hold",
        "_charge",
        "_waits",
        # Accounting (`_accounting`): calls made, their usage and cost, the input tokens'
        # bound and the `max_tokens` the holds were priced by (`_holds.holding`), the record of
        # an attempt whose log line the request's line carries (`_observers`).
        "attempts",
        "usage",
        "_cost",
        "_tokens",
        "_max_tokens",
        "_token_hold",
        "_used_tokens",
        "_held",
        # Answers of a route with `on_rejected` or tools (`_rejected`): set at its first call,
        # never on other routes (not even here: their requests pay nothing for it), so read
        # with `getattr(state, "_answered", None)`.
        "_answered",
        # The chain walk, only on a route whose breaker counts slow calls
        # (`GuardedRoute.slow_call_s`): whether the call that served was slow. Set when the
        # walk returns an answer there, and read only there (`_store_steps.finish_leg`): never
        # set on any other route, so it costs their requests nothing.
        "_slow",
        # The store steps, only on a route with a soft limit (`GuardedRoute.soft_limited`):
        # the header value naming the scopes the request was admitted past their soft limits
        # (None: none). Set at the first admission there, and read only there.
        "_near",
        # Only on a route with `downgrade_to` (`guards.routes._downgrade`): the scopes whose soft
        # limits sent the request to the downgrade chain. Set there, read only there.
        "_downgraded",
        # Only on a route with a deployment limiting tokens (`guards.Deployment(tpm=...)`): its
        # token hold in the minute window, set at its admission and settled by its answer
        # (`_known.tokens_settled`). Read with `getattr(state, "_deployment_hold", None)`.
        "_deployment_hold",
    )
    _answered: Answered
    _slow: bool  # (not set in `__init__`: see above)
    _near: bytes | None
    _downgraded: str
    _deployment_hold: tuple[Charge, str] | None

    # Set only on a route that holds (see `_hold` below), before they are read.
    _charge: Charge
    _token_hold: int
    _used_tokens: int

    def __init__(
        self,
        shared: Shared,
        route: GuardedRoute,
        first: Step | None,
        trace_id: str,
        request: Request | None,
        started: float,
        observe: Observers,
    ) -> None:
        self._shared = shared
        self._route = route
        #: The client's request (None outside a route), watched for a disconnect during calls.
        self._request = request
        #: When the request arrived at the app (`time.perf_counter()`, `guards.waits._arrival`): its
        #: first walk's deadline and its stream's `stream_max_s` count from it.
        self._started = started
        self._observe = observe
        #: The leg whose answer the request was last given (`guards_served_total`).
        self._served_leg: Leg | None = None
        self.trace_id = trace_id
        self.model: str | None = None
        self.fallback_model: str | None = None
        self.attempt_budget = route.attempt_budget
        self._leg: Leg = route.legs[0]
        self._hedge: Leg | None = None
        #: Made at the first note (a walk that skips or loses no leg makes none).
        self._notes: list[Note] = _NO_NOTES
        self._scope: Deadline | None = None
        #: The client watched, from the deadline's mark (`guards.waits._client`).
        self._watch: Watching | None = None
        self._gone = False
        #: The walk's first store step, prepared by the route (`walk_step`), with what the
        #: request's budget charges (None outside a route); the charge's spend, when the route
        #: has a spend cap, is set at the first admission.
        self._first = first
        self._charged = False
        #: The spend and token holds of this request (None without a spend cap or a token
        #: limit). Only a route that holds (`GuardedRoute.holds`) sets the charge as held
        #: (`_charge`), and only a token-limited one the tokens held and used (`_token_hold`,
        #: `_used_tokens`): when it charges (`_holds.holding`), so that no other request
        #: pays for them.
        self._hold: str | None = None
        #: Seconds of cooldown left per leg, as the last store step read them (None: unknown).
        self._waits: list[float] | None = None
        self.attempts = 0
        self.usage: Usage | None = None
        self._cost = 0.0
        self._tokens = 0
        self._max_tokens = route.max_tokens or 0
        self._held: AttemptEnded | None = None

    def _note(self, leg: Leg, what: str, wait_s: float | None) -> None:
        """Note what happened to `leg` in this walk (`_summary`, `_verdicts.exhausted`)."""
        if self._notes is _NO_NOTES:
            self._notes = []
        self._notes.append((leg, what, wait_s))

    def _served(self, leg: Leg, model: str | None) -> None:
        """The request was given `leg`'s answer (`model`: as the provider named it)."""
        self._served_leg = leg
        self.model = model or leg.ref.model
        if not leg.leads:
            self.fallback_model = leg.ref.entry

    def _summary(self, detailed: bool) -> str:
        """Each model tried or skipped by the last walk, and how it ended; model ids when
        `detailed` (else `model 1`, `model 2`...). Bounded, no provider text."""
        if detailed:
            parts = [f"{leg.ref.key}: {what}" for leg, what, _ in self._notes]
        else:
            index = {id(leg): n for n, leg in enumerate(self._route.legs, 1)}
            parts = [f"model {index[id(leg)]}: {what}" for leg, what, _ in self._notes]
        text = "; ".join(parts)
        return text if len(text) <= SUMMARY_MAX else text[: SUMMARY_MAX - 3] + "..."

    def _ended(
        self,
        outcome: str,
        status: int,
        *,
        tripped: GuardTripped | None = None,
        error: ErrorCode | None = None,
        extra: dict[str, Any] | None = None,
    ) -> RequestEnded:
        """The record of the request's end (`Observers.request_ended`); `extra`: more fields
        of its log line."""
        route = self._route
        if route.answers is not None and (rejected := route.answers.logged(self)) is not None:
            extra = {**extra, **rejected} if extra is not None else rejected
        if route.downgrade is not None and (downgraded := getattr(self, "_downgraded", None)) is not None:
            extra = {**(extra or {}), "downgraded": downgraded}
        if route.deployments is not None and (leg := self._served_leg) is not None and leg.ref.deployment:
            extra = {**(extra or {}), "deployment": leg.ref.key}  # the deployment that served
        return (
            route,
            self.trace_id,
            outcome,
            status,
            self._started,
            self.attempts,
            self.attempt_budget,
            self.model,
            self.fallback_model,
            self._served_leg,
            tripped,
            error,
            (self._summary(True) or None) if tripped is not None and len(route.legs) > 1 else None,
            (resumed(self._request) or None) if route.task is not None else None,
            extra,
            self._held,
        )
