"""The alert rules as Prometheus runs them: `promtool check rules` accepts deploy/prometheus/
alerts.yml, and `promtool test rules` runs the cases of alerts.test.yml (each alert fires as
written, and stays quiet below its threshold, on idle routes and before its `for`).

promtool comes with Debian's `prometheus` package, which `.ci/run` installs. On a developer
machine without it these tests are skipped, saying so; with `GUARDS_REQUIRE_PROMTOOL=1` (set by
`.ci/run`) a missing promtool fails them instead, so CI never skips them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = DEPLOY / "alerts.yml"
CASES = DEPLOY / "alerts.test.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("GUARDS_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is required (GUARDS_REQUIRE_PROMTOOL=1) but not on the PATH")
        pytest.skip("promtool not installed (`apt-get install prometheus` provides it; .ci/run does)")
    return found


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, check=False)


def test_promtool_accepts_the_rules() -> None:
    checked = run("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_passes_its_promtool_unit_tests() -> None:
    tested = run("test", "rules", str(CASES))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_firing_case_and_a_quiet_one() -> None:
    """Each alert of alerts.yml is expected to fire in some case of alerts.test.yml, and
    expected silent in another (or before its `for`)."""
    rules = yaml.safe_load(RULES.read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    cases = yaml.safe_load(CASES.read_text())
    assert cases["rule_files"] == ["alerts.yml"]
    fired, quiet = set(), set()
    for case in cases["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
            for alert in check["exp_alerts"]:
                # Annotations are compared too: the rendered text is part of the test.
                assert alert["exp_annotations"].keys() == {"summary", "description"}, check
    assert fired == alerts
    assert quiet == alerts


def test_ci_installs_promtool_and_never_skips_these_tests() -> None:
    script = (DEPLOY.parent.parent / ".ci" / "run").read_text()
    assert "need+=(prometheus)" in script
    assert "export GUARDS_REQUIRE_PROMTOOL=1" in script
