"""A silent model does not burn the deadline: the example app under uvicorn with
`AI_FIRST_OUTPUT_S`, a chain of two models on the fake provider servers, over real HTTP, on both
wires (Workers AI's REST API and an OpenAI-compatible server), streaming and not.

The first model accepts the request and never answers (or answers too late); the walk cancels
that attempt at its first-output limit, closes its connection, and the second model answers,
long before the route's deadline. The silent model is called exactly once: not retried when
another model is configured. Every bound is stated with its test; none is a sleep.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.service import create_app
from app.settings import Settings
from fixtures import FakeOpenAI, FakeWorkersAI, Hang, Meta, Reply, Stream, Text
from guards.testing import Script

from ..conftest import LogLines, Serve, no_sleep

FIRST_OUTPUT_S = 0.3
#: The route's deadline: far longer than a first-output limit plus an answer.
TIMEOUT_S = 8.0
#: Slack for a loaded machine (the healthy model answers in milliseconds).
SLACK_S = 1.5
SILENT, HEALTHY = "silent-model", "healthy-model"
#: The first-output limit of the tests whose model must start answering in time (a slow body or
#: a stall after it): a loaded machine's loopback can take more than FIRST_OUTPUT_S.
HEAD_LIMIT_S = 1.0

#: `(client, server)`: the example app served for real on one wire, with its fake provider.
Make = Callable[..., tuple[httpx.Client, Script]]


@pytest.fixture(params=["workers-ai", "openai"])
def make(
    request: pytest.FixtureRequest, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, serve: Serve
) -> Make:
    """`make(**settings)`: the example app with the chain `SILENT, HEALTHY` on the wire of the
    test's parameter, served by uvicorn; and that wire's fake server."""
    wire: str = request.param

    def start(**overrides: Any) -> tuple[httpx.Client, Script]:
        values: dict[str, Any] = {
            "ai_model": SILENT,
            "ai_fallback_models": HEALTHY,
            "ai_timeout_s": TIMEOUT_S,
            "ai_first_output_s": FIRST_OUTPUT_S,
            "breaker_failure_threshold": 1000,
        }
        server: Script
        if wire == "workers-ai":
            server = fake_workers_ai
            values |= {
                "ai_provider": "workers-ai",
                "cloudflare_account_id": fake_workers_ai.account_id,
                "cloudflare_api_token": fake_workers_ai.api_token,
                "cloudflare_api_base": fake_workers_ai.base_url,
            }
        else:
            server = fake_openai
            values |= {
                "ai_provider": "openai",
                "openai_base_url": fake_openai.base_url,
                "openai_api_key": fake_openai.api_key,
            }
        values |= overrides
        return serve(create_app(Settings(**values), sleep=no_sleep)), server

    return start


def post(client: httpx.Client, path: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = client.post(path, json={"message": "Where is my parcel?"}, timeout=30)
    return response, time.monotonic() - started


def events(response: httpx.Response) -> list[tuple[str, Any]]:
    found = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            found.append((lines["event"], json.loads(lines["data"])))
    return found


def streamed_text(response: httpx.Response) -> str:
    return "".join(data["text"] for name, data in events(response) if name == "delta")


def left(server: Script, model: str) -> bool:
    """Whether the server saw the client close the connection of `model`'s call (its attempt
    was cancelled, not abandoned), within SLACK_S."""
    return server.wait_for(lambda calls: any(c.model == model and c.disconnected for c in calls), SLACK_S)


#: What a model that never starts answering looks like, per route: no answer at all, an answer
#: whose first byte comes after the route's deadline, a stream that sends its head and then
#: nothing, or only a preamble (a role chunk) and then nothing.
SILENCES = {
    "hang": Hang(),
    "first-byte-too-late": Reply("Too late.", delay_s=TIMEOUT_S + 5),
    "head-then-nothing": Stream(parts=(Text("Too late."),), stall_after=0),
    "preamble-then-nothing": Stream(parts=(Meta(), Text("Too late.")), stall_after=1),
}


#: Each silence on each route it can happen to (a stream's head comes only to a stream).
CASES = [
    (path, name)
    for path in ("/draft-reply", "/draft-reply/stream")
    for name, silence in SILENCES.items()
    if path.endswith("/stream") or not isinstance(silence, Stream)
]


@pytest.mark.parametrize(("path", "silence"), CASES, ids=[f"{path}-{name}" for path, name in CASES])
def test_a_silent_first_model_hands_over_to_the_next_within_its_first_output_limit(
    make: Make, path: str, silence: str
) -> None:
    streaming = path.endswith("/stream")
    client, server = make()
    server.script(SILENT, SILENCES[silence])
    server.script(HEALTHY, Reply("Your parcel is on its way."))
    response, elapsed = post(client, path)
    assert response.status_code == 200, response.text
    if streaming:
        assert streamed_text(response) == "Your parcel is on its way."
        assert events(response)[-1][0] == "done"
    else:
        assert response.json()["reply"] == "Your parcel is on its way."
        assert response.json()["attempts"] == 2
    assert response.headers["x-ai-fallback"] == HEALTHY
    assert FIRST_OUTPUT_S <= elapsed < FIRST_OUTPUT_S + SLACK_S
    assert [call.model for call in server.calls] == [SILENT, HEALTHY]  # the silent one once
    assert left(server, SILENT)


def test_a_slow_body_after_a_prompt_head_is_not_a_silence(make: Make) -> None:
    """A whole answer's first output is its first byte: the adapters say when the head came,
    and the rest of the answer has the route's deadline, not the first-output limit. The head
    must come within the limit, so the limit here is HEAD_LIMIT_S: a loaded machine once took
    0.6 s to get the fake's head through at FIRST_OUTPUT_S (CI at 7cc5981)."""
    client, server = make(ai_first_output_s=HEAD_LIMIT_S)
    server.script(SILENT, Reply("Slow but sure.", body_delay_s=2 * HEAD_LIMIT_S))
    response, elapsed = post(client, "/draft-reply")
    assert response.status_code == 200, response.text
    assert response.json()["reply"] == "Slow but sure."
    assert "x-ai-fallback" not in response.headers
    assert elapsed >= 2 * HEAD_LIMIT_S
    assert [call.model for call in server.calls] == [SILENT]


def test_a_stream_that_started_is_never_handed_over(make: Make) -> None:
    """After its first output a stream belongs to its model: the first-output limit is spent,
    and a stall later ends the stream at the adapters' idle timeout with its `error` event; the
    next model is never called. Its first part must come within the limit (HEAD_LIMIT_S), and
    the stall outlasts that limit."""
    idle_s = 1.5 * HEAD_LIMIT_S
    client, server = make(ai_first_output_s=HEAD_LIMIT_S, ai_stream_idle_timeout_s=idle_s)
    server.script(SILENT, Stream(parts=(Text("Your parcel"), Text(" is late.")), stall_after=1))
    response, elapsed = post(client, "/draft-reply/stream")
    assert streamed_text(response) == "Your parcel"
    name, data = events(response)[-1]
    assert (name, data["reason"], data["detail"]) == (
        "error",
        "provider_error",
        "stream interrupted after output",
    )
    assert idle_s <= elapsed < idle_s + SLACK_S
    assert [call.model for call in server.calls] == [SILENT]


def test_every_model_silent_answers_503_before_the_deadline(make: Make, guards_log: LogLines) -> None:
    """Two silent models: each gets its first-output limit, once, then the strict route answers
    `model_temporarily_unavailable` (retryable) with the deadline far from spent. Each attempt
    is on the ledger as `model_temporarily_unavailable`, with no status."""
    client, server = make()
    server.script(SILENT, Hang())
    server.script(HEALTHY, Hang())
    response, elapsed = post(client, "/draft-reply")
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "model_temporarily_unavailable"
    assert response.json()["retryable"] is True
    assert 2 * FIRST_OUTPUT_S <= elapsed < 2 * FIRST_OUTPUT_S + SLACK_S
    assert [call.model for call in server.calls] == [SILENT, HEALTHY]
    assert guards_log.wait_for(lambda: len(guards_log.events("attempt")) == 2)
    attempts = guards_log.events("attempt")
    assert [(a["model"], a["outcome"], a.get("status")) for a in attempts] == [
        (SILENT, "model_temporarily_unavailable", None),
        (HEALTHY, "model_temporarily_unavailable", None),
    ]
    assert all(a["latency_ms"] >= FIRST_OUTPUT_S * 1000 for a in attempts)


#: A route deadline short enough to wait out, with the default first-output share it gives
#: each model but the last of a two-model chain: a third of it.
SHORT_TIMEOUT_S = 1.5
DEFAULT_SHARE_S = SHORT_TIMEOUT_S / 3


@pytest.mark.parametrize(("path", "silence"), CASES, ids=[f"{path}-{name}" for path, name in CASES])
def test_with_the_defaults_a_silent_first_model_hands_over_within_its_share_of_the_deadline(
    make: Make, path: str, silence: str
) -> None:
    """No first-output limit set anywhere: on a chain of two models, the first gets a third of
    the route's deadline to start answering, then the second answers with the rest."""
    client, server = make(ai_first_output_s=None, ai_timeout_s=SHORT_TIMEOUT_S)
    server.script(SILENT, SILENCES[silence])
    server.script(HEALTHY, Reply("Your parcel is on its way."))
    response, elapsed = post(client, path)
    assert response.status_code == 200, response.text
    assert response.headers["x-ai-fallback"] == HEALTHY
    assert DEFAULT_SHARE_S <= elapsed < SHORT_TIMEOUT_S
    assert [call.model for call in server.calls] == [SILENT, HEALTHY]  # the silent one once
    assert left(server, SILENT)
