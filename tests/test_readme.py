"""Every example of the README and of the docs (`docs/**/*.md`) runs as written: each fenced
block is executed (code), run against a live server (curls, commands) or checked against what
the code really produces (sample answers, log lines, the layout). `test_every_block_is_checked`
fails for a block no test covers, so the next drift fails a test.

A block that cannot run here (a `pip install`, a command that needs a real account) is preceded
by a marker that says so and why, on the line just above its fence:

    <!-- not run: installs from the package index -->

A marked block must give its reason, and no test may claim it."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.service import create_app
from app.settings import Settings, load_settings
from fixtures import (
    Fail,
    FakeAnthropic,
    FakeAzureOpenAI,
    FakeBinding,
    FakeGemini,
    FakeOpenAI,
    FakeWorkersAI,
    Hang,
    ManualClock,
    Reply,
    Stream,
    Text,
)
from guards import AI, Budget, CircuitState, ConfigurationError, Envelope, Guards, Outcome, StatusReport
from guards.stores import MemoryStore

from .app.test_app_providers import PROVIDER_VARIABLES
from .app.test_ui_stream import check_ui_stream
from .conftest import (
    UNUSED_PLUGINS,
    AppClient,
    ExampleClient,
    LogLines,
    Serve,
    asgi_client,
    no_sleep,
    wait_until,
    workers_ai_settings,
)
from .spec.test_tracing import otlp_export, otlp_spans

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: The marker of a block that is not run, with its reason.
NOT_RUN = re.compile(r"^\s*<!-- not run: (?P<reason>.*\S.*?) -->\s*$")


def pages() -> list[str]:
    """Every page whose blocks are checked: `README.md`, and each page of the docs by its path
    under `docs/` (`streaming.md`, `operating/logs.md`)."""
    return ["README.md", *sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))]


def page_path(page: str) -> Path:
    return README if page == "README.md" else DOCS / page


def page_text(page: str) -> str:
    return page_path(page).read_text()


@dataclass(frozen=True)
class Block:
    page: str  # `README.md`, or a path under docs/
    lang: str  # the fence's info string (`sh`, `python`, `json`, or empty)
    index: int  # its place among the page's blocks in the same language
    code: str
    not_run: str | None  # the reason of its `<!-- not run: ... -->` marker, if it has one


def page_blocks(page: str) -> list[Block]:
    found: list[Block] = []
    counts = dict[str, int]()
    previous = ""
    lines = iter(page_text(page).splitlines())
    for line in lines:
        if line.lstrip().startswith("```"):  # a fence, also indented in a list item
            indent = len(line) - len(line.lstrip())
            body = []
            for inner in lines:
                if inner.lstrip().startswith("```"):
                    break
                body.append(inner[indent:])
            lang = line.strip()[3:].strip()
            index = counts.get(lang, 0)
            counts[lang] = index + 1
            marker = NOT_RUN.match(previous)
            reason = marker["reason"] if marker else None
            found.append(Block(page, lang, index, "\n".join(body) + "\n", reason))
        previous = line
    return found


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in page_blocks(page)]


def block(page: str, lang: str, index: int = 0) -> str:
    [code] = [b.code for b in page_blocks(page) if (b.lang, b.index) == (lang, index)]
    return code


def run_block(namespace: dict[str, Any], page: str, index: int = 0) -> dict[str, Any]:
    """Executes a page's Python block in `namespace` (what earlier blocks defined)."""
    exec(compile(block(page, "python", index), str(page_path(page)), "exec"), namespace)
    return namespace


def page_example(page: str, index: int = 0) -> dict[str, Any]:
    """The namespace of a page's Python block, executed on its own."""
    return run_block({"__name__": "readme_example"}, page, index)


def readme_example() -> dict[str, Any]:
    """The README's route (`service.py` in its test), executed."""
    return page_example("README.md")


#: Every block of the README and the docs, by page, language and place, and the test that
#: checks it.
CHECKED = {
    ("README.md", "sh", 1): "test_quick_start_commands_are_make_targets",
    **{("README.md", "sh", i): "test_quick_start_curls_answer_what_the_readme_shows" for i in range(2, 9)},
    **{("README.md", "json", i): "test_quick_start_curls_answer_what_the_readme_shows" for i in range(5)},
    **{("README.md", "text", i): "test_quick_start_curls_answer_what_the_readme_shows" for i in range(2)},
    ("README.md", "python", 0): "test_readme_example_degrades_as_documented",
    ("README.md", "python", 1): "test_testing_example_passes_under_pytest",
    ("concepts.md", "python", 0): "test_concepts_route_is_the_readmes",
    ("getting-started.md", "sh", 1): "test_workers_ai_with_an_openai_fallback_as_written",
    ("contracts.md", "json", 0): "test_envelope_samples_are_real_answers",
    ("fallback-chains.md", "python", 0): "test_readme_chain_example_falls_back_as_documented",
    ("fallback-chains.md", "python", 1): "test_chat_route_example_moves_past_a_silent_model",
    ("fallback-chains.md", "python", 2): "test_limits_example_skips_and_moves_on_as_documented",
    ("fallback-chains.md", "python", 3): "test_cross_provider_example_walks_as_documented",
    ("hedging.md", "python", 0): "test_hedge_example_answers_from_the_hedge_after_its_delay",
    ("deployments.md", "python", 0): "test_deployments_example_spreads_then_falls_back",
    ("guards/output.md", "python", 0): "test_output_example_moves_rejected_answers_on",
    ("guards/output.md", "text", 0): "test_output_reask_sample_is_the_turn_sent",
    ("streaming.md", "python", 0): "test_readme_streaming_example_streams_through_the_chain",
    ("streaming.md", "python", 1): "test_use_chat_example_answers_the_ui_message_stream",
    ("streaming.md", "python", 2): "test_structured_stream_example_streams_and_checks_its_json",
    ("streaming.md", "python", 3): "test_resumable_example_resumes_the_chats_stream",
    ("streaming.md", "sh", 0): "test_streaming_curl_streams",
    ("streaming.md", "", 0): "test_stream_sample_has_the_documented_events",
    ("operating/logs.md", "json", 0): "test_log_samples_have_the_fields_of_real_lines",
    ("counting.md", "python", 0): "test_budget_keys_example_keys_by_the_principal",
    ("guards/budget.md", "python", 0): "test_scoped_budgets_example_admits_every_scope_together",
    ("guards/budget.md", "python", 1): "test_breaker_examples_do_what_their_comments_say",
    ("guards/budget.md", "python", 2): "test_breaker_examples_do_what_their_comments_say",
    ("guards/budget.md", "python", 3): "test_soft_limit_example_warns_then_downgrades",
    ("guards/budget.md", "python", 4): "test_prices_example_bills_as_its_comments_say",
    ("guards/budget.md", "python", 5): "test_price_table_example_prices_what_the_app_did_not",
    ("guards/budget.md", "python", 6): "test_fair_share_example_splits_the_limit_by_weight",
    ("effort-routing.md", "python", 0): "test_effort_example_routes_by_effort",
    ("effort-routing.md", "python", 1): "test_effort_override_example_escalates_premium_users",
    ("last-good.md", "python", 0): "test_last_good_example_serves_the_last_answer",
    ("operating/metrics.md", "python", 0): "test_metrics_snippet_serves_the_exposition",
    ("operating/status-page.md", "python", 0): "test_status_example_mounts_a_private_page",
    ("operating/status-page.md", "json", 0): "test_status_sample_has_the_fields_of_a_real_answer",
    ("operating/status-page.md", "sh", 0): "test_status_curls_run_against_a_live_server",
    ("operating/traces.md", "python", 0): "test_tracing_snippet_traces_with_its_provider",
    ("operating/traces.md", "json", 0): "test_traces_sample_is_what_an_otlp_export_sends",
    ("testing.md", "python", 0): "test_testing_page_tests_pass_in_either_order",
    ("testing.md", "python", 1): "test_testing_page_fake_servers_example_passes_under_pytest",
    ("operating/serving.md", "sh", 0): "test_which_server_commands_are_the_served_ones",
    ("operating/serving.md", "sh", 1): "test_serve_command_serves_and_stops_gracefully",
    ("operating/serving.md", "sh", 2): "test_forwarded_commands_name_proxies",
    ("operating/serving.md", "text", 0): "test_shutdown_event_sample_is_the_relays",
    ("operating/serving.md", "nginx", 0): "test_nginx_sketch_agrees_with_the_app",
    ("service-levels.md", "python", 0): "test_health_example_answers_the_level",
    ("tasks.md", "python", 0): "test_readme_task_example_resumes_and_replays",
    ("development.md", "", 0): "test_layout_names_files_that_exist",
    ("benchmarks.md", "sh", 0): "test_benchmark_commands_are_make_targets",
    ("example-app.md", "sh", 0): "test_example_app_provider_lines_start_the_app",
    ("stores.md", "python", 0): "test_development_redis_example_answers",
    ("providers/anthropic.md", "python", 0): "test_anthropic_example_falls_back_over_http",
    ("providers/bedrock.md", "python", 0): "test_bedrock_example_answers_through_the_fake",
    ("providers/azure-openai.md", "python", 0): "test_azure_openai_example_answers_through_the_fake",
}


def test_every_block_is_checked() -> None:
    blocks = all_blocks()
    found = {(b.page, b.lang, b.index) for b in blocks if b.not_run is None}
    not_run = {(b.page, b.lang, b.index) for b in blocks if b.not_run is not None}
    assert found - set(CHECKED) == set(), "a block no test checks: add it to CHECKED"
    assert set(CHECKED) - found - not_run == set(), "CHECKED names a block the pages no longer have"
    assert set(CHECKED) & not_run == set(), "a block marked `not run` that a test claims to check"
    for test in CHECKED.values():
        assert callable(globals().get(test)), test


def test_not_run_marker_needs_a_reason() -> None:
    """`<!-- not run: -->` with nothing after the colon is no marker: its block must be checked."""
    assert NOT_RUN.match("<!-- not run:  -->") is None
    assert NOT_RUN.match("<!-- not run: installs from the package index -->")["reason"] == (  # type: ignore[index]
        "installs from the package index"
    )
    markers = [
        line
        for p in pages()
        for line in page_text(p).splitlines()
        if line.lstrip().startswith("<!-- not run")
    ]
    assert all(NOT_RUN.match(line) for line in markers), "a `not run` marker without its reason"


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
    for command in shell_commands(block("README.md", "sh", 1)):
        words = shlex.split(command, comments=True)
        assert words[0] == "make"
        # `make -n`: the target exists and would run (without running it).
        subprocess.run(["make", "-n", "-C", str(ROOT), *words[1:]], check=True, capture_output=True)


def test_serve_command_serves_and_stops_gracefully() -> None:
    [command] = shell_commands(block("operating/serving.md", "sh", 1))
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


def without_address(words: list[str]) -> list[str]:
    """A server's command without its host and port options (`--host h`, `--port p`, `--bind a`)."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("--host", "--port", "--bind"):
            skip = True
        else:
            kept.append(word)
    return kept


def test_which_server_commands_are_the_served_ones() -> None:
    """The serving page's four commands are the ones the tests serve the example app with:
    `guards.serve` as in the next block (served above), uvicorn, hypercorn and granian as in
    tests/e2e/test_servers.py (served there, each through the Quick start, a stream left early and
    an oversized body)."""
    from .e2e.test_servers import SERVERS

    commands = [shlex.split(c, comments=True) for c in shell_commands(block("operating/serving.md", "sh"))]
    served = without_address(shlex.split(block("operating/serving.md", "sh", 1)))
    assert commands[0] == served
    assert {words[0]: words for words in commands[1:]} == {
        name: without_address(command(8000)) for name, command in SERVERS.items()
    }


def test_forwarded_commands_name_proxies() -> None:
    """Each `--forwarded-allow-ips` of the page is an option guards.serve takes, with addresses
    and networks it can read."""
    import ipaddress

    from guards.serve import main

    with pytest.raises(SystemExit) as shown:
        main(["--help"])
    assert shown.value.code == 0
    commands = [shlex.split(c) for c in shell_commands(block("operating/serving.md", "sh", 2))]
    assert len(commands) == 2
    for words in commands:
        assert words[:4] == ["python", "-m", "guards.serve", "app.main:app"]
        assert words[4] == "--forwarded-allow-ips"
        for address in words[5].split(","):
            ipaddress.ip_network(address)


def test_shutdown_event_sample_is_the_relays() -> None:
    from guards.streams._relay import SHUTDOWN_DETAIL

    [(name, data)] = sse_events(block("operating/serving.md", "text"))
    assert name == "error"
    assert data == {"guard": "call", "reason": "timeout", "detail": SHUTDOWN_DETAIL, "trace_id": "..."}


def test_nginx_sketch_agrees_with_the_app() -> None:
    """No nginx here to run `nginx -t`: the sketch is checked for balanced blocks and closed
    directives, and its limits against the app's own."""
    import inspect

    from guards.providers import WorkersAI

    idle_timeout_s = inspect.signature(WorkersAI).parameters["idle_timeout_s"].default
    config = block("operating/serving.md", "nginx")
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


#: Fields of an answer that differ from one request to the next.
VARYING = {"trace_id"}


def same_answer(real: Any, shown: Any) -> None:
    """`shown`, a sample answer, is `real` but for the fields that vary per request."""
    if isinstance(shown, dict):
        assert isinstance(real, dict), (real, shown)
        assert set(real) == set(shown), (real, shown)
        for key, value in shown.items():
            if key not in VARYING:
                same_answer(real[key], value)
    elif isinstance(shown, list):
        assert isinstance(real, list), (real, shown)
        assert len(real) == len(shown), (real, shown)
        for got, want in zip(real, shown, strict=True):
            same_answer(got, want)
    else:
        assert real == shown, (real, shown)


def sse_events(text: str) -> list[tuple[str, Any]]:
    return [
        (name, json.loads(data))
        for name, data in re.findall(r"^event: (\w+)\ndata: (.*)$", text, re.MULTILINE)
    ]


def check_shown(out: str, lang: str, shown: str) -> None:
    """What a command printed against what the page shows it prints (`...`: lines left out)."""
    if lang == "json":
        same_answer(json.loads(out), json.loads(shown))
    elif shown.startswith("event: "):  # a stream: the events shown first and last, in order
        head, _, tail = shown.partition("\n...\n")
        events, first, last = sse_events(out), sse_events(head), sse_events(tail)
        assert len(events) >= len(first) + len(last)
        ends = events[: len(first)] + events[len(events) - len(last) :]
        for (name, data), (shown_name, shown_data) in zip(ends, first + last, strict=True):
            assert name == shown_name
            same_answer(data, shown_data)
    else:  # lines of the output, in order, with `...` for those left out
        lines = out.splitlines()
        at = 0
        for line in shown.strip().splitlines():
            if line != "...":
                assert line in lines[at:], line
                at = lines.index(line, at) + 1


def run_curl(url: str, command: str) -> str:
    assert command.startswith("curl ")
    done = subprocess.run(
        ["bash", "-c", command.replace("localhost:8000", url.removeprefix("http://"))],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def test_quick_start_curls_answer_what_the_readme_shows(run_server: Callable[..., str]) -> None:
    """Each Quick start command, against a fresh `make run`, in the README's order, prints what
    the block after it shows (but for trace ids); the task's, sent again, is replayed."""
    blocks = [b for b in page_blocks("README.md") if b.not_run is None]
    at = blocks.index(next(b for b in blocks if b.code.startswith("curl ")))
    pairs = list(zip(blocks[at::2], blocks[at + 1 :: 2], strict=True))
    assert len(pairs) == 7
    url = run_server()
    for command_block, shown in pairs:
        [command] = shell_commands(command_block.code)
        assert command_block.lang == "sh", command
        assert shown.lang in ("json", "text"), command
        out = run_curl(url, command)
        check_shown(out, shown.lang, shown.code)
        if "Idempotency-Key" in command:  # sent again: the same answer
            assert run_curl(url, command) == out


def test_streaming_curl_streams(run_server: Callable[..., str]) -> None:
    [command] = shell_commands(block("streaming.md", "sh"))
    out = run_curl(run_server(), command)
    events = [name for name, _ in sse_events(out)]
    assert events[0] == "delta"
    assert events[-1] == "done"
    assert set(events) == {"delta", "done"}


def test_workers_ai_with_an_openai_fallback_as_written(run_server: Callable[..., str]) -> None:
    """The block's settings, with its `...` filled in, and the providers' base URLs pointed at
    the fake servers: the chain it describes answers."""
    words = shlex.split(block("getting-started.md", "sh", 1).replace("\\\n", " "))
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


def test_breaker_examples_do_what_their_comments_say() -> None:
    """The slow-call breaker opens on the fifth slow call within a minute once the minute saw
    ten calls; the probing one, open 30 s, then probes every 5 s."""
    slow_aware = page_example("guards/budget.md", 1)["slow_aware"]
    recovering = page_example("guards/budget.md", 2)["recovering"]
    clock = ManualClock()
    store = MemoryStore(clock=clock)

    async def scenario() -> None:
        for outcome in [Outcome.success] * 9 + [Outcome.slow] * 4:
            assert (await store.breaker_admit("slow", slow_aware)).allowed
            state = await store.breaker_record("slow", slow_aware, outcome, probe=None)
            assert state.state is CircuitState.closed
        state = await store.breaker_record("slow", slow_aware, Outcome.slow, probe=None)
        assert state.state is CircuitState.open
        for _ in range(recovering.failure_threshold):
            await store.breaker_record("probing", recovering, Outcome.failure, probe=None)
        assert (await store.breaker_admit("probing", recovering)).retry_after_s == 30
        clock.advance(30)
        probe = await store.breaker_admit("probing", recovering)
        await store.breaker_record("probing", recovering, Outcome.failure, probe=probe.probe)
        assert (await store.breaker_admit("probing", recovering)).retry_after_s == 5

    anyio.run(scenario)


def test_prices_example_bills_as_its_comments_say() -> None:
    example = page_example("guards/budget.md", 4)
    assert example["cost"] == pytest.approx(0.0159)
    claude, prices = example["claude"], example["prices"]
    assert claude.cost(10_000, 500) == pytest.approx(0.0375)
    assert claude.cost(200_001, 0) == pytest.approx(200_001 * 6e-6)  # twice the rate, whole
    assert prices["*"].cost(1_000_000, 0) == pytest.approx(5.0)
    # "*" prices a spend-capped route's unlisted model: it starts.
    guards = Guards(FakeBinding(), prices=prices)
    guards.route(model="@cf/unlisted/model", max_tokens=10, budget=Budget(spend_per_day=1.0))(ask)


async def ask(ai: AI[str]) -> str:
    return await ai.run({"prompt": "hi"})


def test_price_table_example_prices_what_the_app_did_not() -> None:
    guards = page_example("guards/budget.md", 5)["guards"]
    capped = Budget(spend_per_day=1.0)
    guards.route(model="gpt-4o-mini", fallbacks=["gpt-4o"], max_tokens=10, budget=capped)(ask)
    assert guards.prices["gpt-4o-mini"].input_token == 0.1e-6  # the app's own price wins
    assert guards.prices["gpt-4o"].input_token > 0  # the table's, for the model it did not price
    with pytest.raises(ConfigurationError, match="no price for not-a-listed-model"):
        guards.route(model="not-a-listed-model", max_tokens=10, budget=capped)(ask)


def test_scoped_budgets_example_admits_every_scope_together(use_fake_ai: Any) -> None:
    # The section's block, on top of "Guard a route of your own" (its app, guards and types).
    example = readme_example()
    run_block(example, "guards/budget.md")
    fake = use_fake_ai(example["app"])
    fake.default = Reply({"label": "billing", "urgent": False})

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            body = {"text": "I was charged twice"}
            ada = {"x-user-id": "ada", "x-tenant-id": "acme"}
            answers = [await client.post("/triage/team", json=body, headers=ada) for _ in range(101)]
            bob = {"x-user-id": "bob", "x-tenant-id": "acme"}
            return [*answers, await client.post("/triage/team", json=body, headers=bob)]

    *ada, bob = anyio.run(scenario)
    assert all(answer.json()["fallback"] is None for answer in ada[:100])
    refused = ada[100].json()["fallback"]
    assert refused["reason"] == "budget_exceeded"
    assert refused["detail"] == "triage_team: daily cap of 100 calls reached"
    assert bob.json()["fallback"] is None  # the tenant (101 calls of 1,000) and the global cap have room
    assert len(fake.calls) == 101
    assert all(call.inputs["max_tokens"] == 300 for call in fake.calls)


def test_soft_limit_example_warns_then_downgrades(use_fake_ai: Any) -> None:
    # The section's block, on top of "Guard a route of your own" (its app, guards and types).
    example = readme_example()
    run_block(example, "guards/budget.md", 3)
    fake = use_fake_ai(example["app"])
    fake.default = Reply({"label": "billing", "urgent": False})

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            body, acme = {"text": "I was charged twice"}, {"x-tenant-id": "acme"}
            return [await client.post("/triage/metered", json=body, headers=acme) for _ in range(101)]

    answers = anyio.run(scenario)
    seen = [(a.headers.get("x-ai-budget"), a.headers.get("x-ai-downgraded")) for a in answers[:100]]
    near = "near; scope=metered"
    assert seen == [(None, None)] * 80 + [(near, None)] + [(near, "metered")] * 19
    big, small = "@cf/meta/llama-3.3-70b-instruct-fp8-fast", "@cf/meta/llama-3.1-8b-instruct"
    assert [call.model for call in fake.calls] == [big] * 81 + [small] * 19
    assert answers[100].json()["fallback"]["reason"] == "budget_exceeded"


def test_fair_share_example_splits_the_limit_by_weight(use_fake_ai: Any) -> None:
    # The section's block, on top of "Guard a route of your own" (its app, guards and types).
    example = readme_example()
    run_block(example, "guards/budget.md", 6)
    fake = use_fake_ai(example["app"])
    fake.default = Reply({"label": "billing", "urgent": False})

    async def scenario(tenants: list[str]) -> list[str]:
        async with asgi_client(example["app"]) as client:
            body, admitted = {"text": "I was charged twice"}, []
            for tenant in tenants:
                answer = await client.post("/triage/shared", json=body, headers={"x-tenant-id": tenant})
                if answer.json()["fallback"] is None:
                    admitted.append(tenant)
                else:
                    assert answer.json()["fallback"]["reason"] == "rate_limited"
            return admitted

    def in_one_minute(tenants: list[str]) -> list[str]:
        """`scenario` on a fresh store, within one UTC minute (the shared limit's window): run
        again, once, if a minute began meanwhile (it takes well under a second)."""
        for _ in range(2):
            example["guards"].replace_store(MemoryStore())
            minute = time.time() // 60
            admitted = anyio.run(scenario, tenants)
            if time.time() // 60 == minute:
                return admitted
        raise AssertionError("two minutes began during two runs of under a second each")

    admitted = in_one_minute(["acme", "globex"] * 30)  # both want more than 40
    assert (admitted.count("acme"), admitted.count("globex")) == (30, 10)
    assert in_one_minute(["globex"] * 41) == ["globex"] * 40  # alone: the whole limit


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
    run_block(example, "counting.md")
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
    example = page_example("effort-routing.md")
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
    run_block(example, "effort-routing.md", 1)

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
    run_block(example, "last-good.md")
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
    example = page_example("fallback-chains.md")
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


def test_chat_route_example_moves_past_a_silent_model() -> None:
    """The 70b model accepts the request and says nothing: gpt-4o-mini's first words come about
    `first_output_s` (4 s) after the request, not after the 20 s deadline; the 70b model was
    called once, its call cancelled, and the small model not at all."""
    example = run_block(page_example("fallback-chains.md"), "fallback-chains.md", 1)
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script("*", Hang())
    openai.script("*", Stream(parts=(Text("Hello"), Text(" there."))))

    async def scenario() -> tuple[httpx.Response, float]:
        async with asgi_client(example["app"]) as client:
            started = time.monotonic()
            response = await client.post("/chat", json={"message": "hi"})
            return response, time.monotonic() - started

    response, elapsed = anyio.run(scenario)
    assert response.headers["x-ai-fallback"] == "openai:gpt-4o-mini"
    assert 'data: {"text":"Hello"}' in response.text
    assert response.text.rstrip().splitlines()[-2] == "event: done"
    assert 4.0 <= elapsed < 6.0
    assert [call.model for call in main.calls] == ["@cf/meta/llama-3.3-70b-instruct-fp8-fast"]
    assert main.calls[0].disconnected
    assert len(openai.calls) == 1


def test_hedge_example_answers_from_the_hedge_after_its_delay() -> None:
    """The 70b model is slow: gpt-4o-mini answers about 0.5 s after the request and the 70b
    call is closed; the 70b model answering within 0.5 s, gpt-4o-mini is never called."""
    example = page_example("hedging.md")
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script("*", Hang(), Reply("From the 70b model.", delay_s=0.1))
    openai.script("*", Reply("From gpt-4o-mini."))

    async def scenario() -> list[tuple[httpx.Response, float]]:
        async with asgi_client(example["app"]) as client:
            timed = []
            for _ in range(2):
                started = time.monotonic()
                response = await client.post("/reply", json={"message": "hi"})
                timed.append((response, time.monotonic() - started))
            return timed

    (hedged, hedged_s), (first, first_s) = anyio.run(scenario)
    assert hedged.json() == "From gpt-4o-mini."
    assert hedged.headers["x-ai-fallback"] == "openai:gpt-4o-mini"
    assert 0.5 <= hedged_s < 2.0
    assert main.calls[0].disconnected
    assert first.json() == "From the 70b model."
    assert "x-ai-fallback" not in first.headers
    assert first_s < 0.5
    assert len(openai.calls) == 1


def test_limits_example_skips_and_moves_on_as_documented() -> None:
    example = page_example("fallback-chains.md", 2)
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script("*", Reply("The short summary."), Fail(code=2016, status=400, shape="gateway"))
    openai.script("*", Reply("The long summary."), Reply("The other summary."))

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            return [
                await client.post("/summarize", json={"text": "word " * 10_000}),
                await client.post("/summarize", json={"text": "A short note."}),
                await client.post("/summarize", json={"text": "A note the guardrails block."}),
            ]

    long, short, blocked = anyio.run(scenario)
    assert long.json() == "The long summary."
    assert short.json() == "The short summary."
    assert blocked.json() == "The other summary."
    # The long document never reached the 8b model: its window cannot hold it.
    assert [call.model for call in main.calls] == ["@cf/meta/llama-3.1-8b-instruct-fp8"] * 2
    assert [call.model for call in openai.calls] == ["gpt-4o-mini"] * 2
    assert main.calls[0].inputs["max_tokens"] == 500


def test_output_example_moves_rejected_answers_on() -> None:
    example = page_example("guards/output.md")
    guards = example["guards"]
    fake = guards.binding = FakeBinding()
    big, small = "@cf/meta/llama-3.3-70b-instruct-fp8-fast", "@cf/meta/llama-3.1-8b-instruct"
    fake.script(big, Reply({"label": "billing"}))  # no `urgent`: rejected
    fake.script(small, Reply({"label": "billing", "urgent": False}))
    lookup = "lookup_order"
    fake.script(
        big,
        Reply(None, tool_calls=({"name": lookup, "arguments": {"order_id": "my parcel"}},)),
        Reply(None, tool_calls=({"name": lookup, "arguments": {"order_id": 42}},)),
    )

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            return [
                await client.post("/triage", json={"message": "I was charged twice"}),
                await client.post("/order-status", json={"message": "Where is my parcel?"}),
            ]

    triage, order = anyio.run(scenario)
    assert triage.json() == {"label": "billing", "urgent": False}
    assert (triage.headers["x-ai-rejected"], triage.headers["x-ai-fallback"]) == (big, small)
    assert order.json() == {"reply": "", "orders": [42]}
    assert [call.model for call in fake.calls] == [big, small, big, big]
    assert fake.calls[2].inputs["tools"][0]["function"]["name"] == lookup
    assert fake.calls[3].inputs["messages"][-1]["content"] == (
        "Your previous answer was rejected: tool[lookup_order].order_id: int_parsing. "
        "Answer again, and fix these problems."
    )


def test_output_reask_sample_is_the_turn_sent() -> None:
    example = page_example("guards/output.md")
    guards, triage_type = example["guards"], example["Triage"]
    fake = guards.binding = FakeBinding()
    fake.script("*", Reply({"urgent": "maybe"}), Reply({"label": "billing", "urgent": True}))

    async def reask(ai: Any) -> Any:
        return await ai.run({"prompt": "Triage this."})

    # The page's `Triage` as the output type (this module's annotations are strings).
    reask.__annotations__ = {"ai": AI[triage_type], "return": triage_type}
    example["app"].post("/triage/reask")(guards.route(model="m", on_rejected="reask")(reask))

    async def scenario() -> httpx.Response:
        async with asgi_client(example["app"]) as client:
            return await client.post("/triage/reask")

    assert anyio.run(scenario).json() == {"label": "billing", "urgent": True}
    assert fake.calls[1].inputs["prompt"] == "Triage this.\n\n" + block("guards/output.md", "text").strip()


def test_readme_streaming_example_streams_through_the_chain() -> None:
    example = page_example("fallback-chains.md")
    run_block(example, "streaming.md")
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


def test_use_chat_example_answers_the_ui_message_stream() -> None:
    example = page_example("fallback-chains.md")
    run_block(example, "streaming.md")
    run_block(example, "streaming.md", 1)
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script("*", Fail(code=5035, status=403))
    openai.script("*", Stream(parts=(Text("Hello"), Text(" there."))))
    body = {"id": "c", "messages": [{"id": "m", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            return [
                await client.post("/chat", json=body),
                await client.post(
                    "/chat", json={"messages": [{"role": "user", "parts": [{"type": "file"}]}]}
                ),
            ]

    response, invalid = anyio.run(scenario)
    chunks = check_ui_stream(response)
    assert "".join(c["delta"] for c in chunks if c["type"] == "text-delta") == "Hello there."
    assert chunks[-1]["messageMetadata"]["guards"]["attempts"] == 2
    assert openai.calls[0].inputs["messages"] == [{"role": "user", "content": "hi"}]
    assert invalid.status_code == 400
    assert invalid.json()["error"] == "invalid_request"
    # The version the page says is tested is the one the SDK tests install.
    tested = json.loads((ROOT / "js" / "package.json").read_text())["dependencies"]["ai"]
    assert f"Tested with `ai` {tested}" in page_text("streaming.md")


def test_structured_stream_example_streams_and_checks_its_json() -> None:
    example = page_example("fallback-chains.md")
    run_block(example, "streaming.md")
    run_block(example, "streaming.md", 2)
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script(
        "*",
        Stream(parts=(Text('{"label": "billing",'), Text(' "urgent": true}'))),
        Stream(parts=(Text('{"label": "billing"}'),)),
    )

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            return [
                await client.post("/triage/stream", json={"message": "I was charged twice."}) for _ in "ab"
            ]

    answered, rejected = anyio.run(scenario)
    assert 'data: {"text":"{\\"label\\": \\"billing\\","}' in answered.text
    name, done = answered.text.rstrip().splitlines()[-2:]
    assert name == "event: done"
    assert json.loads(done.removeprefix("data: "))["object"] == {"label": "billing", "urgent": True}
    assert main.calls[0].inputs["response_format"]["json_schema"]["title"] == "Triage"
    name, error = rejected.text.rstrip().splitlines()[-2:]
    assert name == "event: error"
    data = json.loads(error.removeprefix("data: "))
    assert (data["guard"], data["reason"]) == ("output", "schema_invalid")
    # The page's sample of the detail is the real one.
    assert f'"detail": "{data["detail"]}"' in page_text("streaming.md")
    assert openai.calls == []  # committed: no other model


def test_resumable_example_resumes_the_chats_stream() -> None:
    example = page_example("fallback-chains.md")
    for index in range(4):
        run_block(example, "streaming.md", index)
    guards = example["guards"]
    guards.binding = FakeBinding()
    guards.binding.script("*", Stream(parts=(Text("Hello"), Text(" there."))))
    body = {"id": "c1", "messages": [{"id": "m", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
            first = await client.post("/chat/resumable", json=body)
            again = await client.get("/chat/resumable/c1/stream")
            last = sse_ids(again.text)[-1]
            done = await client.get("/chat/resumable/c1/stream", headers={"last-event-id": last})
            return [first, again, done]

    first, again, done = anyio.run(scenario)
    stream_id = first.headers["x-stream-id"]
    ids = sse_ids(first.text)
    assert ids == [f"{stream_id}:{n}" for n in range(1, len(ids) + 1)]
    assert again.status_code == 200
    assert again.text == first.text  # the whole stream again, from its first event
    assert done.status_code == 204
    assert len(guards.binding.calls) == 1


def sse_ids(body: str) -> list[str]:
    return [line[4:] for line in body.splitlines() if line.startswith("id: ")]


def test_metrics_snippet_serves_the_exposition() -> None:
    namespace: dict[str, Any] = {"__name__": "readme_metrics", "app": FastAPI()}
    run_block(namespace, "operating/metrics.md")

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
    run_block(example, "operating/status-page.md")

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
    [sample] = json_values(block("operating/status-page.md", "json"))
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
    commands = shell_commands(block("operating/status-page.md", "sh"))
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
    run_block(namespace, "operating/traces.md")
    assert namespace["guards"].tracing is not None
    namespace["provider"].shutdown()


def test_traces_sample_is_what_an_otlp_export_sends(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """The page's OTLP/JSON is what the exporter sends for its scenario (a retry, then the
    fallback): the same spans, kinds, parents, attributes and statuses; only ids and times
    differ (and the resource's instance id)."""
    [sample] = json_values(block("operating/traces.md", "json"))

    def shape(spans: list[dict[str, Any]]) -> list[Any]:
        ids = {span["spanId"]: n for n, span in enumerate(spans)}
        return [
            (
                span["name"],
                span["kind"],
                ids.get(span.get("parentSpanId", "")),
                span["attributes"],
                span.get("status", {}),
            )
            for span in spans
        ]

    real = otlp_export(example_client, fake_workers_ai, fake_openai)
    assert shape(otlp_spans([sample])) == shape(otlp_spans(real))


def plugin_options() -> list[str]:
    """How a user's `pytest` gets `guards.testing`'s plugin: installed, the package registers it
    (the `pytest11` entry point), so no option. This checkout's own environment may have been
    installed before the entry point was declared: then the plugin is named as the entry point
    names it, as the installed package would load it."""
    import importlib.metadata
    import tomllib

    installed = [
        ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.value.startswith("guards.")
    ]
    if installed:
        return []
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("entry-points", {})
    plugins = [value for value in declared.get("pytest11", {}).values() if value.startswith("guards.")]
    assert plugins, (
        "guards.testing's pytest plugin is not registered (pyproject: [project.entry-points.pytest11])"
    )
    return ["-p", plugins[0]]


def run_pytest(folder: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    """pytest, run from `folder` as a user runs it (warnings as errors, the repository on the
    path as an installed `guards` would be)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *plugin_options(),
            *UNUSED_PLUGINS,
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "error",
            *arguments,
        ],
        cwd=folder,
        env={**environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_testing_example_passes_under_pytest(tmp_path: Path) -> None:
    """The README's test of the README's route, run by pytest as a user runs it."""
    (tmp_path / "service.py").write_text(block("README.md", "python"))
    (tmp_path / "test_service.py").write_text(block("README.md", "python", 1))
    done = run_pytest(tmp_path, "test_service.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


@pytest.mark.slow  # mypy checks guards, FastAPI and pydantic from a cold cache: ~15 s of CPU
def test_testing_example_passes_mypy_strict(tmp_path: Path) -> None:
    """The README's route and its test, as a user's project with `mypy --strict` sees them: the
    fixture's type comes from `guards.testing` (`UseFakeAI`)."""
    (tmp_path / "service.py").write_text(block("README.md", "python"))
    (tmp_path / "test_service.py").write_text(block("README.md", "python", 1))
    assert "use_fake_ai: UseFakeAI" in block("README.md", "python", 1)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(tmp_path / "cache"),
            "service.py",
            "test_service.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT)},  # the repository's guards (installed in editable mode)
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_testing_page_tests_pass_in_either_order(tmp_path: Path) -> None:
    """The testing page's two tests, in the page's order and reversed: the first leaves a
    10-minute cooldown behind, which the second never sees."""
    (tmp_path / "service.py").write_text(block("README.md", "python"))
    (tmp_path / "test_service.py").write_text(block("testing.md", "python"))
    first, second = re.findall(r"^async def (test_\w+)", block("testing.md", "python"), re.MULTILINE)
    for order in ((first, second), (second, first)):
        done = run_pytest(tmp_path, *(f"test_service.py::{name}" for name in order), "-vv")
        assert done.returncode == 0, done.stdout + done.stderr
        ran = re.findall(r"::(test_\w+)\S* PASSED", done.stdout)
        assert ran == list(order), done.stdout


def test_testing_page_fake_servers_example_passes_under_pytest(tmp_path: Path) -> None:
    """The testing page's `use_fake_servers` test of the README's route (built at import time,
    its WorkersAI binding pointed at the fake server), run by pytest as a user runs it."""
    (tmp_path / "service.py").write_text(block("README.md", "python"))
    (tmp_path / "test_servers.py").write_text(block("testing.md", "python", 1))
    done = run_pytest(tmp_path, "test_servers.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_concepts_route_is_the_readmes() -> None:
    """The request path's page shows the README's route, as written (the README's tests run it)."""
    assert block("concepts.md", "python") == block("README.md", "python")


def test_benchmark_commands_are_make_targets() -> None:
    commands = shell_commands(block("benchmarks.md", "sh"))
    assert len(commands) == 4
    for command in commands:
        words = shlex.split(command, comments=True)
        assert words[0] == "make"
        subprocess.run(["make", "-n", "-C", str(ROOT), *words[1:]], check=True, capture_output=True)
    # Each row of the table names the command that reproduces it, one of the block's.
    table = page_text("benchmarks.md").split("| figure | today | command |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 20
    made = {shlex.split(c, comments=True)[1] for c in commands}
    for row in rows:
        command = row.rstrip(" |").rsplit("| `", 1)[1].rstrip("`")
        assert command.split()[0] == "make", row
        assert command.split()[1] in made, row


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
    samples = json_values(block("contracts.md", "json"))
    assert len(samples) == 2
    for sample in samples:
        Envelope[dict[str, Any]].model_validate(sample)
    # The fallback's detail is what the example app answers for a spent quota.
    client = serve(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    fake_workers_ai.script("*", Fail(code=3036, status=429))
    answer = client.post("/summary", json={"text": "refund my invoice"}, headers={"x-user-id": "ada"})
    assert answer.json()["fallback"] == samples[1]["fallback"]


def test_stream_sample_has_the_documented_events() -> None:
    sample = block("streaming.md", "")
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
    section = page_text("streaming.md")
    rows = re.findall(r"^\| `(\w+)` \| `\{([^}]*)\}` \|", section, re.MULTILINE)
    assert {name: re.findall(r'"(\w+)"', fields) for name, fields in rows} == {
        name: data["required"] for name, data in documented.items()
    }


def test_log_samples_have_the_fields_of_real_lines(
    fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    client = serve(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    # A request's only call, on its request line; then one retried: two attempt lines.
    fake_workers_ai.script("*", Reply("Fine."), Fail(code=3040, status=429), Reply("Fine."))
    for _ in range(2):
        assert client.post("/draft-reply", json={"message": "Where is my parcel?"}).status_code == 200
    # Effort routing on, and a model failing every call: the effort decision, and retries until
    # the retry budget (at least 3 per window) refuses one.
    routed = serve(create_app(workers_ai_settings(fake_workers_ai, ai_effort="auto"), sleep=no_sleep))
    fake_workers_ai.script("*", *[Fail(code=3040, status=429)] * 10)
    for _ in range(5):
        routed.post("/draft-reply", json={"message": "Where is my parcel?"})
    # A breaker open on the only model: a skip line (its second's summary).
    fake_workers_ai.script("*", *[Fail(code=5035, status=403)] * 10)
    for _ in range(6):
        client.post("/draft-reply", json={"message": "Where is my parcel?"})
    real: dict[str, list[set[str]]] = {}
    for line in guards_log.events():
        real.setdefault(line["event"], []).append(set(line))
    samples = json_values(block("operating/logs.md", "json"))
    assert [s["event"] for s in samples] == [
        "request",
        "effort",
        "attempt",
        "retry",
        "retry",
        "request",
        "skip",
    ]
    for sample in samples:
        assert set(sample) in real[sample["event"]], sample["event"]


def project_files() -> set[str]:
    """The names of the files in the repository's folders: not in a hidden folder (`.venv`,
    `.git`) nor installed packages (`node_modules`), whose files a layout does not name."""
    names: set[str] = set()
    for folder, folders, files in os.walk(ROOT):
        folders[:] = [f for f in folders if not f.startswith(".") and f != "node_modules"]
        if Path(folder) != ROOT:
            names.update(files)
    return names


def test_layout_names_files_that_exist() -> None:
    layout = block("development.md", "")
    files = project_files()
    for name in re.findall(r"(?<![\w/.])([\w.]+\.py)\b", layout):
        if "/" in name:
            assert (ROOT / name).exists(), name
        else:
            assert name in files, name
    for folder in re.findall(r"^(\w+)/", layout, re.MULTILINE):
        assert (ROOT / folder).is_dir(), folder


# --- what the pages say of behaviour ----------------------------------------------------------


def section(page: str) -> str:
    return page_text(page)


def test_budget_section_says_what_a_missing_key_does(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    text = section("counting.md")
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
    rows = [line for line in page_text("contracts.md").splitlines() if "| circuit_open |" in line]
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
    run_block(example, "service-levels.md")

    async def health() -> httpx.Response:
        async with asgi_client(example["app"]) as client:
            return await client.get("/health")

    assert anyio.run(health).json() == {"ok": True, "level": "full", "down": []}


def test_readme_task_example_resumes_and_replays(use_fake_ai: Any) -> None:
    example = page_example("tasks.md")
    fake = use_fake_ai(example["app"])
    fake.script(
        "*", Reply("A summary."), Reply({"label": "billing", "confidence": 0.9}), Fail(code=5035, status=403)
    )

    async def scenario() -> list[httpx.Response]:
        async with asgi_client(example["app"]) as client:
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


def test_readme_is_a_landing_page() -> None:
    """At most 200 lines, and every link of it into the repository names a file that exists
    (the docs' own links are checked by `mkdocs build --strict`)."""
    text = page_text("README.md")
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) > 20
    for link in local:
        assert (ROOT / link).is_file(), link
    # Each page of the docs is one the README links to, or in the site's navigation.
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in pages()[1:]:
        assert f"docs/{page}" in local or f": {page}" in nav, page


def test_install_lines_name_the_distribution_and_its_extras() -> None:
    """The `pip install` blocks are not run (they install from the package index), but what they
    install is checked: the distribution's name and extras, as pyproject.toml declares them."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installs = [
        command
        for b in all_blocks()
        if b.not_run is not None and "pip install" in b.code
        for command in shell_commands(b.code)
    ]
    assert len(installs) >= 7
    for command in installs:
        [requirement] = shlex.split(command, comments=True)[2:]
        name, _, extras = requirement.partition("[")
        assert name == project["name"], command
        for extra in filter(None, extras.rstrip("]").split(",")):
            assert extra in project["optional-dependencies"], command


def test_development_redis_example_answers() -> None:
    """The stores page's Redis for development starts, answers and stops, as printed."""
    done = subprocess.run(
        [sys.executable, "-c", block("stores.md", "python")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True\n"


def test_anthropic_example_falls_back_over_http(
    use_fake_servers: Callable[[FastAPI], None], fake_anthropic: FakeAnthropic, app_client: AppClient
) -> None:
    """The Anthropic page's route, its binding pointed at the fake Anthropic server: an
    overloaded first model is retried once, then the second answers through the answer tool."""
    app: FastAPI = page_example("providers/anthropic.md")["app"]
    use_fake_servers(app)
    fake_anthropic.script("claude-sonnet-4-5", Fail(status=529), Fail(status=529))
    fake_anthropic.script("claude-haiku-4-5", Reply({"label": "billing", "confidence": 0.9}))
    response = app_client(app).post("/label", json={"text": "I was charged twice."})
    assert response.status_code == 200, response.text
    assert response.json() == {"label": "billing", "confidence": 0.9}
    assert [c.model for c in fake_anthropic.calls] == ["claude-sonnet-4-5"] * 2 + ["claude-haiku-4-5"]
    assert fake_anthropic.calls[0].inputs["system"] == "Label the support ticket."


# --- provider pages -------------------------------------------------------------------------------


def test_bedrock_example_answers_through_the_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's app, its settings from the standard AWS variables (pointed at the fake), its
    requests signed: the first model unavailable, the second answers."""
    from fixtures import FakeBedrock

    with FakeBedrock() as server:
        settings = {
            "AWS_REGION": server.region,
            "AWS_ACCESS_KEY_ID": server.access_key_id,
            "AWS_SECRET_ACCESS_KEY": server.secret_access_key,
            "AWS_ENDPOINT_URL_BEDROCK_RUNTIME": server.base_url,
        }
        for name, value in settings.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
        monkeypatch.delenv("AWS_BEARER_TOKEN_BEDROCK", raising=False)
        app = page_example("providers/bedrock.md")["app"]
        server.script("anthropic.claude-3-5-haiku-20241022-v1:0", Fail(status=503), Fail(status=503))
        server.script("amazon.nova-lite-v1:0", Reply("On its way."))
        Guards.of(app).sleep = no_sleep
        with TestClient(app) as client:
            answer = client.post("/reply", json={"text": "Where is my parcel?"}).json()
        assert answer == {"ok": True, "data": "On its way.", "fallback": None}
        assert len(server.calls) == 3


def test_azure_openai_example_answers_through_the_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    from fixtures import FakeAzureOpenAI

    with FakeAzureOpenAI() as server:
        monkeypatch.setenv("AZURE_OPENAI_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_OPENAI_API_KEY", str(server.api_key))
        monkeypatch.setenv("OPENAI_API_VERSION", "2024-10-21")
        app = page_example("providers/azure-openai.md")["app"]
        server.script("gpt-4o-mini-prod", Fail(status=400, error_code="content_filter"))
        with TestClient(app) as client:
            answer = client.post("/reply", json={"text": "Where is my parcel?"}).json()
        assert answer["fallback"]["reason"] == "moderation_blocked"
        assert answer["data"] == "Sorry, try again later."
        assert [c.model for c in server.calls] == ["gpt-4o-mini-prod"]


def test_example_app_provider_lines_start_the_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each line of docs/example-app.md's providers block is `make run` with settings the app
    starts on (Bedrock's `AWS_PROFILE` read from a shared credentials file, as the AWS chain
    does), each on the provider it names, with the chain it names."""
    credentials = tmp_path / "credentials"
    credentials.write_text("[support]\naws_access_key_id = AKIDEXAMPLE\naws_secret_access_key = secret\n")
    lines = block("example-app.md", "sh").splitlines()
    assert {line.split()[0] for line in lines} == {
        f"AI_PROVIDER={name}" for name in ("anthropic", "gemini", "bedrock", "azure-openai")
    }
    for line in lines:
        *assignments, make, target = shlex.split(line)
        assert (make, target) == ("make", "run")
        with monkeypatch.context() as env:
            for name in PROVIDER_VARIABLES:
                env.delenv(name, raising=False)
            env.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
            env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
            env.setenv("AWS_EC2_METADATA_DISABLED", "true")
            given = dict(assignment.split("=", 1) for assignment in assignments)
            for name, value in given.items():
                env.setenv(name, value)
            settings = load_settings()
            assert settings.ai_provider == given["AI_PROVIDER"]
            assert settings.ai_model == given["AI_MODEL"]
            assert settings.fallback_models == [
                entry for entry in given.get("AI_FALLBACK_MODELS", "").split(",") if entry
            ]


def test_deployments_example_spreads_then_falls_back(
    use_fake_servers: Callable[[FastAPI], None],
    fake_azure_openai: FakeAzureOpenAI,
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
) -> None:
    """Over real HTTP (both Azure deployments on the fake Azure OpenAI server): answers come
    from both deployments, `east` more often; when both fail, the Workers AI model answers."""
    example = run_block({}, "deployments.md", 0)
    use_fake_servers(example["app"])
    client = app_client(example["app"])
    fake_azure_openai.default = Reply("From Azure.")
    served = [client.post("/reply", json={"message": "hi"}) for _ in range(40)]
    assert {response.json() for response in served} == {"From Azure."}
    deployments = [response.headers["x-ai-deployment"] for response in served]
    assert deployments.count("chat/east") > deployments.count("chat/west") > 0
    assert not any("x-ai-fallback" in response.headers for response in served)
    fake_azure_openai.reset()
    fake_azure_openai.default = Fail(status=400)
    fake_workers_ai.script("@cf/meta/llama-3.1-8b-instruct", Reply("From Workers AI."))
    response = client.post("/reply", json={"message": "hi"})
    assert response.json() == "From Workers AI."
    assert response.headers["x-ai-fallback"] == "@cf/meta/llama-3.1-8b-instruct"
    assert len(fake_azure_openai.calls) == 2  # each deployment once


def test_cross_provider_example_walks_as_documented(
    use_fake_servers: Callable[[FastAPI], None],
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    fake_openai: FakeOpenAI,
    app_client: AppClient,
) -> None:
    """Over real HTTP: Anthropic overloaded moves on to claude-sonnet-4-5; a refusal skips it
    for Gemini, whose UNAVAILABLE (retried once) moves on to gpt-4o-mini."""
    example = run_block({}, "fallback-chains.md", 3)
    use_fake_servers(example["app"])
    client = app_client(example["app"])
    fake_anthropic.script("claude-haiku-4-5", Fail(status=529), Fail(status=529))
    fake_anthropic.script("claude-sonnet-4-5", Reply("From Sonnet."))
    response = client.post("/reply", json={"message": "hi"})
    assert (response.json(), response.headers["x-ai-fallback"]) == ("From Sonnet.", "claude-sonnet-4-5")
    fake_anthropic.reset()
    fake_anthropic.script("claude-haiku-4-5", Reply(refusal="I can't help with that."))
    fake_gemini.script("gemini-2.5-flash", Fail(status=503), Fail(status=503))
    fake_openai.script("gpt-4o-mini", Reply("From GPT."))
    response = client.post("/reply", json={"message": "hi"})
    assert (response.json(), response.headers["x-ai-fallback"]) == ("From GPT.", "openai:gpt-4o-mini")
    assert [call.model for call in fake_anthropic.calls] == ["claude-haiku-4-5"]
    assert [call.model for call in fake_gemini.calls] == ["gemini-2.5-flash"] * 2
    assert [call.model for call in fake_openai.calls] == ["gpt-4o-mini"]
