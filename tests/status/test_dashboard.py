"""deploy/grafana/guards.json: a valid Grafana dashboard model whose every query names only
metrics, labels and label values guards exports (the same closed sets as the alert rules)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from app.service import create_app
from fixtures import FakeWorkersAI

from ..conftest import AppClient, no_sleep, workers_ai_settings
from ..observe.test_metrics import (
    assert_labels_exported,
    exported_series,
    label_names,
    label_values,
    scrape,
    with_pending,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "guards.json"
PANEL_TYPES = {"row", "timeseries", "stat", "state-timeline", "bargauge", "table"}
#: What the dashboard must show (the issue's list), each as a metric some query uses.
SHOWN = {
    "guards_requests_total",  # requests and outcomes per route
    "guards_fallbacks_total",  # fallbacks by guard and reason
    "guards_provider_attempts_total",  # provider attempts by kind
    "guards_request_duration_seconds_bucket",  # latency percentiles
    "guards_provider_attempt_duration_seconds_bucket",
    "guards_breaker_state",  # breaker states
    "guards_breaker_transitions_total",  # and transitions
    "guards_model_skips_total",  # cooldown skips
    "guards_tokens_total",  # tokens
    "guards_cost_usd_total",  # and cost
    "guards_service_level",  # service level (issue 14)
    "guards_served_total",  # answers by chain position
    "guards_model_first_output_seconds_bucket",  # each model's latency (issue 43)
    "guards_model_answer_seconds_bucket",
}


def load() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def queries(document: dict[str, Any]) -> list[str]:
    found = [target["expr"] for panel in document["panels"] for target in panel.get("targets", [])]
    for variable in document["templating"]["list"]:
        if variable["type"] == "query":
            found.append(variable["query"]["query"])
    return found


def test_the_dashboard_is_a_valid_grafana_model() -> None:
    document = load()
    assert isinstance(document["schemaVersion"], int)
    assert document["schemaVersion"] >= 36
    assert document["uid"] == "guards"
    assert document["title"]
    assert {"from", "to"} <= document["time"].keys()
    variables = {variable["name"]: variable for variable in document["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in document["panels"]]
    assert all(isinstance(panel_id, int) for panel_id in ids)
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in document["panels"]:
        title = panel["title"]
        assert panel["type"] in PANEL_TYPES, title
        grid = panel["gridPos"]
        assert set(grid) == {"x", "y", "w", "h"}, title
        assert all(isinstance(grid[key], int) and grid[key] >= 0 for key in grid), title
        assert grid["w"] >= 1
        assert grid["h"] >= 1
        assert grid["x"] + grid["w"] <= 24, title
        # No two panels overlap.
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, title
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        targets = panel["targets"]
        assert targets, title
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in targets:
            assert isinstance(target["expr"], str), title
            assert target["expr"].strip(), title
            assert target["expr"].count("(") == target["expr"].count(")"), title


def test_every_query_names_only_what_guards_exports(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    text = scrape(app_client(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep)))
    labels_of = with_pending(label_names())  # guards_service_level: issue 14's, see PENDING
    assert exported_series(text) <= set(labels_of)
    values_of = label_values(text)
    used_anywhere: set[str] = set()
    for expr in queries(load()):
        used = set(re.findall(r"\bguards_\w+", expr))
        assert used, expr
        assert used <= set(labels_of), (expr, used - set(labels_of))
        used_anywhere |= used
        assert_labels_exported(expr, labels_of, values_of)
    assert used_anywhere >= SHOWN, SHOWN - used_anywhere


def test_legends_name_only_labels_their_query_keeps() -> None:
    for panel in load()["panels"]:
        for target in panel.get("targets", []):
            kept = {
                label.strip()
                for group in re.findall(r"\bby\s*\(([^)]*)\)", target["expr"])
                for label in group.split(",")
            }
            assert set(re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", ""))) <= kept, panel["title"]
