"""This process's counts (`Tally`, `StampedTally`, `HistogramTally`, `GaugeTally`: one per
series, `counter(metric, *labels)` and the like), and their flush to prometheus-client.

The counts of every request are tallied in plain process memory (an integer increment, a
bucket search) and written to prometheus-client at most `FLUSH_INTERVAL_S` later, by a timer
of the event loop (`flush_soon`): prometheus-client's own update path (locks, and in
multiprocess mode a write to a shared file per update) costs more than all of a request's
guards.

Tallies are updated from event-loop threads and only grow; a flush (under a lock, from any
thread) adds what grew since the last one, so an update racing a flush is written by the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from itertools import compress
from operator import sub
from typing import TYPE_CHECKING, Any, TypeAlias

from ._families import LOG_LINES_DROPPED
from ._log import dropped_lines, emit_warning
from ._prometheus import Metric, multiprocess, worker_files

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

    #: What a tally counts into: one of guards' metrics, or a prometheus-client metric.
    Source: TypeAlias = "Metric | Counter | Gauge | Histogram"

__all__ = [
    "FLUSH_DUE",
    "FLUSH_INTERVAL_S",
    "GaugeTally",
    "HistogramTally",
    "StampedTally",
    "Tally",
    "bucket_label",
    "counter",
    "counts",
    "flush_metrics",
    "flush_soon",
    "gauge",
    "histogram",
    "peek",
    "stamped_counter",
    "totals",
]

#: The longest a request's counts wait in this process before prometheus-client sees them.
FLUSH_INTERVAL_S = 1.0


class Tally:
    """This process's count of one counter series (`counter(metric, *labels)`): `add()` on the
    request path; `flush_metrics()` adds what is new to the prometheus-client series (bound
    to it by the first flush)."""

    __slots__ = ("_child", "_flushed", "_labels", "_metric", "count")

    def __init__(self, metric: Metric | Counter, labels: tuple[str, ...]) -> None:
        self._metric = metric
        self._labels = labels
        self._child: Counter | None = None
        #: Only ever grows; `_flushed` is what prometheus-client has of it.
        self.count: float = 0
        self._flushed: float = 0

    def add(self, amount: float = 1) -> None:
        self.count += amount

    def _flush(self) -> None:
        child = self._child
        if child is None:
            child = self._child = _child(self._metric, self._labels)
        count, flushed = self.count, self._flushed
        if count != flushed:
            self._flushed = count  # first: an amount prometheus-client refuses is dropped
            child.inc(count - flushed)


class StampedTally(Tally):
    """A tally that also keeps when it was last added to (`last_at`, seconds since the epoch,
    0.0: never): a model's failure kinds, for the status page's last failure of each model.
    Only failures pay for the clock read; a model's successes count in a plain `Tally`."""

    __slots__ = ("last_at",)

    def __init__(self, metric: Metric | Counter, labels: tuple[str, ...]) -> None:
        super().__init__(metric, labels)
        self.last_at = 0.0

    def add(self, amount: float = 1) -> None:
        self.count += amount
        self.last_at = time.time()


class HistogramTally:
    """This process's observations of one histogram series (`histogram(metric, *labels)`):
    per bucket (the first bound >= the value, as prometheus-client counts) and their sum."""

    __slots__ = (
        "_bounds",
        "_child",
        "_counts",
        "_flushed",
        "_flushed_sum",
        "_keys",
        "_labels",
        "_metric",
        "_sum",
    )

    def __init__(self, metric: Metric | Histogram, labels: tuple[str, ...]) -> None:
        self._metric = metric
        self._labels = labels
        self._child: Histogram | None = None
        # prometheus-client's bounds of this histogram, +Inf last.
        self._bounds: tuple[float, ...] = (
            metric.upper_bounds() if isinstance(metric, Metric) else tuple(metric._upper_bounds)
        )
        self._counts = [0] * len(self._bounds)
        self._flushed = [0] * len(self._bounds)
        self._sum = 0.0
        self._flushed_sum = 0.0
        self._keys: tuple[tuple[str, ...], ...] | None = None

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def observe_answer(
        self, answered: HistogramTally, first_output: HistogramTally | None, value: float
    ) -> None:
        """An answered call's `value` (seconds) in this, its attempt histogram, in `answered`
        and, a whole answer's (its first output is its arrival), in `first_output`, in one
        call: the two latency histograms share their bounds (`LATENCY_BUCKETS`), so one
        search finds the bucket of both. Every successful request's path."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value
        index = bisect_left(answered._bounds, value)
        answered._counts[index] += 1
        answered._sum += value
        if first_output is not None:
            first_output._counts[index] += 1
            first_output._sum += value

    def cumulative(self) -> list[tuple[tuple[str, ...], float]]:
        """Each bucket's count as `/metrics` shows it: by the series' labels and its bound
        (`le`, `bucket_label`), the observations at or below it. (The label tuples are made
        once: copies of the counts share them.)"""
        keys = self._keys
        if keys is None:
            keys = self._keys = tuple((*self._labels, bucket_label(bound)) for bound in self._bounds)
        found, total = [], 0.0
        for key, count in zip(keys, self._counts, strict=True):
            total += count
            found.append((key, total))
        return found

    def _flush(self) -> None:
        # prometheus-client has no public "add n observations": its histogram child keeps one
        # value per bucket (`_buckets`, non-cumulative) and `_sum`, which this adds to.
        child = self._child
        if child is None:
            child = self._child = _child(self._metric, self._labels)
            if not all(hasattr(child, name) for name in ("_upper_bounds", "_buckets", "_sum")) or (
                tuple(child._upper_bounds) != self._bounds
            ):
                raise RuntimeError(
                    "this prometheus-client's Histogram has no _upper_bounds/_buckets/_sum, or "
                    "other bounds: guards needs a release that keeps them (0.26 does)"
                )
        counts = self._counts
        if counts != self._flushed:  # a histogram's many buckets: only the grown ones
            now = counts.copy()  # first: what grows while this runs is the next flush's
            grown = list(map(sub, now, self._flushed))
            self._flushed = now
            for index in compress(range(len(grown)), grown):
                child._buckets[index].inc(grown[index])
        total, flushed_sum = self._sum, self._flushed_sum
        if total != flushed_sum:
            self._flushed_sum = total  # first, as `Tally._flush`
            child._sum.inc(total - flushed_sum)


class GaugeTally:
    """One gauge series (`gauge(metric, *labels)`), `set()` when its value changes: at once
    once prometheus-client is loaded; before that, the value waits here with the time it was
    set (what a `mostrecent` gauge of several workers compares), and a flush, scheduled
    now, writes it."""

    __slots__ = ("_child", "_labels", "_metric", "_pending")

    def __init__(self, metric: Metric | Gauge, labels: tuple[str, ...]) -> None:
        self._metric = metric
        self._labels = labels
        self._child: Gauge | None = None
        #: The value set before the series was bound, and when (seconds since the epoch).
        self._pending: tuple[float, float] | None = None

    def set(self, value: float) -> None:
        child = self._child
        if child is None:
            with _flush_lock:  # a flush in another thread may be binding it
                child = self._child
                if child is None:
                    self._pending = (float(value), time.time())
            if child is None:
                _flush_later()
                return
        child.set(value)

    def _flush(self) -> None:
        child = self._child
        if child is None:
            child = self._child = _child(self._metric, self._labels)
            if not hasattr(child, "_value"):
                raise RuntimeError("this prometheus-client's Gauge has no _value: guards needs 0.26's")
        pending = self._pending
        if pending is not None:
            self._pending = None
            # What `Gauge.set` writes (a `mostrecent` gauge's value with its time), at its time.
            child._value.set(pending[0], timestamp=pending[1])


AnyTally: TypeAlias = "Tally | HistogramTally | GaugeTally"
_tallies: dict[tuple[Source, tuple[str, ...]], AnyTally] = {}
_flush_lock = threading.Lock()
#: The metrics whose flush failed, each said once (`flush_metrics`): at most one per metric.
_failed_metrics: set[str] = set()
#: When the scheduled flush is overdue (`time.perf_counter()`); 0.0: none scheduled. A cell, so
#: that a request's end reads it without a call (`flush_soon` only when it is due).
FLUSH_DUE = [0.0]


def _child(metric: Source, labels: tuple[str, ...]) -> Any:
    """The prometheus-client series of `metric` with `labels` (the metric itself without)."""
    made = metric.made() if isinstance(metric, Metric) else metric
    return made.labels(*labels) if labels else made


def counter(metric: Metric | Counter, *labels: str) -> Tally:
    """The process's tally of `metric`'s series with `labels` (one per series, kept)."""
    tally = _tally(metric, labels, Tally)
    assert isinstance(tally, Tally)
    return tally


def stamped_counter(metric: Metric | Counter, *labels: str) -> StampedTally:
    """The process's tally of `metric`'s series with `labels`, keeping when it last grew."""
    tally = _tally(metric, labels, StampedTally)
    assert isinstance(tally, StampedTally)
    return tally


def gauge(metric: Metric | Gauge, *labels: str) -> GaugeTally:
    """The process's value of `metric`'s series with `labels` (one per series, kept)."""
    tally = _tally(metric, labels, GaugeTally)
    assert isinstance(tally, GaugeTally)
    return tally


def peek(metric: Metric | Counter, *labels: str) -> Tally | None:
    """The process's tally of `metric`'s series with `labels` if one was made (never makes one:
    reading must not add a series to the exposition)."""
    tally = _tallies.get((metric, labels))
    return tally if isinstance(tally, Tally) else None


def bucket_label(bound: float) -> str:
    """A histogram bucket's `le` as `counts` and `totals` key it (one spelling for this
    process's tallies and the workers' files)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


def counts(*metrics: Metric) -> dict[tuple[Metric, tuple[str, ...]], float]:
    """This process's count so far of every series of the counters `metrics` that has a
    tally, by `(metric, labels)`; of a histogram, each bucket's cumulative count, by `(metric,
    labels + (le,))` (call it from the event loop that updates them)."""
    wanted = set(metrics)
    found: dict[tuple[Metric, tuple[str, ...]], float] = {}
    for (metric, labels), tally in list(_tallies.items()):
        if metric not in wanted:
            continue
        if isinstance(tally, Tally):
            found[metric, labels] = tally.count
        elif isinstance(tally, HistogramTally):
            for key, count in tally.cumulative():
                found[metric, key] = count
    return found


def totals(*metrics: Metric) -> dict[tuple[Metric, tuple[str, ...]], float]:
    """Every worker's count so far of each series of the counters `metrics`, by `(metric,
    labels)`: in multiprocess mode the sums of the files all workers wrote (this process's
    tallies written first; the others' at most `FLUSH_INTERVAL_S` old), else this process's
    own. Reads files: call it off the event loop."""
    if not multiprocess():
        return counts(*metrics)
    flush_metrics()
    by_sample = {
        f"{metric._name}_bucket" if metric._kind == "Histogram" else f"{metric._name}_total": metric
        for metric in metrics
    }
    found: dict[tuple[Metric, tuple[str, ...]], float] = {}
    for family in worker_files().collect():
        for sample in family.samples:
            metric = by_sample.get(sample.name)
            if metric is not None:
                labels = tuple(sample.labels.get(name, "") for name in metric._labelnames)
                if metric._kind == "Histogram":  # a bucket: keyed by its `le` too
                    labels = (*labels, bucket_label(float(sample.labels["le"])))
                found[metric, labels] = found.get((metric, labels), 0.0) + sample.value
    return found


def histogram(metric: Metric | Histogram, *labels: str) -> HistogramTally:
    """The process's tally of `metric`'s series with `labels` (one per series, kept)."""
    tally = _tally(metric, labels, HistogramTally)
    assert isinstance(tally, HistogramTally)
    return tally


def _tally(metric: Any, labels: tuple[str, ...], make: Callable[[Any, tuple[str, ...]], AnyTally]) -> Any:
    tally = _tallies.get((metric, labels))
    if tally is None:
        tally = _tallies[metric, labels] = make(metric, labels)
    return tally


def flush_metrics() -> None:
    """Write this process's new counts to prometheus-client (any thread); the first flush
    imports it and binds every tally to its series (a series counted 0 included).

    An amount prometheus-client refuses (one no float holds, a negative one: a binding of the
    app's own may report any usage) is dropped from its series, which counts on from there,
    and said once per metric (`metrics_flush_failed`, never the amount): one series never
    stops the others."""
    with _flush_lock:
        _dropped_lines.count = dropped_lines()  # counted by `guards.observe._log`'s writer
        for tally in list(_tallies.values()):
            try:
                tally._flush()
            except (ArithmeticError, TypeError, ValueError) as error:
                name = getattr(tally._metric, "_name", "")
                if name not in _failed_metrics:
                    _failed_metrics.add(name)
                    emit_warning("metrics_flush_failed", metric=name, error=type(error).__name__)


def _flush_later() -> None:
    """`flush_soon` from a loop's thread; nothing outside one (the next request's does it)."""
    with contextlib.suppress(RuntimeError):  # no running event loop
        flush_soon(time.perf_counter())


def flush_soon(now: float) -> None:
    """Make sure a flush runs within FLUSH_INTERVAL_S (called once per request, in a loop;
    `now` is `time.perf_counter()`). While one is scheduled, this reads no event loop: only
    when the scheduled flush is overdue (its loop stopped before it ran, or lags) is another
    scheduled, on the running loop."""
    if now >= FLUSH_DUE[0]:
        FLUSH_DUE[0] = now + 2 * FLUSH_INTERVAL_S
        asyncio.get_running_loop().call_later(FLUSH_INTERVAL_S, _timed_flush)


def _timed_flush() -> None:
    FLUSH_DUE[0] = 0.0
    flush_metrics()


#: The log lines this process dropped (`guards.observe._log`), as a series.
_dropped_lines = counter(LOG_LINES_DROPPED)
