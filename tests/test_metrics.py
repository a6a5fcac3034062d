"""Prometheus metrics: exact counts per label set through real HTTP, in one process and across
uvicorn worker processes (multiprocess mode), labels free of user data, and alert rules that
name only metrics and labels guards exports.

The default registry is process-global and other tests count too, so the in-process test
compares scrapes before and after its requests (deltas), never absolute values.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

import guards._metrics
from app.main import create_app
from fixtures import Fail, FakeWorkersAI, Reply
from guards import GuardName, Kind, Reason, render_metrics

from .conftest import no_sleep, wait_until, workers_ai_settings
from .test_shared_state import MODEL, AppProcess, app_process_env, burst

ALERTS = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "alerts.yml"
CANARY = "CANARY-METRICS-7f3a91"
SUMMARY = Reply({"label": "billing", "confidence": 0.9})
#: Not the route's schema: an empty label and a confidence above 1.
INVALID_SUMMARY = Reply({"label": "", "confidence": 2})
INCOMPATIBLE = Fail(code=5035, status=403)
#: How long another worker's counts may take to reach the shared files (see FLUSH_INTERVAL_S).
FLUSHED_S = guards._metrics.FLUSH_INTERVAL_S + 5
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
    allowed = {"route", "outcome", "guard", "reason", "model", "kind", "action", "tier", "hint", "le"}
    for (name, labels), _ in parse(text).items():
        assert {label for label, _ in labels} <= allowed, name
        for label, value in labels:
            assert len(value) <= 80, (name, label)
            assert "attempt(s)" not in value
            assert "code=" not in value


# --- one process, through uvicorn -------------------------------------------------------------


def test_counts_per_label_set_are_exact(
    fake_workers_ai: FakeWorkersAI, serve: Callable[[FastAPI], httpx.Client]
) -> None:
    client = serve(create_app(workers_ai_settings(fake_workers_ai, daily_call_limit=3), sleep=no_sleep))
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

    after = scrape(client)
    changes = delta(parse(before), parse(after))
    assert counters(changes) == {
        series("guards_requests_total", route="summary", outcome="ok"): 1,
        series("guards_requests_total", route="summary", outcome="fallback"): 3,
        series("guards_requests_total", route="draft_reply", outcome="ok"): 2,
        series("guards_requests_total", route="draft_reply", outcome="error"): 1,
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


# --- several uvicorn workers (multiprocess mode) ----------------------------------------------


def requests_per_worker(directory: Path) -> dict[str, float]:
    """Guarded requests each worker process counted, from its own counter file."""
    counted = {}
    for path in directory.glob("counter_*.db"):
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

#: Values each label may take in a matcher (closed sets; route and model names are the app's).
LABEL_VALUES = {
    "reason": {r.value for r in Reason},
    "guard": {g.value for g in GuardName} | {"cooldown", "breaker"},
    "outcome": {"ok", "fallback", "error"},
    "kind": {"ok", *(k.value for k in Kind)},
}
SERIES_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


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
    """Each series name of guards' metric objects -> its label names."""
    names: dict[str, set[str]] = {}
    for metric in vars(guards._metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for suffix in SERIES_SUFFIXES[metric._type]:
                extra = {"le"} if suffix == "_bucket" else set()
                names[metric._name + suffix] = set(metric._labelnames) | extra
    return names


def test_alert_rules_use_only_what_guards_exports(
    fake_workers_ai: FakeWorkersAI, serve: Callable[[FastAPI], httpx.Client]
) -> None:
    client = serve(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    exported = exported_series(scrape(client))
    labels_of = label_names()
    assert set(labels_of) == exported

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
        for metric, matchers in re.findall(r"(guards_\w+)\{([^}]*)\}", expr):
            for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
                assert label in labels_of[metric], (name, metric, label)
                values = value.split("|") if op in ("=~", "!~") else [value]
                assert set(values) <= LABEL_VALUES[label], (name, label, value)
        grouping = {
            label.strip()
            for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)
            for label in group.split(",")
            if label.strip()
        }
        for metric in used:  # grouping by a label a metric lacks silently merges everything
            assert grouping <= labels_of[metric], (name, metric, grouping)
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
    hist = guards._metrics.histogram(batched, "r")
    count = guards._metrics.counter(batched_count, "r")
    values = [0.0, 0.01, 0.010001, 0.1, 0.5, 1.0, 1.5, 1e9, 0.003]
    for index, value in enumerate(values):
        direct.labels("r").observe(value)
        direct_count.labels("r").inc()
        hist.observe(value)
        count.add()
        if index in (2, 3, 7):
            guards._metrics.flush_metrics()
    guards._metrics.flush_metrics()
    guards._metrics.flush_metrics()  # nothing new: adds nothing

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
