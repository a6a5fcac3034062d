"""Hedged requests: when a call has not answered after a delay, a second attempt starts on the
next model of the chain, and the first answer wins (`guards.walk._retries` runs the race).

The delay is fixed (`Hedge(after_s=0.5)`) or the first model's recent p95 to first output
(`Hedge(after="p95")`): a call slower than 95 % of its model's calls is likely to be the tail
worth hedging. The p95 is read from the model's first-output histogram in this worker
(`guards_model_first_output_seconds`, the status page's figures: `guards.observe._latency`)
over about the last `window_s` seconds, never below `floor_s` (a model answering in 5 ms
would otherwise be hedged at once, doubling its load), and is `default_s` while the window
holds fewer than `min_calls` calls. Bounded: one window per model, of at most `_MARKS` copies
of its bucket counts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..contracts._errors import ConfigurationError
from ..contracts._settings import number, settings, whole
from ..observe._latency import quantile

if TYPE_CHECKING:
    from ..observe._tallies import HistogramTally

__all__ = ["Hedge"]

#: The most copies of a model's counts its window keeps (its resolution: `window_s / _MARKS`).
_MARKS = 10


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class Hedge:
    """When a route's call starts a second attempt (`route(hedge=Hedge(...))`).

    `after_s`: a fixed delay in seconds; or `after="p95"`: the first model's p95 to first output
    over about the last `window_s` seconds (default 300) in this worker, at least `floor_s`
    (default 0.05), and `default_s` (default 1.0) while fewer than `min_calls` (default 20)
    calls were timed in the window. Exactly one of `after_s` and `after`. Raises
    `ConfigurationError` for anything else."""

    after_s: float | None = None
    after: Literal["p95"] | None = None
    floor_s: float = 0.05
    default_s: float = 1.0
    min_calls: int = 20
    window_s: float = 300.0
    #: The p95 windows, by model key (keys are configured: a closed set).
    _windows: dict[str, _Window] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.after_s is None) == (self.after is None):
            raise ConfigurationError(
                'Hedge: give exactly one of after_s (seconds) and after="p95"; '
                f"got after_s={self.after_s!r}, after={self.after!r}"
            )
        if self.after is not None and self.after != "p95":
            raise ConfigurationError(f'Hedge: after must be "p95"; got {self.after!r}')
        number("Hedge.after_s", self.after_s, above=0, unit="seconds", none='after="p95"')
        number("Hedge.floor_s", self.floor_s, above=0, unit="seconds")
        number("Hedge.default_s", self.default_s, above=0, unit="seconds")
        whole("Hedge.min_calls", self.min_calls)
        number("Hedge.window_s", self.window_s, above=0, unit="seconds")

    def delay_s(
        self, model: str, first_output: HistogramTally, *, clock: Callable[[], float] = time.monotonic
    ) -> float:
        """How long a call to the model keyed `model` (its first-output histogram:
        `first_output`) runs before it is hedged."""
        if self.after_s is not None:
            return self.after_s
        window = self._windows.get(model)
        if window is None:
            window = self._windows[model] = _Window()
        p95 = window.p95(first_output, self, clock())
        return self.default_s if p95 is None else max(self.floor_s, p95)


class _Window:
    """One model's first-output counts over about the last window: copies of its cumulative
    bucket counts, at most one per `window_s / _MARKS`; the p95 is over what grew since the
    oldest copy at or before the window's start (about 20 buckets: read at each delay)."""

    __slots__ = ("_marks",)

    def __init__(self) -> None:
        #: (monotonic time, cumulative counts by bucket bound), oldest first.
        self._marks: deque[tuple[float, list[tuple[float, float]]]] = deque()

    def p95(self, tally: HistogramTally, hedge: Hedge, now: float) -> float | None:
        marks = self._marks
        counts = [(float(key[-1]), count) for key, count in tally.cumulative()]  # ("+Inf": inf)
        while len(marks) > 1 and marks[1][0] <= now - hedge.window_s:
            marks.popleft()  # the oldest kept is the last one at or before the window's start
        base = marks[0][1] if marks else counts  # (the first delay asked for: no call yet)
        if not marks or now - marks[-1][0] >= hedge.window_s / _MARKS:
            marks.append((now, counts))
        grown = [(bound, count - before) for (bound, count), (_, before) in zip(counts, base, strict=True)]
        return quantile(grown, 0.95) if grown and grown[-1][1] >= hedge.min_calls else None
