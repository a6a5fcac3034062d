"""A missing optional dependency is an error that names the extra to install (`pip install
'route-guards[serve]'`), never a bare traceback: each checked in a fresh interpreter where the
dependency cannot be imported (`sys.modules[name] = None`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_serve_without_uvicorn_says_to_install_the_serve_extra() -> None:
    done = python(
        """
        import runpy, sys
        sys.modules["uvicorn"] = None
        sys.argv = ["guards.serve", "app.main:app"]
        runpy.run_module("guards.serve", run_name="__main__")
        """
    )
    assert done.returncode == 1
    assert done.stderr == "python -m guards.serve needs uvicorn: pip install 'route-guards[serve]'\n"


def test_importing_serve_without_uvicorn_raises_an_error_naming_the_extra() -> None:
    done = python(
        """
        import sys
        sys.modules["uvicorn"] = None
        try:
            import guards.serve
        except ModuleNotFoundError as exc:
            print(exc.name, exc, sep="|")
        """
    )
    assert done.stdout == "uvicorn|guards.serve needs uvicorn: pip install 'route-guards[serve]'\n", (
        done.stderr
    )


def test_redis_store_without_hiredis_raises_an_error_naming_the_extra() -> None:
    done = python(
        """
        import sys
        sys.modules["hiredis"] = None
        import guards, guards.stores  # the base install imports fine
        try:
            guards.stores.RedisStore
        except ModuleNotFoundError as exc:
            print(exc.name, exc, sep="|")
        """
    )
    assert done.stdout == "hiredis|RedisStore needs hiredis: pip install 'route-guards[redis]'\n", done.stderr


def test_tracing_without_opentelemetry_raises_an_error_naming_the_extra() -> None:
    done = python(
        """
        import sys
        from guards import ConfigurationError, Guards
        from guards.testing import FakeBinding
        sys.modules["opentelemetry"] = None  # after FastAPI, which may look for it itself
        Guards(FakeBinding())  # tracing off: nothing of OpenTelemetry is imported
        try:
            Guards(FakeBinding(), tracing=True)
        except ConfigurationError as exc:
            print(exc)
        """
    )
    assert done.stdout == "tracing needs the OpenTelemetry API: pip install 'route-guards[otel]'\n", (
        done.stderr
    )
