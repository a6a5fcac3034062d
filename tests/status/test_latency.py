"""Each model's latency on the status page, over real HTTP against the fake providers: the time to
first output and to the whole answer, p50 and p95 over the recent window, per model, for calls
with known fake delays (whole answers and streams); the trend and its chart on the HTML page,
with the page's CSP as it was; and memory that many requests do not grow."""

from __future__ import annotations

import gc
import logging
import re
import tracemalloc
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.service import create_app
from fixtures import Fail, FakeBinding, FakeWorkersAI, Reply, Stream, Text
from guards import AI, Guards
from guards.stores import MemoryStore

from ..conftest import GUARDS_DIR, AppClient, no_sleep, wait_until, workers_ai_settings
from .test_status import HTML, JSON, TOKEN, model, status

#: Model names of these tests only (metrics are the process's: another test's calls to a
#: model would be another window's, but these keep the figures plainly theirs).
A = "@cf/test/latency-a"
B = "@cf/test/latency-b"


def latency(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = model(report, name)["latency"]
    return found


def example_client(fake: FakeWorkersAI, app_client: AppClient) -> httpx.Client:
    settings = workers_ai_settings(
        fake, ai_model=A, ai_fallback_models=B, breaker_failure_threshold=1, status_token=TOKEN
    )
    return app_client(create_app(settings, sleep=no_sleep))


def test_each_model_shows_its_p50_and_p95_of_the_last_window(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    """A answers after 20 ms eight times, then fails (its breaker opens); B then answers
    after 80 ms: each model's figures fall in its own range (the fake's delay, plus the
    loopback, within the histogram's resolution)."""
    client = example_client(fake_workers_ai, app_client)
    fake_workers_ai.script(A, *[Reply("Thank you.", delay_s=0.02)] * 8, Fail(code=5035, status=403))
    fake_workers_ai.default = Reply("Thank you.", delay_s=0.08)
    for _ in range(8 + 6):
        answered = client.post("/draft-reply", json={"message": "Where is my parcel?"})
        assert answered.status_code == 200, answered.text
    report = status(client)
    fast, slow = latency(report, A), latency(report, B)
    assert (fast["answers"], fast["first_outputs"]) == (8, 8)  # the failed call is no answer
    assert (slow["answers"], slow["first_outputs"]) == (6, 6)
    assert 0.02 <= fast["answer_p50_s"] <= 0.075, fast
    assert fast["answer_p50_s"] <= fast["answer_p95_s"] <= 0.2, fast
    assert 0.075 <= slow["answer_p50_s"] <= 0.2, slow
    assert slow["answer_p50_s"] <= slow["answer_p95_s"] <= 0.3, slow
    # A whole answer's first output is its arrival: the same figures.
    assert fast["first_output_p50_s"] == fast["answer_p50_s"]
    assert slow["first_output_p95_s"] == slow["answer_p95_s"]


def test_a_stream_times_its_first_output_and_its_end(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    """Three parts 60 ms apart after a 20 ms head: the first output comes at about 80 ms,
    the whole answer at about 200 ms."""
    client = example_client(fake_workers_ai, app_client)
    parts = (Text("Thank "), Text("you "), Text("for waiting."))
    fake_workers_ai.default = Stream(parts=parts, delay_s=0.02, interval_s=0.06)
    for _ in range(4):
        streamed = client.post("/draft-reply/stream", json={"message": "hi"})
        assert "event: done" in streamed.text
    figures = latency(status(client), A)
    assert (figures["first_outputs"], figures["answers"]) == (4, 4)
    assert 0.05 <= figures["first_output_p50_s"] <= 0.15, figures
    assert 0.15 <= figures["answer_p50_s"] <= 0.4, figures
    assert figures["first_output_p95_s"] < figures["answer_p50_s"]


def one_model_app(fake: FakeBinding, window_s: float) -> FastAPI:
    guards = Guards(fake, store=MemoryStore(), sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router(window_s=window_s))

    @app.post("/ask")
    @guards.route(model=A)
    async def ask(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    return app


def test_the_html_page_draws_the_trend_inline(fake_ai: FakeBinding, app_client: AppClient) -> None:
    """A 1-second window: a trend point every 0.2 s. Calls spread over several points give the
    model a chart: an inline SVG of numbers only, under the page's CSP as it was (nothing
    loaded, one script)."""
    client = app_client(one_model_app(fake_ai, window_s=1.0))
    fake_ai.default = Reply("hi", delay_s=0.03)

    def charted() -> bool:
        assert client.post("/ask").status_code == 200
        return len(latency(status(client), A)["trend"]) >= 3

    wait_until(charted, timeout_s=10)
    points = latency(status(client), A)["trend"]
    assert len(points) <= 60
    for point in points:
        # At least a step (0.2 s); more when the copying timer ran late (a loaded machine's
        # loop can be seconds late: no upper bound here).
        assert point["seconds"] >= 0.19, point
        assert 0.03 <= point["answer_p50_s"] <= 0.15, point
    assert [p["at"] for p in points] == sorted(p["at"] for p in points)
    page = client.get("/status", headers=HTML)
    (row,) = re.findall(r'<tr data-model="@cf/test/latency-a">.*?</tr>', page.text, re.S)
    assert "answer " in row
    (chart,) = re.findall(r'<svg class="trend".*?</svg>', row, re.S)
    assert chart.count("<polyline") == 2
    assert not re.search(r"\b(src|href)\s*=|url\(|<script", chart)
    assert page.text.count("<script>") == 1
    assert "default-src 'none'" in page.headers["content-security-policy"]


def library_memory() -> int:
    """Bytes allocated by guards' own code, less its test kit's (the fake keeps every call)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, f"{GUARDS_DIR}/*"), tracemalloc.Filter(False, f"{GUARDS_DIR}/testing/*")]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_many_requests_keep_the_latency_bounded(
    fake_ai: FakeBinding, app_client: AppClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The figures come from histogram counts: a hundred more requests add no memory to what
    guards holds. (The copies of the counts are bounded by time, not requests: `COPIES + 1` of
    the window, `TREND_POINTS + 1` of the trend; a window of 3,000 s takes none meanwhile.)
    Request lines are off: pytest's log capture keeps every line's text, which guards makes."""
    caplog.set_level(logging.WARNING, logger="guards")
    client = app_client(one_model_app(fake_ai, window_s=3000.0))
    fake_ai.default = Reply("hi")
    for _ in range(50):  # the warm-up: every series and copy made
        assert client.post("/ask").status_code == 200
    status(client)
    tracemalloc.start()
    try:
        before = library_memory()
        for _ in range(100):
            assert client.post("/ask").status_code == 200
        report = client.get("/status", headers=JSON).json()
        after = library_memory()
    finally:
        tracemalloc.stop()
    assert latency(report, A)["answers"] > 0
    assert len(latency(report, A)["trend"]) <= 60
    assert after - before < 16_000, f"{after - before} bytes more after 100 requests"
