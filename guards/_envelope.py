"""The two public response shapes: the envelope of a degrading route and the error body of a
strict one (DESIGN.md, contracts 1 and 2).

`GuardName`, `Reason` and `ErrorCode` are closed sets: safe as metric labels, matched to the
letter by clients. `detail` is free text for people and logs, never a label.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")

__all__ = [
    "MAX_PROBLEMS",
    "Envelope",
    "ErrorBody",
    "ErrorCode",
    "FallbackInfo",
    "GuardName",
    "Problem",
    "Reason",
]


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
}


class FallbackInfo(BaseModel):
    """Which guard substituted `data`, and why."""

    model_config = ConfigDict(frozen=True)

    guard: GuardName
    reason: Reason
    detail: str = Field(description="Free text for people and logs; never a metric label.")


class Envelope(BaseModel, Generic[T]):
    """The answer of a degrading route: always HTTP 200, always this shape.

    `data` validates against the route's model whether the model produced it
    (`fallback` is null) or a guard substituted it (`fallback` says which and why).
    """

    ok: bool = True
    data: T
    fallback: FallbackInfo | None = None


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


#: The most problems a 400 lists.
MAX_PROBLEMS = 10


class Problem(BaseModel):
    """One thing to fix in a request: where, and the pydantic error type. Never the value."""

    model_config = ConfigDict(frozen=True)

    field: str = Field(description="Where: `body.message`, `header.x-user-id`, `query.page`, or `body`.")
    problem: str = Field(
        description="The pydantic error type: `missing`, `string_too_long`, `string_type`, `json_invalid`..."
    )


class ErrorBody(BaseModel):
    """The body of every error a guarded route answers."""

    error: ErrorCode
    retryable: bool = Field(
        description="True only for transient failures; then the Retry-After header says when."
    )
    trace_id: str | None = Field(default=None, description="Also sent as the x-trace-id header.")
    problems: list[Problem] | None = Field(
        default=None,
        max_length=MAX_PROBLEMS,
        description=f"400 invalid_request only: what to fix (at most {MAX_PROBLEMS}), never the input.",
    )
