"""The two public response shapes: the envelope of a degrading route and the error body of a
strict one (DESIGN.md, contracts 1 and 2).

`GuardName`, `Reason` and `ErrorCode` (closed sets, in `guards.contracts._vocabulary`) are matched to the
letter by clients. `detail` is free text for people and logs, never a label.

Each model's validator and serializer are built when first used (`defer_build`), not when
guards is imported: `ErrorBody` serves the OpenAPI document only, `Problem` a 400, and a
degrading route builds its `Envelope[...]` and `FallbackInfo` when it is declared.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ._vocabulary import ErrorCode, GuardName, Reason

T = TypeVar("T")

__all__ = ["MAX_PROBLEMS", "Envelope", "ErrorBody", "FallbackInfo", "Problem"]


class FallbackInfo(BaseModel):
    """Which guard substituted `data`, and why."""

    model_config = ConfigDict(frozen=True, defer_build=True)

    guard: GuardName
    reason: Reason
    detail: str = Field(description="Free text for people and logs; never a metric label.")


class Envelope(BaseModel, Generic[T]):
    """The answer of a degrading route: always HTTP 200, always this shape.

    `data` validates against the route's model whether the model produced it
    (`fallback` is null) or a guard substituted it (`fallback` says which and why).
    """

    model_config = ConfigDict(defer_build=True)

    ok: bool = True
    data: T
    fallback: FallbackInfo | None = None


#: The most problems a 400 lists.
MAX_PROBLEMS = 10


class Problem(BaseModel):
    """One thing to fix in a request: where, and the pydantic error type. Never the value."""

    model_config = ConfigDict(frozen=True, defer_build=True)

    field: str = Field(description="Where: `body.message`, `header.x-user-id`, `query.page`, or `body`.")
    problem: str = Field(
        description="The pydantic error type: `missing`, `string_too_long`, `string_type`, `json_invalid`..."
    )


class ErrorBody(BaseModel):
    """The body of every error a guarded route answers."""

    model_config = ConfigDict(defer_build=True)

    error: ErrorCode
    retryable: bool = Field(
        description="True only for transient failures; then the Retry-After header says when."
    )
    trace_id: str | None = Field(default=None, description="Also sent as the x-trace-id header.")
    problems: list[Problem] | None = Field(
        default=None,
        max_length=MAX_PROBLEMS,
        description=f"A 400 only: what to fix (at most {MAX_PROBLEMS}), never the input.",
    )
