"""Effort routing: the estimator's rules as a table, then through the example app's
`AI_EFFORT=auto` (simple turns to the local model, complex ones to the cloud model, seen at
the fake providers), escalation `never`, a trusted override, a pinned route that is never
rerouted, and the decision's log line and metric. Across the memory, SQLite and Redis stores."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Request

from app.service import create_app
from fixtures import FakeOpenAI, FakeWorkersAI, ManualClock, Reply
from guards import (
    AI,
    ConfigurationError,
    Effort,
    EventStream,
    Guards,
    estimate_effort,
    override_effort,
)
from guards.providers import WorkersAI
from guards.stores import Store

from ..conftest import AppClient, ExampleClient, LogLines, no_sleep, workers_ai_settings

LOCAL = "@cf/test/local"
CLOUD = "@cf/test/cloud"
PINNED = "@cf/test/model"
SIMPLE = "Where is my parcel?"
COMPLEX = "Why was I charged twice? Can you refund me? And how do I stop it happening again?"
CANARY = "EFFORT-CANARY-51d2"


def prose(chars: int) -> str:
    """Plain sentences (no question, no fence), exactly `chars` characters long once trimmed."""
    return ("The parcel was sent on Monday and has not arrived yet. " * 100)[: chars - 1] + "x"


# --- the estimator -------------------------------------------------------------------------


def turn(text: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": "You draft replies."}, {"role": "user", "content": text}]
    }


@pytest.mark.parametrize(
    ("inputs", "tier"),
    [
        # no user text: standard
        ({}, "standard"),
        ({"messages": []}, "standard"),
        ({"messages": [{"role": "system", "content": "Hi."}]}, "standard"),
        (turn(""), "standard"),
        (turn("   \n "), "standard"),
        ({"messages": [{"role": "user", "content": 42}]}, "standard"),
        ({"messages": "Where is it?"}, "standard"),
        # a code fence: complex, however short
        (turn("```x = 1```"), "complex"),
        (turn("Why does this fail?\n~~~\nraise ValueError\n~~~"), "complex"),
        (turn("Use `x` and ``y`` here."), "simple"),  # inline code is no fence
        # three questions or more (a run of marks counts once): complex
        (turn(COMPLEX), "complex"),
        (turn("Why? How? When?"), "complex"),
        (turn("Why\uff1f How\uff1f When\uff1f"), "complex"),  # fullwidth question marks
        (turn("Why??? Really?!"), "standard"),  # two runs: two questions
        (turn("Is it late? Was it sent?"), "standard"),
        # length: complex from COMPLEX_CHARS characters
        (turn(prose(1_999)), "standard"),
        (turn(prose(2_000)), "complex"),
        # one short sentence: simple
        (turn(SIMPLE), "simple"),
        (turn("Thanks for your help!"), "simple"),
        (turn("  Where is my parcel?  \n"), "simple"),  # trimmed first
        ({"prompt": "Cancel my order."}, "simple"),
        (turn("x" * 79), "simple"),
        (turn("x" * 80), "standard"),  # not under 80 characters
        (turn("Hi. Where is my parcel?"), "standard"),  # two sentences
        (turn("Hello\nwhere is it"), "standard"),  # two lines
        (turn("Is it late?Where is it"), "standard"),  # a question inside
        (
            turn("\u3053\u3093\u306b\u3061\u306f\u3002\u8377\u7269\u306f"),
            "standard",
        ),  # an ideographic full stop inside
        # the latest user turn decides, not the system prompt nor earlier turns
        (
            {
                "messages": [
                    {"role": "system", "content": "```never read```"},
                    {"role": "user", "content": COMPLEX},
                    {"role": "assistant", "content": "Sure."},
                    {"role": "user", "content": SIMPLE},
                ]
            },
            "simple",
        ),
        # text parts are read; other parts are not
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "```code```"}, {"type": "image"}]}
                ]
            },
            "complex",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "standard"),
    ],
)
def test_estimator_rules(inputs: dict[str, Any], tier: str) -> None:
    assert estimate_effort(inputs) == tier


@pytest.mark.parametrize(
    "hostile",
    [
        "?" * 200_000,
        "?a" * 100_000,
        "`" * 2 + "a" * 200_000,
        "~a" * 100_000,
        ". " * 100_000,
        "\uff1f" * 200_000,
    ],
    ids=["question-run", "questions", "backticks", "tildes", "sentences", "fullwidth"],
)
def test_estimator_is_linear_on_hostile_text(hostile: str) -> None:
    """200,000 characters built to defeat a backtracking pattern are read in one pass: a bound
    a quadratic reading (40 billion steps) could not meet on any machine."""
    started = time.process_time()
    estimate_effort(turn(hostile))
    assert time.process_time() - started < 0.5


def test_effort_declaration_errors() -> None:
    with pytest.raises(ConfigurationError, match="escalate"):
        Effort(simple="a", standard="a", complex="b", escalate="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"Effort\.complex"):
        Effort(simple="a", standard="a", complex=" ")
    guards = Guards(WorkersAI(account_id="a", api_token="t"), hints={"a": "@cf/a"})
    with pytest.raises(ConfigurationError, match="not both"):

        @guards.route(model="@cf/a", effort=Effort(simple="a", standard="a", complex="a"))
        async def both(ai: AI[str]) -> str:
            return await ai.run({"prompt": "hi"})

    with pytest.raises(ValueError, match="unknown effort tier"):
        override_effort(Request({"type": "http"}), "hard")  # type: ignore[arg-type]


# --- the example app over HTTP -----------------------------------------------------------------


@pytest.fixture
def make_client(example_client: ExampleClient, store: Store, clock: ManualClock) -> ExampleClient:
    return functools.partial(
        example_client, store=store, clock=clock, ai_local_model=LOCAL, ai_cloud_model=CLOUD
    )


def draft(client: httpx.Client, message: str) -> httpx.Response:
    response = client.post("/draft-reply", json={"message": message})
    assert response.status_code == 200, response.text
    return response


def test_auto_sends_simple_turns_to_the_local_model_and_complex_ones_to_the_cloud(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, guards_log: LogLines
) -> None:
    client = make_client(ai_effort="auto")
    simple, standard, complex_ = (
        draft(client, SIMPLE),
        draft(client, "Hello. My parcel is late."),
        draft(client, COMPLEX),
    )
    assert [call.model for call in fake_workers_ai.calls] == [LOCAL, LOCAL, CLOUD]
    assert [r.headers["x-ai-model"] for r in (simple, standard, complex_)] == [LOCAL, LOCAL, CLOUD]
    assert [r.json()["model"] for r in (simple, standard, complex_)] == [LOCAL, LOCAL, CLOUD]
    assert "x-ai-fallback" not in complex_.headers  # the tier's own model served: no fallback
    decisions = [
        {k: e[k] for k in ("route", "tier", "hint", "escalated", "override")}
        for e in guards_log.events("effort")
    ]
    assert decisions == [
        {"route": "draft_reply", "tier": "simple", "hint": "local", "escalated": False, "override": False},
        {"route": "draft_reply", "tier": "standard", "hint": "local", "escalated": False, "override": False},
        {"route": "draft_reply", "tier": "complex", "hint": "cloud", "escalated": True, "override": False},
    ]


def test_the_stream_route_routes_by_effort_too(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI
) -> None:
    client = make_client(ai_effort="auto")
    for message in (SIMPLE, COMPLEX):
        with client.stream("POST", "/draft-reply/stream", json={"message": message}) as response:
            assert response.status_code == 200
            body = response.read().decode()
        assert "event: done" in body
    assert [call.model for call in fake_workers_ai.calls] == [LOCAL, CLOUD]


def test_the_cloud_model_may_name_its_provider(
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    app_client: AppClient,
    store: Store,
    clock: ManualClock,
) -> None:
    settings = workers_ai_settings(
        fake_workers_ai,
        ai_effort="auto",
        ai_local_model=LOCAL,
        ai_cloud_model="openai:gpt-4o",
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key,
    )
    client = app_client(create_app(settings, store=store, clock=clock, sleep=no_sleep))
    fake_openai.script("gpt-4o", Reply("From the cloud.", model="gpt-4o-2024-08-06"))
    response = draft(client, COMPLEX)
    assert response.headers["x-ai-model"] == "gpt-4o-2024-08-06"
    assert [call.model for call in fake_openai.calls] == ["gpt-4o"]
    assert fake_workers_ai.calls == []
    draft(client, SIMPLE)
    assert [call.model for call in fake_workers_ai.calls] == [LOCAL]


def test_off_by_default_the_pinned_model_serves_every_turn(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, guards_log: LogLines
) -> None:
    client = make_client()
    draft(client, SIMPLE)
    draft(client, COMPLEX)
    assert [call.model for call in fake_workers_ai.calls] == [PINNED, PINNED]
    assert guards_log.events("effort") == []


def test_the_decision_is_counted_and_its_log_never_carries_the_text(
    make_client: Callable[..., httpx.Client], guards_log: LogLines
) -> None:
    client = make_client(ai_effort="auto")
    series = 'guards_effort_decisions_total{hint="cloud",route="draft_reply",tier="complex"}'

    def count() -> float:
        found = re.search(re.escape(series) + r" (\S+)", client.get("/metrics").text)
        return float(found.group(1)) if found else 0.0

    before = count()
    draft(client, f"What is {CANARY}? Why? How?")
    assert count() == before + 1
    assert all(CANARY not in line for line in guards_log.lines)


# --- escalation never, overrides: a route of the app's own, over HTTP ----------------------------


def effort_app(server: FakeWorkersAI, store: Store, effort: Effort, *, pinned: bool = False) -> FastAPI:
    guards = Guards(
        WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url),
        store=store,
        sleep=no_sleep,
        hints={"local": LOCAL, "cloud": CLOUD},
    )
    app = FastAPI()
    guards.install(app)

    async def trusted_plan(request: Request) -> None:
        # The app's own decision (an authenticated plan, say): never a client's header value.
        if request.query_params.get("plan") == "premium":
            override_effort(request, "complex")
        elif request.query_params.get("plan") == "free":
            override_effort(request, "simple")

    @app.post("/reply", dependencies=[Depends(trusted_plan)])
    @guards.route(effort=effort)
    async def reply(message: str, ai: AI[str]) -> str:
        return await ai.run({"messages": [{"role": "user", "content": message}]})

    @app.post("/reply/stream")
    @guards.route(effort=effort, name="reply_stream")
    async def reply_stream(message: str, ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": message})

    @app.post("/pinned", dependencies=[Depends(trusted_plan)])
    @guards.route(model=PINNED)
    async def pinned_route(message: str, ai: AI[str]) -> str:
        return await ai.run({"prompt": message})

    return app


@pytest.mark.parametrize("escalate", ["auto", "never"])
def test_both_directions_with_both_escalation_settings(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, escalate: str, guards_log: LogLines
) -> None:
    effort = Effort(simple="local", standard="local", complex="cloud", escalate=escalate)  # type: ignore[arg-type]
    client = app_client(effort_app(fake_workers_ai, store, effort))
    for message in (SIMPLE, COMPLEX):
        response = client.post("/reply", params={"message": message})
        assert response.status_code == 200, response.text
        with client.stream("POST", "/reply/stream", params={"message": message}) as streamed:
            assert "event: done" in streamed.read().decode()
    complex_model = CLOUD if escalate == "auto" else LOCAL
    assert [call.model for call in fake_workers_ai.calls] == [LOCAL, LOCAL, complex_model, complex_model]
    complex_decision = guards_log.events("effort")[-1]
    assert (complex_decision["tier"], complex_decision["hint"], complex_decision["escalated"]) == (
        "complex",
        "cloud" if escalate == "auto" else "local",
        escalate == "auto",
    )


def test_a_trusted_override_skips_the_estimator(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, guards_log: LogLines
) -> None:
    client = app_client(
        effort_app(fake_workers_ai, store, Effort(simple="local", standard="local", complex="cloud"))
    )
    assert client.post("/reply", params={"message": SIMPLE, "plan": "premium"}).status_code == 200
    assert client.post("/reply", params={"message": COMPLEX, "plan": "free"}).status_code == 200
    assert [call.model for call in fake_workers_ai.calls] == [CLOUD, LOCAL]
    assert [(e["tier"], e["override"]) for e in guards_log.events("effort")] == [
        ("complex", True),
        ("simple", True),
    ]
    # A route pinned to its model is never rerouted, override or not.
    assert client.post("/pinned", params={"message": COMPLEX, "plan": "free"}).status_code == 200
    assert fake_workers_ai.calls[-1].model == PINNED
    assert len(guards_log.events("effort")) == 2
