"""Call guard: bounded retry of classified failures inside one deadline.

The deadline itself is a timeout scope the caller opens around `call_model`, so when it fires
the in-flight provider request is cancelled (its connection closed), not abandoned.
Cancellation is never caught here: it is never retried and never moves on.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from ._binding import AIResult, Binding
from ._classify import Classification, classify

__all__ = ["CallFailed", "Retry", "call_model", "should_retry"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Bounded retry policy for one guarded call.

    `attempts` is the total number of provider calls (default 2: one retry). Only failures the
    classifier calls retryable are retried, after `delay_s` jittered by ±`jitter` (a fraction),
    and only when at least `min_room_s` of the deadline is left after that delay.
    """

    attempts: int = 2
    delay_s: float = 0.2
    jitter: float = 0.5
    min_room_s: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("Retry.attempts counts every call, the first included: at least 1")
        if self.delay_s < 0 or not 0 <= self.jitter <= 1 or self.min_room_s < 0:
            raise ValueError("Retry delays must be >= 0 and jitter within [0, 1]")

    def delay(self, rng: Callable[[], float] = random.random) -> float:
        return self.delay_s * (1 + self.jitter * (2 * rng() - 1))


def should_retry(
    verdict: Classification, attempt: int, policy: Retry, remaining_s: float, delay_s: float
) -> bool:
    """Retry only retryable kinds, within the attempt budget, when the deadline leaves room."""
    return verdict.retryable and attempt < policy.attempts and remaining_s - delay_s >= policy.min_room_s


class CallFailed(Exception):
    """Internal: the call guard gave up. Carries the last failure's verdict and the attempts."""

    def __init__(self, error: Exception, verdict: Classification, attempts: int) -> None:
        super().__init__(verdict.kind.value)
        self.error = error
        self.verdict = verdict
        self.attempts = attempts


OnRetry = Callable[[int, Classification, float], None]


async def call_model(
    binding: Binding,
    model: str,
    inputs: Mapping[str, Any],
    *,
    policy: Retry,
    deadline: float,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    on_attempt: Callable[[], None] | None = None,
    on_retry: OnRetry | None = None,
) -> tuple[AIResult, int]:
    """Call `binding.run` with bounded retry. Returns the result and the number of attempts.

    `deadline` is in event-loop time (`loop.time()`) and only informs the retry decision; the
    caller's timeout scope enforces it. Raises `CallFailed` when it gives up.
    """
    attempt = 0
    while True:
        attempt += 1
        if on_attempt is not None:
            on_attempt()
        try:
            return await binding.run(model, inputs), attempt
        except Exception as error:  # a binding raises ProviderError; any other bug is "unavailable"
            verdict = classify(error)
            if getattr(error, "json_mode_failed", False):
                raise CallFailed(error, verdict, attempt) from None
            delay = policy.delay()
            remaining = deadline - asyncio.get_running_loop().time()
            if not should_retry(verdict, attempt, policy, remaining, delay):
                raise CallFailed(error, verdict, attempt) from None
            if on_retry is not None:
                on_retry(attempt, verdict, delay)
        await sleep(delay)
