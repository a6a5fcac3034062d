"""Retry budget: a model's retries stay a small share of its requests, in each worker.

Bounded retry (`Retry.attempts`) caps the calls of one request; it does not stop a storm. When
a model fails every call, every request retries, and the provider that is already failing
gets twice the load. The budget admits a retry of a model only while its retries of the last
`window_s` seconds stay under `share` of its requests in that window, or under `min_retries`
whatever the traffic (`RetryBudget`: 20 %, 3, 10 s by default). A retry over the budget is not
made: the walk moves on to the next model, or the request fails as if its retry were spent.

Per model, not per provider: a model is what fails together (Workers AI's 3040 "out of
capacity" is one model's), and it is the unit the breaker and the cooldowns already keep. A
provider-wide budget would let one failing model spend the retries of its healthy neighbours.

Counted over a window, not over the requests in flight at an instant (Envoy's form): a retry
that fails fast frees its slot for the next request's retry, so an in-flight budget lets a
storm of fast failures retry nearly every request. Counting the window's retries against the
window's requests (Finagle's `RetryBudget`) bounds the total: N requests in a window make at
most `max(min_retries, share * N)` retries.

Per worker, in memory: no store operation. Requests are counted from the worker's call tallies
of the model (the same counts `guards_provider_attempts_total` flushes), read only when a retry
is considered, so the success path pays nothing for the budget. The window is kept as at most
`_MARKS` marks of those counts, one per `window_s / _MARKS` at most, taken on retry decisions:
bounded memory, whatever the traffic.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..contracts._settings import number, settings, whole
from ..observe._metrics import Tally

__all__ = ["RetryBudget", "RetryWindows", "admit_retry"]

#: The most marks a model's window keeps (its resolution: `window_s / _MARKS`).
_MARKS = 10


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class RetryBudget:
    """How many retries of one model a worker admits: while its retries of the last `window_s`
    seconds stay under `share` (a fraction) of its requests in that window, or under
    `min_retries` (so a quiet model can still retry). Raises `ConfigurationError` for a negative
    share or floor, or a window that is not positive (`ConfigurationError`)."""

    share: float = 0.2
    min_retries: int = 3
    window_s: float = 10.0

    def __post_init__(self) -> None:
        number("RetryBudget.share", self.share, least=0)
        whole("RetryBudget.min_retries", self.min_retries, least=0)
        number("RetryBudget.window_s", self.window_s, above=0, unit="seconds")

    def allows(self, retries: int, requests: int) -> bool:
        """Whether one more retry fits, after `retries` retries for `requests` requests."""
        return retries < max(self.min_retries, self.share * requests)


class _Window:
    """One model's requests and retries in this worker, over the last window."""

    __slots__ = ("_calls", "_marks", "retries")

    def __init__(self, calls: Iterable[Tally]) -> None:
        #: The model's call tallies (every outcome kind): they only grow.
        self._calls = tuple(calls)
        #: (monotonic time, calls, retries) when each mark was taken, oldest first.
        self._marks: deque[tuple[float, int, int]] = deque()
        #: Retries admitted, ever (only grows).
        self.retries = 0

    def admit(self, policy: RetryBudget, now: float) -> bool:
        calls = int(sum(tally.count for tally in self._calls))  # counts of calls: whole numbers
        marks = self._marks
        horizon = now - policy.window_s
        while marks and marks[0][0] < horizon:
            marks.popleft()
        if not marks or now - marks[-1][0] >= policy.window_s / _MARKS:
            marks.append((now, calls, self.retries))
        _, first_calls, first_retries = marks[0]
        retries = self.retries - first_retries
        # Calls include the retries made since the mark: what is left are first calls.
        requests = calls - first_calls - retries
        if not policy.allows(retries, requests):
            return False
        self.retries += 1
        return True


class RetryWindows:
    """The retry budget's state in this worker: one window per model key (model keys are
    configured: a closed set). `Guards` holds one: the apps of a worker do not share it."""

    __slots__ = ("_windows",)

    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}

    def of(self, model: str, attempts: Iterable[Tally]) -> _Window:
        """The window of the model keyed `model`, whose attempts' tallies are `attempts`."""
        window = self._windows.get(model)
        if window is None:
            window = self._windows[model] = _Window(attempts)
        return window


def admit_retry(
    windows: RetryWindows,
    model: str,
    attempts: Iterable[Tally],
    policy: RetryBudget | None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Whether the model keyed `model` (its attempts' tallies: `attempts`) may be retried now
    under `policy` (None: no budget), counted in `windows`. The caller reports a refusal (a
    `retry` line with `"skipped": "retry_budget"`, `guards_retry_budget_exhausted_total`)."""
    return policy is None or windows.of(model, attempts).admit(policy, clock())
