"""Each model's latency on the status page: the time to first output and to the whole answer,
p50 and p95 over the recent window (5 minutes by default), and their trend over the last
`TREND_POINTS` steps of `window_s / 5` (an hour of minutes by default).

Every figure is `guards.observe._latency.latency_figures` over two copies of the latency
histograms' counts (`History`): the recent window's between the counts now and the window's
oldest copy, as the page's rates; each trend point's between two consecutive trend copies.
"""

from __future__ import annotations

import itertools

from pydantic import BaseModel, Field

from ..observe._latency import ModelLatency, latency_figures
from ._history import Reading

__all__ = ["Latency", "LatencyPoint", "latencies"]


class LatencyPoint(BaseModel):
    at: float = Field(description="The end of the point's interval, seconds since the epoch.")
    seconds: float = Field(description="The interval's length, in seconds.")
    first_output_p95_s: float | None = Field(
        description="The 95th percentile of the time to first output in the interval; null: no call."
    )
    answer_p50_s: float | None = Field(description="The median time to the whole answer; null: no answer.")
    answer_p95_s: float | None = Field(description="The 95th percentile of the time to the whole answer.")


class Latency(BaseModel):
    first_outputs: int = Field(description="Calls that produced a first output in the recent window.")
    answers: int = Field(description="Calls answered whole (kind ok) in the recent window.")
    first_output_p50_s: float | None = Field(
        description="Median seconds from a call's start to its first output (a stream's first "
        "part, a whole answer's arrival) in the recent window; null: no call."
    )
    first_output_p95_s: float | None = Field(description="Its 95th percentile.")
    answer_p50_s: float | None = Field(
        description="Median seconds from a call's start to its whole answer (a stream's end); null: none."
    )
    answer_p95_s: float | None = Field(description="Its 95th percentile.")
    trend: list[LatencyPoint] = Field(
        description="One point per window_s / 5 (a minute by default), the newest last, an hour at "
        "most; only intervals the page saw whole (none before its second copy)."
    )


def latencies(reading: Reading) -> dict[str, Latency]:
    """Each model's latency (by its chain key) in `reading`: those with no call in the recent
    window or the trend are left out."""
    recent = latency_figures(reading.now, reading.recent)
    trends: dict[str, list[LatencyPoint]] = {}
    trend = reading.trend
    for (before, older), (at, newer) in itertools.pairwise(trend):
        for model, figures in latency_figures(newer, older).items():
            trends.setdefault(model, []).append(
                LatencyPoint(
                    at=round(at, 3),
                    seconds=round(at - before, 1),
                    first_output_p95_s=figures.first_output_p95_s,
                    answer_p50_s=figures.answer_p50_s,
                    answer_p95_s=figures.answer_p95_s,
                )
            )
    empty = ModelLatency(0, 0, None, None, None, None)
    return {
        model: Latency(**recent.get(model, empty)._asdict(), trend=trends.get(model, []))
        for model in recent.keys() | trends.keys()
    }


#: A model with no call: no figure, no trend.
NO_LATENCY = Latency(
    first_outputs=0,
    answers=0,
    first_output_p50_s=None,
    first_output_p95_s=None,
    answer_p50_s=None,
    answer_p95_s=None,
    trend=[],
)
