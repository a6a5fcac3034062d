"""This worker's counts over time, for the status page's rates and spend (`History`).

The counts are those `/metrics` exports: every worker's in prometheus-client's multiprocess mode
(`PROMETHEUS_MULTIPROC_DIR`: the sums of the workers' files, read in a thread), else the
answering worker's tallies; copied every `window_s / COPIES` seconds by a task of the event
loop (`History`, started with the app's lifespan, or by the first view). A rate is the
difference between the counts now and the oldest copy at most `window_s` old, over the time
between them; the day's spend, the difference since the copy the UTC day started from.

The latency histograms' counts are copied with them, and one copy in `TREND_STEPS` (every
`window_s / 5`: a minute for the default 5-minute window) is kept, latency only, for
`TREND_POINTS` steps (an hour): the latency trend (`guards.status._latency`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import anyio.to_thread

from ..observe._latency import LATENCY_METRICS
from ..observe._metrics import (
    ATTEMPTS,
    BUDGET_SETTLED,
    COST,
    FALLBACKS,
    REQUESTS,
    SERVED,
    Metric,
    counts,
    multiprocess,
    totals,
)
from ..stores import utc_day

__all__ = ["COPIES", "DAY_S", "TREND_POINTS", "Counts", "History", "Reading", "grown"]

#: Copies of the counts a window holds: a rate's window is `window_s` less at most one interval.
COPIES = 30
#: The latency trend: a point every `window_s / TREND_STEPS`, `TREND_POINTS` of them at most.
TREND_STEPS = 5
TREND_POINTS = 60
DAY_S = 86_400.0

Key = tuple[Metric, tuple[str, ...]]
Counts = dict[Key, float]


@dataclass(frozen=True, slots=True)
class _Copy:
    mono: float
    wall: float
    counts: Counts


#: The counters the page reads.
_COUNTED = (REQUESTS, SERVED, FALLBACKS, ATTEMPTS, COST, BUDGET_SETTLED, *LATENCY_METRICS)


async def _copy() -> _Copy:
    """The counts now: every worker's in multiprocess mode (files: read in a thread), else
    this worker's."""
    if multiprocess():
        found = await anyio.to_thread.run_sync(totals, *_COUNTED)
    else:
        found = counts(*_COUNTED)
    return _Copy(time.monotonic(), time.time(), found)


@dataclass(frozen=True, slots=True)
class Reading:
    """The counts now, and the two baselines to subtract: the window's and the day's."""

    now: Counts
    recent: Counts
    recent_s: float
    today: Counts
    day: str
    since: float
    #: The latency trend's copies, oldest first: (seconds since the epoch, latency counts).
    trend: tuple[tuple[float, Counts], ...] = ()


class History:
    """Copies of the counts, one every `window_s / COPIES` seconds, kept for `window_s`; the
    copy the UTC day started from; and the latency trend's copies. Bounded: at most `COPIES +
    1` copies and `TREND_POINTS + 1` trend copies, each one count per series. The first copy
    is taken when copying starts (the app's lifespan, else the first view)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.every_s = window_s / COPIES
        self.trend_step_s = window_s / TREND_STEPS
        self._copies: deque[_Copy] = deque()
        self._trend: deque[tuple[float, float, Counts]] = deque()
        self._day, self._day_counts, self._since = "", Counts(), 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Take the first copy, and copy every `every_s` on this event loop (already copying:
        nothing)."""
        if self._task is not None and not self._task.done():
            return
        if not self._copies:
            self._add(await _copy())
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self._add(await _copy())

    def _add(self, copy: _Copy) -> None:
        self._roll(copy)
        copies = self._copies
        copies.append(copy)
        while len(copies) > COPIES + 1 or (len(copies) > 1 and copies[0].mono < copy.mono - self.window_s):
            copies.popleft()
        trend = self._trend
        # A step's copy (less a tenth of an interval: the timer's copies drift a little late).
        if not trend or copy.mono - trend[-1][0] >= self.trend_step_s - self.every_s / 10:
            latency = {key: n for key, n in copy.counts.items() if key[0] in LATENCY_METRICS}
            trend.append((copy.mono, copy.wall, latency))
            while len(trend) > TREND_POINTS + 1:
                trend.popleft()

    def _roll(self, copy: _Copy) -> None:
        """A new UTC day starts from the newest copy (taken before midnight, at most one interval
        before it: what was spent in between counts for the new day); the first copy starts
        the first day (the page counts from then)."""
        day = utc_day(copy.wall)
        if not self._copies:
            self._day, self._day_counts, self._since = day, copy.counts, copy.wall
        elif day != self._day:
            self._day, self._day_counts = day, self._copies[-1].counts
            self._since = copy.wall // DAY_S * DAY_S

    async def read(self) -> Reading:
        await self.start()
        now = await _copy()
        self._roll(now)
        oldest = now.mono - self.window_s
        # The oldest copy within the window; when the timer did not run (no copy that recent),
        # the newest one, and the window says how long it really is.
        base = next((c for c in self._copies if c.mono >= oldest), self._copies[-1])
        return Reading(
            now.counts,
            base.counts,
            now.mono - base.mono,
            self._day_counts,
            self._day,
            self._since,
            tuple((wall, counts) for _, wall, counts in self._trend),
        )


def grown(reading: Reading, base: Counts, metric: Metric) -> dict[tuple[str, ...], float]:
    """How much each series of `metric` grew since `base`."""
    return {
        labels: count - base.get((m, labels), 0.0)
        for (m, labels), count in reading.now.items()
        if m is metric and count != base.get((m, labels), 0.0)
    }
