"""Fallback chains over real HTTP: call counts at the fake providers, one attempt budget per
call, cooldowns, per-model breakers, attribution headers, the usage ledger, and the flattening
of profile graphs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import Fail, FakeWorkersAI, Hang, ManualClock, Reply
from guards import (
    AI,
    Attempt,
    Breaker,
    ConfigurationError,
    Guards,
    GuardTripped,
    Profile,
    Retry,
    flatten_chain,
)
from guards.providers import WorkersAI
from guards.stores import MemoryStore

from ..conftest import AppClient, LogLines, no_sleep

PRIMARY = "@cf/test/primary"
BACKUP = "@cf/test/backup"
THIRD = "@cf/test/third"
CANARY = "PROVIDER-CANARY-7f3a"


class Label(BaseModel):
    label: str


class Ask(BaseModel):
    text: str


class Recorder:
    """A ledger that keeps every record."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)


class Sleeps:
    """Retry waits, recorded instead of waited."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


@pytest.fixture
def backup_server() -> Iterator[FakeWorkersAI]:
    with FakeWorkersAI() as server:
        yield server


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def ledger() -> Recorder:
    return Recorder()


Build = Callable[..., httpx.Client]


@pytest.fixture
def build(
    fake_workers_ai: FakeWorkersAI,
    backup_server: FakeWorkersAI,
    app_client: AppClient,
    manual_clock: ManualClock,
    sleeps: Sleeps,
    ledger: Recorder,
) -> Build:
    """`build(fallbacks=[...], degrading=False, route={...}, **guards_options)`: an app whose main binding is
    the `fake_workers_ai` server and whose `backup` provider is `backup_server`, served by
    uvicorn; `POST /label` calls `PRIMARY` then the fallbacks."""

    def make(
        *,
        fallbacks: tuple[str, ...] = (f"backup:{BACKUP}",),
        degrading: bool = False,
        breaker: Breaker | None = Breaker(failure_threshold=1000),
        timeout_s: float = 3.0,
        attempts: int | None = None,
        route: dict[str, Any] | None = None,
        **options: Any,
    ) -> httpx.Client:
        def binding(server: FakeWorkersAI) -> WorkersAI:
            return WorkersAI(
                account_id=server.account_id, api_token=server.api_token, base_url=server.base_url
            )

        guards = Guards(
            binding(fake_workers_ai),
            providers={"backup": binding(backup_server)},
            store=MemoryStore(clock=manual_clock),
            sleep=sleeps,
            ledger=ledger,
            **options,
        )
        app = FastAPI()
        guards.install(app)
        extra: dict[str, Any] = {"fallback": Label(label="unknown")} if degrading else {}

        @app.post("/label")
        @guards.route(
            model=PRIMARY,
            fallbacks=fallbacks,
            breaker=breaker,
            timeout_s=timeout_s,
            attempts=attempts,
            **extra,
            **(route or {}),
        )
        async def label(body: Ask, ai: AI[Label]) -> Label:
            return await ai.run({"prompt": body.text})

        return app_client(app, socket=True)

    return make


def ask(client: httpx.Client) -> httpx.Response:
    return client.post("/label", json={"text": "where is my parcel"})


ANSWER = Reply({"label": "shipping"})


def test_incompatible_primary_falls_back_in_two_calls(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI, ledger: Recorder
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
    backup_server.script(BACKUP, ANSWER)
    response = ask(build())
    assert response.status_code == 200
    assert response.json() == {"label": "shipping"}
    assert len(fake_workers_ai.calls) == 1
    assert len(backup_server.calls) == 1
    assert response.headers["x-ai-model"] == BACKUP
    assert response.headers["x-ai-fallback"] == f"backup:{BACKUP}"
    # The ledger has both billable calls, the rejected one included.
    assert [(a.attempt, a.model, a.outcome) for a in ledger.attempts] == [
        (1, PRIMARY, "model_incompatible"),
        (2, f"backup:{BACKUP}", "ok"),
    ]
    assert {a.requested_model for a in ledger.attempts} == {PRIMARY}
    assert ledger.attempts[1].served_model == BACKUP
    assert ledger.attempts[1].usage is not None
    assert ledger.attempts[1].usage.total_tokens == 15
    assert len({a.trace_id for a in ledger.attempts}) == 1
    assert ledger.attempts[0].trace_id == response.headers["x-trace-id"]


def test_the_primary_answering_carries_no_fallback_header(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, ANSWER)
    response = ask(build())
    assert response.status_code == 200
    assert response.headers["x-ai-model"] == PRIMARY
    assert "x-ai-fallback" not in response.headers
    assert len(backup_server.calls) == 0


def test_transient_primary_never_makes_more_calls_than_the_stated_budget(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI, guards_log: LogLines
) -> None:
    """Two models, one retry in total: at most 3 calls, whatever fails."""
    fake_workers_ai.script(PRIMARY, *[Fail(code=3040, status=429)] * 5)
    backup_server.script(BACKUP, *[Fail(code=3040, status=429)] * 5)
    response = ask(build())
    assert response.status_code == 503
    assert response.json()["error"] == "model_temporarily_unavailable"
    assert len(fake_workers_ai.calls) + len(backup_server.calls) == 3
    # The retry went to the primary; the fallback kept its one call.
    assert len(fake_workers_ai.calls) == 2
    assert len(backup_server.calls) == 1
    (line,) = guards_log.events("request")
    assert line["attempt_budget"] == 3
    assert line["attempts"] == 3


def test_transient_primary_twice_then_the_fallback_answers(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=3040, status=429), Fail(code=3040, status=429))
    backup_server.script(BACKUP, ANSWER)
    response = ask(build())
    assert response.status_code == 200
    assert response.headers["x-ai-fallback"] == f"backup:{BACKUP}"
    assert (len(fake_workers_ai.calls), len(backup_server.calls)) == (2, 1)


def test_an_explicit_attempt_budget_is_a_hard_limit(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=3040, status=429))
    response = ask(build(attempts=1))
    assert response.status_code == 503
    assert (len(fake_workers_ai.calls), len(backup_server.calls)) == (1, 0)


def test_rate_limited_primary_cools_down_and_is_skipped_without_a_call(
    build: Build,
    fake_workers_ai: FakeWorkersAI,
    backup_server: FakeWorkersAI,
    manual_clock: ManualClock,
    guards_log: LogLines,
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(status=429, retry_after="60"))
    backup_server.default = ANSWER
    fake_workers_ai.default = ANSWER
    client = build()
    first = ask(client)
    assert first.status_code == 200
    assert first.headers["x-ai-fallback"] == f"backup:{BACKUP}"
    assert (len(fake_workers_ai.calls), len(backup_server.calls)) == (1, 1)
    for _ in range(3):
        manual_clock.advance(19)
        again = ask(client)
        assert again.status_code == 200
        assert again.headers["x-ai-fallback"] == f"backup:{BACKUP}"
    assert len(fake_workers_ai.calls) == 1, "the cooling primary got no call"
    assert len(backup_server.calls) == 4
    # One line per second at most, counting the skips of that second.
    assert guards_log.skips() == {(PRIMARY, "cooldown"): 3}
    assert guards_log.events("cooldown")[0]["seconds"] == 60
    manual_clock.advance(4)  # 61 s after the 429: the cooldown is over
    back = ask(client)
    assert back.status_code == 200
    assert "x-ai-fallback" not in back.headers
    assert len(fake_workers_ai.calls) == 2


def test_quota_exhausted_primary_cools_down_for_the_default_quota_pause(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI, manual_clock: ManualClock
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=3036, status=429))
    backup_server.default = ANSWER
    client = build()
    assert ask(client).status_code == 200
    manual_clock.advance(599)
    assert ask(client).status_code == 200
    assert len(fake_workers_ai.calls) == 1
    manual_clock.advance(2)
    fake_workers_ai.default = ANSWER
    assert "x-ai-fallback" not in ask(client).headers
    assert len(fake_workers_ai.calls) == 2


def test_retry_after_longer_than_the_deadline_moves_on_at_once(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI, sleeps: Sleeps
) -> None:
    """A transient failure asks for 60 s; the deadline is 3 s: no wait, no retry, next model."""
    fake_workers_ai.script(PRIMARY, Fail(status=503, retry_after="60"))
    backup_server.script(BACKUP, ANSWER)
    response = ask(build())
    assert response.status_code == 200
    assert sleeps.waits == []
    assert (len(fake_workers_ai.calls), len(backup_server.calls)) == (1, 1)


def test_retry_after_that_fits_the_deadline_is_honoured(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI, sleeps: Sleeps
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(status=503, retry_after="1"), ANSWER)
    response = ask(build(timeout_s=5.0))
    assert response.status_code == 200
    assert sleeps.waits == [1.0]
    assert (len(fake_workers_ai.calls), len(backup_server.calls)) == (2, 0)


def test_every_leg_failing_reports_a_bounded_summary_without_provider_text(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI, guards_log: LogLines
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403, message=f"AiError: {CANARY}"))
    backup_server.script(BACKUP, Fail(status=500, message=CANARY), Fail(status=502, message=CANARY))
    response = ask(build(degrading=True))
    assert response.status_code == 200
    body = response.json()
    assert body["data"] == {"label": "unknown"}
    fallback = body["fallback"]
    assert (fallback["guard"], fallback["reason"]) == ("call", "provider_error")
    detail = fallback["detail"]
    assert f"{PRIMARY}: model_incompatible" in detail
    assert f"backup:{BACKUP}: model_temporarily_unavailable x2" in detail
    assert len(detail) <= 420
    (line,) = guards_log.events("request")
    assert line["legs"] == f"{PRIMARY}: model_incompatible; backup:{BACKUP}: model_temporarily_unavailable x2"
    assert CANARY not in response.text
    assert not any(CANARY in text for text in guards_log.lines)


def test_strict_route_answers_the_last_failure_after_every_leg(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=3040, status=429), Fail(code=3040, status=429))
    backup_server.script(BACKUP, Fail(code=5035, status=403))
    response = ask(build())
    assert (response.status_code, response.json()["error"]) == (502, "model_incompatible")


def test_open_breaker_on_the_primary_skips_to_the_fallback(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI, guards_log: LogLines
) -> None:
    fake_workers_ai.default = Fail(code=5035, status=403)
    backup_server.default = ANSWER
    client = build(breaker=Breaker(failure_threshold=2, reset_timeout_s=30))
    for _ in range(2):
        assert ask(client).status_code == 200
    assert len(fake_workers_ai.calls) == 2
    for _ in range(3):
        response = ask(client)
        assert response.status_code == 200
        assert response.headers["x-ai-fallback"] == f"backup:{BACKUP}"
    assert len(fake_workers_ai.calls) == 2, "an open breaker means no call"
    assert len(backup_server.calls) == 5
    assert guards_log.skips() == {(PRIMARY, "circuit_open"): 3}


def test_every_model_skipped_is_circuit_open_with_the_shortest_wait(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(status=429, retry_after="40"))
    backup_server.script(BACKUP, Fail(status=429, retry_after="90"))
    client = build()
    first = ask(client)
    assert (first.status_code, first.json()["error"]) == (503, "model_rate_limited")
    second = ask(client)
    assert (second.status_code, second.json()["error"]) == (503, "circuit_open")
    assert second.headers["retry-after"] == "40"
    assert (len(fake_workers_ai.calls), len(backup_server.calls)) == (1, 1)


def test_the_deadline_covers_the_whole_chain_and_never_moves_on(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, Hang())
    response = ask(build(timeout_s=0.3, route={"first_output_s": None}))  # the deadline alone
    assert (response.status_code, response.json()["error"]) == (503, "model_temporarily_unavailable")
    assert len(backup_server.calls) == 0
    assert fake_workers_ai.wait_for(lambda calls: calls[0].disconnected, timeout=5)


def test_a_client_that_disconnects_mid_call_gets_no_further_leg(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI, guards_log: LogLines
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403, delay_s=0.5))
    backup_server.default = ANSWER
    client = build()
    with pytest.raises(httpx.ReadTimeout):
        client.post("/label", json={"text": "hello"}, timeout=0.1)
    # The primary answers (a failure) after the client left; the route ends without a leg.
    assert guards_log.wait_for(lambda: guards_log.events("request"), timeout=5)
    (line,) = guards_log.events("request")
    assert line["kind"] == "cancelled"
    assert len(fake_workers_ai.calls) == 1
    assert len(backup_server.calls) == 0


def test_a_client_that_disconnects_cancels_the_call_in_flight(
    build: Build,
    fake_workers_ai: FakeWorkersAI,
    backup_server: FakeWorkersAI,
    guards_log: LogLines,
    ledger: Recorder,
) -> None:
    """The primary hangs; the route's deadline is 30 s. The client leaves after 0.3 s: the
    provider call is cancelled (its connection closed) long before the deadline, and no
    fallback is tried."""
    fake_workers_ai.script(PRIMARY, Hang())
    client = build(timeout_s=30.0)
    with pytest.raises(httpx.ReadTimeout):
        client.post("/label", json={"text": "hello"}, timeout=0.3)
    assert fake_workers_ai.wait_for(lambda calls: calls[0].disconnected, timeout=5)
    assert guards_log.wait_for(lambda: guards_log.events("request"), timeout=5)
    (line,) = guards_log.events("request")
    assert (line["outcome"], line["kind"]) == ("cancelled", "cancelled")
    assert line["latency_ms"] < 5_000
    assert len(backup_server.calls) == 0
    assert [a.outcome for a in ledger.attempts] == ["cancelled"]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("detailed", {"x-ai-model": BACKUP, "x-ai-fallback": f"backup:{BACKUP}"}),
        ("redacted", {"x-ai-fallback": "true"}),
        ("off", {}),
    ],
)
def test_attribution_modes(
    build: Build,
    fake_workers_ai: FakeWorkersAI,
    backup_server: FakeWorkersAI,
    mode: str,
    expected: dict[str, str],
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
    backup_server.script(BACKUP, ANSWER)
    response = ask(build(attribution=mode))
    assert response.status_code == 200
    headers = {k: v for k, v in response.headers.items() if k.startswith("x-ai-")}
    assert headers == expected


def test_redacted_attribution_keeps_model_ids_out_of_the_detail(
    build: Build, fake_workers_ai: FakeWorkersAI, backup_server: FakeWorkersAI
) -> None:
    fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
    backup_server.script(BACKUP, Fail(code=5035, status=403))
    detail = ask(build(degrading=True, attribution="redacted")).json()["fallback"]["detail"]
    assert "model 1: model_incompatible" in detail
    assert "model 2: model_incompatible" in detail
    assert PRIMARY not in detail
    assert BACKUP not in detail


# --- profile graphs -----------------------------------------------------------------------------


def keys(entries: list[str], **profiles: Profile) -> tuple[tuple[str, ...], tuple[str, ...]]:
    chain = flatten_chain(entries, profiles=profiles, providers=("openai", "backup"))
    return tuple(ref.key for ref in chain.models), chain.problems


def test_profiles_flatten_depth_first() -> None:
    models, problems = keys(
        ["main"],
        main=Profile(model="@cf/a", fallbacks=("cheap", "local")),
        cheap=Profile(model="openai:gpt-4o-mini", fallbacks=("tiny",)),
        tiny=Profile(model="openai:gpt-4.1-nano"),
        local=Profile(model="backup:llama3:8b"),
    )
    assert models == ("@cf/a", "openai:gpt-4o-mini", "openai:gpt-4.1-nano", "backup:llama3:8b")
    assert problems == ()


def test_a_cycle_is_reported_and_cut() -> None:
    models, problems = keys(
        ["a"],
        a=Profile(model="@cf/a", fallbacks=("b",)),
        b=Profile(model="@cf/b", fallbacks=("a",)),
    )
    assert models == ("@cf/a", "@cf/b")
    assert problems == ("a -> b -> a: cycle removed",)


def test_a_dangling_reference_is_reported_and_removed() -> None:
    models, problems = keys(
        ["a"], a=Profile(model="@cf/a", fallbacks=("missing", "b")), b=Profile(model="@cf/b")
    )
    assert models == ("@cf/a", "@cf/b")
    assert problems == ("a: fallback 'missing' names no profile, removed",)


def test_a_duplicate_is_reported_and_removed() -> None:
    models, problems = keys(["@cf/a", "openai:gpt-4o", "a"], a=Profile(model="@cf/a", fallbacks=()))
    assert models == ("@cf/a", "openai:gpt-4o")
    assert problems == ("profile 'a': duplicate model '@cf/a' removed",)


def test_empty_model_ids_are_reported_and_removed() -> None:
    models, problems = keys(["@cf/a", "", "openai:", "  "])
    assert models == ("@cf/a",)
    assert problems == (
        "entry '': empty model id removed",
        "entry 'openai:': empty model id removed",
        "entry '': empty model id removed",
    )


def test_excessive_depth_is_reported_and_cut() -> None:
    profiles = {f"p{i}": Profile(model=f"@cf/m{i}", fallbacks=(f"p{i + 1}",)) for i in range(12)}
    profiles["p12"] = Profile(model="@cf/m12")
    chain = flatten_chain(["p0"], profiles=profiles)
    assert len(chain.models) == 8
    assert len(chain.problems) == 1
    assert "deeper than 8 profiles" in chain.problems[0]


def test_a_provider_without_credentials_fails_start_up() -> None:
    with pytest.raises(ConfigurationError, match="provider 'anthropic', which is not configured"):
        flatten_chain(["@cf/a", "anthropic:claude-haiku"], providers=("openai",))


def test_a_bedrock_model_id_with_a_colon_is_the_main_bindings_model() -> None:
    """Bedrock's ids (`vendor.model-v1:0`) have a colon after a dotted name: no provider."""
    chain = flatten_chain(
        ["anthropic.claude-3-5-haiku-20241022-v1:0", "bedrock:amazon.nova-lite-v1:0"], providers=("bedrock",)
    )
    assert [(ref.provider, ref.model) for ref in chain.models] == [
        (None, "anthropic.claude-3-5-haiku-20241022-v1:0"),
        ("bedrock", "amazon.nova-lite-v1:0"),
    ]


def test_a_main_binding_model_id_with_a_colon_uses_the_default_prefix() -> None:
    chain = flatten_chain(["default:llama3:8b"])
    assert [(ref.provider, ref.model) for ref in chain.models] == [(None, "llama3:8b")]


def test_route_logs_chain_problems_at_start_up(fake_ai: Any, guards_log: LogLines) -> None:
    guards = Guards(fake_ai, profiles={"a": Profile(model="@cf/a", fallbacks=("nope",))})

    @guards.route(model="a", fallbacks=("@cf/a", "@cf/b"))
    async def route(ai: AI[str]) -> str:
        return await ai.run({"prompt": "x"})

    problems = [line["problem"] for line in guards_log.events("chain_invalid")]
    assert problems == [
        "a: fallback 'nope' names no profile, removed",
        "entry '@cf/a': duplicate model '@cf/a' removed",
    ]


def test_a_route_with_no_model_left_fails_start_up(fake_ai: Any) -> None:
    guards = Guards(fake_ai)
    with pytest.raises(ConfigurationError, match="no model left"):

        @guards.route(model="default:")
        async def route(ai: AI[str]) -> str:
            return await ai.run({"prompt": "x"})


def test_default_attempt_budget_is_chain_length_plus_one_retry(fake_ai: Any, app_client: AppClient) -> None:
    guards = Guards(fake_ai, providers={"backup": fake_ai})
    seen: list[int] = []
    app = FastAPI()
    guards.install(app)

    @app.get("/x")
    @guards.route(model="@cf/a", fallbacks=("@cf/b", "backup:@cf/c"), retry=Retry(attempts=3))
    async def route(ai: AI[str]) -> str:
        seen.append(ai.attempt_budget)
        return await ai.run({"prompt": "x"})

    assert app_client(app).get("/x").status_code == 200
    assert seen == [5]  # 3 models + 2 retries in total


@pytest.mark.parametrize(
    ("mode", "headers"),
    [
        ("detailed", {"x-ai-model", "x-ai-fallback", "x-trace-id", "x-service-level"}),
        ("redacted", {"x-ai-fallback", "x-trace-id", "x-service-level"}),
        ("off", {"x-trace-id", "x-service-level"}),
    ],
)
def test_openapi_documents_the_attribution_headers(fake_ai: Any, mode: Any, headers: set[str]) -> None:
    guards = Guards(fake_ai, attribution=mode)
    app = FastAPI()
    guards.install(app)

    @app.post("/x")
    @guards.route(model="@cf/a", fallbacks=("@cf/b",))
    async def route(ai: AI[str]) -> str:
        return await ai.run({"prompt": "x"})

    documented = app.openapi()["paths"]["/x"]["post"]["responses"]["200"]["headers"]
    assert set(documented) == headers


def test_the_attempt_budget_is_per_request_across_calls(fake_ai: Any, app_client: AppClient) -> None:
    """A handler that calls the model again after a failure shares the request's budget: once
    it is spent, the next call fails at once, without a provider call."""
    guards = Guards(fake_ai, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    seen: list[str] = []

    @app.get("/twice")
    @guards.route(model="@cf/a", breaker=None)
    async def twice(ai: AI[str]) -> str:
        for _ in range(2):
            try:
                return await ai.run({"prompt": "x"})
            except GuardTripped as tripped:
                seen.append(tripped.detail)
        return "gave up"

    fake_ai.script("@cf/a", Fail(code=3040, status=429), Fail(code=3040, status=429), Reply("late"))
    assert app_client(app).get("/twice").json() == "gave up"
    assert len(fake_ai.calls) == 2  # the budget: one model, one retry
    assert seen[1] == "the request's attempt budget of 2 provider calls is spent"
