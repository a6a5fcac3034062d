"""Cooldowns: a model that answered "rate limited" or "quota exhausted" is left alone for a while.

While a model cools down, chains skip it without a call (and record the skip), so a provider
that asked for a pause is not hammered by every request in the meantime. The cooldown itself
lives in the store (`Store.start_cooldown`), shared by every worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._classify import Kind, classify

__all__ = ["Cooldown"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cooldown:
    """How long a model cools down after a rate limit (429) or an exhausted quota (3036).

    The provider's `Retry-After` (or `retry-after-ms`) when it sent one, capped at `max_s`;
    else `rate_limited_s` for a rate limit and `quota_s` for a quota.
    """

    rate_limited_s: float = 30.0
    quota_s: float = 600.0
    max_s: float = 3600.0

    def __post_init__(self) -> None:
        if min(self.rate_limited_s, self.quota_s, self.max_s) <= 0:
            raise ValueError("cooldown durations must be positive")

    def seconds(self, error: BaseException) -> float:
        """The cooldown a failure calls for (0.0: none)."""
        kind = classify(error).kind
        if kind is Kind.model_rate_limited:
            default = self.rate_limited_s
        elif kind is Kind.model_quota_exhausted:
            default = self.quota_s
        else:
            return 0.0
        hint = getattr(error, "retry_after_s", None)
        return min(self.max_s, hint if hint is not None and hint > 0 else default)
