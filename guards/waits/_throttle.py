"""`Throttled`: pace calls to a provider below its published rate limit.

A provider's rate limit is per account, not per user: a burst from many users turns into 429s
(`model_rate_limited`) that no retry should hammer. Wrapping the binding in `Throttled` makes
excess calls wait for capacity instead, inside the route's deadline: a call that cannot get
capacity in time ends as `timeout`, without reaching the provider.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiolimiter import AsyncLimiter

from ..contracts._binding import AIResult, Binding

__all__ = ["Throttled"]


class Throttled:
    """A binding that lets at most `max_rate` calls start per `time_period_s` (a leaky bucket,
    `aiolimiter.AsyncLimiter`, shared by every route using this binding in this process)."""

    def __init__(self, binding: Binding, *, max_rate: float, time_period_s: float = 60.0) -> None:
        if max_rate <= 0 or time_period_s <= 0:
            raise ValueError("Throttled needs a positive max_rate and time_period_s")
        self.binding = binding
        self._limiter = AsyncLimiter(max_rate, time_period_s)
        #: Traces name the provider behind the pacing (see `guards.spec._tracing.provider_name`).
        self.gen_ai_provider_name: str | None = getattr(binding, "gen_ai_provider_name", None)

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        async with self._limiter:
            return await self.binding.run(model, inputs)

    async def aclose(self) -> None:
        await self.binding.aclose()
