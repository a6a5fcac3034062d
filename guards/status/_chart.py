"""A model's latency on the HTML status page: its figures, and its trend as a small inline SVG
chart (drawn on the server: no script, nothing loaded, only numbers in it, so the page's CSP
holds as it is)."""

from __future__ import annotations

import html

from ._latency import Latency

__all__ = ["latency_cell"]

#: The chart's size in CSS pixels, and the margin that keeps a line's stroke inside it.
_WIDTH, _HEIGHT, _PAD = 120.0, 28.0, 2.0


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def latency_cell(latency: Latency) -> str:
    """The latency cell of a model's row: p50 and p95 of the time to first output and to the
    whole answer, and the trend chart (none before two of its points)."""
    if not latency.first_outputs and not latency.answers:
        figures = '<span class="muted">no call</span>'
    else:
        figures = (
            f"first {html.escape(_ms(latency.first_output_p50_s))} / "
            f"{html.escape(_ms(latency.first_output_p95_s))}<br>"
            f"answer {html.escape(_ms(latency.answer_p50_s))} / {html.escape(_ms(latency.answer_p95_s))}"
        )
    return figures + _chart(latency)


def _chart(latency: Latency) -> str:
    """The trend as an SVG chart: the answer's p95 (solid) and the first output's (dashed),
    over the trend's span, scaled to the highest; empty below two points."""
    points = latency.trend
    if len(points) < 2:
        return ""
    first_at, last_at = points[0].at, points[-1].at
    span = max(last_at - first_at, 1e-9)
    highest = max(max(p.answer_p95_s or 0.0, p.first_output_p95_s or 0.0) for p in points) or 1e-9

    def line(values: list[tuple[float, float | None]]) -> str:
        found = [
            f"{_PAD + (at - first_at) / span * (_WIDTH - 2 * _PAD):.1f},"
            f"{_HEIGHT - _PAD - value / highest * (_HEIGHT - 2 * _PAD):.1f}"
            for at, value in values
            if value is not None
        ]
        return " ".join(found)

    answer = line([(p.at, p.answer_p95_s) for p in points])
    first = line([(p.at, p.first_output_p95_s) for p in points])
    minutes = round(span / 60)
    label = f"p95 over the last {minutes} min: answer (solid), first output (dashed); top {_ms(highest)}"
    return (
        f'<svg class="trend" width="{_WIDTH:g}" height="{_HEIGHT:g}" viewBox="0 0 {_WIDTH:g} {_HEIGHT:g}" '
        f'role="img" aria-label="{html.escape(label)}"><title>{html.escape(label)}</title>'
        f'<polyline points="{answer}" fill="none" stroke="currentColor" stroke-width="1.5"/>'
        f'<polyline points="{first}" fill="none" stroke="currentColor" stroke-width="1" '
        'stroke-dasharray="3 2" opacity="0.7"/></svg>'
    )
