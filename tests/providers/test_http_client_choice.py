"""One place decides the adapters' HTTP client library (`httpx` or `httpx2`), and both work:
the suite runs on the one chosen by default, and here the adapters' tests over real HTTP run
again on the other, in a fresh interpreter (the choice is made once, at import)."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from guards import ConfigurationError
from guards.providers import OpenAICompatible, WorkersAI, http_client, http_library, tls_context

from ..conftest import UNUSED_PLUGINS

ROOT = Path(__file__).resolve().parents[2]
#: The adapters' tests over real HTTP against the fake servers: every adapter, runs and
#: streams, cancellation, the connection pool's admission, redirects, bodies too large.
ADAPTER_TESTS = ("tests/providers/test_http_bindings.py",)


def other_library() -> str:
    return "httpx" if http_library.__name__ == "httpx2" else "httpx2"


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_httpx2_is_chosen_when_installed_and_the_setting_decides() -> None:
    assert http_library.__name__ == "httpx2"  # both are installed for the tests: the fork wins
    code = "from guards.providers import http_library; print(http_library.__name__)"
    assert run(code, GUARDS_HTTP_CLIENT="httpx").stdout == "httpx\n"
    assert run(code, GUARDS_HTTP_CLIENT="httpx2").stdout == "httpx2\n"
    wrong = run(code, GUARDS_HTTP_CLIENT="requests")
    assert wrong.returncode != 0
    assert "GUARDS_HTTP_CLIENT must be httpx or httpx2; got 'requests'" in wrong.stderr


def test_a_client_of_the_other_library_is_refused_naming_the_fix() -> None:
    client = httpx.AsyncClient()  # `httpx`'s, while the adapters use `httpx2`
    try:
        for make in (
            lambda: OpenAICompatible(api_key="k", client=client),
            lambda: WorkersAI(account_id="a", api_token="t", client=client),
        ):
            with pytest.raises(
                ConfigurationError, match=r"must be an httpx2\.AsyncClient .*GUARDS_HTTP_CLIENT=httpx"
            ):
                make()
    finally:
        asyncio.run(client.aclose())


def test_the_adapters_tests_pass_on_the_other_library() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            *UNUSED_PLUGINS,
            *ADAPTER_TESTS,
        ],
        cwd=ROOT,
        env={**os.environ, "GUARDS_HTTP_CLIENT": other_library()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    assert "failed" not in done.stdout


def test_the_clients_guards_makes_share_one_tls_context() -> None:
    """Making a TLS context loads the whole CA bundle (50 to 60 ms of CPU): the adapters' clients
    share the one `tls_context()` made, which verifies certificates (read in httpcore's pool)."""
    contexts = []
    for client in (http_client(), http_client(max_connections=1)):
        pool = client._transport._transport._pool  # type: ignore[attr-defined]
        contexts.append(pool._ssl_context)
    assert contexts[0] is contexts[1] is tls_context()
    assert tls_context().verify_mode == ssl.CERT_REQUIRED
    assert tls_context().check_hostname
