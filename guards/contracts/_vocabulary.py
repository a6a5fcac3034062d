"""The closed vocabularies: every token a client, a dashboard or an alert may match on.

Each is a `StrEnum`, so a member is its own wire value and safe as a metric label. They live
together because they are one contract (DESIGN.md): a new member of any of them is a change of
that contract, and this module is where to look for it.

- `GuardName`: which guard fired (`budget`, `call`, `output`).
- `Reason`: why it fired, the envelope's `fallback.reason`; each reason belongs to one guard.
- `ErrorCode`: a strict route's public error token (`{"error": ...}`).
- `Kind`: what a provider call ended in, the classifier's verdict (`guards.classify`).
- `Level`: the service level (`full`, `degraded`, `minimal`).
- `CircuitState`: a breaker's state (`closed`, `open`, `half_open`), as metrics and the status page show it.
- `Attribution`: how responses name the model that served (`Guards(attribution=...)`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

__all__ = ["Attribution", "CircuitState", "ErrorCode", "GuardName", "Kind", "Level", "Reason"]


class CircuitState(StrEnum):
    """A breaker's state."""

    closed = "closed"
    open = "open"
    half_open = "half_open"


class GuardName(StrEnum):
    """Which guard fired."""

    budget = "budget"
    call = "call"
    output = "output"


class Reason(StrEnum):
    """Why a guard fired. Each reason belongs to exactly one guard (`Reason.guard`)."""

    rate_limited = "rate_limited"
    budget_exceeded = "budget_exceeded"
    circuit_open = "circuit_open"
    timeout = "timeout"
    provider_error = "provider_error"
    schema_invalid = "schema_invalid"
    empty_response = "empty_response"
    moderation_blocked = "moderation_blocked"
    #: The input does not fit the context window of any model the walk may call.
    context_length_exceeded = "context_length_exceeded"

    @property
    def guard(self) -> GuardName:
        return _GUARD_OF[self]


_GUARD_OF = {
    Reason.rate_limited: GuardName.budget,
    Reason.budget_exceeded: GuardName.budget,
    Reason.circuit_open: GuardName.budget,
    Reason.timeout: GuardName.call,
    Reason.provider_error: GuardName.call,
    Reason.schema_invalid: GuardName.output,
    Reason.empty_response: GuardName.output,
    Reason.moderation_blocked: GuardName.output,
    Reason.context_length_exceeded: GuardName.call,
}


class ErrorCode(StrEnum):
    """The stable error tokens of strict routes (DESIGN.md, contract 2)."""

    invalid_request = "invalid_request"
    model_incompatible = "model_incompatible"
    incompatible_model_response = "incompatible_model_response"
    model_quota_exhausted = "model_quota_exhausted"
    model_rate_limited = "model_rate_limited"
    model_temporarily_unavailable = "model_temporarily_unavailable"
    model_unavailable = "model_unavailable"
    application_failure = "application_failure"
    rate_limited = "rate_limited"
    budget_exceeded = "budget_exceeded"
    circuit_open = "circuit_open"
    #: Multi-step tasks: another request holds the task of this `Idempotency-Key` (409).
    task_in_progress = "task_in_progress"
    #: Multi-step tasks: this `Idempotency-Key` was used with another request body (422).
    idempotency_key_reused = "idempotency_key_reused"
    #: The input does not fit the context window of any model the route may call (400): the
    #: client must shorten it.
    context_length_exceeded = "context_length_exceeded"


class Kind(StrEnum):
    """What kind of failure a provider call ended in."""

    model_incompatible = "model_incompatible"
    model_quota_exhausted = "model_quota_exhausted"
    model_temporarily_unavailable = "model_temporarily_unavailable"
    model_rate_limited = "model_rate_limited"
    model_unavailable = "model_unavailable"
    #: The input (with the answer's `max_tokens`) does not fit the model's context window.
    #: Never retried; the walk moves on only to a model with a larger declared window.
    context_length_exceeded = "context_length_exceeded"
    #: The provider's content policy refused the call (a content filter). Never retried; the
    #: walk moves on only to another provider's model, when the route allows it.
    moderation_blocked = "moderation_blocked"
    #: The caller stopped waiting (deadline or client gone). Never retried, never moves on.
    cancelled = "cancelled"


class Level(StrEnum):
    """The service level, best first."""

    full = "full"
    degraded = "degraded"
    minimal = "minimal"


#: How responses name the model that served: `detailed` (model ids), `redacted` (a fallback
#: flag only) or `off`.
Attribution = Literal["off", "redacted", "detailed"]
