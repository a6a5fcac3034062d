"""The distribution as users install it: the wheel built from this tree holds `guards` and
nothing else (the example app and the repository's `fixtures/` stay here), registers the
pytest plugin, and carries the metadata and the one version."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import guards

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy: setuptools builds in the source tree, and a `build/` left there could carry
    # files the tree no longer has into the wheel.
    source = out / "source"
    ignore = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, source, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("*.whl")
    return zipfile.ZipFile(built)


def dist_info(wheel: zipfile.ZipFile) -> str:
    return f"route_guards-{guards.__version__}.dist-info"


def test_the_wheel_installs_guards_and_nothing_else(wheel: zipfile.ZipFile) -> None:
    top = {name.split("/")[0] for name in wheel.namelist()}
    assert top == {"guards", dist_info(wheel)}
    names = set(wheel.namelist())
    assert {"guards/py.typed", "guards/testing/__init__.py", "guards/testing/pytest_plugin.py"} <= names
    # The Redis store's Lua scripts, each file the package's own (read at import).
    lua = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "guards").rglob("*.lua"))
    assert lua
    assert {name for name in names if name.endswith(".lua")} == set(lua)


def test_the_wheel_registers_the_pytest_plugin(wheel: zipfile.ZipFile) -> None:
    entry_points = wheel.read(f"{dist_info(wheel)}/entry_points.txt").decode()
    assert "[pytest11]\nroute_guards = guards.testing.pytest_plugin\n" in entry_points


def test_the_wheel_carries_the_metadata(wheel: zipfile.ZipFile) -> None:
    metadata = Parser().parsestr(wheel.read(f"{dist_info(wheel)}/METADATA").decode())
    assert metadata["Name"] == "route-guards"
    assert metadata["Version"] == guards.__version__
    assert metadata["License-Expression"] == "MIT"
    assert f"{dist_info(wheel)}/licenses/LICENSE" in wheel.namelist()
    classifiers = set(metadata.get_all("Classifier"))
    assert {
        "Framework :: FastAPI",
        "Typing :: Typed",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
    } <= classifiers
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    assert set(urls) == {"Homepage", "Documentation", "Changelog", "Issues"}
    assert all(url.startswith("https://github.com/route-guards/route-guards") for url in urls.values())
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"serve", "redis", "otel", "dev"} <= extras
    assert "app" not in extras


def test_the_installed_version_is_the_packages() -> None:
    assert importlib.metadata.version("route-guards") == guards.__version__
