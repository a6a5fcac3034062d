"""Routing hints: `hint:name` chain entries resolved at start-up (to a model, at any provider, or
to a profile), the unknown hint (logged, kept as the literal model, reported as requested), and
attribution of the entry as written, through the example app against the fake
providers, across the memory, SQLite and Redis stores."""

from __future__ import annotations

import functools
from collections.abc import Callable

import httpx
import pytest

from app.settings import Settings, SettingsError, load_settings
from fixtures import Fail, FakeOpenAI, FakeWorkersAI, ManualClock, Reply
from guards import ConfigurationError, Guards, ModelRef, Profile, flatten_chain
from guards.providers import WorkersAI
from guards.stores import Store

from ..conftest import ExampleClient, LogLines, assert_error

PRIMARY = "@cf/test/model"
BACKUP = "@cf/test/backup"


# --- flattening ------------------------------------------------------------------------------


def test_a_hint_resolves_to_its_target_and_remembers_it() -> None:
    chain = flatten_chain(["hint:fast", "@cf/a"], providers={"openai"}, hints={"fast": "openai:gpt-4o-mini"})
    assert chain.models == (ModelRef("openai", "gpt-4o-mini"), ModelRef(None, "@cf/a"))
    assert chain.problems == ()
    assert [(ref.hint, ref.entry) for ref in chain.models] == [
        ("fast", "hint:fast"),
        (None, "@cf/a"),
    ]


def test_a_hint_may_name_a_profile_with_its_fallbacks() -> None:
    profiles = {"cheap": Profile(model="@cf/small", fallbacks=("tiny",)), "tiny": Profile(model="@cf/tiny")}
    chain = flatten_chain(["@cf/big", "hint:budget"], profiles=profiles, hints={"budget": "cheap"})
    assert [ref.key for ref in chain.models] == ["@cf/big", "@cf/small", "@cf/tiny"]
    assert [ref.entry for ref in chain.models] == ["@cf/big", "hint:budget", "hint:budget"]


def test_an_unknown_hint_is_reported_and_kept_as_the_literal_model() -> None:
    chain = flatten_chain(["hint:nope", "@cf/a", "hint:nope"], hints={"fast": "@cf/fast"})
    assert chain.models == (ModelRef(None, "hint:nope"), ModelRef(None, "@cf/a"))
    assert chain.problems == (
        "entry 'hint:nope': unknown hint",
        "entry 'hint:nope': unknown hint",
        "entry 'hint:nope': duplicate model 'hint:nope' removed",
    )


def test_a_hint_and_the_same_model_written_plainly_are_one_model() -> None:
    chain = flatten_chain(["@cf/a", "hint:a"], hints={"a": "@cf/a"})
    assert [ref.key for ref in chain.models] == ["@cf/a"]
    assert chain.problems == ("entry '@cf/a': duplicate model '@cf/a' removed",)


@pytest.mark.parametrize(
    ("hints", "providers", "message"),
    [
        ({"has space": "@cf/a"}, {}, "hint name 'has space'"),
        ({"fast": " "}, {}, "hint 'fast' names no model"),
        ({"fast": "hint:slow", "slow": "@cf/a"}, {}, "names another hint"),
        ({}, {"hint": "binding"}, "starts routing hints"),
    ],
)
def test_bad_hints_fail_start_up(hints: dict[str, str], providers: dict[str, str], message: str) -> None:
    binding = WorkersAI(account_id="a", api_token="t")
    with pytest.raises(ConfigurationError, match=message):
        Guards(binding, hints=hints, providers={name: binding for name in providers})


# --- the example app over HTTP ---------------------------------------------------------------


@pytest.fixture
def make_client(
    example_client: ExampleClient, fake_openai: FakeOpenAI, store: Store, clock: ManualClock
) -> ExampleClient:
    return functools.partial(
        example_client,
        store=store,
        clock=clock,
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key,
    )


def test_ai_model_names_a_hint_at_another_provider(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    client = make_client(
        ai_hints="fast=openai:gpt-4o-mini, local=@cf/meta/llama-3.1-8b-instruct", ai_model="hint:fast"
    )
    fake_openai.script("gpt-4o-mini", Reply("On its way.", model="gpt-4o-mini-2024-07-18"))
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert response.status_code == 200, response.text
    assert response.headers["x-ai-model"] == "gpt-4o-mini-2024-07-18"
    assert [call.model for call in fake_openai.calls] == ["gpt-4o-mini"]
    assert fake_workers_ai.calls == []


def test_a_fallback_hint_is_attributed_as_written(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, guards_log: LogLines
) -> None:
    client = make_client(ai_hints=f"backup={BACKUP}", ai_fallback_models="hint:backup")
    fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
    fake_workers_ai.script(BACKUP, Reply("On its way."))
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert response.status_code == 200, response.text
    assert response.headers["x-ai-model"] == BACKUP  # the model the hint resolved to
    assert response.headers["x-ai-fallback"] == "hint:backup"  # the chain entry as written
    assert [call.model for call in fake_workers_ai.calls] == [PRIMARY, BACKUP]
    ledger = [(a["model"], a.get("entry")) for a in guards_log.events("attempt")]
    assert ledger == [(PRIMARY, None), (BACKUP, "hint:backup")]  # entry: only when it differs


def test_the_breaker_applies_to_the_resolved_model(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI
) -> None:
    """A hint resolves before the target's own reliability policy: the breaker of the model is
    the same whether the chain names it by hint or by id."""
    client = make_client(ai_hints=f"main={PRIMARY}", ai_model="hint:main", breaker_failure_threshold=2)
    fake_workers_ai.default = Fail(code=5035, status=403)
    for _ in range(2):
        assert_error(client.post("/draft-reply", json={"message": "Hi"}), 502, "model_incompatible", False)
    response = client.post("/draft-reply", json={"message": "Hi"})
    assert_error(response, 503, "circuit_open", True)
    assert len(fake_workers_ai.calls) == 2


def test_an_unknown_hint_is_logged_called_literally_and_reported_as_requested(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, guards_log: LogLines
) -> None:
    client = make_client(ai_model="hint:nope")
    warnings = [e for e in guards_log.events("chain_invalid") if e["route"] == "draft_reply"]
    assert [e["problem"] for e in warnings] == ["entry 'hint:nope': unknown hint"]
    # The provider rejects the literal id, and the usual classification follows.
    fake_workers_ai.script("hint:nope", Fail(code=5007, status=400))
    response = client.post("/draft-reply", json={"message": "Where is my parcel?"})
    assert_error(response, 502, "model_incompatible", False)
    assert [call.model for call in fake_workers_ai.calls] == ["hint:nope"]
    # Its only call is on the request's line (no `attempt` line for a request's only call).
    assert guards_log.events("attempt") == []
    request = guards_log.events("request")[-1]
    assert (request["model"], request["attempts"], request["provider_status"]) == ("hint:nope", 1, 400)


def test_ai_hints_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_HINTS", "fast")
    with pytest.raises(SettingsError, match="AI_HINTS: each entry is name=model"):
        load_settings()
    monkeypatch.setenv("AI_HINTS", "fast=openai:gpt-4o-mini")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(SettingsError, match="AI_HINTS uses openai, which needs OPENAI_API_KEY"):
        load_settings()


def test_local_and_cloud_hints_default_and_yield_to_their_settings() -> None:
    assert Settings().hints == {
        "local": "@cf/meta/llama-3.1-8b-instruct",
        "cloud": "@cf/meta/llama-3.3-70b-instruct-fp8-fast",
    }
    assert Settings(ai_hints="local=@cf/a, fast=@cf/b").hints == {
        "local": "@cf/a",
        "cloud": "@cf/meta/llama-3.3-70b-instruct-fp8-fast",
        "fast": "@cf/b",
    }
    assert Settings(ai_hints="local=@cf/a", ai_local_model="@cf/c").hints["local"] == "@cf/c"
