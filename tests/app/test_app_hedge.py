"""The example app's `AI_HEDGE_AFTER_S` (read and checked with `AI_FIRST_OUTPUT_S`, in
tests/app/test_app_chains.py): set, a call to the chain's first model with no answer after it
asks the next model too, served over real HTTP (uvicorn, the fake Workers AI server), and the
first call is closed; unset, no hedge; the hedge's attempt span says it is one."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from fixtures import FakeWorkersAI, Hang, Reply

from ..conftest import ExampleClient

MODEL, BACKUP = "@cf/test/model", "@cf/test/backup"


@pytest.mark.parametrize("hedge_after_s", [None, 0.2])
def test_ai_hedge_after_s_hedges_a_slow_first_model(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI, hedge_after_s: float | None
) -> None:
    """The first model answers after 1.5 s: with AI_HEDGE_AFTER_S=0.2, the backup's answer comes
    about 0.2 s after the request, and the first model's connection is closed; unset, the first
    model's answer after 1.5 s, and the backup never called."""
    settings = {} if hedge_after_s is None else {"ai_hedge_after_s": hedge_after_s}
    # A deadline whose first-output share (8 s / 3) lets the first model answer.
    client = example_client(ai_fallback_models=BACKUP, ai_timeout_s=8.0, socket=True, **settings)
    fake_workers_ai.script(MODEL, Reply("Slow but sure.", delay_s=1.5))
    fake_workers_ai.script(BACKUP, Reply("From the backup."))
    started = time.monotonic()
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    if hedge_after_s is None:
        assert response.json()["reply"] == "Slow but sure."
        assert elapsed >= 1.5
        assert fake_workers_ai.calls_to(BACKUP) == []
    else:
        assert response.json()["reply"] == "From the backup."
        assert response.headers["x-ai-fallback"] == BACKUP
        assert hedge_after_s <= elapsed < 1.5
        assert fake_workers_ai.wait_for(lambda calls: calls[0].disconnected, 1.0)


def test_the_hedges_attempt_span_says_it_is_one(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    """With tracing on: one attempt span per call, the hedge's with `guards.attempt.hedge`, the
    first call's ended as cancelled."""
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    client = example_client(
        ai_fallback_models=BACKUP, ai_timeout_s=8.0, ai_hedge_after_s=0.1, tracer_provider=provider
    )
    fake_workers_ai.script(MODEL, Hang())
    fake_workers_ai.script(BACKUP, Reply("From the backup."))
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert response.status_code == 200, response.text
    provider.shutdown()  # every span ended and exported
    found = {
        span.attributes["guards.model"]: dict(span.attributes)
        for span in exported.get_finished_spans()
        if span.kind is SpanKind.CLIENT and span.attributes is not None
    }
    assert found[BACKUP]["guards.attempt.hedge"] is True
    assert found[BACKUP]["guards.attempt.outcome"] == "ok"
    assert "guards.attempt.hedge" not in found[MODEL]
    assert found[MODEL]["guards.attempt.outcome"] == "cancelled"
