"""Prometheus metrics: exact counts per label set through HTTP requests, in one process and across
uvicorn worker processes (multiprocess mode), labels free of user data, and alert rules that
name only metrics and labels guards exports.

The default registry is process-global and other tests count too, so the in-process test
compares scrapes before and after its requests (deltas), never absolute values.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

import guards.observe._metrics
import guards.observe._prometheus
from app.service import create_app
from fixtures import Fail, FakeWorkersAI, ManualClock, Reply
from guards import AI, CircuitState, GuardName, Guards, Kind, Price, Reason, Retry, render_metrics
from guards.providers import WorkersAI
from guards.stores import MemoryStore

from ..conftest import AppClient, no_sleep, wait_until, workers_ai_settings
from ..e2e.test_shared_state import MODEL, AppProcess, app_process_env, burst

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
CANARY = "CANARY-METRICS-7f3a91"
SUMMARY = Reply({"label": "billing", "confidence": 0.9})
#: Not the route's schema: an empty label and a confidence above 1.
INVALID_SUMMARY = Reply({"label": "", "confidence": 2})
INCOMPATIBLE = Fail(code=5035, status=403)
#: How long another worker's counts may take to reach the shared files (see FLUSH_INTERVAL_S).
FLUSHED_S = guards.observe._metrics.FLUSH_INTERVAL_S + 5
TRANSIENT = Fail(code=3040, status=429)

Series = tuple[str, tuple[tuple[str, str], ...]]


def series(name: str, **labels: str) -> Series:
    return name, tuple(sorted(labels.items()))


def parse(text: str) -> dict[Series, float]:
    """Every `guards_*` sample of an exposition, by (sample name, sorted labels)."""
    return {
        series(sample.name, **sample.labels): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("guards_") and not sample.name.endswith("_created")
    }


#: The label names guards' metrics may carry: each takes its values from a closed set.
LABELS = frozenset(
    {
        "route",
        "outcome",
        "guard",
        "reason",
        "model",
        "kind",
        "action",
        "le",
        "position",
        "type",
        "to",
        "tier",
        "hint",
        "scope",  # a budget's scope: a name the app configured, never a budget key
        "unit",  # tokens, spend
        "store",  # the store's kind (redis, sqlite): never its URL
        "what",  # a resumable stream's events, writes, dropped
    }
)


def scrape(client: httpx.Client) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return response.text


def delta(before: Mapping[Series, float], after: Mapping[Series, float]) -> dict[Series, float]:
    changed = {key: value - before.get(key, 0.0) for key, value in after.items()}
    return {key: value for key, value in changed.items() if value}


def counters(samples: Mapping[Series, float]) -> dict[Series, float]:
    """Counter samples, and the `_count` of histograms (their buckets follow from timing)."""
    return {
        key: value
        for key, value in samples.items()
        if key[0].endswith("_total") or (key[0].endswith("_count") and "duration" in key[0])
    }


def assert_no_user_data(text: str, *secrets: str) -> None:
    """No label carries a user's text, a budget key or a free-text detail."""
    for secret in secrets:
        assert secret not in text
    for (name, labels), _ in parse(text).items():
        assert {label for label, _ in labels} <= LABELS, name
        for label, value in labels:
            assert len(value) <= 80, (name, label)
            assert "attempt(s)" not in value
            assert "code=" not in value


# --- one process, in process through ASGI ----------------------------------------------------


def test_counts_per_label_set_are_exact(fake_workers_ai: FakeWorkersAI, app_client: AppClient) -> None:
    client = app_client(create_app(workers_ai_settings(fake_workers_ai, daily_call_limit=3), sleep=no_sleep))
    user = {"x-user-id": f"{CANARY}-user"}
    before = scrape(client)

    def summary() -> dict[str, Any]:
        response = client.post("/summary", json={"text": f"refund {CANARY}"}, headers=user)
        assert response.status_code == 200
        return dict(response.json())

    def draft() -> httpx.Response:
        return client.post("/draft-reply", json={"message": f"hello {CANARY}"})

    fake_workers_ai.script(MODEL, SUMMARY, INCOMPATIBLE, INVALID_SUMMARY)
    assert summary()["fallback"] is None
    provider_error = summary()["fallback"]
    assert provider_error["guard"] == "call"
    assert provider_error["reason"] == "provider_error"
    assert summary()["fallback"]["reason"] == "schema_invalid"
    assert summary()["fallback"]["reason"] == "budget_exceeded"  # daily cap of 3: no call
    fake_workers_ai.script(MODEL, Reply("Sure."), TRANSIENT, Reply("Sure."), INCOMPATIBLE)
    assert draft().json()["attempts"] == 1
    assert draft().json()["attempts"] == 2  # 3040, retried once, then answered
    assert draft().status_code == 502  # 5035: model_incompatible, a public error
    assert len(fake_workers_ai.calls) == 7
    # Two 400s before any handler: an invalid field, and a body over the route's 1 MiB limit.
    assert client.post("/draft-reply", json={"message": ""}).status_code == 400
    oversized = client.post(
        "/draft-reply", content=b"x" * (1 << 21), headers={"content-type": "application/json"}
    )
    assert oversized.status_code == 400
    assert oversized.json()["error"] == "invalid_request"
    assert len(fake_workers_ai.calls) == 7

    after = scrape(client)
    changes = delta(parse(before), parse(after))
    assert counters(changes) == {
        series("guards_requests_total", route="summary", outcome="ok"): 1,
        series("guards_requests_total", route="summary", outcome="fallback"): 3,
        series("guards_requests_total", route="draft_reply", outcome="ok"): 2,
        series("guards_requests_total", route="draft_reply", outcome="error"): 1,
        series("guards_requests_total", route="draft_reply", outcome="invalid"): 2,
        # Which chain position answered: the first model, for every answer served.
        series("guards_served_total", route="summary", model=MODEL, position="first"): 1,
        series("guards_served_total", route="draft_reply", model=MODEL, position="first"): 2,
        # The fake's usage: 10 input and 5 output tokens for each of the 4 answers.
        series("guards_tokens_total", model=MODEL, type="input"): 40,
        series("guards_tokens_total", model=MODEL, type="output"): 20,
        series("guards_fallbacks_total", route="summary", guard="call", reason="provider_error"): 1,
        series("guards_fallbacks_total", route="summary", guard="output", reason="schema_invalid"): 1,
        series("guards_fallbacks_total", route="summary", guard="budget", reason="budget_exceeded"): 1,
        series("guards_fallbacks_total", route="draft_reply", guard="call", reason="provider_error"): 1,
        # The invalid answer is a provider call that succeeded: the output guard rejected it.
        series("guards_provider_attempts_total", model=MODEL, kind="ok"): 4,
        series("guards_provider_attempts_total", model=MODEL, kind="model_incompatible"): 2,
        series("guards_provider_attempts_total", model=MODEL, kind="model_temporarily_unavailable"): 1,
        series("guards_request_duration_seconds_count", route="summary"): 4,
        series("guards_request_duration_seconds_count", route="draft_reply"): 3,
        series("guards_provider_attempt_duration_seconds_count", model=MODEL): 7,
    }
    # The last breaker decision for the model: closed (two failures, far from the threshold).
    assert parse(after)[series("guards_breaker_state", model=MODEL)] == 0
    assert_no_user_data(after, CANARY, provider_error["detail"])


def test_metrics_route_is_not_in_the_openapi_document(fake_workers_ai: FakeWorkersAI) -> None:
    app = create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep)
    assert "/metrics" not in app.openapi()["paths"]
    assert any(getattr(route, "path", None) == "/metrics" for route in app.routes)


def test_render_metrics_without_multiprocess_is_the_default_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    body, content_type = render_metrics()
    assert content_type == CONTENT_TYPE_LATEST
    text = body.decode()
    assert "# TYPE guards_requests_total counter" in text
    assert "process_" in text or "python_info" in text  # the default registry's collectors


FALLBACK_MODEL = "@cf/test/fallback"


def priced_chain_app(fake: FakeWorkersAI) -> FastAPI:
    """A route whose chain has two models, both priced in cents (`cost_unit_usd=0.01`)."""
    guards = Guards(
        WorkersAI(account_id=fake.account_id, api_token=fake.api_token, base_url=fake.base_url),
        sleep=no_sleep,
        prices={
            MODEL: Price(input_token=1.0, output_token=2.0),  # cents per token
            FALLBACK_MODEL: Price(input_token=3.0, output_token=4.0, call=0.5),
        },
        cost_unit_usd=0.01,
    )
    app = FastAPI()
    guards.install(app)

    @app.get("/metrics")
    def metrics() -> Response:
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    @app.post("/priced")
    @guards.route(model=MODEL, fallbacks=[FALLBACK_MODEL], retry=Retry(attempts=1), name="priced")
    async def priced(ai: AI[str]) -> str:
        return await ai.run({"prompt": f"price me {CANARY}"})

    return app


def test_tokens_cost_and_the_chain_position_that_answered(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(priced_chain_app(fake_workers_ai))
    before = parse(scrape(client))
    usage = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    fake_workers_ai.script(MODEL, Reply("first", usage=usage), INCOMPATIBLE, Reply("first", usage=usage))
    fake_workers_ai.script(FALLBACK_MODEL, Reply("fallback", usage=usage))
    assert client.post("/priced").headers.get("x-ai-fallback") is None
    assert client.post("/priced").headers["x-ai-fallback"] == FALLBACK_MODEL
    assert client.post("/priced").headers.get("x-ai-fallback") is None
    after = scrape(client)
    changes = delta(before, parse(after))
    served = {key: value for key, value in changes.items() if key[0] == "guards_served_total"}
    assert served == {
        series("guards_served_total", route="priced", model=MODEL, position="first"): 2,
        series("guards_served_total", route="priced", model=FALLBACK_MODEL, position="fallback"): 1,
    }
    assert changes[series("guards_tokens_total", model=MODEL, type="input")] == 200
    assert changes[series("guards_tokens_total", model=MODEL, type="output")] == 40
    assert changes[series("guards_tokens_total", model=FALLBACK_MODEL, type="input")] == 100
    assert changes[series("guards_tokens_total", model=FALLBACK_MODEL, type="output")] == 20
    # Cents to dollars: 2 x (100 x 1 + 20 x 2) = 280 cents; 0.5 + 100 x 3 + 20 x 4 = 380.5 cents.
    # The failed call reported no usage: it adds nothing.
    cost = {key: value for key, value in changes.items() if key[0] == "guards_cost_usd_total"}
    assert cost == pytest.approx(
        {
            series("guards_cost_usd_total", route="priced", model=MODEL): 2.80,
            series("guards_cost_usd_total", route="priced", model=FALLBACK_MODEL): 3.805,
        }
    )
    assert_no_user_data(after, CANARY)


def test_breaker_transitions_are_counted_once_each(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    clock = ManualClock()
    settings = workers_ai_settings(fake_workers_ai, breaker_failure_threshold=2, breaker_reset_s=30)
    client = app_client(create_app(settings, store=MemoryStore(clock=clock), sleep=no_sleep))
    before = parse(scrape(client))

    def draft() -> int:
        return client.post("/draft-reply", json={"message": "hello"}).status_code

    fake_workers_ai.script(MODEL, INCOMPATIBLE, INCOMPATIBLE, INCOMPATIBLE, Reply("Sure."), Reply("Sure."))
    assert [draft(), draft(), draft()] == [502, 502, 503]  # the breaker opened: skipped
    clock.advance(30)
    assert draft() == 502  # the half-open probe fails: open again
    clock.advance(30)
    assert [draft(), draft(), draft()] == [200, 200, 200]  # two probes close it
    changes = delta(before, parse(scrape(client)))
    transitions = {
        key: value for key, value in changes.items() if key[0] == "guards_breaker_transitions_total"
    }
    assert transitions == {
        series("guards_breaker_transitions_total", model=MODEL, to="open"): 2,
        series("guards_breaker_transitions_total", model=MODEL, to="half_open"): 2,
        series("guards_breaker_transitions_total", model=MODEL, to="closed"): 1,
    }


# --- several uvicorn workers (multiprocess mode) ----------------------------------------------


def requests_per_worker(directory: Path) -> dict[str, float]:
    """Guarded requests each worker process counted, from its own counter file."""
    counted = {}
    for path in directory.glob("counter_*.db"):
        if not path.stat().st_size:
            continue  # a worker creating its file: nothing in it yet
        metrics = MultiProcessCollector.merge([str(path)])
        counted[path.stem.split("_", 1)[1]] = sum(
            sample.value
            for metric in metrics
            if metric.name == "guards_requests"
            for sample in metric.samples
            if sample.name == "guards_requests_total"
        )
    return counted


def test_totals_are_exact_across_two_uvicorn_workers(tmp_path: Path, fake_workers_ai: FakeWorkersAI) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    fake_workers_ai.default = SUMMARY
    env = app_process_env(
        fake_workers_ai,
        "memory://",
        PROMETHEUS_MULTIPROC_DIR=str(directory),
        DAILY_CALL_LIMIT="100000",
        BREAKER_FAILURE_THRESHOLD="1000",
    )
    app = AppProcess(env, workers=2)
    fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
    try:
        app.wait_ready()
        # Concurrent bursts over fresh connections until both workers have answered some
        # (the kernel picks the worker that accepts each connection).
        # Each worker writes its counts to its file within FLUSH_INTERVAL_S: wait for them.
        burst_ok = 0
        for _ in range(10):
            burst_ok += sum(r.json()["fallback"] is None for r in asyncio.run(burst([app.url], 20)))
            wait_until(lambda ok=burst_ok: sum(requests_per_worker(directory).values()) == ok, FLUSHED_S)
            if len([n for n in requests_per_worker(directory).values() if n]) == 2:
                break
        served = requests_per_worker(directory)
        assert len([n for n in served.values() if n]) == 2, served

        with httpx.Client(base_url=app.url, timeout=30, limits=fresh) as client:
            # Scripted failures, one request at a time: each takes its outcomes in order.
            fake_workers_ai.script(MODEL, INCOMPATIBLE, INCOMPATIBLE, INVALID_SUMMARY, SUMMARY)
            reasons = [client.post("/summary", json={"text": "refund"}).json()["fallback"] for _ in range(4)]
            assert [r and r["reason"] for r in reasons] == [
                "provider_error",
                "provider_error",
                "schema_invalid",
                None,
            ]
            fake_workers_ai.script(MODEL, Reply("Sure."), TRANSIENT, Reply("Sure."), INCOMPATIBLE)
            statuses = [client.post("/draft-reply", json={"message": "hi"}).status_code for _ in range(3)]
            assert statuses == [200, 200, 502]
            expected = expected_totals(burst_ok + 1)
            # Once both workers wrote their last requests, every scrape, whichever worker
            # answers it, shows the totals of both.
            wait_until(lambda: nonzero(parse(scrape(client))) == expected, FLUSHED_S)
            scrapes = [parse(scrape(client)) for _ in range(10)]
    finally:
        app.stop()

    assert len(fake_workers_ai.calls) == burst_ok + 1 + 3 + 4
    for samples in scrapes:
        assert nonzero(samples) == expected
        assert samples[series("guards_breaker_state", model=MODEL)] == 0  # one series, no pid


def test_a_breaker_opened_under_two_workers_is_counted_once(
    tmp_path: Path, fake_workers_ai: FakeWorkersAI
) -> None:
    """Two uvicorn workers share the breaker in SQLite, and both see it open (their requests
    are refused after it opened); the transition happened once, in one store operation, and is
    counted once, whichever worker answers the scrape."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    fake_workers_ai.default = INCOMPATIBLE
    env = app_process_env(
        fake_workers_ai,
        f"sqlite:///{tmp_path / 'guards.db'}",
        PROMETHEUS_MULTIPROC_DIR=str(directory),
        DAILY_CALL_LIMIT="100000",
        BREAKER_FAILURE_THRESHOLD="3",
        BREAKER_RESET_S="600",
    )
    app = AppProcess(env, workers=2)
    try:
        app.wait_ready()
        answered = len(asyncio.run(burst([app.url], 20)))  # 20 failures: the breaker opens
        wait_until(lambda: sum(requests_per_worker(directory).values()) == answered, FLUSHED_S)
        calls = len(fake_workers_ai.calls)
        opened = requests_per_worker(directory)
        for _ in range(10):  # fresh connections until both workers were refused by it
            answered += len(asyncio.run(burst([app.url], 20)))
            wait_until(lambda n=answered: sum(requests_per_worker(directory).values()) == n, FLUSHED_S)
            later = requests_per_worker(directory)
            if len([pid for pid, n in later.items() if n > opened.get(pid, 0)]) == 2:
                break
        assert len([pid for pid, n in later.items() if n > opened.get(pid, 0)]) == 2
        assert len(fake_workers_ai.calls) == calls  # skipped without a call: it was open
        with httpx.Client(
            base_url=app.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
        ) as client:
            scrapes = [parse(scrape(client)) for _ in range(10)]
    finally:
        app.stop()
    for samples in scrapes:
        transitions = {
            key: value
            for key, value in samples.items()
            if key[0] == "guards_breaker_transitions_total" and value
        }
        assert transitions == {series("guards_breaker_transitions_total", model=MODEL, to="open"): 1}


def test_an_empty_file_left_by_a_killed_worker_does_not_fail_the_scrape(
    tmp_path: Path, fake_workers_ai: FakeWorkersAI
) -> None:
    """A worker creates its metrics file, then sizes it: one killed in between leaves an empty
    file, on which prometheus-client fails every later merge (its issue 1199). `/metrics` and
    `/status` leave the empty file out and answer with the counts of the files that hold some."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    fake_workers_ai.default = SUMMARY
    token = "status-token-0123456789abcdef"
    env = app_process_env(
        fake_workers_ai, "memory://", PROMETHEUS_MULTIPROC_DIR=str(directory), STATUS_TOKEN=token
    )
    app = AppProcess(env, workers=1)
    try:
        app.wait_ready()
        with httpx.Client(base_url=app.url, timeout=30) as client:
            assert client.post("/summary", json={"text": "refund"}).json()["fallback"] is None
            for kind in ("counter", "histogram", "gauge_mostrecent"):
                (directory / f"{kind}_4194000.db").touch()  # the killed worker's files
            samples = parse(scrape(client))
            status = client.get(
                "/status", headers={"authorization": f"Bearer {token}", "accept": "application/json"}
            )
    finally:
        app.stop()
    assert samples[series("guards_requests_total", route="summary", outcome="ok")] == 1
    assert status.status_code == 200, status.text
    [summary] = [route for route in status.json()["routes"] if route["route"] == "summary"]
    assert summary["requests"] == 1


def nonzero(samples: Mapping[Series, float]) -> dict[Series, float]:
    return {key: value for key, value in counters(samples).items() if value}


def expected_totals(summary_ok: int) -> dict[Series, float]:
    """The non-zero counts of the scripted sequence of the two-worker test."""
    expected = {
        series("guards_requests_total", route="summary", outcome="ok"): summary_ok,
        series("guards_requests_total", route="summary", outcome="fallback"): 3,
        series("guards_requests_total", route="summary", outcome="error"): 0,
        series("guards_requests_total", route="draft_reply", outcome="ok"): 2,
        series("guards_requests_total", route="draft_reply", outcome="fallback"): 0,
        series("guards_requests_total", route="draft_reply", outcome="error"): 1,
        series("guards_served_total", route="summary", model=MODEL, position="first"): summary_ok,
        series("guards_served_total", route="draft_reply", model=MODEL, position="first"): 2,
        series("guards_tokens_total", model=MODEL, type="input"): 10 * (summary_ok + 1 + 2),
        series("guards_tokens_total", model=MODEL, type="output"): 5 * (summary_ok + 1 + 2),
        series("guards_fallbacks_total", route="summary", guard="call", reason="provider_error"): 2,
        series("guards_fallbacks_total", route="summary", guard="output", reason="schema_invalid"): 1,
        series("guards_fallbacks_total", route="draft_reply", guard="call", reason="provider_error"): 1,
        series("guards_provider_attempts_total", model=MODEL, kind="ok"): summary_ok + 1 + 2,
        series("guards_provider_attempts_total", model=MODEL, kind="model_incompatible"): 3,
        series("guards_provider_attempts_total", model=MODEL, kind="model_temporarily_unavailable"): 1,
        series("guards_request_duration_seconds_count", route="summary"): summary_ok + 3,
        series("guards_request_duration_seconds_count", route="draft_reply"): 3,
        series("guards_provider_attempt_duration_seconds_count", model=MODEL): summary_ok + 3 + 4,
    }
    return {key: value for key, value in expected.items() if value}


# --- alert rules -------------------------------------------------------------------------------

#: Values each label may take in a matcher (closed sets; route and model names are the app's;
#: `outcome` and `le` are read from a live exposition, see `label_values`).
LABEL_VALUES = {
    "reason": {r.value for r in Reason},
    "guard": {g.value for g in GuardName} | {"cooldown", "breaker"},
    "kind": {"ok", *(k.value for k in Kind)},
    "position": {"first", "fallback"},
    "type": {"input", "output"},
    "to": {s.value for s in CircuitState},
}
SERIES_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}

#: Metrics another branch adds, allowed in queries before it merges, with their label names.
#: Issue 14 (service levels) adds the gauge `guards_service_level` (0 full, 1 degraded, 2
#: minimal, no labels). Once a metric of this name is registered, its entry is ignored and the
#: real one checked: remove the entry when issue 14 has merged.
PENDING: dict[str, set[str]] = {"guards_service_level": set()}


def exported_series(text: str) -> set[str]:
    """The series names guards exposes, from a live exposition (empty families included)."""
    return {
        family.name + suffix
        for family in text_string_to_metric_families(text)
        # `*_created` (the time each child was made) is prometheus-client's, not a metric.
        if family.name.startswith("guards_") and not family.name.endswith("_created")
        for suffix in SERIES_SUFFIXES[family.type]
    }


def label_names() -> dict[str, set[str]]:
    """Each series name of guards' metrics -> its label names: every `guards_*` metric in
    prometheus-client's default registry, whichever module of guards defines it."""
    names: dict[str, set[str]] = {}
    collectors = set(REGISTRY._names_to_collectors.values())
    for metric in collectors:
        if isinstance(metric, MetricWrapperBase) and metric._name.startswith("guards_"):
            for suffix in SERIES_SUFFIXES[metric._type]:
                extra = {"le"} if suffix == "_bucket" else set()
                names[metric._name + suffix] = set(metric._labelnames) | extra
    return names


def with_pending(labels_of: dict[str, set[str]]) -> dict[str, set[str]]:
    """`labels_of` and the metrics of `PENDING` not registered (yet)."""
    return {**{name: labels for name, labels in PENDING.items() if name not in labels_of}, **labels_of}


def label_values(text: str) -> dict[str, set[str]]:
    """`LABEL_VALUES`, with the outcomes and histogram bounds a live exposition shows (every
    route's outcomes are bound at start-up)."""
    samples = [
        sample
        for family in text_string_to_metric_families(text)
        if family.name.startswith("guards_")
        for sample in family.samples
    ]
    outcomes = {s.labels["outcome"] for s in samples if s.name == "guards_requests_total"}
    bounds = {s.labels["le"] for s in samples if s.name.endswith("_bucket")}
    assert {"ok", "fallback", "error", "cancelled", "invalid"} <= outcomes
    return {**LABEL_VALUES, "outcome": outcomes, "le": bounds}


def assert_labels_exported(
    expr: str, labels_of: dict[str, set[str]], values_of: dict[str, set[str]]
) -> set[str]:
    """Every label a PromQL expression matches or groups by is one its metric has, and every
    value it matches is one guards exports (a `$` value is a dashboard variable, left to
    `label_values`). Returns the labels it groups by."""
    used = set(re.findall(r"\bguards_\w+", expr))
    for metric, matchers in re.findall(r"(guards_\w+)\{([^}]*)\}", expr):
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
            assert label in labels_of[metric], (expr, metric, label)
            if value.startswith("$"):
                continue  # a dashboard variable (its values come from label_values)
            values = value.split("|") if op in ("=~", "!~") else [value]
            assert set(values) <= values_of[label], (expr, label, value)
    grouping = {
        label.strip()
        for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)
        for label in group.split(",")
        if label.strip()
    }
    for metric in used:  # grouping by a label a metric lacks silently merges everything
        assert grouping <= labels_of[metric], (expr, metric, grouping)
    for metric, label in re.findall(r"label_values\((guards_\w+),\s*(\w+)\)", expr):
        assert label in labels_of[metric], expr
    return grouping


def test_alert_rules_use_only_what_guards_exports(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    text = scrape(client)
    exported = exported_series(text)
    assert set(label_names()) == exported
    labels_of = with_pending(label_names())
    exported |= set(labels_of)
    values_of = label_values(text)

    document = yaml.safe_load(ALERTS.read_text())
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    assert {group["name"] for group in document["groups"]} == {"guards"}
    assert len(rules) >= 7
    assert len({rule["alert"] for rule in rules}) == len(rules)
    for rule in rules:
        name = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"Guards[A-Z]\w+", name)
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"].keys() >= {"summary", "description"}, name
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")"), name
        used = set(re.findall(r"\bguards_\w+", expr))
        assert used, name
        assert used <= exported, (name, used - exported)
        # Rates over a window, never single events.
        assert "rate(" in expr or "_over_time(" in expr, name
        grouping = assert_labels_exported(expr, labels_of, values_of)
        for text in rule["annotations"].values():
            assert set(re.findall(r"\$labels\.(\w+)", text)) <= grouping, name


def test_tallies_write_what_prometheus_client_would_have_counted() -> None:
    """Requests are tallied in process memory and written to prometheus-client in batches:
    the buckets (values on a bound count in it), sums and counts must be what observing each
    value directly would have given, however the flushes fall."""
    registry = CollectorRegistry()
    buckets = (0.01, 0.1, 1.0)
    direct = Histogram("direct_seconds", "h", ["route"], buckets=buckets, registry=registry)
    batched = Histogram("batched_seconds", "h", ["route"], buckets=buckets, registry=registry)
    direct_count = PromCounter("direct", "c", ["route"], registry=registry)
    batched_count = PromCounter("batched", "c", ["route"], registry=registry)
    hist = guards.observe._metrics.histogram(batched, "r")
    count = guards.observe._metrics.counter(batched_count, "r")
    values = [0.0, 0.01, 0.010001, 0.1, 0.5, 1.0, 1.5, 1e9, 0.003]
    for index, value in enumerate(values):
        direct.labels("r").observe(value)
        direct_count.labels("r").inc()
        hist.observe(value)
        count.add()
        if index in (2, 3, 7):
            guards.observe._metrics.flush_metrics()
    guards.observe._metrics.flush_metrics()
    guards.observe._metrics.flush_metrics()  # nothing new: adds nothing

    def samples(prefix: str) -> dict[tuple[str, str], float]:
        return {
            (sample.name.removeprefix(prefix), sample.labels.get("le", "")): sample.value
            for family in registry.collect()
            if family.name.startswith(prefix)
            for sample in family.samples
            if not sample.name.endswith("_created")
        }

    assert samples("batched") == samples("direct")
    assert samples("batched")[("_seconds_bucket", "0.01")] == 3
    assert samples("batched")[("_total", "")] == len(values)


def test_a_gauge_set_before_the_first_flush_is_written_by_it() -> None:
    """Until a flush binds a gauge's series (the first one imports prometheus-client), its
    value waits in the tally, with the time it was set; from then on it is set at once."""
    registry = CollectorRegistry()
    direct = Gauge("deferred_state", "g", ["model"], registry=registry)
    deferred = guards.observe._metrics.gauge(direct, "m")
    assert guards.observe._metrics.gauge(direct, "m") is deferred  # one per series
    deferred.set(2)
    assert registry.get_sample_value("deferred_state", {"model": "m"}) is None  # not bound yet
    guards.observe._metrics.flush_metrics()
    assert registry.get_sample_value("deferred_state", {"model": "m"}) == 2
    deferred.set(1)
    assert registry.get_sample_value("deferred_state", {"model": "m"}) == 1  # bound: at once
    guards.observe._metrics.flush_metrics()  # nothing waiting: leaves it
    assert registry.get_sample_value("deferred_state", {"model": "m"}) == 1


def test_guards_metrics_are_made_when_first_needed() -> None:
    """`guards.observe._metrics.Metric` makes its prometheus-client metric once, on first use, with
    the declared name, labels and options."""
    metric = guards.observe._metrics.REQUEST_SECONDS
    made = metric.made()
    assert metric.made() is made
    assert isinstance(made, Histogram)
    assert made._name == "guards_request_duration_seconds"
    assert made._labelnames == ("route",)
    assert tuple(made._upper_bounds) == metric.upper_bounds()
    assert REGISTRY._names_to_collectors["guards_request_duration_seconds_bucket"] is made


def test_every_metric_guards_declares_has_only_closed_set_labels() -> None:
    """Every metric, not only those a test happened to touch first in this process."""
    declared = guards.observe._prometheus.METRICS
    assert len(declared) >= 25
    for metric in declared:
        assert set(metric._labelnames) <= LABELS, metric._name
