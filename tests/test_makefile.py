"""`make help` lists every target of the Makefile, with its variables expanded."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: A rule's target at the start of a line (not a file rule such as `$(BIN)/.installed`, not a
#: variable assignment such as `HOST ?= ...`).
TARGET = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*):(?![=])", re.MULTILINE)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_help(*overrides: str) -> str:
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "help", *overrides],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout


def test_help_lists_every_target() -> None:
    targets = set(TARGET.findall((ROOT / "Makefile").read_text())) - {".PHONY", ".DEFAULT_GOAL"}
    assert {"help", "run", "test", "bench-instructions", "soak"} <= targets
    listed = {line.split()[1] for line in make_help().splitlines() if line.startswith("  make ")}
    assert listed == targets


def test_help_expands_variables() -> None:
    text = make_help("HOST=0.0.0.0", "PORT=9123")
    assert "0.0.0.0:9123" in text
    assert "$(" not in text


def test_make_test_runs_the_suite_and_not_the_soak() -> None:
    """`make test` is the quick suite (tests/e2e/test_soak.py checks the soak's parts in seconds);
    the soak itself, many minutes long, runs only when asked for."""
    commands = subprocess.run(
        ["make", "--no-print-directory", "-n", "-C", str(ROOT), "test"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert "-m pytest" in commands
    assert "bench.soak" not in commands


def _requirements(lines: list[str]) -> set[str]:
    return {line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()}


def test_make_run_installs_what_the_example_app_needs_and_no_dev_tools() -> None:
    """`make run` installs guards with its [serve,redis,otel] extras and app/requirements.txt,
    not the [dev] extra (test tools, browsers, docs); `make install` covers both."""
    tomllib = pytest.importorskip("tomllib")
    commands = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "-C", str(ROOT), "run", "VENV=/nonexistent/venv"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    installs = [line for line in commands.splitlines() if "pip install" in line]
    assert installs, commands
    assert not [line for line in installs if "dev" in line], installs
    assert any("-r app/requirements.txt" in line and "'.[serve,redis,otel]'" in line for line in installs)
    app_needs = _requirements((ROOT / "app" / "requirements.txt").read_text().splitlines())
    dev = _requirements(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    )
    assert app_needs
    assert app_needs <= dev
