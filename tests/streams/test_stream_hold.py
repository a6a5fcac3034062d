"""The hold before a stream's commit point (`route(stream_hold=StreamHold(...))`) and the minimum
rate before it (`min_chars_per_s`), over real HTTP: the app under uvicorn, its models the fake
Workers AI and OpenAI-compatible servers, each case with either one first (`WIRES`), in guards'
events and in the UI message stream (`FORMATS`).

An answer the output guard rejects inside the hold (empty, moderated, filtered) or a failure
inside it is answered by the next model, and the client sees nothing of the first; a model
below its minimum rate moves on before the commit, never after; the hold ends early when the
answer completes, never extends the deadline, and its bounds are checked when the route is
declared. Every bound below is stated with its test; none is a sleep.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import FakeOpenAI, FakeWorkersAI, Meta, Stream, Text
from guards import (
    AI,
    GUARDS_EVENTS,
    UI_MESSAGE_STREAM,
    Attempt,
    Breaker,
    Budget,
    ConfigurationError,
    EventStream,
    Guards,
    Model,
    Price,
    StreamFormat,
    StreamHold,
    render_metrics,
)
from guards.providers import OpenAICompatible, WorkersAI

from ..conftest import AppClient, no_sleep, wait_until

WORKERS_MODEL = "@cf/test/model"
OPENAI_MODEL = "gpt-4o-mini"
#: Which wire serves the route's first model (the other serves its fallback).
WIRES = ("workers_ai", "openai")
FORMATS = {"guards-events": GUARDS_EVENTS, "ui-message-stream": UI_MESSAGE_STREAM}
ANSWER = Stream(parts=(Text("Your parcel"), Text(" is on"), Text(" its way.")))
#: Slack for a loaded machine on a bound a test measures.
SLACK_S = 1.5


class Ask(BaseModel):
    message: str


class Recorder:
    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)


@dataclass
class Answer:
    """A streamed response read to its end: status, headers, body, the text the client saw, the
    name of its last event (`done`/`error`, `finish`/`error` in the UI stream) and wall time."""

    status: int
    headers: httpx.Headers
    body: str
    text: str
    last: str | None
    elapsed: float


def read(response: httpx.Response, elapsed: float) -> Answer:
    body = response.text
    text, last = "", None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for block in body.split("\n\n"):
            fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
            data = fields.get("data")
            if data is None or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "event" in fields:  # guards' events
                last = fields["event"]
                text += chunk["text"] if last == "delta" else ""
            else:  # the UI message stream
                last = chunk["type"]
                text += chunk["delta"] if last == "text-delta" else ""
    return Answer(response.status_code, response.headers, body, text, last, elapsed)


@dataclass
class Setup:
    """The route's first model on `wire` (its server `first`), its fallback on the other wire."""

    wire: str
    first: FakeWorkersAI | FakeOpenAI
    second: FakeWorkersAI | FakeOpenAI
    first_model: str
    second_model: str
    ledger: Recorder

    def script(self, first: Any, second: Any = ANSWER) -> None:
        self.first.script(self.first_model, first)
        self.second.script(self.second_model, second)

    @property
    def first_entry(self) -> str:
        return WORKERS_MODEL if self.wire == "workers_ai" else f"openai:{OPENAI_MODEL}"

    @property
    def second_entry(self) -> str:
        return f"openai:{OPENAI_MODEL}" if self.wire == "workers_ai" else WORKERS_MODEL


#: `post(setup, **route)`: one request to a route streaming `setup`'s chain, declared with
#: `route` (and `stream_format`, `first` a `Model`'s settings for the first model).
Post = Callable[..., Answer]


@pytest.fixture(params=WIRES)
def setup(request: pytest.FixtureRequest, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI) -> Setup:
    if request.param == "workers_ai":
        return Setup("workers_ai", fake_workers_ai, fake_openai, WORKERS_MODEL, OPENAI_MODEL, Recorder())
    return Setup("openai", fake_openai, fake_workers_ai, OPENAI_MODEL, WORKERS_MODEL, Recorder())


def make_guards(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, ledger: Recorder, **settings: Any
) -> Guards:
    return Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        ),
        providers={"openai": OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)},
        sleep=no_sleep,
        ledger=ledger,
        **settings,
    )


@pytest.fixture
def post(
    setup: Setup, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, app_client: AppClient
) -> Post:
    def send(
        *,
        stream_format: StreamFormat = GUARDS_EVENTS,
        first: dict[str, Any] | None = None,
        app: dict[str, Any] | None = None,
        **route: Any,
    ) -> Answer:
        guards = make_guards(fake_workers_ai, fake_openai, setup.ledger, **(app or {}))
        served = FastAPI()
        guards.install(served)
        route.setdefault("timeout_s", 5)
        route.setdefault("fallbacks", [setup.second_entry])
        route.setdefault("breaker", Breaker(failure_threshold=100))

        @served.post("/stream")
        @guards.route(
            model=Model(setup.first_entry, **(first or {})),
            stream_format=stream_format,
            **route,
        )
        async def stream(body: Ask, ai: AI[str]) -> EventStream:
            return await ai.stream({"messages": [{"role": "user", "content": body.message}]})

        client = app_client(served, socket=True)
        started = time.monotonic()
        response = client.post("/stream", json={"message": "Where is my parcel?"}, timeout=15)
        return read(response, time.monotonic() - started)

    return send


def metric(name: str, **labels: str) -> float:
    """The value of a series of guards' metrics in this process (0 when absent)."""
    body, _ = render_metrics()
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_second_answered(answer: Answer, setup: Setup) -> None:
    """The fallback's answer is all the client saw, completed."""
    assert answer.status == 200, answer.body
    assert answer.text == ANSWER.text
    assert answer.last in ("done", "finish")
    assert answer.headers["x-ai-fallback"] == setup.second_entry
    assert (len(setup.first.calls), len(setup.second.calls)) == (1, 1)


# --- the output guard inside the hold -----------------------------------------------------------

EMPTY = {
    "blank-text": Stream(parts=(Text("  "), Text("\n"))),
    "no-output": Stream(parts=(Meta(),)),
}


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("empty", EMPTY.values(), ids=EMPTY.keys())
def test_an_empty_answer_inside_the_hold_is_answered_by_the_next_model(
    post: Post, setup: Setup, empty: Stream, fmt: StreamFormat
) -> None:
    """With a hold, an answer that completes empty is rejected and moves on (no recovery call
    to the same model): the client sees the fallback's answer alone."""
    setup.script(empty)
    before = metric("guards_stream_hold_rejections_total", route="stream", reason="empty_response")
    answer = post(stream_hold=StreamHold(chars=100, seconds=2), stream_format=fmt)
    assert_second_answered(answer, setup)
    assert answer.elapsed < 2  # ended by the answer's end, not the hold's seconds
    assert [(a.model, a.outcome, a.problems) for a in setup.ledger.attempts] == [
        (setup.first_entry, "rejected", ("answer: empty_response",)),
        (setup.second_entry, "ok", ()),
    ]
    after = metric("guards_stream_hold_rejections_total", route="stream", reason="empty_response")
    assert after == before + 1


def blocks(text: str) -> bool:
    return "forbidden" in text


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_a_moderated_answer_inside_the_hold_is_answered_by_the_next_model(
    post: Post, setup: Setup, fmt: StreamFormat
) -> None:
    """The moderation hook sees the held text: the flagged answer is never sent, even in part."""
    words = (
        Text("This is "),
        Text("the forbidden"),
        Text(" answer"),
        *(Text(" and more") for _ in range(50)),
    )
    setup.script(Stream(parts=words))
    before = metric("guards_stream_hold_rejections_total", route="stream", reason="moderation_blocked")
    answer = post(stream_hold=StreamHold(chars=40), moderation=blocks, stream_format=fmt)
    assert_second_answered(answer, setup)
    assert "This is" not in answer.body
    assert "forbidden" not in answer.body
    assert [(a.outcome, a.problems) for a in setup.ledger.attempts] == [
        ("rejected", ("answer: moderation_blocked",)),
        ("ok", ()),
    ]
    after = metric("guards_stream_hold_rejections_total", route="stream", reason="moderation_blocked")
    assert after == before + 1


def test_a_rejected_hold_without_usage_is_charged_what_it_read_not_its_worst_case(
    post: Post, setup: Setup
) -> None:
    """On a spend-capped route, a stream cut unsent inside its hold reports no usage: it is
    charged as a stream that ended early (its input and the characters it held), not the
    worst case of `max_tokens` (0.1 here)."""
    words = (Text("This is "), Text("the forbidden"), *(Text(" and more") for _ in range(50)))
    setup.script(Stream(parts=words))
    price = Price(input_token=1e-6, output_token=1e-6)
    before = metric("guards_budget_settled_total", scope="stream", unit="spend")
    answer = post(
        stream_hold=StreamHold(chars=40),
        moderation=blocks,
        budget=Budget(spend_per_day=10.0),
        max_tokens=100_000,
        app={"prices": {setup.first_entry: price, setup.second_entry: price}},
    )
    assert_second_answered(answer, setup)
    wait_until(lambda: metric("guards_budget_settled_total", scope="stream", unit="spend") > before)
    settled = metric("guards_budget_settled_total", scope="stream", unit="spend") - before
    assert 0 < settled < 0.001


def test_a_provider_filter_inside_the_hold_is_answered_by_the_next_model(post: Post, setup: Setup) -> None:
    """A `finish_reason: content_filter` inside the hold (OpenAI-style chunks carry it) is a
    rejection too, its text unsent."""
    if setup.wire != "openai":
        pytest.skip("Workers AI's native events carry no finish reason")
    setup.script(Stream(parts=(Text("Half of a"), Text(" filtered answer")), finish_reason="content_filter"))
    answer = post(stream_hold=StreamHold(chars=500))
    assert_second_answered(answer, setup)
    assert "filtered answer" not in answer.body


def test_a_moderated_answer_with_no_model_left_is_a_real_error(post: Post, setup: Setup) -> None:
    setup.script(Stream(parts=(Text("forbidden"),)), Stream(parts=(Text("also forbidden"),)))
    answer = post(stream_hold=StreamHold(chars=500), moderation=blocks)
    assert (answer.status, json.loads(answer.body)["error"]) == (502, "incompatible_model_response")
    assert "forbidden" not in answer.body


def test_a_failure_inside_the_hold_moves_on_like_one_before_the_first_output(
    post: Post, setup: Setup
) -> None:
    """An in-band error after two parts, inside the hold: retried once (transient), then the
    fallback answers; nothing of the first model reaches the client."""
    cut = Stream(parts=(Text("Half"), Text(" an answer"), Text(" more")), error_after=2, error_code=3040)
    setup.first.script(setup.first_model, cut, cut)
    setup.second.script(setup.second_model, ANSWER)
    answer = post(stream_hold=StreamHold(chars=500))
    assert answer.status == 200
    assert answer.text == ANSWER.text
    assert "Half" not in answer.body
    assert len(setup.second.calls) == 1


# --- what the hold sends, and when --------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_an_accepted_hold_is_sent_at_once_then_the_rest_as_it_comes(
    post: Post, setup: Setup, fmt: StreamFormat
) -> None:
    words = tuple(Text(f"word{i} ") for i in range(30))
    setup.script(Stream(parts=words, interval_s=0.01))
    answer = post(stream_hold=StreamHold(chars=20, seconds=1), moderation=blocks, stream_format=fmt)
    assert answer.status == 200
    assert answer.text == "".join(part.text for part in words)
    assert answer.last in ("done", "finish")
    assert (len(setup.first.calls), len(setup.second.calls)) == (1, 0)
    assert [a.outcome for a in setup.ledger.attempts] == ["ok"]


def test_the_answer_completing_inside_the_hold_ends_it_early(post: Post, setup: Setup) -> None:
    setup.script(ANSWER)
    answer = post(stream_hold=StreamHold(chars=10_000, seconds=3))
    assert answer.text == ANSWER.text
    assert answer.last == "done"
    assert answer.elapsed < 1.0  # not the hold's 3 s


def test_status_and_headers_wait_for_the_end_of_the_hold(
    setup: Setup, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, app_client: AppClient
) -> None:
    """A hold of 0.5 s on a stream of a part every 0.1 s: the response's head comes once the
    hold ends (not at the first part), then the held parts at once, then the rest."""
    guards = make_guards(fake_workers_ai, fake_openai, setup.ledger)
    app = FastAPI()
    guards.install(app)

    @app.post("/stream")
    @guards.route(model=setup.first_entry, timeout_s=5, stream_hold=StreamHold(seconds=0.5))
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": body.message})

    words = tuple(Text(f"w{i} ") for i in range(10))
    setup.first.script(setup.first_model, Stream(parts=words, interval_s=0.1))
    client = app_client(app, socket=True)
    started = time.monotonic()
    with client.stream("POST", "/stream", json={"message": "hi"}) as response:
        head = time.monotonic() - started
        answer = read(
            httpx.Response(response.status_code, headers=response.headers, content=response.read()), 0
        )
    assert 0.5 + 0.1 <= head < 0.6 + SLACK_S  # the first part (0.1 s), then the hold
    assert answer.text == "".join(part.text for part in words)
    assert answer.last == "done"


def test_the_hold_never_extends_the_deadline(post: Post, setup: Setup) -> None:
    """A hold of 5,000 characters on a model streaming about 60 a second, on a 1 s deadline:
    the request ends at the deadline, as one with no first output would (503, retryable)."""
    setup.script(Stream(parts=(Text("la "),), endless=True, interval_s=0.05))
    answer = post(stream_hold=StreamHold(chars=5_000), timeout_s=1, fallbacks=[])
    assert (answer.status, json.loads(answer.body)["error"]) == (503, "model_temporarily_unavailable")
    assert 1.0 <= answer.elapsed < 1.0 + SLACK_S
    assert answer.text == ""
    assert "la la" not in answer.body


def test_the_first_output_limit_bounds_the_first_output_not_the_hold(post: Post, setup: Setup) -> None:
    """`first_output_s` 0.6 s and a hold of 0.9 s on a stream of a part every 0.1 s: the
    first part came in time, so the hold runs on; the model is not cancelled at 0.6 s. (The
    limit leaves a loaded machine 0.5 s to bring the first part over loopback.)"""
    words = tuple(Text(f"w{i} ") for i in range(15))
    setup.script(Stream(parts=words, interval_s=0.1))
    answer = post(stream_hold=StreamHold(seconds=0.9), first={"first_output_s": 0.6})
    assert answer.text == "".join(part.text for part in words)
    assert (len(setup.first.calls), len(setup.second.calls)) == (1, 0)


def test_a_breaker_times_a_held_stream_to_its_first_output_not_the_end_of_its_hold(
    post: Post, setup: Setup
) -> None:
    """A breaker counting calls slower than 0.6 s as failures (opening at the first) and a hold
    of 0.9 s: the call's time is to its first output (0.1 s), as without a hold, so the
    breaker stays closed."""
    words = tuple(Text(f"w{i} ") for i in range(15))
    setup.script(Stream(parts=words, interval_s=0.1))
    opened = {"model": setup.first_entry, "to": "open"}
    before = metric("guards_breaker_transitions_total", **opened)
    served = metric("guards_requests_total", route="stream", outcome="ok")
    breaker = Breaker(slow_call_s=0.6, window_s=60, failure_threshold=1, minimum_calls=1)
    answer = post(stream_hold=StreamHold(seconds=0.9), breaker=breaker)
    assert answer.text == "".join(part.text for part in words)
    # The request is counted once its breaker outcome was recorded.
    wait_until(lambda: metric("guards_requests_total", route="stream", outcome="ok") > served)
    assert metric("guards_breaker_transitions_total", **opened) == before


# --- minimum throughput -------------------------------------------------------------------------

#: Two characters a second, forever.
TWO_A_SECOND = Stream(parts=(Text("a"),), endless=True, interval_s=0.5)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_a_two_chars_a_second_model_moves_on_before_the_commit(
    post: Post, setup: Setup, fmt: StreamFormat
) -> None:
    """No hold: the rate is measured over the first second after the first output (at 0.5 s),
    so the slow model is cancelled about 1.5 s in and the fallback answers."""
    setup.script(TWO_A_SECOND)
    before = metric("guards_stream_slow_models_total", route="stream", model=setup.first_entry)
    answer = post(first={"min_chars_per_s": 10}, stream_format=fmt)
    assert_second_answered(answer, setup)
    assert answer.elapsed < 1.5 + SLACK_S
    first, second = setup.ledger.attempts
    assert (first.model, first.outcome) == (setup.first_entry, "model_temporarily_unavailable")
    assert second.outcome == "ok"
    assert setup.first.wait_for(lambda calls: calls[0].disconnected, 2.0), "slow stream not closed"
    after = metric("guards_stream_slow_models_total", route="stream", model=setup.first_entry)
    assert after == before + 1


def test_the_rate_is_measured_over_the_hold(post: Post, setup: Setup) -> None:
    """The route's `min_chars_per_s` with a hold of 10,000 characters: past 10,000 / 10 s the
    rate can only fall short, but a 2-chars-a-second model is behind at the hold's 1 s."""
    setup.script(TWO_A_SECOND)
    answer = post(stream_hold=StreamHold(chars=10_000, seconds=1), min_chars_per_s=10)
    assert_second_answered(answer, setup)
    assert answer.elapsed < 1.5 + SLACK_S


def test_a_model_fast_enough_commits_and_is_never_judged_after(post: Post, setup: Setup) -> None:
    """20 characters at once clears a rate of 10 a second at once (the commit is not held a
    second); then two parts 0.3 s apart: slow, but after the commit, so the stream goes on."""
    parts = (Text("x" * 20), Text(" y"), Text(" z"))
    setup.script(Stream(parts=parts, interval_s=0.3))
    answer = post(first={"min_chars_per_s": 10})
    assert answer.text == "x" * 20 + " y z"
    assert answer.last == "done"
    assert (len(setup.first.calls), len(setup.second.calls)) == (1, 0)


# --- declared bounds ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"chars": 65_537}, r"StreamHold\.chars"),
        ({"chars": 0}, r"StreamHold\.chars"),
        ({"seconds": 30.5}, r"StreamHold\.seconds"),
        ({"seconds": 0}, r"StreamHold\.seconds"),
        ({"seconds": float("inf")}, r"StreamHold\.seconds"),
        ({}, "StreamHold needs chars, seconds or both"),
    ],
)
def test_a_hold_out_of_its_bounds_is_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        StreamHold(**settings)


def test_the_largest_hold_is_accepted() -> None:
    assert StreamHold(chars=65_536, seconds=30) == StreamHold(chars=65_536, seconds=30.0)


ROUTE_ERRORS = {
    "not-a-hold": ({"stream_hold": 400}, "stream_hold must be a guards.StreamHold"),
    "seconds-not-below-the-deadline": (
        {"stream_hold": StreamHold(seconds=5), "timeout_s": 5},
        r"stream_hold's seconds \(5\) must be below timeout_s",
    ),
    "chars-past-the-stream-limit": (
        {"stream_hold": StreamHold(chars=2_000), "stream_max_chars": 1_000},
        "must not exceed stream_max_chars",
    ),
    "a-rate-of-zero": ({"min_chars_per_s": 0}, "route: min_chars_per_s"),
}


@pytest.mark.parametrize(("route", "message"), ROUTE_ERRORS.values(), ids=ROUTE_ERRORS.keys())
def test_a_route_declared_with_a_bad_hold_or_rate_fails_at_decoration(
    route: dict[str, Any], message: str
) -> None:
    guards = Guards(WorkersAI(account_id="a", api_token="t"))
    with pytest.raises(ConfigurationError, match=message):

        @guards.route(model=WORKERS_MODEL, **route)
        async def stream(body: Ask, ai: AI[str]) -> EventStream:
            return await ai.stream({"prompt": body.message})


def test_a_model_rate_out_of_bounds_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"Model\.min_chars_per_s"):
        Model(WORKERS_MODEL, min_chars_per_s=-1)


def test_a_hold_on_a_route_that_does_not_stream_is_refused() -> None:
    guards = Guards(WorkersAI(account_id="a", api_token="t"))
    with pytest.raises(ConfigurationError, match="for streaming routes"):

        @guards.route(model=WORKERS_MODEL, stream_hold=StreamHold(chars=100))
        async def reply(body: Ask, ai: AI[str]) -> str:
            return await ai.run({"prompt": body.message})
