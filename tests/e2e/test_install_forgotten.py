"""An app that never called `guards.install(app)`: a guarded route installs guards on the app
that serves it at its first request that reaches the handler (once per app, with one
`install_missing` warning naming the fix), and the app builds its middleware again for the next
request. From then on the 400 contract holds as if `install` had been called: invalid or
unreadable input and an oversized body answer `400 invalid_request` with `problems` and their
`request` log line, and OpenAPI documents every status. Before that request, FastAPI's own 422
answers (what the docs say). Over uvicorn, Starlette's `TestClient` and `httpx.ASGITransport`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from fixtures import FakeBinding, Hang, Reply
from guards import AI, ConfigurationError, Guards

from ..conftest import AppClient, LogLines, asgi_client, assert_error, problems

MODEL = "@cf/test/model"
LIMIT = 1024
ROOT = Path(__file__).resolve().parents[2]


class Ask(BaseModel):
    message: str = Field(min_length=1, max_length=50)


def forgetful(guards: Guards, app: FastAPI, path: str = "/ask") -> None:
    """A strict guarded route on `app`, whose `guards.install(app)` was forgotten."""

    @app.post(path)
    @guards.route(model=MODEL, max_body_bytes=LIMIT, name=path.strip("/").replace("/", "_"))
    async def ask(body: Ask, ai: AI[str]) -> str:
        return await ai.run({"prompt": body.message})


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def statuses(client: httpx.Client, path: str = "/ask") -> list[str]:
    return sorted(client.get("/openapi.json").json()["paths"][path]["post"]["responses"])


@pytest.mark.parametrize("socket", [True, False], ids=["uvicorn", "testclient"])
def test_the_400_contract_holds_from_the_first_guarded_request(
    app_client: AppClient, guards_log: LogLines, socket: bool
) -> None:
    guards, app = Guards(FakeBinding(Reply("hello"))), FastAPI()
    forgetful(guards, app)
    client = app_client(app, socket=socket)

    # Before any request reached a guarded handler: FastAPI's own answers, as documented.
    assert client.post("/ask", json={}).status_code == 422
    assert statuses(client) == ["200", "422"]

    first = client.post("/ask", json={"message": "hi"})
    assert first.status_code == 200, first.text
    assert first.json() == "hello"
    [warning] = guards_log.events("install_missing")
    assert warning["route"] == "ask"
    assert "guards.install(app)" in warning["detail"]
    assert Guards.of(app) is guards

    invalid = client.post("/ask", json={"message": ""})
    assert_error(invalid, 400, "invalid_request", False)
    assert problems(invalid) == [("body.message", "string_too_short")]
    unreadable = client.post("/ask", content=b'{"message": ', headers={"content-type": "application/json"})
    assert_error(unreadable, 400, "invalid_request", False)
    assert problems(unreadable) == [("body", "json_invalid")]
    oversized = b'{"message": "' + b"a" * (2 * LIMIT) + b'"}'
    too_long = client.post("/ask", content=oversized, headers={"content-type": "application/json"})
    assert_error(too_long, 400, "invalid_request", False)
    assert problems(too_long) == [("body", "too_long")]

    lines = [line for line in guards_log.events("request") if line["route"] == "ask"]
    assert [(line["status"], line.get("problems")) for line in lines] == [
        (200, None),
        (400, ["body.message:string_too_short"]),
        (400, ["body:json_invalid"]),
        (400, ["body:too_long"]),
    ]
    assert statuses(client) == ["200", "400", "500", "502", "503"]

    assert client.post("/ask", json={"message": "again"}).status_code == 200
    assert len(guards_log.events("install_missing")) == 1  # once per app


def test_lines_show_up_on_stderr_with_no_logging_set_up() -> None:
    """A process that configured no logging, whose app never called `install`: its lines are
    written to stderr, as `install` would have them."""
    script = textwrap.dedent(
        """
        from fastapi import FastAPI
        from pydantic import BaseModel
        from starlette.testclient import TestClient
        from guards import AI, Guards
        from guards.testing import FakeBinding, Reply

        class Ask(BaseModel):
            message: str

        guards, app = Guards(FakeBinding(Reply("hello"))), FastAPI()

        @app.post("/ask")
        @guards.route(model="@cf/test/model")
        async def ask(body: Ask, ai: AI[str]) -> str:
            return await ai.run({"prompt": body.message})

        with TestClient(app) as client:
            assert client.post("/ask", json={"message": "hi"}).status_code == 200
            assert client.post("/ask", json={}).status_code == 400
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [(line["event"], line.get("status")) for line in lines] == [
        ("install_missing", None),
        ("request", 200),
        ("request", 400),
    ]


@pytest.mark.anyio
async def test_a_mounted_app_installs_on_itself() -> None:
    guards, parent, child = Guards(FakeBinding(Reply("hello"))), FastAPI(), FastAPI()
    forgetful(guards, child)
    parent.mount("/child", child)
    async with asgi_client(parent) as client:
        assert (await client.post("/child/ask", json={"message": "hi"})).status_code == 200
        invalid = await client.post("/child/ask", json={})
        assert problems(invalid) == [("body.message", "missing")]
    assert Guards.of(child) is guards
    with pytest.raises(ConfigurationError, match=r"guards\.install\(app\)"):
        Guards.of(parent)


@pytest.mark.anyio
async def test_two_guards_on_one_app_install_the_first_one_served(guards_log: LogLines) -> None:
    first, second, app = Guards(FakeBinding(Reply("one"))), Guards(FakeBinding(Reply("two"))), FastAPI()
    forgetful(first, app, "/one")
    forgetful(second, app, "/two")
    async with asgi_client(app) as client:
        assert (await client.post("/two", json={"message": "hi"})).json() == "two"
        assert (await client.post("/one", json={"message": "hi"})).json() == "one"
        for path in ("/one", "/two"):
            assert problems(await client.post(path, json={})) == [("body.message", "missing")]
    assert Guards.of(app) is second
    assert [line["route"] for line in guards_log.events("install_missing")] == ["two"]


@pytest.mark.anyio
async def test_install_after_the_automatic_one_is_no_error(guards_log: LogLines) -> None:
    guards, app = Guards(FakeBinding(Reply("hello"))), FastAPI()
    forgetful(guards, app)
    async with asgi_client(app) as client:
        assert (await client.post("/ask", json={"message": "hi"})).status_code == 200
        guards.install(app)  # e.g. an app factory that installs late: kept as it is
        assert Guards.of(app) is guards
        assert problems(await client.post("/ask", json={})) == [("body.message", "missing")]
    with pytest.raises(ConfigurationError, match="already"):
        guards.install(app)  # installing twice on purpose is the mistake it always was
    with pytest.raises(ConfigurationError, match="already"):
        Guards(FakeBinding()).install(app)


@pytest.mark.anyio
async def test_an_installed_app_warns_of_nothing(guards_log: LogLines) -> None:
    guards, app = Guards(FakeBinding(Reply("hello"))), FastAPI()
    guards.install(app)
    forgetful(guards, app)
    async with asgi_client(app) as client:
        assert problems(await client.post("/ask", json={})) == [("body.message", "missing")]
        assert (await client.post("/ask", json={"message": "hi"})).status_code == 200
    assert guards_log.events("install_missing") == []


@pytest.mark.anyio
async def test_a_sub_app_of_an_installed_app_counts_each_request_in_flight_once() -> None:
    """Guards installed on the parent app, forgotten on the mounted app that serves the routes:
    the mounted app installs them too, and a request through both apps still counts once in
    flight (`max_in_flight=1`: with one request held, the next of a `shed_at` route is shed)."""
    fake = FakeBinding(Reply("hello"))
    guards, parent, child = Guards(fake, max_in_flight=1), FastAPI(), FastAPI()
    guards.install(parent)
    parent.mount("/child", child)
    held_in = anyio.Event()

    @child.post("/hold")
    @guards.route(model=MODEL, timeout_s=1.0)
    async def hold(ai: AI[str]) -> str:
        held_in.set()  # counted in flight before the handler runs
        return await ai.run({"prompt": "hold"})

    @child.post("/optional")
    @guards.route(model=MODEL, shed_at="degraded", fallback="shed")
    async def optional(ai: AI[str]) -> str:
        return await ai.run({"prompt": "optional"})

    async with asgi_client(parent) as client:
        for _ in range(3):  # the first installs guards on the child app too
            assert (await client.post("/child/optional")).json()["fallback"] is None
        fake.script(MODEL, Hang())
        async with anyio.create_task_group() as held:
            held.start_soon(client.post, "/child/hold")
            with anyio.fail_after(5):
                await held_in.wait()
            shed = (await client.post("/child/optional")).json()
            assert shed["data"] == "shed"
            assert shed["fallback"]["reason"] == "circuit_open"
            held.cancel_scope.cancel()  # the client leaves: the held request is counted out
        assert (await client.post("/child/optional")).json()["fallback"] is None
