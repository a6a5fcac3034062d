"""From a tripped guard to what the client receives (DESIGN.md, contracts 1 and 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from ._envelope import Problem
from ._errors import GuardTripped
from ._vocabulary import ErrorCode, Kind, Reason

__all__ = ["PublicError", "error_response", "public_error"]


@dataclass(frozen=True, slots=True)
class PublicError:
    status: int
    error: ErrorCode
    retryable: bool
    retry_after_s: float | None = None


_BY_KIND = {
    Kind.model_incompatible: (502, ErrorCode.model_incompatible),
    Kind.model_quota_exhausted: (503, ErrorCode.model_quota_exhausted),
    Kind.model_rate_limited: (503, ErrorCode.model_rate_limited),
    Kind.model_temporarily_unavailable: (503, ErrorCode.model_temporarily_unavailable),
    Kind.model_unavailable: (503, ErrorCode.model_unavailable),
}

#: Kinds that are not retried at once but carry a known wait (the provider's, or the cooldown).
_WAIT_KINDS = frozenset({Kind.model_rate_limited, Kind.model_quota_exhausted})

#: The error tokens a strict route may answer with each status (documented in OpenAPI).
STRICT_STATUSES: dict[int, tuple[ErrorCode, ...]] = {
    400: (ErrorCode.context_length_exceeded,),
    429: (ErrorCode.rate_limited, ErrorCode.budget_exceeded),
    502: (ErrorCode.model_incompatible, ErrorCode.incompatible_model_response),
    503: (
        ErrorCode.model_quota_exhausted,
        ErrorCode.model_rate_limited,
        ErrorCode.model_temporarily_unavailable,
        ErrorCode.model_unavailable,
        ErrorCode.circuit_open,
    ),
}


def public_error(tripped: GuardTripped, retry_after_s: float) -> PublicError:
    """Map a tripped guard to a strict route's public error.

    `retry_after_s` is the configured wait for `model_temporarily_unavailable` (a timeout, or a
    transient failure that outlived its retry); a longer wait the provider asked for wins.
    A known wait is always sent: `model_rate_limited` and `model_quota_exhausted` carry the
    provider's wait or the model's cooldown, and stay `retryable: false` (no immediate
    automatic retry).
    """
    reason = tripped.reason
    if reason is Reason.rate_limited:
        return PublicError(429, ErrorCode.rate_limited, False, tripped.retry_after_s)
    if reason is Reason.budget_exceeded:
        return PublicError(429, ErrorCode.budget_exceeded, False, tripped.retry_after_s)
    if reason is Reason.circuit_open:
        return PublicError(503, ErrorCode.circuit_open, True, tripped.retry_after_s)
    if reason is Reason.context_length_exceeded:
        return PublicError(400, ErrorCode.context_length_exceeded, False)
    if reason in (Reason.schema_invalid, Reason.empty_response, Reason.moderation_blocked):
        return PublicError(502, ErrorCode.incompatible_model_response, False)
    kind = Kind.model_temporarily_unavailable if reason is Reason.timeout else tripped.kind
    if kind is Kind.model_temporarily_unavailable:
        wait = max(retry_after_s, tripped.retry_after_s or 0.0)
        return PublicError(503, ErrorCode.model_temporarily_unavailable, True, wait)
    status, error = _BY_KIND.get(kind or Kind.model_unavailable, (503, ErrorCode.model_unavailable))
    if kind in _WAIT_KINDS:
        return PublicError(status, error, False, tripped.retry_after_s)
    return PublicError(status, error, False)


def error_response(
    error: PublicError, trace_id: str, *, problems: list[Problem] | None = None
) -> JSONResponse:
    """The error body (`ErrorBody`) with `x-trace-id`, and `Retry-After` when the wait is known;
    `problems` for a 400."""
    if problems is None and error.error is ErrorCode.context_length_exceeded:
        # Every 400 names what to fix: here the body, too long (which of its fields made the
        # input too long, only the client knows).
        problems = [Problem(field="body", problem="too_long")]
    headers = {"x-trace-id": trace_id}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
    body: dict[str, Any] = {"error": error.error.value, "retryable": error.retryable, "trace_id": trace_id}
    if problems is not None:
        body["problems"] = [{"field": p.field, "problem": p.problem} for p in problems]
    return JSONResponse(body, status_code=error.status, headers=headers)
