"""Call guard: bounded retry of classified failures inside one deadline.

The deadline itself is a timeout scope the caller opens around `call_model`, so when it fires
the in-flight provider request is cancelled (its connection closed), not abandoned.
Cancellation is never caught here: it is never retried and never moves on.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from ..contracts._classify import Classification, classify
from ..contracts._errors import ConfigurationError
from ..contracts._settings import number, settings, whole
from ..contracts._vocabulary import Kind
from ._retry_budget import RetryBudget

__all__ = ["CallFailed", "Retry", "call_model", "retry_delay", "should_retry", "waits_out"]

R = TypeVar("R")


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Bounded retry policy for one guarded call.

    `attempts` is the most calls to one model, the first included (default 2: one retry); a
    route's attempt budget caps the calls across its whole fallback chain. Only failures the
    classifier calls retryable are retried, after `delay_s` jittered by ±`jitter` (a fraction),
    and only when at least `min_room_s` of the deadline is left after that delay. `budget`
    caps a model's retries across requests, in each worker (`RetryBudget`: 20 % of its
    requests, at least 3, over 10 s); None lets every request retry. An attempt that produced
    no first output within its model's `first_output_s` is retried only on a one-model chain:
    with another model configured, the walk moves on.

    `wait_out_s` (default 2 s; 0: off): a rate limit (429, never retried at once) whose
    provider wait (`Retry-After`, `retry-after-ms`) is at most this long is waited out, then
    retried once, when no other model of the chain can answer (none left, or every later one
    resting: cooling down, or its breaker open, as this worker knows) and the deadline leaves
    `min_room_s` after the wait. Like any retry it counts against `attempts`, the request's
    attempt budget and `budget`; a half-open breaker's probe is never retried. Raises
    `ConfigurationError` for a value of the wrong type or out of range.
    """

    attempts: int = 2
    delay_s: float = 0.2
    jitter: float = 0.5
    min_room_s: float = 0.5
    budget: RetryBudget | None = RetryBudget()
    wait_out_s: float = 2.0

    def __post_init__(self) -> None:
        whole("Retry.attempts", self.attempts)  # every call, the first included
        number("Retry.delay_s", self.delay_s, least=0, unit="seconds")
        number("Retry.jitter", self.jitter, least=0, most=1)
        number("Retry.min_room_s", self.min_room_s, least=0, unit="seconds")
        if self.budget is not None and not isinstance(self.budget, RetryBudget):
            raise ConfigurationError(
                f"Retry.budget must be a RetryBudget(...), or None (no budget); got {self.budget!r}"
            )
        number("Retry.wait_out_s", self.wait_out_s, least=0, unit="seconds")  # 0: never waited out

    def delay(self, rng: Callable[[], float] = random.random) -> float:
        return self.delay_s * (1 + self.jitter * (2 * rng() - 1))


def should_retry(
    verdict: Classification,
    attempt: int,
    limit: int,
    policy: Retry,
    remaining_s: float,
    delay_s: float,
    waiting: bool = False,
) -> bool:
    """Retry only retryable kinds (or, `waiting`, a provider's wait to wait out: `waits_out`),
    within `limit` calls, when the deadline leaves `min_room_s` after the delay (so a
    `Retry-After` longer than the deadline allows moves on instead of waiting)."""
    return (verdict.retryable or waiting) and attempt < limit and remaining_s - delay_s >= policy.min_room_s


def waits_out(verdict: Classification, policy: Retry, error: Exception) -> bool:
    """Whether a failure that is not retried at once may be waited out, when no other model
    can answer: a rate limit whose provider wait is known and at most `policy.wait_out_s`.
    (The deadline's room is `should_retry`'s to check.)"""
    hint = getattr(error, "retry_after_s", None)
    return verdict.kind is Kind.model_rate_limited and hint is not None and 0 < hint <= policy.wait_out_s


def retry_delay(policy: Retry, error: Exception) -> float:
    """The wait before a retry: the policy's jittered delay, or the provider's `Retry-After`
    (`retry-after-ms`) when it asks for longer."""
    delay = policy.delay()
    hint = getattr(error, "retry_after_s", None)
    return max(delay, hint) if hint is not None else delay


class CallFailed(Exception):
    """Internal: the call guard gave up. Carries the last failure's verdict and the attempts."""

    def __init__(self, error: Exception, verdict: Classification, attempts: int) -> None:
        super().__init__(verdict.kind.value)
        self.error = error
        self.verdict = verdict
        self.attempts = attempts


#: Called once per provider call: (attempt number, its result or exception, perf_counter start).
OnAttempt = Callable[[int, Any, float], None]
#: Called before each retry the policy allows (attempt number, verdict, delay); returning False
#: skips it (the retry budget), as if the policy had refused.
OnRetry = Callable[[int, Classification, float], bool | None]
#: Called with the failure before its provider wait is waited out (see `Retry.wait_out_s`).
WaitOut = Callable[[Exception], Awaitable[None]]


async def call_model(
    call: Callable[[str, Mapping[str, Any]], Awaitable[R]],
    model: str,
    inputs: Mapping[str, Any],
    *,
    policy: Retry,
    deadline: float,
    limit: int | None = None,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    on_attempt: OnAttempt | None = None,
    on_retry: OnRetry | None = None,
    failed: Exception | None = None,
    wait_out: WaitOut | None = None,
) -> tuple[R, int]:
    """Make one provider call (`await call(model, inputs)`) with bounded retry. Returns its
    result and the number of attempts.

    At most `limit` calls (default and cap: `policy.attempts`). `deadline` is in event-loop
    time (`loop.time()`) and only informs the retry decision; the caller's timeout scope
    enforces it. A retry the policy allows is made unless `on_retry` returns False (the retry
    budget). Raises `CallFailed` when it gives up; cancellation passes through untouched.
    `failed`: the first call's failure, when the caller made that call itself (and passed it
    to `on_attempt`): the walk does, one coroutine less on every request's path.
    `wait_out`: given when no other model can answer; a short provider wait
    (`Retry.wait_out_s`) is then waited out once, after `wait_out(error)`, and retried.
    """
    limit = policy.attempts if limit is None else min(limit, policy.attempts)
    attempt, error = (0, None) if failed is None else (1, failed)
    waited = False  # a provider's wait was waited out (once per call)
    while True:
        if error is not None:
            verdict = classify(error)
            # JSON mode not met: the model answered. No first output, with another model to
            # try (`NoFirstOutput.moves_on`): a silent model is not waited on twice.
            if getattr(error, "json_mode_failed", False) or getattr(error, "moves_on", False):
                raise CallFailed(error, verdict, attempt) from None
            delay = retry_delay(policy, error)
            remaining = deadline - asyncio.get_running_loop().time()
            waiting = wait_out is not None and not waited and waits_out(verdict, policy, error)
            if not should_retry(verdict, attempt, limit, policy, remaining, delay, waiting) or (
                on_retry is not None and on_retry(attempt, verdict, delay) is False
            ):
                raise CallFailed(error, verdict, attempt) from None
            if waiting:
                assert wait_out is not None
                waited = True
                await wait_out(error)
            await sleep(delay)
        attempt += 1
        started = time.perf_counter()
        try:
            result = await call(model, inputs)
        except Exception as failure:  # a binding raises ProviderError; any other bug is "unavailable"
            if on_attempt is not None:
                on_attempt(attempt, failure, started)
            error = failure
        except BaseException as stopped:  # cancelled: the attempt may still have been billed
            if on_attempt is not None:
                on_attempt(attempt, stopped, started)
            raise
        else:
            if on_attempt is not None:
                on_attempt(attempt, result, started)
            return result, attempt
