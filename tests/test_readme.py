"""Every example of the README runs as written: each fenced block is executed (code), run against
a live server (curls, commands) or checked against what the code really produces (sample
answers, log lines, the layout). `test_every_block_is_checked` fails for a block no test covers,
so the next drift fails a test."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from app.service import create_app
from app.settings import Settings
from fixtures import Fail, FakeBinding, FakeOpenAI, FakeWorkersAI, Reply, Stream, Text
from guards import Envelope, StatusReport

from .conftest import LogLines, no_sleep, wait_until, workers_ai_settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
Serve = Callable[[FastAPI], httpx.Client]


@dataclass(frozen=True)
class Block:
    section: str  # the heading above it, as written (`## Quick start`)
    lang: str  # the fence's info string (`sh`, `python`, `json`, or empty)
    index: int  # its place among the blocks of its section in the same language
    code: str


def readme_blocks() -> list[Block]:
    found: list[Block] = []
    section, counts = "", dict[tuple[str, str], int]()
    lines = iter(README.read_text().splitlines())
    for line in lines:
        if line.startswith("#"):
            section = line.strip()
        elif line.lstrip().startswith("```"):  # a fence, also indented in a list item
            indent = len(line) - len(line.lstrip())
            body = []
            for inner in lines:
                if inner.lstrip().startswith("```"):
                    break
                body.append(inner[indent:])
            lang = line.strip()[3:].strip()
            index = counts.get((section, lang), 0)
            counts[section, lang] = index + 1
            found.append(Block(section, lang, index, "\n".join(body) + "\n"))
    return found


def block(section: str, lang: str, index: int = 0) -> str:
    [code] = [b.code for b in readme_blocks() if (b.section, b.lang, b.index) == (section, lang, index)]
    return code


def readme_example(heading: str = "## Guard a route of your own") -> dict[str, Any]:
    """The namespace of a README section's (first) Python block, executed."""
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(block(heading, "python"), str(README), "exec"), namespace)
    return namespace


#: Every block of the README and the test that checks it.
CHECKED = {
    ("## Quick start", "sh", 0): "test_quick_start_commands_are_make_targets",
    ("## Quick start", "sh", 1): "test_curls_run_against_a_live_server",
    ("## Quick start", "sh", 2): "test_workers_ai_with_an_openai_fallback_as_written",
    ("## Guard a route of your own", "python", 0): "test_readme_example_degrades_as_documented",
    ("### The envelope (degrading routes)", "json", 0): "test_envelope_samples_are_real_answers",
    ("## Fallback chains", "python", 0): "test_readme_chain_example_falls_back_as_documented",
    ("## Streaming routes", "python", 0): "test_readme_streaming_example_streams_through_the_chain",
    ("## Streaming routes", "sh", 0): "test_curls_run_against_a_live_server",
    ("## Streaming routes", "", 0): "test_stream_sample_has_the_documented_events",
    ("## Logs", "json", 0): "test_log_samples_have_the_fields_of_real_lines",
    ("## How the guards count", "python", 0): "test_budget_keys_example_keys_by_the_principal",
    ("## Effort routing", "python", 0): "test_effort_example_routes_by_effort",
    ("## Effort routing", "python", 1): "test_effort_override_example_escalates_premium_users",
    ("## The last good answer", "python", 0): "test_last_good_example_serves_the_last_answer",
    ("## Metrics", "python", 0): "test_metrics_snippet_serves_the_exposition",
    ("## Status page", "python", 0): "test_status_example_mounts_a_private_page",
    ("## Status page", "json", 0): "test_status_sample_has_the_fields_of_a_real_answer",
    ("## Status page", "sh", 0): "test_status_curls_run_against_a_live_server",
    ("## Traces", "python", 0): "test_tracing_snippet_traces_with_its_provider",
    ("## Testing your routes", "python", 0): "test_testing_example_passes_under_pytest",
    ("## Serving in production", "sh", 0): "test_serve_command_serves_and_stops_gracefully",
    ("## Serving in production", "nginx", 0): "test_nginx_sketch_agrees_with_the_app",
    ("## Service levels and shedding", "python", 0): "test_health_example_answers_the_level",
    ("## Multi-step tasks", "python", 0): "test_readme_task_example_resumes_and_replays",
    ("## Layout", "", 0): "test_layout_names_files_that_exist",
}


def test_every_block_is_checked() -> None:
    found = {(b.section, b.lang, b.index) for b in readme_blocks()}
    assert found - set(CHECKED) == set(), "a README block no test checks: add it to CHECKED"
    assert set(CHECKED) - found == set(), "CHECKED names a block the README no longer has"
    for test in CHECKED.values():
        assert callable(globals().get(test)), test


# --- a live server, as `make run` starts it -----------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


#: Settings of the example app: none of the test machine's own may leak into a server run here.
_SETTINGS = re.compile(
    r"^(AI_|CLOUDFLARE_|OPENAI_|GUARDS_|CORS_|DAILY_|RATE_|BREAKER_|RETRY_|PROMETHEUS_|OTEL_|STATUS_)"
)


@pytest.fixture
def run_server(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """`url = run_server(**env)`: the example app under uvicorn in a process of its own, like
    `make run` (a fresh prometheus multiprocess directory), with `env` set; stopped after."""
    started: list[subprocess.Popen[bytes]] = []

    def run(**env: str) -> str:
        port = free_port()
        metrics = tmp_path / f"prometheus-{port}"
        metrics.mkdir()
        environ = {k: v for k, v in os.environ.items() if not _SETTINGS.match(k)}
        environ.update(PROMETHEUS_MULTIPROC_DIR=str(metrics), **env)
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        started.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url) or process.poll() is not None, timeout_s=30)
        assert process.poll() is None, "the server did not start"
        return url

    yield run
    for process in started:
        process.terminate()
        process.wait(10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments kept (the shell
    drops them)."""
    return [line for line in code.replace("\\\n", " ").splitlines() if line.strip()]


def test_quick_start_commands_are_make_targets() -> None:
    for command in shell_commands(block("## Quick start", "sh", 0)):
        words = shlex.split(command, comments=True)
        assert words[0] == "make"
        # `make -n`: the target exists and would run (without running it).
        subprocess.run(["make", "-n", "-C", str(ROOT), *words[1:]], check=True, capture_output=True)


def test_serve_command_serves_and_stops_gracefully() -> None:
    [command] = shell_commands(block("## Serving in production", "sh"))
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "guards.serve"]
    # As written, on a free port and with two workers (this machine has two cores).
    words[words.index("--port") + 1] = str(port := free_port())
    words[words.index("--workers") + 1] = "2"
    environ = {k: v for k, v in os.environ.items() if not _SETTINGS.match(k)}
    process = subprocess.Popen(
        [sys.executable, *words[1:]],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url) or process.poll() is not None, timeout_s=30)
        assert _healthy(url)
    finally:
        process.terminate()  # SIGTERM: a graceful stop
        assert process.wait(timeout=30) == 0


def test_nginx_sketch_agrees_with_the_app() -> None:
    """No nginx here to run `nginx -t`: the sketch is checked for balanced blocks and closed
    directives, and its limits against the app's own."""
    import inspect

    from guards.providers import WorkersAI

    idle_timeout_s = inspect.signature(WorkersAI).parameters["idle_timeout_s"].default
    config = block("## Serving in production", "nginx")
    lines = [line.split("#", 1)[0].strip() for line in config.splitlines()]
    assert config.count("{") == config.count("}")
    for line in filter(None, lines):
        assert line.endswith((";", "{", "}")), line
    directives = dict(line.rstrip(";").split(None, 1) for line in lines if line.endswith(";"))
    # Larger bodies never reach the app: the proxy's cap is the routes' default (1 MiB).
    assert directives["client_max_body_size"] == "1m"
    # A stream that is merely idle must end by the app's idle timeout, not the proxy's.
    assert float(directives["proxy_read_timeout"].rstrip("s")) > idle_timeout_s
    assert directives["proxy_buffering"] == "off"  # Server-Sent Events leave as they come


def check_curl(command: str, out: str) -> None:
    """What each README curl must print, by the route it calls."""
    if "/health" in command:
        assert json.loads(out) == {"ok": True, "level": "full", "down": []}
    elif "/draft-reply/stream" in command:
        assert out.startswith("event: delta\n")
        assert out.rstrip().splitlines()[-2] == "event: done"
    elif '"message": ""' in command:  # the 400
        body = json.loads(out)
        assert (body["error"], body["problems"]) == (
            "invalid_request",
            [{"field": "body.message", "problem": "string_too_short"}],
        )
    elif "/draft-reply" in command:
        assert set(json.loads(out)) == {"model", "reply", "attempts", "trace_id"}
    elif "/report" in command:
        assert set(json.loads(out)) == {"summary", "label", "reply", "resumed_steps", "trace_id"}
    elif "/summary" in command:
        body = json.loads(out)
        assert body["ok"] is True
        assert set(body["data"]) == {"label", "confidence"}
    elif "/metrics" in command:
        assert "guards_requests_total" in out
    else:  # pragma: no cover - a new curl: say what it must answer above
        raise AssertionError(f"no check for {command!r}")


def test_curls_run_against_a_live_server(run_server: Callable[..., str]) -> None:
    url = run_server()
    curls = [
        command
        for section, index in (("## Quick start", 1), ("## Streaming routes", 0))
        for command in shell_commands(block(section, "sh", index))
    ]
    assert len(curls) == 8
    for command in curls:
        assert command.startswith("curl ")
        outputs = []
        # "again: replayed": the same request a second time gets the same answer.
        for _ in range(2 if "again: replayed" in command else 1):
            done = subprocess.run(
                ["bash", "-c", command.replace("localhost:8000", url.removeprefix("http://"))],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert done.returncode == 0, (command, done.stderr)
            check_curl(command, done.stdout)
            outputs.append(done.stdout)
        assert len(set(outputs)) == 1


def test_workers_ai_with_an_openai_fallback_as_written(run_server: Callable[..., str]) -> None:
    """The block's settings, with its `...` filled in, and the providers' base URLs pointed at
    the fake servers: the chain it describes answers."""
    words = shlex.split(block("## Quick start", "sh", 2).replace("\\\n", " "))
    assert words[-2:] == ["make", "run"]
    env = dict(word.split("=", 1) for word in words[:-2])
    with FakeWorkersAI() as workers_ai, FakeOpenAI() as openai:
        filled = {
            "CLOUDFLARE_ACCOUNT_ID": workers_ai.account_id,
            "CLOUDFLARE_API_TOKEN": workers_ai.api_token,
            "OPENAI_API_KEY": str(openai.api_key),
        }
        env = {name: filled[name] if value == "..." else value for name, value in env.items()}
        url = run_server(CLOUDFLARE_API_BASE=workers_ai.base_url, OPENAI_BASE_URL=openai.base_url, **env)
        workers_ai.script("*", Fail(code=3036, status=429))
        openai.script("gpt-4o-mini", Reply("Your parcel ships today."))
        answer = httpx.post(url + "/draft-reply", json={"message": "Where is my parcel?"}, timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["reply"] == "Your parcel ships today."
        assert answer.headers["x-ai-fallback"] == "openai:gpt-4o-mini"
        assert [call.model for call in workers_ai.calls] == ["@cf/meta/llama-3.3-70b-instruct-fp8-fast"]


# --- code blocks, executed ------------------------------------------------------------------------


def asgi_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_readme_example_degrades_as_documented(use_fake_ai: Any) -> None:
    example = readme_example()
    fake = use_fake_ai(example["app"])
    fake.script("*", Reply({"label": "billing", "urgent": False}), Fail(code=3036, status=429))

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            body = {"text": "The site is down!"}
            return [await client.post("/triage", json=body) for _ in range(2)] + [
                await client.post("/triage", json={"text": ""})
            ]

    answered, degraded, invalid = anyio.run(scenario)
    assert answered.json() == {"ok": True, "data": {"label": "billing", "urgent": False}, "fallback": None}
    assert degraded.json()["data"] == {"label": "outage", "urgent": True}
    assert degraded.json()["fallback"]["reason"] == "provider_error"
    assert invalid.status_code == 400
    assert len(fake.calls) == 2


def test_budget_keys_example_keys_by_the_principal(use_fake_ai: Any) -> None:
    # The section's block, on top of "Guard a route of your own" (its app, guards and types),
    # with an `authenticate` that trusts a bearer token naming its user.
    example = readme_example()

    @dataclass(frozen=True)
    class User:
        id: str

    async def authenticate(request: Any) -> User | None:
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        return User(token) if token else None

    example["authenticate"] = authenticate
    exec(compile(block("## How the guards count", "python"), str(README), "exec"), example)
    fake = use_fake_ai(example["app"])
    fake.default = Reply({"label": "billing", "urgent": False})

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            body = {"text": "I was charged twice"}
            ada = {"authorization": "Bearer ada"}
            return [
                await client.post("/triage/mine", json=body),  # no principal: 401, no call
                await client.post("/triage/mine", json=body, headers=ada),
                # The principal decides, whatever x-user-id the client sends.
                await client.post("/triage/mine", json=body, headers={**ada, "x-user-id": "eve"}),
            ]

    refused, first, second = anyio.run(scenario)
    assert refused.status_code == 401
    assert first.json() == second.json() == {"label": "billing", "urgent": False}
    assert len(fake.calls) == 2
    # Both calls were charged to ada's key (a third fits a cap of 3, a fourth does not), none
    # to the header's.
    store = example["guards"].store

    async def charge(key: str, cap: int) -> bool:
        return (await store.charge_budget(key, per_minute=None, per_day=cap)).allowed

    assert anyio.run(charge, "guards:triage_mine:ada", 3)
    assert not anyio.run(charge, "guards:triage_mine:ada", 3)
    assert anyio.run(charge, "guards:triage_mine:eve", 1)


def effort_example() -> tuple[dict[str, Any], FakeBinding, FakeBinding]:
    """The "Effort routing" example, its main binding and its `openai` provider faked."""
    example = readme_example("## Effort routing")
    guards = example["guards"]
    main, openai = FakeBinding(Reply("from the main binding")), FakeBinding(Reply("from openai"))
    guards.binding, guards.providers["openai"] = main, openai
    return example, main, openai


def test_effort_example_routes_by_effort() -> None:
    example, main, openai = effort_example()

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            return [
                await client.post("/reply", json={"message": "Where is my parcel?"}),  # simple
                await client.post("/reply", json={"message": "Why? How? When?"}),  # complex
            ]

    simple, complex_ = anyio.run(scenario)
    assert simple.json() == "from the main binding"
    assert complex_.json() == "from openai"
    assert [call.model for call in main.calls] == ["@cf/meta/llama-3.1-8b-instruct"]
    assert [call.model for call in openai.calls] == ["gpt-4o"]


def test_effort_override_example_escalates_premium_users() -> None:
    example, _, openai = effort_example()

    @dataclass(frozen=True)
    class User:
        plan: str

    async def authenticate(request: Any) -> User | None:
        plan = request.headers.get("authorization", "").removeprefix("Bearer ")
        return User(plan) if plan else None

    example["authenticate"] = authenticate
    exec(compile(block("## Effort routing", "python", 1), str(README), "exec"), example)

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            body = {"message": "Where is my parcel?"}  # simple, by the estimator
            return [
                await client.post("/reply/premium", json=body, headers={"authorization": "Bearer free"}),
                await client.post("/reply/premium", json=body, headers={"authorization": "Bearer premium"}),
            ]

    free, premium = anyio.run(scenario)
    assert free.json() == "from the main binding"
    assert premium.json() == "from openai"
    assert [call.model for call in openai.calls] == ["gpt-4o"]


def test_last_good_example_serves_the_last_answer(use_fake_ai: Any) -> None:
    example = readme_example()
    exec(compile(block("## The last good answer", "python"), str(README), "exec"), example)
    fake = use_fake_ai(example["app"])
    fake.script("*", Reply({"label": "billing", "urgent": False}), Fail(code=3036, status=429))

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            return [
                await client.post("/triage/cached", json={"text": "I was charged twice"}),
                # The same question (whitespace and case aside), when the model fails.
                await client.post("/triage/cached", json={"text": "  i WAS charged   twice "}),
                # Another question: the computed fallback.
                await client.post("/triage/cached", json={"text": "The site is down"}),
            ]

    answered, remembered, computed = anyio.run(scenario)
    assert answered.json()["fallback"] is None
    assert remembered.json()["data"] == {"label": "billing", "urgent": False}
    assert remembered.json()["fallback"]["detail"].startswith("the last good answer")
    assert computed.json()["data"] == {"label": "outage", "urgent": True}  # triage_by_rules


def test_readme_chain_example_falls_back_as_documented() -> None:
    example = readme_example("## Fallback chains")
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script("*", Fail(code=5035, status=403))
    openai.script("*", Fail(code=5035, status=403))
    main.script("@cf/meta/llama-3.1-8b-instruct", Reply("Hello from the small model."))

    async def scenario() -> httpx.Response:
        async with asgi_client(example["app"]) as client:
            # The body a reader sends, as with the example app.
            return await client.post("/reply", json={"message": "hi"})

    response = anyio.run(scenario)
    assert response.json() == "Hello from the small model."
    assert response.headers["x-ai-fallback"] == "@cf/meta/llama-3.1-8b-instruct"
    assert [call.model for call in main.calls + openai.calls] == [
        "@cf/meta/llama-3.3-70b-instruct-fp8-fast",
        "@cf/meta/llama-3.1-8b-instruct",
        "gpt-4o-mini",
    ]
    assert main.calls[0].inputs["prompt"] == "hi"


def test_readme_streaming_example_streams_through_the_chain() -> None:
    example = readme_example("## Fallback chains")
    exec(compile(block("## Streaming routes", "python"), str(README), "exec"), example)
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script("*", Fail(code=5035, status=403))
    openai.script("*", Stream(parts=(Text("Hello"), Text(" there."))))

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            return [
                await client.post("/reply/stream", json={"message": "hi"}),
                await client.post("/reply/stream", json={"message": ""}),
            ]

    response, invalid = anyio.run(scenario)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-ai-fallback"] == "openai:gpt-4o-mini"
    assert 'data: {"text":"Hello"}' in response.text
    assert response.text.rstrip().splitlines()[-2] == "event: done"
    assert invalid.json()["problems"] == [{"field": "body.message", "problem": "string_too_short"}]


def test_metrics_snippet_serves_the_exposition() -> None:
    namespace: dict[str, Any] = {"__name__": "readme_metrics", "app": FastAPI()}
    exec(compile(block("## Metrics", "python"), str(README), "exec"), namespace)

    async def scrape() -> httpx.Response:
        async with asgi_client(namespace["app"]) as client:
            return await client.get("/metrics")

    response = anyio.run(scrape)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "guards_requests_total" in response.text


STATUS_TOKEN = "readme-status-token-0123456789"


def test_status_example_mounts_a_private_page(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATUS_TOKEN", STATUS_TOKEN)
    example = readme_example()
    exec(compile(block("## Status page", "python"), str(README), "exec"), example)

    async def views() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            return [
                await client.get("/status"),
                await client.get("/status", headers={"authorization": f"Bearer {STATUS_TOKEN}"}),
                await client.get(
                    "/status", headers={"authorization": f"Bearer {STATUS_TOKEN}", "accept": "text/html"}
                ),
            ]

    refused, answered, page = anyio.run(views)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    StatusReport.model_validate(answered.json())
    assert page.headers["content-type"] == "text/html; charset=utf-8"


def _keys(value: Any) -> Any:
    """A JSON value's shape: its objects' keys, all the way down (a list: its first item's)."""
    if isinstance(value, dict):
        return {key: _keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return None


def test_status_sample_has_the_fields_of_a_real_answer(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    [sample] = json_values(block("## Status page", "json"))
    StatusReport.model_validate(sample)
    model, fallback = sample["models"][0]["model"], sample["models"][1]["model"]
    settings = workers_ai_settings(fake_workers_ai, ai_model=model, ai_fallback_models=fallback)
    client = serve(create_app(settings, sleep=no_sleep))
    fake_workers_ai.default = Reply("Thank you.")
    fake_workers_ai.script(model, *[Fail(status=500)] * 20)
    for _ in range(5):
        assert client.post("/draft-reply", json={"message": "Where is my parcel?"}).status_code == 200
    real = client.get("/status").json()
    real["routes"] = real["routes"][:1]  # the sample shows one route of four
    assert _keys(real) == _keys(sample)
    # The figures the sample shows are the ones this scenario gives.
    for field in ("level", "store", "refresh_s"):
        assert real[field] == sample[field], field
    for shown, got in zip(sample["models"], real["models"], strict=True):
        for field in ("model", "down", "breaker", "cooldown_s", "calls", "failures", "last_failure"):
            if field == "last_failure":
                assert (got[field] or {}).get("kind") == (shown[field] or {}).get("kind")
            else:
                assert got[field] == shown[field], field
    for field in ("route", "requests", "outcomes", "error_rate", "fallback_model_rate", "trips"):
        assert real["routes"][0][field] == sample["routes"][0][field], field


def test_status_curls_run_against_a_live_server(run_server: Callable[..., str]) -> None:
    url = run_server(STATUS_TOKEN=STATUS_TOKEN)
    commands = shell_commands(block("## Status page", "sh"))
    assert len(commands) == 3
    outputs = []
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command.replace("localhost:8000", url.removeprefix("http://"))],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "STATUS_TOKEN": STATUS_TOKEN},
        )
        assert done.returncode == 0, (command, done.stderr)
        outputs.append(done.stdout)
    as_json, refused, page = outputs
    StatusReport.model_validate(json.loads(as_json))
    assert refused == "401\n"
    assert page.startswith("<!doctype html>")
    assert STATUS_TOKEN not in page


def test_tracing_snippet_traces_with_its_provider() -> None:
    namespace: dict[str, Any] = {"__name__": "readme_traces"}
    exec(compile(block("## Traces", "python"), str(README), "exec"), namespace)
    assert namespace["guards"].tracing is not None
    namespace["provider"].shutdown()


def test_testing_example_passes_under_pytest(tmp_path: Path) -> None:
    """The README's test of the README's route, run by pytest as a user runs it."""
    (tmp_path / "service.py").write_text(block("## Guard a route of your own", "python"))
    (tmp_path / "test_service.py").write_text(block("## Testing your routes", "python"))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-W",
            "error",
            "test_service.py",
        ],
        cwd=tmp_path,
        env={**environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


# --- samples, checked against what the code produces ------------------------------------------------


def json_values(text: str) -> list[Any]:
    """Every JSON value of a block (one per line, or spanning lines)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while at < len(text):
        value, end = decoder.raw_decode(text, at)
        values.append(value)
        at = end
        while at < len(text) and text[at].isspace():
            at += 1
    return values


def test_envelope_samples_are_real_answers(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    samples = json_values(block("### The envelope (degrading routes)", "json"))
    assert len(samples) == 2
    for sample in samples:
        Envelope[dict[str, Any]].model_validate(sample)
    # The fallback's detail is what the example app answers for a spent quota.
    client = serve(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    fake_workers_ai.script("*", Fail(code=3036, status=429))
    answer = client.post("/summary", json={"text": "refund my invoice"}, headers={"x-user-id": "ada"})
    assert answer.json()["fallback"] == samples[1]["fallback"]


def test_stream_sample_has_the_documented_events() -> None:
    sample = block("## Streaming routes", "")
    events = re.findall(r"^event: (\w+)\ndata: (\{.*\})$", sample, re.MULTILINE)
    assert [name for name, _ in events] == ["delta", "delta", "done"]
    schema = create_app(Settings()).openapi()["paths"]["/draft-reply/stream"]["post"]["responses"]["200"]
    documented = {
        e["properties"]["event"]["const"]: e["properties"]["data"]["contentSchema"]
        for e in schema["content"]["text/event-stream"]["schema"]["oneOf"]
    }
    for name, data in events:
        assert list(json.loads(data)) == documented[name]["required"], name
    # The table below it names the same events, with the same fields.
    section = README.read_text().split("## Streaming routes", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `\{([^}]*)\}` \|", section, re.MULTILINE)
    assert {name: re.findall(r'"(\w+)"', fields) for name, fields in rows} == {
        name: data["required"] for name, data in documented.items()
    }


def test_log_samples_have_the_fields_of_real_lines(
    fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    client = serve(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    fake_workers_ai.script("*", Fail(code=3040, status=429), Reply("Fine."))
    assert client.post("/draft-reply", json={"message": "Where is my parcel?"}).status_code == 200
    # Effort routing on, and a model failing every call: the effort decision, and retries until
    # the retry budget (at least 3 per window) refuses one.
    routed = serve(create_app(workers_ai_settings(fake_workers_ai, ai_effort="auto"), sleep=no_sleep))
    fake_workers_ai.script("*", *[Fail(code=3040, status=429)] * 10)
    for _ in range(5):
        routed.post("/draft-reply", json={"message": "Where is my parcel?"})
    real: dict[str, list[set[str]]] = {}
    for line in guards_log.events():
        real.setdefault(line["event"], []).append(set(line))
    samples = json_values(block("## Logs", "json"))
    assert [s["event"] for s in samples] == ["effort", "attempt", "retry", "retry", "request"]
    for sample in samples:
        assert set(sample) in real[sample["event"]], sample["event"]


def test_layout_names_files_that_exist() -> None:
    layout = block("## Layout", "")
    for name in re.findall(r"(?<![\w/.])([\w.]+\.py)\b", layout):
        if "/" in name:
            assert (ROOT / name).exists(), name
        else:
            assert list(ROOT.glob(f"*/**/{name}")), name
    for folder in re.findall(r"^(\w+)/", layout, re.MULTILINE):
        assert (ROOT / folder).is_dir(), folder


# --- what the README says of behaviour ----------------------------------------------------------


def section(heading: str) -> str:
    return README.read_text().split(heading + "\n", 1)[1].split("\n## ", 1)[0]


def test_budget_section_says_what_a_missing_key_does(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    text = section("## How the guards count")
    assert "without it" in text
    assert "IP address" in text
    # And so it is: two callers without the header, from one address, share one daily cap.
    client = serve(create_app(workers_ai_settings(fake_workers_ai, daily_call_limit=1), sleep=no_sleep))
    fake_workers_ai.default = Reply({"label": "billing", "confidence": 0.9})
    first = client.post("/summary", json={"text": "one"})
    second = client.post("/summary", json={"text": "two"})
    assert first.json()["fallback"] is None
    assert second.json()["fallback"]["reason"] == "budget_exceeded"
    third = client.post("/summary", json={"text": "three"}, headers={"x-user-id": "ada"})
    assert third.json()["fallback"] is None


def test_reason_tables_say_a_cooldown_answers_circuit_open(
    fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    rows = [line for line in README.read_text().splitlines() if "| circuit_open |" in line]
    assert len(rows) == 2
    assert all("cooling down" in row for row in rows)
    assert "3036" in rows[0]
    assert "10 minutes" in rows[0]
    # And so it is: one 3036 takes a one-model route out for 10 minutes.
    client = serve(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    fake_workers_ai.script("*", Fail(code=3036, status=429))
    client.post("/summary", json={"text": "refund"}, headers={"x-user-id": "ada"})
    skipped = client.post("/summary", json={"text": "refund"}, headers={"x-user-id": "ada"})
    assert skipped.json()["fallback"]["reason"] == "circuit_open"
    strict = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert strict.json()["error"] == "circuit_open"
    assert 590 <= int(strict.headers["retry-after"]) <= 600
    assert len(fake_workers_ai.calls) == 1


def test_health_example_answers_the_level() -> None:
    example = readme_example()
    example["app"] = FastAPI()  # the block's own route, on an app of its own
    exec(compile(block("## Service levels and shedding", "python"), str(README), "exec"), example)

    async def health() -> httpx.Response:
        async with asgi_client(example["app"]) as client:
            return await client.get("/health")

    assert anyio.run(health).json() == {"ok": True, "level": "full", "down": []}


def test_readme_task_example_resumes_and_replays(use_fake_ai: Any) -> None:
    example = readme_example("## Multi-step tasks")
    fake = use_fake_ai(example["app"])
    fake.script(
        "*", Reply("A summary."), Reply({"label": "billing", "confidence": 0.9}), Fail(code=5035, status=403)
    )

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=example["app"])
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"Idempotency-Key": "ticket-42", "x-user-id": "ada"}
            answers = [await client.post("/report", json={"text": "Charged twice"}, headers=headers)]
            fake.script("*", Reply("Sorry, refunded."))
            for _ in range(2):
                answers.append(await client.post("/report", json={"text": "Charged twice"}, headers=headers))
            return answers

    failed, resumed, replayed = anyio.run(scenario)
    assert failed.status_code == 502
    assert resumed.json() == {
        "summary": "A summary.",
        "label": "billing",
        "reply": "Sorry, refunded.",
        "resumed_steps": ["summarize", "classify"],
    }
    assert replayed.content == resumed.content
    assert replayed.headers["idempotent-replayed"] == "true"
    assert len(fake.calls) == 4
