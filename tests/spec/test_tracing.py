"""OpenTelemetry traces (GenAI semantic conventions) of the example app in process (ASGI), against
the fake providers over real HTTP, collected by the SDK's in-memory exporter: the tree of
a fallback chain with a retry, attributes, statuses, skipped models, streams, the caller's
`traceparent`, `x-trace-id`; no prompt or answer in any span; and, with tracing off, nothing
of OpenTelemetry imported at all.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NoOpTracerProvider, SpanKind, StatusCode
from pydantic import BaseModel

from app.service import create_app
from fixtures import Fail, FakeOpenAI, FakeWorkersAI, Reply, Stream, Text
from guards import AI, Guards
from guards.providers import WorkersAI

from ..conftest import AppClient, ExampleClient, no_sleep, workers_ai_settings
from ..e2e.test_shared_state import AppProcess, app_process_env

MODEL = "@cf/test/model"
FALLBACK = "gpt-4o-mini"
SERVED = "gpt-4o-mini-2024-07-18"
PROMPT_CANARY = "CANARY-PROMPT-5b1e07"
ANSWER_CANARY = "CANARY-ANSWER-c9d342"
#: A provider's error text and a budget key (the caller's x-user-id): in no span either.
MESSAGE_CANARY = "CANARY-MESSAGE-77a0e1"
KEY_CANARY = "CANARY-KEY-3f9b52"
TRANSIENT = Fail(code=3040, status=429, message=f"AiError: out of capacity {MESSAGE_CANARY}")
#: A caller's W3C trace context: the request span joins this trace, under this span.
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(spans: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    yield provider
    provider.shutdown()


@pytest.fixture
def client(example_client: ExampleClient, fake_openai: FakeOpenAI, provider: TracerProvider) -> httpx.Client:
    return example_client(
        ai_fallback_models=f"openai:{FALLBACK}",
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key,
        breaker_failure_threshold=1,
        tracer_provider=provider,
    )


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def finished(spans: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The spans exported so far, once there are `count` (a stream's end in the server's
    thread may come just after the client read its last event)."""
    deadline = time.monotonic() + 5
    while len(spans.get_finished_spans()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    found = list(spans.get_finished_spans())
    assert len(found) == count, [span.name for span in found]
    return found


def route_span(found: list[ReadableSpan]) -> ReadableSpan:
    (span,) = [span for span in found if span.name == "guards.route"]
    return span


def attempts(found: list[ReadableSpan]) -> list[ReadableSpan]:
    """The attempt spans, in the order they started."""
    return sorted((span for span in found if span.kind is SpanKind.CLIENT), key=lambda s: s.start_time or 0)


def assert_no_content(found: list[ReadableSpan]) -> None:
    """Neither the prompt, the answer, a provider's message nor a budget key anywhere in the
    spans (names, attributes, events, statuses)."""
    text = json.dumps([json.loads(span.to_json()) for span in found])
    for canary in (PROMPT_CANARY, ANSWER_CANARY, MESSAGE_CANARY, KEY_CANARY):
        assert canary not in text
    for span in found:
        assert not [key for key in span.attributes or {} if key.startswith(("gen_ai.input", "gen_ai.output"))]
        assert "gen_ai.system_instructions" not in (span.attributes or {})


def test_a_fallback_chain_with_a_retry_is_one_tree(
    client: httpx.Client,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    spans: InMemorySpanExporter,
) -> None:
    fake_workers_ai.script(MODEL, TRANSIENT, TRANSIENT)
    fake_openai.script(
        FALLBACK,
        Reply(
            f"Sure. {ANSWER_CANARY}",
            model=SERVED,
            usage={"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38},
        ),
    )
    response = client.post(
        "/draft-reply",
        json={"message": f"Where is my parcel? {PROMPT_CANARY}"},
        headers={"traceparent": TRACEPARENT, "x-user-id": KEY_CANARY},
    )
    assert response.status_code == 200, response.text
    assert response.json()["attempts"] == 3
    found = finished(spans, 4)

    route = route_span(found)
    # The request joined the caller's trace, under the caller's span; x-trace-id is its id.
    assert hex_id(route.context.trace_id, 32) == CALLER_TRACE == response.headers["x-trace-id"]
    assert route.parent is not None
    assert route.parent.is_remote
    assert hex_id(route.parent.span_id, 16) == CALLER_SPAN
    assert route.kind is SpanKind.INTERNAL
    # The gateway span: the requested model (the chain's first) and the effective one.
    assert dict(route.attributes or {}) == {
        "guards.route": "draft_reply",
        "guards.outcome": "ok",
        "guards.attempts": 3,
        "http.response.status_code": 200,
        "guards.service_level": "full",
        "gen_ai.gateway.request.model": MODEL,
        "guards.model": f"openai:{FALLBACK}",
        "gen_ai.response.model": SERVED,
    }
    assert route.status.status_code is StatusCode.UNSET

    first, retry, fallback = attempts(found)
    for span in (first, retry, fallback):
        assert span.parent is not None
        assert span.parent.span_id == route.context.span_id
        assert span.context.trace_id == route.context.trace_id
    assert [span.name for span in (first, retry, fallback)] == [
        f"chat {MODEL}",
        f"chat {MODEL}",
        f"chat {FALLBACK}",
    ]
    for number, span in enumerate((first, retry), 1):
        assert dict(span.attributes or {}) == {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "cloudflare.workers_ai",
            "gen_ai.request.model": MODEL,
            "guards.model": MODEL,
            "guards.attempt.number": number,
            "guards.attempt.retry": number == 2,
            "guards.attempt.fallback": False,
            "guards.attempt.outcome": "model_temporarily_unavailable",
            "error.type": "model_temporarily_unavailable",
        }
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "model_temporarily_unavailable"
    assert dict(fallback.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": FALLBACK,
        "guards.model": f"openai:{FALLBACK}",
        "guards.attempt.number": 3,
        "guards.attempt.retry": False,
        "guards.attempt.fallback": True,
        "gen_ai.response.model": SERVED,
        "gen_ai.usage.input_tokens": 31,
        "gen_ai.usage.output_tokens": 7,
        "gen_ai.response.finish_reasons": ("stop",),
        "guards.attempt.outcome": "ok",
    }
    assert fallback.status.status_code is StatusCode.UNSET
    # Each attempt lies within the request's span.
    assert route.start_time is not None
    assert route.end_time is not None
    for span in (first, retry, fallback):
        assert span.start_time is not None
        assert span.end_time is not None
        assert route.start_time <= span.start_time <= span.end_time <= route.end_time
    assert_no_content(found)


def test_skipped_models_are_child_spans_and_a_public_error_is_the_span_status(
    client: httpx.Client,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    spans: InMemorySpanExporter,
) -> None:
    # The first model is incompatible (its breaker opens at once), the fallback rate-limited
    # (it cools down): the next request skips both without a call.
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403))
    fake_openai.script(FALLBACK, Fail(status=429))
    first = client.post("/draft-reply", json={"message": f"hi {PROMPT_CANARY}"})
    assert first.status_code == 503
    assert first.json()["error"] == "model_rate_limited"
    found = finished(spans, 3)
    route = route_span(found)
    assert route.status.status_code is StatusCode.ERROR
    assert route.status.description == "model_rate_limited"
    assert (route.attributes or {})["error.type"] == "model_rate_limited"
    assert (route.attributes or {})["guards.fallback.guard"] == "call"
    assert (route.attributes or {})["guards.fallback.reason"] == "provider_error"
    assert (route.attributes or {})["http.response.status_code"] == 503
    kinds = [(span.attributes or {})["error.type"] for span in attempts(found)]
    assert kinds == ["model_incompatible", "model_rate_limited"]

    spans.clear()
    skipped = client.post("/draft-reply", json={"message": "hi"})
    assert skipped.status_code == 503
    assert skipped.json()["error"] == "circuit_open"
    found = finished(spans, 3)  # no call: no CLIENT span, a skip span per model
    route = route_span(found)
    assert not attempts(found)
    skips = sorted((span for span in found if span is not route), key=lambda s: s.start_time or 0)
    assert [span.name for span in skips] == [f"guards.skip {MODEL}", f"guards.skip openai:{FALLBACK}"]
    for span, model, key, reason in (
        (skips[0], MODEL, MODEL, "circuit_open"),
        (skips[1], FALLBACK, f"openai:{FALLBACK}", "cooldown"),
    ):
        assert span.kind is SpanKind.INTERNAL
        assert span.parent is not None
        assert span.parent.span_id == route.context.span_id
        attributes = dict(span.attributes or {})
        assert attributes.pop("guards.retry_after_s") > 0
        assert attributes == {
            "gen_ai.request.model": model,
            "guards.model": key,
            "guards.attempt.skipped": True,
            "guards.attempt.fallback": key != MODEL,
            "guards.skip.reason": reason,
            "guards.attempt.outcome": "skipped",
        }
    assert not route.events
    attributes = dict(route.attributes or {})
    assert attributes["gen_ai.gateway.request.model"] == MODEL
    assert "guards.model" not in attributes  # no model answered: no effective model
    assert "gen_ai.response.model" not in attributes
    assert attributes["guards.outcome"] == "error"
    assert attributes["guards.fallback.guard"] == "budget"
    assert attributes["guards.fallback.reason"] == "circuit_open"
    assert attributes["guards.attempts"] == 0
    assert_no_content(found)


def test_a_stream_attempt_ends_with_its_stream(
    client: httpx.Client,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    spans: InMemorySpanExporter,
) -> None:
    """The attempt committed at the first word, but its span ends when the stream does: cut
    after two parts, it carries the failure and what was delivered."""
    parts = (Text("Thank "), Text(f"you {ANSWER_CANARY}"), Text(" for waiting."))
    fake_workers_ai.script(MODEL, Stream(parts=parts, cut_after=2))
    response = client.post("/draft-reply/stream", json={"message": f"hi {PROMPT_CANARY}"})
    assert response.status_code == 200
    assert "event: error" in response.text
    found = finished(spans, 2)
    route = route_span(found)
    (attempt,) = attempts(found)
    assert hex_id(route.context.trace_id, 32) == response.headers["x-trace-id"]
    attributes = dict(attempt.attributes or {})
    assert attributes["guards.stream.delivered_chars"] == len("Thank ") + len(f"you {ANSWER_CANARY}")
    assert attributes["error.type"] == "model_temporarily_unavailable"
    assert attributes["guards.attempt.outcome"] == "model_temporarily_unavailable"
    assert attributes["gen_ai.response.time_to_first_chunk"] > 0
    assert attempt.status.status_code is StatusCode.ERROR
    assert (route.attributes or {})["guards.outcome"] == "error"
    assert (route.attributes or {})["guards.fallback.reason"] == "provider_error"
    assert route.status.status_code is StatusCode.UNSET  # a 200 whose stream ended in `error`
    assert attempt.end_time is not None
    assert route.end_time is not None
    assert attempt.end_time <= route.end_time

    spans.clear()  # that failure opened the first model's breaker: the fallback streams
    fake_openai.script(
        FALLBACK, Stream(parts=(Text("Sure."),), usage={"prompt_tokens": 4, "completion_tokens": 2})
    )
    whole = client.post("/draft-reply/stream", json={"message": "hi"})
    assert "event: done" in whole.text
    found = finished(spans, 3)  # the route, the first model's skip (its breaker), the fallback
    (attempt,) = attempts(found)
    (skip,) = [span for span in found if span.name == f"guards.skip {MODEL}"]
    assert (skip.attributes or {})["guards.skip.reason"] == "circuit_open"
    attributes = dict(attempt.attributes or {})
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["guards.attempt.fallback"] is True
    assert attributes["guards.stream.delivered_chars"] == len("Sure.")
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["gen_ai.usage.input_tokens"] == 4
    assert attributes["gen_ai.usage.output_tokens"] == 2
    assert attributes["guards.attempt.outcome"] == "ok"
    assert "error.type" not in attributes
    assert_no_content(found)


class Triage(BaseModel):
    label: str
    urgent: bool


def test_a_rejected_answer_is_its_attempts_outcome(
    fake_workers_ai: FakeWorkersAI,
    provider: TracerProvider,
    spans: InMemorySpanExporter,
    app_client: AppClient,
) -> None:
    """An answer the output guard rejects, on a route that moves it on: its attempt's span
    ends once the walk judged it, with `rejected` as its outcome; the next model's answer is
    the effective one."""
    binding = WorkersAI(
        account_id=fake_workers_ai.account_id,
        api_token=fake_workers_ai.api_token,
        base_url=fake_workers_ai.base_url,
    )
    guards = Guards(binding, sleep=no_sleep, tracing=provider)
    app = FastAPI()
    guards.install(app)
    second = "@cf/test/second"

    @app.post("/triage")
    @guards.route(model=MODEL, fallbacks=[second], on_rejected="next_model")
    async def triage(ai: AI[Triage]) -> Triage:
        return await ai.run({"prompt": f"triage {PROMPT_CANARY}"})

    fake_workers_ai.script(MODEL, Reply({"label": ANSWER_CANARY}))  # no `urgent`: rejected
    fake_workers_ai.script(second, Reply({"label": "billing", "urgent": False}))
    answered = app_client(app).post("/triage")
    assert answered.status_code == 200, answered.text
    found = finished(spans, 3)
    rejected, accepted = attempts(found)
    assert (rejected.attributes or {})["guards.attempt.outcome"] == "rejected"
    assert (rejected.attributes or {})["error.type"] == "rejected"
    assert rejected.status.status_code is StatusCode.ERROR
    assert (accepted.attributes or {})["guards.attempt.outcome"] == "ok"
    route = dict(route_span(found).attributes or {})
    assert (route["gen_ai.gateway.request.model"], route["guards.model"]) == (MODEL, second)
    assert_no_content(found)


def test_an_invalid_request_is_a_span_too(client: httpx.Client, spans: InMemorySpanExporter) -> None:
    response = client.post("/draft-reply", json={"message": ""}, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 400
    (route,) = finished(spans, 1)
    assert response.headers["x-trace-id"] == response.json()["trace_id"] == CALLER_TRACE
    assert dict(route.attributes or {}) == {
        "guards.route": "draft_reply",
        "guards.outcome": "invalid",
        "guards.attempts": 0,
        "http.response.status_code": 400,
        "gen_ai.gateway.request.model": MODEL,
    }


def test_without_a_traceparent_each_request_is_a_trace_of_its_own(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, spans: InMemorySpanExporter
) -> None:
    fake_workers_ai.default = Reply("Sure.")
    given = client.post("/draft-reply", json={"message": "hi"}, headers={"x-trace-id": "client-chosen-id"})
    other = client.post("/draft-reply", json={"message": "hi"})
    found = [span for span in finished(spans, 4) if span.name == "guards.route"]
    assert [span.parent for span in found] == [None, None]
    ids = [hex_id(span.context.trace_id, 32) for span in found]
    # Tracing on, x-trace-id is the span's trace id (send traceparent to join a trace).
    assert ids == [given.headers["x-trace-id"], other.headers["x-trace-id"]]
    assert ids[0] != ids[1]


@pytest.mark.parametrize("unrecorded", ["no-op API", "sampled out"])
def test_a_request_no_span_records_keeps_the_callers_trace_id(
    unrecorded: str, fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    """With the API's no-op tracer (no SDK set up), or a sampler that drops the request, no
    span is recorded and nothing more is done; x-trace-id still follows the caller's trace."""
    spans = InMemorySpanExporter()
    provider: Any = NoOpTracerProvider()
    if unrecorded == "sampled out":
        provider = TracerProvider(sampler=ALWAYS_OFF)
        provider.add_span_processor(SimpleSpanProcessor(spans))
    fake_workers_ai.default = Reply("Sure.")
    client = app_client(
        create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep, tracer_provider=provider)
    )
    joined = client.post("/draft-reply", json={"message": "hi"}, headers={"traceparent": TRACEPARENT})
    assert joined.status_code == 200
    assert joined.headers["x-trace-id"] == CALLER_TRACE
    alone = client.post("/draft-reply", json={"message": "hi"}, headers={"x-trace-id": "client-chosen-id"})
    assert alone.status_code == 200
    if unrecorded == "no-op API":  # no trace at all: the request's own id, as with tracing off
        assert alone.headers["x-trace-id"] == "client-chosen-id"
    assert spans.get_finished_spans() == ()


# --- tracing off: nothing imported, nothing set up ----------------------------------------------

#: Serves one request with tracing off, and prints each import of OpenTelemetry that guards' or
#: the example app's own code made. (FastAPI >= 0.16x depends on opentelemetry-api and imports
#: it itself, so the check is on who imports, not on `sys.modules`: every import statement of
#: a module under guards/ or app/ is seen, whether or not the module was loaded already.)
NO_OTEL = textwrap.dedent(
    """
    import asyncio, builtins, os
    import fastapi, httpx
    OURS = tuple(os.path.join(os.getcwd(), name) + os.sep for name in ("guards", "app"))
    imported = []
    real_import = builtins.__import__

    def watching(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {{}}).get("__file__") or ""
        if level == 0 and name.split(".")[0] == "opentelemetry" and importer.startswith(OURS):
            imported.append((name, importer))
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = watching
    {setup}
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answered = await client.post("/draft-reply", json={{"message": "hi"}})
            assert answered.status_code == 200, answered.text
            assert len(answered.headers["x-trace-id"]) == 32
    asyncio.run(main())
    # The app's log lines are written by guards' writer thread: let it finish first, then
    # print the finding in one write so that no line can land in the middle of it.
    from guards import flush_logs
    flush_logs()
    import sys
    sys.stdout.write(repr(imported) + "\\n")
    """
)


@pytest.mark.parametrize(
    "setup",
    [
        # The library alone: a guarded route answering a request, tracing off (the default).
        """
        from fixtures import FakeBinding
        from guards import AI, Guards
        guards = Guards(FakeBinding())
        app = fastapi.FastAPI()
        guards.install(app)
        @app.post("/draft-reply")
        @guards.route(model="@cf/test/model")
        async def draft_reply(ai: AI[str]) -> str:
            return await ai.run({"prompt": "hi"})
        """,
        # The example app with OTEL_TRACES_EXPORTER unset.
        """
        from app.service import create_app
        app = create_app()
        """,
    ],
    ids=["guards", "example-app"],
)
def test_tracing_off_imports_nothing_of_opentelemetry(setup: str) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    script = NO_OTEL.format(setup=textwrap.dedent(setup))
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # The script prints the modules it found; the app's log lines (JSON objects) may follow it.
    assert [line for line in done.stdout.splitlines() if line.startswith("[")] == ["[]"]


def test_the_import_check_sees_an_import_by_guards() -> None:
    """The check above can fail: with tracing on, guards' own code imports the API."""
    setup = NO_OTEL.split("{setup}")[0].replace("{{", "{").replace("}}", "}")  # as `format` leaves it
    script = textwrap.dedent(setup) + textwrap.dedent(
        """
        from fixtures import FakeBinding
        from guards import Guards
        Guards(FakeBinding(), tracing=True)
        print(imported)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "_tracing.py" in done.stdout


def test_tracing_without_the_opentelemetry_api_says_what_to_install() -> None:
    script = textwrap.dedent(
        """
        import builtins
        import fastapi  # (which needs the API itself, from FastAPI 0.16x on)
        real_import = builtins.__import__

        def without_otel(name, globals=None, *args):
            # The API is not installed, as far as guards can tell.
            if name.startswith("opentelemetry") and (globals or {}).get("__name__", "").startswith("guards"):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return real_import(name, globals, *args)

        builtins.__import__ = without_otel
        from fixtures import FakeBinding
        from guards import ConfigurationError, Guards
        Guards(FakeBinding())  # off: fine
        try:
            Guards(FakeBinding(), tracing=True)
        except ConfigurationError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'route-guards[otel]'" in done.stdout


# --- the example app: OTEL_TRACES_EXPORTER ------------------------------------------------------


def console_spans(text: str) -> list[dict[str, Any]]:
    """The spans the SDK's console exporter printed (JSON objects over several lines) among the
    app's JSON log lines."""
    decoder = json.JSONDecoder()
    found, index = [], 0
    while (start := text.find("{\n", index)) != -1:
        value, index = decoder.raw_decode(text, start)
        if isinstance(value, dict) and "context" in value:
            found.append(value)
    return found


def test_the_example_app_traces_to_the_console_when_asked(
    tmp_path: Path, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = Reply("Sure.")
    env = app_process_env(
        fake_workers_ai, "memory://", OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="support"
    )
    out = tmp_path / "stdout"
    with out.open("wb") as stdout:
        app = AppProcess(env, stdout=stdout)
        try:
            app.wait_ready()
            response = httpx.post(
                f"{app.url}/draft-reply", json={"message": f"hi {PROMPT_CANARY}"}, timeout=10
            )
            assert response.status_code == 200
        finally:
            app.stop()  # the lifespan's shutdown exports what is still batched
    trace_id = "0x" + response.headers["x-trace-id"]
    printed = [span for span in console_spans(out.read_text()) if span["context"]["trace_id"] == trace_id]
    by_name = {span["name"]: span for span in printed}
    # FastAPI's own server span (its native telemetry, on once a global provider is set), the
    # request's span under it, the attempt under that.
    assert {"POST /draft-reply", "guards.route", f"chat {MODEL}"} <= set(by_name)
    route, attempt = by_name["guards.route"], by_name[f"chat {MODEL}"]
    assert attempt["parent_id"] == route["context"]["span_id"]
    assert route["attributes"]["guards.outcome"] == "ok"
    assert attempt["attributes"]["gen_ai.provider.name"] == "cloudflare.workers_ai"
    assert {span["resource"]["attributes"]["service.name"] for span in printed} == {"support"}
    assert PROMPT_CANARY not in out.read_text()  # neither in a span nor in a log line


# --- OTLP over loopback: what a collector receives -----------------------------------------------


class _OTLPReceiver(ThreadingHTTPServer):
    """The receiving end of OTLP/HTTP (`POST /v1/traces`, protobuf), on loopback: each export
    decoded to its OTLP/JSON form (what `docs/operating/traces.md` shows)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", 0), _OTLPHandler)


class _OTLPHandler(BaseHTTPRequestHandler):
    server: _OTLPReceiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        found = json_format.MessageToDict(export)
        for resource in found["resourceSpans"]:  # ids in hex, as OTLP/JSON writes them
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    for name in ("traceId", "spanId", "parentSpanId"):
                        if name in span:
                            span[name] = base64.b64decode(span[name]).hex()
        self.server.received.append(found)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def otlp_attributes(span: dict[str, Any]) -> dict[str, Any]:
    """An OTLP/JSON span's attributes as plain values."""
    found: dict[str, Any] = {}
    for attribute in span.get("attributes", []):
        ((kind, value),) = attribute["value"].items()
        found[attribute["key"]] = (
            [next(iter(v.values())) for v in value["values"]] if kind == "arrayValue" else value
        )
    return found


def otlp_export(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> list[dict[str, Any]]:
    """What the SDK's OTLP/HTTP exporter sends over loopback for a request to the example app
    whose first model fails transiently, is retried, fails again, and whose fallback answers:
    each export as OTLP/JSON."""
    receiver = _OTLPReceiver()
    serving = threading.Thread(target=receiver.serve_forever, daemon=True)
    serving.start()
    provider = TracerProvider()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5)))
    try:
        client = example_client(
            ai_fallback_models=f"openai:{FALLBACK}",
            openai_base_url=fake_openai.base_url,
            openai_api_key=fake_openai.api_key,
            tracer_provider=provider,
        )
        fake_workers_ai.script(MODEL, TRANSIENT, TRANSIENT)
        fake_openai.script(
            FALLBACK,
            Reply(ANSWER_CANARY, model=SERVED, usage={"prompt_tokens": 31, "completion_tokens": 7}),
        )
        response = client.post(
            "/draft-reply", json={"message": f"hi {PROMPT_CANARY}"}, headers={"x-user-id": KEY_CANARY}
        )
        assert response.status_code == 200
    finally:
        provider.shutdown()
        receiver.shutdown()
        receiver.server_close()
    return receiver.received


def otlp_spans(received: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """guards' spans in OTLP/JSON exports, in the order they started."""
    spans = [
        span
        for export in received
        for resource in export["resourceSpans"]
        for scope in resource["scopeSpans"]
        if scope["scope"]["name"] == "guards"
        for span in scope["spans"]
    ]
    return sorted(spans, key=lambda span: int(span["startTimeUnixNano"]))


def test_a_retry_and_a_fallback_exported_over_otlp(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """The SDK's OTLP/HTTP exporter sends the request's trace over loopback: the gateway span
    and its three attempt children arrive with the documented attributes, and nothing else."""
    received = otlp_export(example_client, fake_workers_ai, fake_openai)
    text = json.dumps(received)
    if dump := os.environ.get("GUARDS_OTLP_DUMP"):  # the trace docs/operating/traces.md shows
        Path(dump).write_text(json.dumps(received, indent=1))
    for canary in (PROMPT_CANARY, ANSWER_CANARY, MESSAGE_CANARY, KEY_CANARY):
        assert canary not in text
    spans = otlp_spans(received)
    by_name = {span["name"]: span for span in spans}
    route = by_name["guards.route"]
    assert route["traceId"]
    assert len(spans) == 4
    assert {span["name"] for span in spans} == {"guards.route", f"chat {MODEL}", f"chat {FALLBACK}"}
    assert otlp_attributes(route)["gen_ai.gateway.request.model"] == MODEL
    assert otlp_attributes(route)["gen_ai.response.model"] == SERVED
    children = sorted(
        (span for span in spans if span is not route), key=lambda span: int(span["startTimeUnixNano"])
    )
    assert all(span["parentSpanId"] == route["spanId"] for span in children)
    assert [otlp_attributes(span)["guards.attempt.number"] for span in children] == ["1", "2", "3"]
    assert [otlp_attributes(span)["guards.attempt.outcome"] for span in children] == [
        "model_temporarily_unavailable",
        "model_temporarily_unavailable",
        "ok",
    ]


def test_each_attempt_span_names_its_deployment(
    example_client: ExampleClient,
    fake_workers_ai: FakeWorkersAI,
    provider: TracerProvider,
    spans: InMemorySpanExporter,
) -> None:
    """A deployment that fails, then the group's other one that answers: two attempt spans,
    each naming its deployment, neither a fallback."""
    client = example_client(ai_deployments="east=1,west=1", tracer_provider=provider)
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403), Reply("Sure."))
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert response.status_code == 200, response.text
    calls = attempts(finished(spans, 3))
    named = [span.attributes["guards.deployment"] for span in calls if span.attributes]
    assert sorted(named) == ["draft/east", "draft/west"]
    assert named[-1] == response.headers["x-ai-deployment"]
    # Both deployments are of the chain's first entry: neither call is a fallback.
    assert [span.attributes["guards.attempt.fallback"] for span in calls if span.attributes] == [False, False]
    assert "x-ai-fallback" not in response.headers
    assert [span.attributes["guards.attempt.outcome"] for span in calls if span.attributes] == [
        "model_incompatible",
        "ok",
    ]
