"""First-output limits (`Model(first_output_s=..., stream_idle_s=...)`, and a route's defaults):
how they are declared and checked, which model gets which limit, and what a silence is on the
request path: a failure that moves on (never retried when another model is configured; retried
once on a one-model chain), counted on the breaker, with no cooldown, inside the route's one
deadline. In process with the fake binding, and over HTTP where a binding's own first byte
matters. Every bound is stated with its test; none is a sleep."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import FakeBinding, FakeWorkersAI, Hang, Reply, Stream, Text
from guards import (
    AI,
    AIResult,
    Breaker,
    ConfigurationError,
    EventStream,
    Guards,
    Model,
    ModelRef,
    Profile,
    Retry,
    flatten_chain,
)
from guards.providers import WorkersAI, http_client

from ..conftest import AppClient, LogLines, no_sleep

PRIMARY, BACKUP = "@cf/test/primary", "@cf/test/backup"
LIMIT_S = 0.2
#: Slack for a loaded machine (an answer of the fake takes milliseconds).
SLACK_S = 1.5


class Ask(BaseModel):
    text: str


class Answer(BaseModel):
    reply: str
    model: str
    attempts: int


Build = Callable[..., httpx.Client]


def make_app(
    binding: Any,
    *,
    model: str | Model = PRIMARY,
    fallbacks: Sequence[str | Model] = (f"backup:{BACKUP}",),
    providers: Mapping[str, Any] | None = None,
    timeout_s: float = 5.0,
    **route: Any,
) -> FastAPI:
    """`/ask` (strict), `/degrading` and `/stream` (strict, streamed), each on `model` then
    `fallbacks`; `route` goes to every `Guards.route`."""
    guards = Guards(binding, providers=providers or {}, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    options = {"model": model, "fallbacks": fallbacks, "timeout_s": timeout_s, **route}

    @app.post("/ask")
    @guards.route(**options)
    async def ask(body: Ask, ai: AI[str]) -> Answer:
        reply = await ai.run({"prompt": body.text})
        return Answer(reply=reply, model=ai.model or "", attempts=ai.attempts)

    @app.post("/degrading")
    @guards.route(**options, fallback="(no reply)")
    async def degrading(body: Ask, ai: AI[str]) -> str:
        return await ai.run({"prompt": body.text})

    @app.post("/stream")
    @guards.route(**options, name="stream")
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": body.text})

    return app


def post(client: httpx.Client, path: str = "/ask") -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = client.post(path, json={"text": "Hi"})
    return response, time.monotonic() - started


def events(response: httpx.Response) -> list[tuple[str, Any]]:
    found = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            found.append((lines["event"], json.loads(lines["data"])))
    return found


# --- declaring limits ---------------------------------------------------------------------------

BAD_LIMITS = [0, -1, 0.0, math.nan, math.inf, True, "1"]


@pytest.mark.parametrize("value", BAD_LIMITS, ids=repr)
@pytest.mark.parametrize("name", ["first_output_s", "stream_idle_s"])
def test_a_limit_is_a_positive_finite_number_of_seconds(name: str, value: Any) -> None:
    message = f"{name} must be a positive, finite number of seconds"
    with pytest.raises(ConfigurationError, match=message):
        Model(PRIMARY, **{name: value})
    with pytest.raises(ConfigurationError, match=message):
        make_app(FakeBinding(), fallbacks=(), **{name: value})


def test_a_model_is_a_string_with_limits() -> None:
    assert Model(PRIMARY, first_output_s=2).first_output_s == 2.0
    assert Model(PRIMARY).first_output_s is None
    assert Model(PRIMARY).stream_idle_s is None
    with pytest.raises(ConfigurationError, match="a chain entry string"):
        Model(42)  # type: ignore[arg-type]


def test_an_entrys_limits_go_to_every_model_it_names_unless_a_profile_model_sets_its_own() -> None:
    profiles = {
        "chat": Profile(model=Model("openai:gpt-4o-mini", first_output_s=1.5), fallbacks=("local",)),
        "local": Profile(model="@cf/local"),
    }
    chain = flatten_chain(
        [Model("chat", first_output_s=3, stream_idle_s=4), Model("hint:big", stream_idle_s=9), "@cf/plain"],
        profiles=profiles,
        providers={"openai"},
        hints={"big": "@cf/big"},
    )
    assert [(ref.key, ref.first_output_s, ref.stream_idle_s, ref.hint) for ref in chain.models] == [
        ("openai:gpt-4o-mini", 1.5, 4.0, None),  # the profile's own first-output limit
        ("@cf/local", 3.0, 4.0, None),
        ("@cf/big", None, 9.0, "big"),
        ("@cf/plain", None, None, None),
    ]
    assert chain.models[0] == ModelRef("openai", "gpt-4o-mini")  # limits are not the model's identity


def test_a_first_output_limit_not_below_the_deadline_is_logged_and_kept(guards_log: LogLines) -> None:
    make_app(FakeBinding(), fallbacks=(Model(BACKUP, first_output_s=5),), timeout_s=5.0)
    problems = [line["problem"] for line in guards_log.events("chain_invalid") if line["route"] == "ask"]
    assert problems == [
        f"model '{BACKUP}': first_output_s 5s is not below the route's timeout_s 5s: it never fires "
        "(the deadline does first)"
    ]


# --- what a silence does ------------------------------------------------------------------------


@pytest.fixture
def main() -> FakeBinding:
    return FakeBinding()


@pytest.fixture
def backup() -> FakeBinding:
    return FakeBinding()


@pytest.fixture
def build(main: FakeBinding, backup: FakeBinding, app_client: AppClient) -> Build:
    """`build(**route)`: an in-process client of `make_app` on the fake bindings `main` (the
    primary model's) and `backup`."""

    def make(**route: Any) -> httpx.Client:
        return app_client(make_app(main, providers={"backup": backup}, **route))

    return make


def test_the_routes_limit_applies_where_a_model_sets_none(
    build: Build, main: FakeBinding, backup: FakeBinding
) -> None:
    """The primary model has the route's 0.2 s; the backup its own 5 s, which its 0.5 s answer
    keeps within (the fake binding, like a binding that says nothing of its first byte, has
    its first output when the answer is whole)."""
    client = build(first_output_s=LIMIT_S, fallbacks=(Model(f"backup:{BACKUP}", first_output_s=5),))
    main.script(PRIMARY, Hang())
    backup.script(BACKUP, Reply("Late but here.", delay_s=0.5))
    response, elapsed = post(client)
    assert response.status_code == 200, response.text
    assert response.json() == {"reply": "Late but here.", "model": BACKUP, "attempts": 2}
    assert LIMIT_S + 0.5 <= elapsed < LIMIT_S + 0.5 + SLACK_S
    assert len(main.calls) == 1
    assert main.calls[0].disconnected
    assert len(backup.calls) == 1


def test_a_binding_that_never_tells_its_first_byte_must_answer_whole_within_the_limit(
    build: Build, main: FakeBinding, backup: FakeBinding
) -> None:
    """A user's binding that knows nothing of `first_output_arrived`: its whole answer is its
    first output. The fake binding, which says when its head came (as the HTTP adapters do),
    keeps its slow answer."""
    client = build(first_output_s=LIMIT_S)
    main.script(PRIMARY, Reply("Whole, but late.", delay_s=3 * LIMIT_S))
    backup.script(BACKUP, Reply("From the backup."))
    response, _ = post(client)
    assert response.json()["reply"] == "From the backup."
    main.script(PRIMARY, Reply("Started at once.", body_delay_s=3 * LIMIT_S))
    response, elapsed = post(client)
    assert response.json()["reply"] == "Started at once."
    assert elapsed >= 3 * LIMIT_S
    assert len(main.calls) == 2
    assert len(backup.calls) == 1


class Quiet:
    """A user's own binding: answers after `delay_s`, and never calls `first_output_arrived`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return AIResult(response="From a quiet binding.", model=model)

    async def aclose(self) -> None:
        pass


def test_a_users_own_binding_works_unchanged(app_client: AppClient, backup: FakeBinding) -> None:
    quick, slow = Quiet(0.0), Quiet(3 * LIMIT_S)
    for binding, served in ((quick, PRIMARY), (slow, BACKUP)):
        client = app_client(make_app(binding, providers={"backup": backup}, first_output_s=LIMIT_S))
        response, _ = post(client)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == served
    assert (quick.calls, slow.calls, len(backup.calls)) == (1, 1, 1)


def test_a_one_model_chain_retries_its_silence_once(build: Build, main: FakeBinding) -> None:
    """With no other model, a silence is retried like any transient failure (`Retry`: one
    retry by default, while the deadline leaves room); without retries it is a 503."""
    client = build(fallbacks=(), first_output_s=LIMIT_S)
    main.script(PRIMARY, Hang(), Reply("Second time lucky."))
    response, elapsed = post(client)
    assert response.json() == {"reply": "Second time lucky.", "model": PRIMARY, "attempts": 2}
    assert LIMIT_S <= elapsed < LIMIT_S + SLACK_S
    client = build(fallbacks=(), first_output_s=LIMIT_S, retry=Retry(attempts=1))
    main.reset()
    main.script(PRIMARY, Hang())
    response, elapsed = post(client)
    assert response.status_code == 503
    assert response.json()["error"] == "model_temporarily_unavailable"
    assert response.json()["retryable"] is True
    assert len(main.calls) == 1
    assert LIMIT_S <= elapsed < LIMIT_S + SLACK_S


def test_a_silent_model_is_not_retried_when_another_is_configured(
    build: Build, main: FakeBinding, backup: FakeBinding
) -> None:
    """Even with retries to spare (three calls per model), each silent model gets one call,
    the last of the chain too: the route answers 503 after two limits, not six."""
    client = build(first_output_s=LIMIT_S, retry=Retry(attempts=3), attempts=6)
    main.script(PRIMARY, Hang(), Hang(), Hang())
    backup.script(BACKUP, Reply("From the backup."))
    response, _ = post(client)
    assert response.json() == {"reply": "From the backup.", "model": BACKUP, "attempts": 2}
    backup.script(BACKUP, Hang(), Hang(), Hang())
    response, elapsed = post(client)
    assert response.status_code == 503
    assert response.json()["error"] == "model_temporarily_unavailable"
    assert (len(main.calls), len(backup.calls)) == (2, 2)
    assert 2 * LIMIT_S <= elapsed < 2 * LIMIT_S + SLACK_S


def test_the_envelope_says_the_model_was_silent(build: Build, main: FakeBinding) -> None:
    client = build(fallbacks=(), first_output_s=LIMIT_S, retry=Retry(attempts=1))
    main.script(PRIMARY, Hang())
    response, _ = post(client, "/degrading")
    assert response.json() == {
        "ok": True,
        "data": "(no reply)",
        "fallback": {
            "guard": "call",
            "reason": "provider_error",
            "detail": "model_temporarily_unavailable after 1 attempt(s): no first output within 0.2s",
        },
    }


@pytest.mark.parametrize("breaker", [Breaker(failure_threshold=1), None], ids=["breaker", "no-breaker"])
def test_a_silence_counts_on_the_breaker_and_starts_no_cooldown(
    build: Build, main: FakeBinding, backup: FakeBinding, breaker: Breaker | None
) -> None:
    """With a breaker that opens at the first failure, the silent model is skipped by the next
    request; with none, it is called again at once: no cooldown (the provider asked no pause)."""
    client = build(first_output_s=LIMIT_S, breaker=breaker)
    main.script(PRIMARY, Hang(), Hang())
    for _ in range(2):
        response, _ = post(client)
        assert response.json()["model"] == BACKUP
    assert len(main.calls) == (1 if breaker is not None else 2)


def test_the_route_deadline_still_bounds_the_whole_chain(
    build: Build, main: FakeBinding, backup: FakeBinding
) -> None:
    """The next model gets what is left of the deadline: 0.3 s here, then the route's timeout."""
    client = build(first_output_s=0.5, timeout_s=0.8)
    main.script(PRIMARY, Hang())
    backup.script(BACKUP, Hang())
    response, elapsed = post(client, "/degrading")
    assert response.json()["fallback"]["reason"] == "timeout"
    assert 0.8 <= elapsed < 0.8 + SLACK_S
    assert main.calls[0].disconnected
    assert backup.calls[0].disconnected


def test_a_stream_that_goes_quiet_after_its_first_words_ends_at_its_models_idle_limit(
    build: Build, main: FakeBinding, backup: FakeBinding
) -> None:
    """The fake binding's stall waits until cancelled (no idle timeout of its own): the
    model's `stream_idle_s` ends it, as the `error` event; the backup is never called."""
    client = build(fallbacks=(Model(f"backup:{BACKUP}", stream_idle_s=60),), stream_idle_s=LIMIT_S)
    main.script(PRIMARY, Stream(parts=(Text("Hello"), Text(" there")), stall_after=1))
    response, elapsed = post(client, "/stream")
    found = events(response)
    assert [data["text"] for name, data in found if name == "delta"] == ["Hello"]
    name, data = found[-1]
    assert (name, data["guard"], data["reason"], data["detail"]) == (
        "error",
        "call",
        "provider_error",
        "stream interrupted after output",
    )
    assert LIMIT_S <= elapsed < LIMIT_S + SLACK_S
    assert main.calls[0].disconnected
    assert backup.calls == []


def test_an_idle_limit_does_not_count_the_time_between_words_that_keep_coming(
    build: Build, main: FakeBinding
) -> None:
    client = build(stream_idle_s=LIMIT_S)
    words = tuple(Text(f"w{n} ") for n in range(6))
    main.script(PRIMARY, Stream(parts=words, interval_s=LIMIT_S / 4))
    response, elapsed = post(client, "/stream")
    assert events(response)[-1][0] == "done"
    assert "".join(data["text"] for name, data in events(response) if name == "delta") == "w0 w1 w2 w3 w4 w5 "
    assert elapsed >= 6 * LIMIT_S / 4  # longer than the idle limit, in gaps shorter than it


def test_a_stream_idle_limit_over_http_whatever_the_adapters_own(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    """The Workers AI adapter's idle timeout is 30 s by default; the model's 0.2 s ends the
    stream, and the provider's connection is closed."""
    binding = WorkersAI(
        account_id=fake_workers_ai.account_id,
        api_token=fake_workers_ai.api_token,
        base_url=fake_workers_ai.base_url,
    )
    client = app_client(
        make_app(binding, model=Model(PRIMARY, stream_idle_s=LIMIT_S), fallbacks=()), socket=True
    )
    fake_workers_ai.script(PRIMARY, Stream(parts=(Text("Hello"), Text(" there")), stall_after=1))
    response, elapsed = post(client, "/stream")
    assert events(response)[-1][0] == "error"
    assert LIMIT_S <= elapsed < LIMIT_S + SLACK_S
    assert fake_workers_ai.wait_for(lambda calls: calls[-1].disconnected, SLACK_S)
    assert len(fake_workers_ai.calls) == 1


def test_a_limit_spent_waiting_for_a_connection_moves_on_without_blaming_the_model(
    fake_workers_ai: FakeWorkersAI, backup: FakeBinding, app_client: AppClient
) -> None:
    """The primary's binding has one connection, held by a slow answer (its head came at once).
    A second request waits for that connection past its first-output limit: it moves on to the
    backup, its wait is no attempt (the call never left) and no failure of the model: with a
    breaker that opens at the first failure, the next request still calls the primary."""
    binding = WorkersAI(
        account_id=fake_workers_ai.account_id,
        api_token=fake_workers_ai.api_token,
        base_url=fake_workers_ai.base_url,
        client=http_client(max_connections=1),
    )
    app = make_app(
        binding,
        providers={"backup": backup},
        first_output_s=LIMIT_S,
        breaker=Breaker(failure_threshold=1),
    )
    client = app_client(app, socket=True)
    fake_workers_ai.script(
        PRIMARY, Reply("Slow but sure.", body_delay_s=5 * LIMIT_S), Reply("Primary again.")
    )
    backup.script(BACKUP, Reply("From the backup."))
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, client)
        assert fake_workers_ai.wait_for(lambda calls: len(calls) == 1)
        queued, elapsed = post(client)
        assert queued.json() == {"reply": "From the backup.", "model": BACKUP, "attempts": 1}
        assert LIMIT_S <= elapsed < LIMIT_S + SLACK_S
        assert slow.result()[0].json()["reply"] == "Slow but sure."
    again, _ = post(client)
    assert again.json()["reply"] == "Primary again."
    assert len(fake_workers_ai.calls) == 2
