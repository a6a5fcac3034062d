"""`guards.testing`'s pytest plugin as a user meets it: loaded by the `pytest11` entry point
(no `-p` flag), and `use_fake_ai(app)` giving each test a fresh store, so tests that trip the
guards pass in any order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from fastapi import FastAPI

import guards.testing.pytest_plugin
from guards import AI, ConfigurationError, Guards, Level
from guards.stores import MemoryStore
from guards.testing import Fail, FakeBinding, ManualClock

from ..conftest import UNUSED_PLUGINS, asgi_client

ROOT = Path(__file__).resolve().parents[2]

SERVICE = """
from fastapi import FastAPI
from pydantic import BaseModel

from guards import AI, Guards
from guards.providers import WorkersAI


class Ticket(BaseModel):
    text: str


guards = Guards(WorkersAI(account_id="acc", api_token="token"))
app = FastAPI()
guards.install(app)


@app.post("/triage")
@guards.route(model="@cf/meta/llama-3.1-8b-instruct", fallback="by the rules")
async def triage(ticket: Ticket, ai: AI[str]) -> str:
    return await ai.run({"messages": [{"role": "user", "content": ticket.text}]})
"""

RATE_LIMITED = """
def test_rate_limited(use_fake_ai):
    fake = use_fake_ai(app)
    fake.script("*", Fail(code=3036, status=429))  # the model cools down for minutes
    answer = TestClient(app).post("/triage", json={"text": "hi"}).json()
    assert answer["data"] == "by the rules"
    assert len(fake.calls) == 1
"""

ANSWERED = """
def test_answered(use_fake_ai):
    fake = use_fake_ai(app)
    fake.script("*", Reply("billing"))
    answer = TestClient(app).post("/triage", json={"text": "hi"}).json()
    assert answer == {"ok": True, "data": "billing", "fallback": None}
    assert len(fake.calls) == 1
"""

HEADER = "from fastapi.testclient import TestClient\n\nfrom guards.testing import Fail, Reply\nfrom service import app\n"


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *UNUSED_PLUGINS,
            "-p",
            "no:cacheprovider",
            "-q",
            "-W",
            "error",
            *args,
        ],
        cwd=folder,
        env={**environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("order", [(RATE_LIMITED, ANSWERED), (ANSWERED, RATE_LIMITED)])
def test_tests_that_trip_the_guards_pass_in_either_order(tmp_path: Path, order: tuple[str, str]) -> None:
    """The rate-limited test puts the model in a cooldown: through a shared store the other test,
    run after it, would get the fallback without a call."""
    (tmp_path / "service.py").write_text(SERVICE)
    (tmp_path / "test_service.py").write_text(HEADER + "".join(textwrap.dedent(t) for t in order))
    done = run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_the_app_gets_its_own_store_back_after_the_test(tmp_path: Path) -> None:
    (tmp_path / "service.py").write_text(SERVICE)
    (tmp_path / "test_service.py").write_text(
        HEADER
        + textwrap.dedent("""
            from guards import Guards

            ORIGINAL = Guards.of(app).store

            def test_swapped(use_fake_ai):
                use_fake_ai(app)
                assert Guards.of(app).store is not ORIGINAL

            def test_restored():
                assert Guards.of(app).store is ORIGINAL
            """)
    )
    done = run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


OPENAI_SERVICE = """
from fastapi import FastAPI
from pydantic import BaseModel

from guards import AI, Guards
from guards.providers import OpenAICompatible


class Ticket(BaseModel):
    text: str


guards = Guards(OpenAICompatible(api_key="sk-the-real-one"))  # built at import time
app = FastAPI()
guards.install(app)


@app.post("/triage")
@guards.route(model="gpt-4o-mini", fallback="by the rules")
async def triage(ticket: Ticket, ai: AI[str]) -> str:
    return await ai.run({"messages": [{"role": "user", "content": ticket.text}]})
"""

SERVERS_HEADER = """from fastapi.testclient import TestClient

from guards import Guards
from guards.testing import Fail, FakeOpenAI, Reply, UseFakeServers
from service import app

ORIGINAL = Guards.of(app).binding
"""

SERVER_QUOTA = """
def test_quota_spent(use_fake_servers: UseFakeServers, fake_openai: FakeOpenAI) -> None:
    assert Guards.of(app).binding is ORIGINAL
    use_fake_servers(app)
    fake_openai.script("*", Fail(status=429, error_code="insufficient_quota"))  # a 10-minute cooldown
    answers = [TestClient(app).post("/triage", json={"text": "hi"}).json() for _ in range(2)]
    assert [answer["data"] for answer in answers] == ["by the rules"] * 2
    assert answers[0]["fallback"]["detail"].startswith("model_quota_exhausted")
    assert len(fake_openai.calls) == 1  # the second request skipped the cooling model
"""

SERVER_ANSWERED = """
def test_answered(use_fake_servers: UseFakeServers, fake_openai: FakeOpenAI) -> None:
    assert Guards.of(app).binding is ORIGINAL
    use_fake_servers(app)
    fake_openai.script("*", Reply("billing"), Reply("billing"))
    for _ in range(2):
        answer = TestClient(app).post("/triage", json={"text": "hi"}).json()
        assert answer == {"ok": True, "data": "billing", "fallback": None}
    assert [call.headers["authorization"] for call in fake_openai.calls] == ["Bearer test-key"] * 2
"""


@pytest.mark.parametrize("order", [(SERVER_QUOTA, SERVER_ANSWERED), (SERVER_ANSWERED, SERVER_QUOTA)])
def test_use_fake_servers_points_an_app_built_at_import_time_at_the_fake(
    tmp_path: Path, order: tuple[str, str]
) -> None:
    """The app's real adapter calls the fake OpenAI server over HTTP (each request on an event
    loop of its own), with a fresh store: the quota test's cooldown never reaches the next
    test, and the app gets its own binding back in between."""
    (tmp_path / "service.py").write_text(OPENAI_SERVICE)
    (tmp_path / "test_service.py").write_text(SERVERS_HEADER + "".join(textwrap.dedent(t) for t in order))
    done = run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


@pytest.mark.parametrize(
    ("flags", "section"), [((), "Captured log call"), (("-p", "no:logging"), "Captured stderr call")]
)
def test_guards_log_lines_stay_with_their_test_not_after_the_summary(
    tmp_path: Path, flags: tuple[str, ...], section: str
) -> None:
    """guards' JSON lines are written within the test that caused them (pytest captures them, as
    log records or as stderr without its logging plugin, and shows them with a failure), never
    on the terminal after pytest's summary."""
    (tmp_path / "service.py").write_text(SERVICE)
    (tmp_path / "test_service.py").write_text(
        HEADER
        + textwrap.dedent(RATE_LIMITED)
        + textwrap.dedent("""
            def test_failing(use_fake_ai):
                fake = use_fake_ai(app)
                fake.script("*", Fail(code=3036, status=429))
                TestClient(app).post("/triage", json={"text": "hi"})
                assert False, "shown with its lines"
            """)
    )
    done = run_pytest(tmp_path, *flags)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout
    assert '"event"' not in done.stderr  # nothing written outside pytest's capture
    summary = done.stdout.rindex("1 failed, 1 passed")
    assert '"event"' not in done.stdout[summary:]
    failure = done.stdout[done.stdout.index("test_failing ___") : summary]
    assert section in failure
    assert '{"event":"request","route":"triage"' in failure


def test_the_plugin_is_loaded_once_by_its_entry_point(pytestconfig: pytest.Config) -> None:
    manager = pytestconfig.pluginmanager
    assert manager.get_plugin("route_guards") is guards.testing.pytest_plugin
    assert [p for p in manager.get_plugins() if p is guards.testing.pytest_plugin] == [
        guards.testing.pytest_plugin
    ]


def test_replace_store_forgets_the_service_level_and_refuses_another_clock() -> None:
    clock = ManualClock()
    fake = FakeBinding()
    guards = Guards(fake, store=MemoryStore(clock=clock))
    app = FastAPI()
    guards.install(app)

    @app.post("/ask")
    @guards.route(model="@cf/m", fallback="later")
    async def ask(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hi"})

    fake.script("*", Fail(code=3036, status=429))

    async def scenario() -> Level:
        async with asgi_client(app) as client:
            await client.post("/ask")
        # The level is read from the store at most once a second: poll it (bounded).
        for _ in range(100):  # at most 5 s
            if guards.service_level().level is not Level.full:
                break
            await anyio.sleep(0.05)
        return guards.service_level().level

    assert anyio.run(scenario) is Level.minimal  # the model cools down
    old = guards.store
    assert guards.replace_store(MemoryStore(clock=clock)) is old
    assert guards.service_level().level is Level.full
    with pytest.raises(ConfigurationError, match="same clock"):
        guards.replace_store(MemoryStore())
