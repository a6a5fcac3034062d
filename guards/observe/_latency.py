"""Each model's latency over a window: the time to first output and to the whole answer, p50 and
p95 (`latency_figures`), read from the two latency histograms (`guards_model_first_output_seconds`,
`guards_model_answer_seconds`): what grew between two copies of their bucket counts.

The one function the status page reads its latency from, and the one a latency-aware balancer
or a hedge's delay will read: the same figures, from the same counts (every worker's in
prometheus-client's multiprocess mode, summed as `/metrics` sums them; else the answering
worker's). Bounded: a copy holds one count per model and bucket, whatever the traffic.

Resolution: a percentile is interpolated linearly within the bucket it falls in, as Prometheus'
`histogram_quantile` does, so it is off by less than that bucket's width: each bound of
`LATENCY_BUCKETS` is at most twice the one below it (10 to 20 ms at the bottom, 1 to 1.5 s in
the middle, 60 to 120 s at the top); past the last bound (120 s), the last bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from ._families import ANSWER_SECONDS, FIRST_OUTPUT_SECONDS
from ._prometheus import Metric

__all__ = ["LATENCY_METRICS", "ModelLatency", "latency_figures", "quantile"]

#: The histograms `latency_figures` reads (copy their counts with `counts` or `totals`).
LATENCY_METRICS = (FIRST_OUTPUT_SECONDS, ANSWER_SECONDS)

#: Counts as `counts` and `totals` give them: by (metric, (model, le)), cumulative per bucket.
Counts = Mapping[tuple[Metric, tuple[str, ...]], float]


class ModelLatency(NamedTuple):
    """One model's latency over a window, in seconds (None: no call in the window)."""

    #: Calls that produced a first output, and calls answered whole, in the window.
    first_outputs: int
    answers: int
    first_output_p50_s: float | None
    first_output_p95_s: float | None
    answer_p50_s: float | None
    answer_p95_s: float | None


def latency_figures(now: Counts, base: Counts) -> dict[str, ModelLatency]:
    """Each model's latency over the calls between two copies of the latency histograms'
    counts (`base` the older): models with no call in between are left out."""
    grown: dict[tuple[Metric, str], list[tuple[float, float]]] = {}
    for (metric, labels), count in now.items():
        if metric is FIRST_OUTPUT_SECONDS or metric is ANSWER_SECONDS:
            model, le = labels
            bound = math.inf if le == "+Inf" else float(le)
            grown.setdefault((metric, model), []).append((bound, count - base.get((metric, labels), 0.0)))
    found: dict[str, ModelLatency] = {}
    for model in sorted({model for _, model in grown}):
        first = sorted(grown.get((FIRST_OUTPUT_SECONDS, model), ()))
        whole = sorted(grown.get((ANSWER_SECONDS, model), ()))
        firsts, answers = round(first[-1][1]) if first else 0, round(whole[-1][1]) if whole else 0
        if firsts or answers:
            found[model] = ModelLatency(
                firsts,
                answers,
                quantile(first, 0.5),
                quantile(first, 0.95),
                quantile(whole, 0.5),
                quantile(whole, 0.95),
            )
    return found


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The `q` quantile of observations counted in cumulative `buckets` ((upper bound,
    observations at or below it), bounds rising, +Inf last), interpolated linearly within
    its bucket (from 0 for the first); None without observations. Past the last finite
    bound: that bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return round(
                lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count), 4
            )
        lower_bound, lower_count = bound, count
    return lower_bound
