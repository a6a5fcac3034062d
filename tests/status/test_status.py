"""The status page of the example app (in process through ASGI; two worker processes where they
share a store), against the fake Workers AI server. Content negotiation (JSON for machines, HTML
for browsers, 406 for neither), the JSON shape (the OpenAPI schema's), the operator token (401 with
`WWW-Authenticate: Bearer` without it or with a wrong one, 200 with it; a browser gets the page
that asks for it), each model's breaker, cooldown and last failure kind after real failures, shared
across two workers on one store, the per-route rates, today's spend against the spend caps on an
app with prices, and canaries: no budget key, user id, prompt, answer, provider message or the
token itself, in JSON or HTML."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI

from app.service import create_app
from app.settings import Settings, SettingsError, load_settings
from fixtures import Fail, FakeBinding, FakeWorkersAI, Reply
from guards import AI, Breaker, Budget, ConfigurationError, Guards, Price, bearer_token
from guards.stores import MemoryStore, RedisStore, SQLiteStore

from ..conftest import AppClient, LogLines, no_sleep, wait_until, workers_ai_settings
from ..e2e.served import ServedApp
from ..e2e.test_shared_state import app_process_env

A = "@cf/test/a"
B = "@cf/test/b"
TOKEN = "status-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "accept": "application/json"}
HTML = {**AUTH, "accept": "text/html"}
#: What Chromium sends for a page it navigates to.
BROWSER_ACCEPT = (
    "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,image/apng,"
    "*/*;q=0.8,application/signed-exchange;v=b3;q=0.7"
)
RESET_S = 30.0
#: Breaks `A` for good: every call to it fails as unavailable (a 5xx).
DOWN = Fail(status=500)


def settings_for(fake: FakeWorkersAI, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "ai_model": A,
        "ai_fallback_models": B,
        "breaker_failure_threshold": 1,
        "breaker_reset_s": RESET_S,
        "status_token": TOKEN,
    }
    return workers_ai_settings(fake, **{**values, **overrides})


def status(client: httpx.Client) -> dict[str, Any]:
    answer = client.get("/status", headers=JSON)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    body: dict[str, Any] = answer.json()
    return body


def model(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(m for m in report["models"] if m["model"] == name)
    return found


def route(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(r for r in report["routes"] if r["route"] == name)
    return found


def draft(client: httpx.Client, message: str = "Where is my parcel?", **headers: str) -> httpx.Response:
    return client.post("/draft-reply", json={"message": message}, headers=headers)


# --- the operator token ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong-token-0123456789abcdef",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Basic {TOKEN}",
        TOKEN,
        "Bearer",
    ],
)
def test_without_the_token_the_page_answers_401(
    authorization: str | None, fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(create_app(settings_for(fake_workers_ai), sleep=no_sleep))
    headers = {} if authorization is None else {"authorization": authorization}
    for accept in ("application/json", None):
        answer = client.get("/status", headers={**headers, **({"accept": accept} if accept else {})})
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"] == "Bearer"
        assert answer.headers["cache-control"] == "no-store"
        assert answer.json() == {"detail": "a valid operator token is required"}
    # A browser gets the page that asks for the token, still a 401, and nothing of the status.
    page = client.get("/status", headers={**headers, "accept": BROWSER_ACCEPT})
    assert page.status_code == 401
    assert page.headers["www-authenticate"] == "Bearer"
    assert page.headers["content-type"].startswith("text/html")
    assert 'id="sign-in"' in page.text
    assert A not in page.text
    assert "draft_reply" not in page.text
    refused = "That token was refused." in page.text
    assert refused == (authorization is not None and authorization.startswith("Bearer "))


def test_with_the_token_the_page_answers(fake_workers_ai: FakeWorkersAI, app_client: AppClient) -> None:
    client = app_client(create_app(settings_for(fake_workers_ai), sleep=no_sleep))
    assert client.get("/status", headers=AUTH).status_code == 200
    # Other routes never ask for it.
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_without_a_status_token_the_page_is_open(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(create_app(settings_for(fake_workers_ai, status_token=""), sleep=no_sleep))
    answer = client.get("/status")
    assert answer.status_code == 200
    assert answer.json()["level"] == "full"


@pytest.mark.parametrize("token", ["short", "has space in it 0123456789", "é" * 20, "x" * 257])
def test_a_status_token_that_is_too_weak_or_not_a_bearer_token_is_refused(
    token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STATUS_TOKEN", token)
    with pytest.raises(SettingsError) as raised:
        load_settings()
    assert "STATUS_TOKEN" in str(raised.value)
    assert token not in str(raised.value)  # a secret, even a bad one, is never echoed


def test_an_empty_token_or_a_bad_path_is_a_configuration_error() -> None:
    guards = Guards(FakeBinding())
    with pytest.raises(ConfigurationError):
        guards.status_router(token="")
    with pytest.raises(ConfigurationError):
        guards.status_router(path="status")
    with pytest.raises(ConfigurationError):
        guards.status_router(refresh_s=0.5)
    with pytest.raises(ConfigurationError):
        guards.status_router(window_s=0)


# --- content negotiation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "answer"),
    [
        (None, "json"),
        ("*/*", "json"),
        ("application/json", "json"),
        ("application/*", "json"),
        ("text/html", "html"),
        (BROWSER_ACCEPT, "html"),
        ("text/html;q=0.5, application/json", "json"),
        ("application/json;q=0.5, text/html", "html"),
        ("text/html, application/json", "json"),  # a tie: machines first
        ("application/json;q=0, */*", "html"),
        ("text/*", "html"),
        ("image/png", 406),
        ("text/html;q=0, application/json;q=0", 406),
        ("text/html;q=nonsense", 406),
        ("," * 10_000 + "application/json", 406),  # read up to a bound: nothing acceptable in it
    ],
)
def test_the_answer_follows_accept(
    accept: str | None,
    answer: str | int,
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
) -> None:
    client = app_client(create_app(settings_for(fake_workers_ai), sleep=no_sleep))
    headers = {**AUTH, **({"accept": accept} if accept is not None else {})}
    if accept is None:
        headers["accept"] = ""  # httpx sends */* unless told otherwise; an empty header: none
    got = client.get("/status", headers=headers)
    assert "Accept" in got.headers["vary"]
    assert got.headers["cache-control"] == "no-store"
    if answer == 406:
        assert got.status_code == 406
        assert got.json() == {"detail": "ask for application/json or text/html"}
    elif answer == "json":
        assert got.status_code == 200
        assert got.headers["content-type"] == "application/json"
        assert got.json()["level"] == "full"
    else:
        assert got.status_code == 200
        assert got.headers["content-type"] == "text/html; charset=utf-8"
        assert got.text.startswith("<!doctype html>")


def test_the_html_is_one_self_contained_page(fake_workers_ai: FakeWorkersAI, app_client: AppClient) -> None:
    client = app_client(create_app(settings_for(fake_workers_ai), sleep=no_sleep))
    page = client.get("/status", headers=HTML)
    text = page.text
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in text
    # Nothing loaded from anywhere: no src, no href, no url(), no @import.
    assert not re.search(r"\b(src|href)\s*=|url\(|@import", text)
    assert text.count("<script>") == 1
    # The browser runs only that script (by its hash), and it may call only this app.
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp
    assert "connect-src 'self'" in csp
    script = re.search(r"<script>(.*)</script>", text, re.S)
    assert script is not None
    digest = base64.b64encode(hashlib.sha256(script.group(1).encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp
    # Without scripts, the page still reloads itself.
    assert '<noscript><meta http-equiv="refresh" content="5"></noscript>' in text
    assert '<main data-refresh="5">' in text


# --- what it shows ------------------------------------------------------------------------------


def test_the_json_has_the_documented_shape(fake_workers_ai: FakeWorkersAI, app_client: AppClient) -> None:
    app = create_app(settings_for(fake_workers_ai), sleep=no_sleep)
    client = app_client(app)
    report = status(client)
    assert set(report) == {
        "level",
        "time",
        "store",
        "store_resets",
        "refresh_s",
        "models",
        "routes",
        "recent",
        "today",
        "budgets",
    }
    assert report["level"] == "full"
    assert report["store"] == "ok"
    assert report["refresh_s"] == 5.0
    assert [m["model"] for m in report["models"]] == [A, B]
    assert set(report["models"][0]) == {
        "model",
        "down",
        "down_for_s",
        "breaker",
        "breaker_wait_s",
        "cooldown_s",
        "last_failure",
        "calls",
        "failures",
        "cost_usd_today",
        "price",
        "latency",
    }
    assert set(report["models"][0]["latency"]) == {
        "first_outputs",
        "answers",
        "first_output_p50_s",
        "first_output_p95_s",
        "answer_p50_s",
        "answer_p95_s",
        "trend",
    }
    assert [r["route"] for r in report["routes"]] == [
        "draft_reply",
        "draft_reply_stream",
        "chat",
        "summary",
        "report",
    ]
    assert set(report["routes"][0]) == {
        "route",
        "requests",
        "per_minute",
        "outcomes",
        "error_rate",
        "fallback_rate",
        "fallback_model_rate",
        "trips",
        "cost_usd_today",
        "spend_cap",
    }
    assert report["recent"]["seconds"] <= 300
    assert set(report["today"]) == {"day", "since", "cost_usd", "counts", "worker"}
    assert set(report["budgets"][0]) == {
        "scope",
        "routes",
        "limits",
        "soft_limit",
        "spent_usd_today",
        "tokens_today",
    }
    assert report["recent"]["counts"] == report["today"]["counts"] == "this_worker"
    # The schema in the OpenAPI document is the answer's: every field it requires is there.
    schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/status"]["get"]
    assert operation["security"] == [{"HTTPBearer": []}]
    assert set(operation["responses"]) == {"200", "401", "406"}
    content = operation["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/html"}
    components = schema["components"]["schemas"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/StatusReport"}
    assert set(components["StatusReport"]["required"]) == set(report)
    assert set(components["ModelStatus"]["required"]) == set(report["models"][0])
    assert set(components["RouteStatus"]["required"]) == set(report["routes"][0])


def test_a_failing_model_shows_its_open_breaker_cooldown_and_last_failure_kind(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(create_app(settings_for(fake_workers_ai), sleep=no_sleep))
    fake_workers_ai.default = Reply("Thank you for your message.")
    # A is down for good: the first request falls back to B, and A's breaker opens.
    fake_workers_ai.script(A, *[DOWN] * 10)
    answered = draft(client)
    assert answered.status_code == 200
    assert answered.headers["x-ai-model"] == B
    # B is rate limited (a cooldown): the next request has no model left.
    fake_workers_ai.script(B, Fail(status=429, retry_after="20"))
    assert draft(client).status_code == 503
    report = status(client)
    a, b = model(report, A), model(report, B)
    assert a["down"] is True
    assert a["breaker"] == "open"
    assert 0 < a["breaker_wait_s"] <= RESET_S
    assert 0 < a["down_for_s"] <= RESET_S
    assert a["last_failure"]["kind"] == "model_temporarily_unavailable"
    assert a["calls"] >= 1
    assert a["failures"] == a["calls"]
    assert b["down"] is True, b
    assert 0 < b["cooldown_s"] <= 20, b
    assert b["last_failure"]["kind"] == "model_rate_limited"
    assert report["level"] == "minimal"
    draft_reply = route(report, "draft_reply")
    assert draft_reply["requests"] == 2
    assert draft_reply["outcomes"] == {"ok": 1, "fallback": 0, "error": 1, "cancelled": 0, "invalid": 0}
    assert draft_reply["error_rate"] == 0.5
    assert draft_reply["fallback_model_rate"] == 1.0  # its one answer came from B
    # The page shows the same, for people.
    page = client.get("/status", headers=HTML).text
    assert '<span id="level" class="pill level bad">minimal</span>' in page
    row = re.search(rf'<tr data-model="{re.escape(A)}">.*?</tr>', page, re.S)
    assert row is not None
    assert "open" in row.group(0)
    assert "model_temporarily_unavailable" in row.group(0)


def test_the_degrading_route_shows_its_fallbacks(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(create_app(settings_for(fake_workers_ai, ai_fallback_models=""), sleep=no_sleep))
    fake_workers_ai.script(A, *[DOWN] * 10)
    answer = client.post("/summary", json={"text": "refund please"}, headers={"x-user-id": "ada"})
    assert answer.json()["fallback"] is not None
    summary = route(status(client), "summary")
    assert summary["outcomes"]["fallback"] == 1
    assert summary["fallback_rate"] == 1.0
    assert summary["trips"] == [{"guard": "call", "reason": "provider_error", "count": 1}]


def test_two_workers_on_one_store_show_the_same_breakers(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, tmp_path: Path
) -> None:
    settings = settings_for(fake_workers_ai)
    first, second = (
        app_client(create_app(settings, sleep=no_sleep, store=SQLiteStore(tmp_path / "guards.db")))
        for _ in range(2)
    )
    fake_workers_ai.default = Reply("Thank you for your message.")
    fake_workers_ai.script(A, *[DOWN] * 10)
    assert draft(first).headers["x-ai-model"] == B
    # The second worker made no call, yet shows A's breaker open: it lives in the store.
    for worker in (first, second):
        shown = model(status(worker), A)
        assert shown["breaker"] == "open"
        assert shown["down"] is True
        assert status(worker)["level"] == "degraded"


def test_a_price_with_cache_rates_and_a_long_context_tier_is_shown_whole(
    fake_ai: FakeBinding, app_client: AppClient
) -> None:
    tier = Price(input_token=4, output_token=8, cached_input_token=1)
    priced = Price(
        input_token=2,
        output_token=4,
        cached_input_token=0.5,
        cache_write_token=2.5,
        long_context_above=200_000,
        long_context=tier,
    )
    guards = Guards(fake_ai, store=MemoryStore(), sleep=no_sleep, prices={A: priced}, cost_unit_usd=0.0001)
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router())

    @app.post("/ask")
    @guards.route(model=A)
    async def ask(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    client = app_client(app)
    assert client.post("/ask").status_code == 200
    assert model(status(client), A)["price"] == {
        "input_usd_per_mtok": pytest.approx(200.0),
        "output_usd_per_mtok": pytest.approx(400.0),
        "call_usd": 0.0,
        "cached_input_usd_per_mtok": pytest.approx(50.0),
        "cache_write_usd_per_mtok": pytest.approx(250.0),
        "long_context_above_tokens": 200_000,
        "long_context": {
            "input_usd_per_mtok": pytest.approx(400.0),
            "output_usd_per_mtok": pytest.approx(800.0),
            "call_usd": 0.0,
            "cached_input_usd_per_mtok": pytest.approx(100.0),
            "cache_write_usd_per_mtok": None,
            "long_context_above_tokens": None,
            "long_context": None,
        },
    }


def test_spend_today_and_the_caps_of_an_app_with_prices(fake_ai: FakeBinding, app_client: AppClient) -> None:
    guards = Guards(
        fake_ai,
        store=MemoryStore(),
        sleep=no_sleep,
        prices={A: Price(input_token=2, output_token=4, call=100)},
        cost_unit_usd=0.0001,  # prices in hundredths of a cent
    )
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router())

    @app.post("/ask")
    @guards.route(model=A, max_tokens=50, budget=Budget(spend_per_day=5000))
    async def ask(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    client = app_client(app)
    fake_ai.default = Reply("hi", usage={"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110})
    for _ in range(3):
        assert client.post("/ask").status_code == 200
    report = status(client)
    cost = 3 * (100 + 100 * 2 + 10 * 4) * 0.0001  # three calls: $0.102
    assert model(report, A)["cost_usd_today"] == pytest.approx(cost)
    assert model(report, A)["price"] == {
        "input_usd_per_mtok": pytest.approx(200.0),
        "output_usd_per_mtok": pytest.approx(400.0),
        "call_usd": pytest.approx(0.01),
        "cached_input_usd_per_mtok": None,
        "cache_write_usd_per_mtok": None,
        "long_context_above_tokens": None,
        "long_context": None,
    }
    ask_route = route(report, "ask")
    assert ask_route["cost_usd_today"] == pytest.approx(cost)
    assert ask_route["spend_cap"] == {"usd_per_key_per_day": pytest.approx(0.5), "scope": "ask"}
    assert report["today"]["cost_usd"] == pytest.approx(cost)
    page = client.get("/status", headers={"accept": "text/html"}).text
    assert "$0.1020" in page
    assert "$0.5000" in page


def test_the_budgets_are_shown_per_scope_with_what_every_key_settled_today(
    fake_ai: FakeBinding, app_client: AppClient
) -> None:
    guards = Guards(
        fake_ai, store=MemoryStore(), sleep=no_sleep, prices={A: Price(call=100)}, cost_unit_usd=0.0001
    )
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router())
    users = Budget(per_day=10, spend_per_day=5000, key=lambda request: request.headers["x-user-id"])
    tenants = Budget(
        tokens_per_day=1000,
        soft_limit=0.5,
        key=lambda request: request.headers["x-tenant-id"],
        scope="tenant",
    )

    @app.post("/ask")
    @guards.route(model=A, max_tokens=50, budget=[users, tenants])
    async def ask(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    @app.post("/other")
    @guards.route(model=A, max_tokens=50, budget=Budget(per_minute=5, scope="tenant"))
    async def other(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    client = app_client(app)
    fake_ai.default = Reply("hi", usage={"prompt_tokens": 10, "completion_tokens": 5})
    for who in (USER, KEY):
        assert client.post("/ask", headers={"x-user-id": who, "x-tenant-id": who}).status_code == 200
    report = status(client)
    assert report["budgets"] == [
        {
            "scope": "ask",
            "routes": ["ask"],
            "limits": {"per_day": 10, "spend_per_day": pytest.approx(0.5)},
            "soft_limit": None,
            "spent_usd_today": pytest.approx(2 * 100 * 0.0001),
            "tokens_today": 0,
        },
        {
            "scope": "tenant",
            "routes": ["ask", "other"],  # the first route's budget of the scope
            "limits": {"tokens_per_day": 1000},
            "soft_limit": 0.5,
            "spent_usd_today": 0.0,
            "tokens_today": 2 * 15,
        },
    ]
    page = client.get("/status", headers=HTML).text
    assert "tokens_per_day 1,000 · soft at 50%" in page
    assert "per_day 10 · spend_per_day $0.5000" in page
    for text in (page, json.dumps(report)):
        assert USER not in text
        assert KEY not in text


# --- privacy --------------------------------------------------------------------------------------

USER = "CANARY-USER-91b2c4"
PROMPT = "CANARY-PROMPT-77ad01"
PROVIDER = "CANARY-PROVIDER-5c0d11"
REPLY = "CANARY-REPLY-3e8f20"
KEY = "CANARY-KEY-a1b2c3"


def test_the_page_never_shows_a_key_a_user_a_prompt_an_answer_a_provider_message_or_the_token(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(create_app(settings_for(fake_workers_ai, daily_call_limit=1000), sleep=no_sleep))
    fake_workers_ai.default = Reply(f"{REPLY} thanks")
    fake_workers_ai.script(
        A,
        Fail(status=500, message=f"AiError: {PROVIDER} {PROMPT}"),
        Fail(code=5035, status=403, message=f"AiError: {PROVIDER} needs a paid plan"),
    )
    draft(client, f"{PROMPT} where is it", **{"x-user-id": USER})
    fake_workers_ai.script(B, Fail(code=3036, status=429, message=f"{PROVIDER} {USER}", shape="aierror"))
    client.post("/summary", json={"text": f"{PROMPT} refund"}, headers={"x-user-id": USER})
    client.post("/summary", json={"text": f"{PROMPT} refund"}, headers={"x-user-id": KEY})
    client.post("/draft-reply", json={"message": PROMPT, "tone": PROMPT}, headers={"x-user-id": USER})
    answers = [
        client.get("/status", headers=JSON).text,
        client.get("/status", headers=HTML).text,
        json.dumps(status(client)),
        client.get("/status", headers={"accept": "text/html"}).text,  # the sign-in page
        client.get("/status", headers={"accept": "text/html", "authorization": f"Bearer {USER}xxxxxxx"}).text,
    ]
    assert model(status(client), A)["last_failure"] is not None  # the failures did happen
    for text in answers:
        for canary in (USER, PROMPT, PROVIDER, REPLY, KEY, TOKEN, "paid plan", "AiError"):
            assert canary not in text, canary


# --- several workers ------------------------------------------------------------------------------


def test_every_worker_shows_the_totals_of_all_in_multiprocess_mode(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path
) -> None:
    """Two worker processes (`python -m guards.serve --workers 2`) with PROMETHEUS_MULTIPROC_DIR
    and one SQLite store, as `make run WORKERS=2` serves: whichever worker answers `/status`
    shows the requests both served, and the breaker both share."""
    metrics = tmp_path / "prometheus"
    metrics.mkdir()
    env = app_process_env(
        fake_workers_ai,
        f"sqlite:///{tmp_path / 'guards.db'}",
        AI_MODEL=A,
        AI_FALLBACK_MODELS=B,
        BREAKER_FAILURE_THRESHOLD="1",
        BREAKER_RESET_S=str(RESET_S),
        STATUS_TOKEN=TOKEN,
        PROMETHEUS_MULTIPROC_DIR=str(metrics),
    )
    fake_workers_ai.default = Reply("Thank you for your message.")
    fake_workers_ai.script(A, *[DOWN] * 10)
    requests = 12
    with ServedApp(tmp_path / "log", "app.main:app", "--workers", "2", env=env) as served:
        served.wait_started(2)
        workers = set(served.started_pids())
        # A new connection per request: the kernel spreads them over both workers.
        fresh = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=served.url, limits=fresh, timeout=10) as client:
            served_by = set()
            for _ in range(requests):
                answered = draft(client)
                assert answered.status_code == 200
                served_by.add(answered.headers["x-ai-model"])
            assert served_by == {B}  # A failed once, then its breaker kept it out

            seen: dict[int, dict[str, Any]] = {}

            def both_workers_show_the_totals() -> bool:
                report = status(client)
                if route(report, "draft_reply")["requests"] == requests:
                    seen[report["recent"]["worker"]] = report
                return set(seen) == workers

            # Each worker's counts reach the files within a second (FLUSH_INTERVAL_S).
            wait_until(both_workers_show_the_totals, timeout_s=20)
    for report in seen.values():
        assert report["recent"]["counts"] == "all_workers"
        assert route(report, "draft_reply")["fallback_model_rate"] == 1.0
        assert model(report, A)["breaker"] == "open"
        assert model(report, B)["calls"] == requests
        # The latency histograms are summed over the workers' files too.
        assert model(report, B)["latency"]["answers"] == requests


def test_bearer_token_guards_a_route_of_your_own(app_client: AppClient) -> None:
    app = FastAPI()

    @app.get("/ops", dependencies=[Depends(bearer_token(TOKEN))])
    async def ops() -> dict[str, bool]:
        return {"ok": True}

    client = app_client(app)
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {TOKEN}"}):
        refused = client.get("/ops", headers=headers)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
    assert client.get("/ops", headers=AUTH).json() == {"ok": True}
    with pytest.raises(ConfigurationError):
        bearer_token("")


def test_without_the_store_the_page_says_so_and_shows_no_breakers(
    fake_ai: FakeBinding, app_client: AppClient, guards_log: LogLines
) -> None:
    """A store that does not answer (Redis on a port nobody listens on): the page still
    answers, with `store: unavailable`, the worker's last level and no breaker or cooldown."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    guards = Guards(fake_ai, store=RedisStore(f"redis://127.0.0.1:{port}", timeout_s=0.2), sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router())

    @app.post("/ask")
    @guards.route(model=A, breaker=Breaker())
    async def ask(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    report = status(app_client(app))
    assert report["store"] == "unavailable"
    assert report["level"] == "full"
    [shown] = report["models"]
    assert (shown["model"], shown["down"], shown["breaker"], shown["cooldown_s"]) == (A, False, None, None)
    assert any(
        line["guard"] == "status" and line["op"] == "health"
        for line in guards_log.events("store_unavailable")
    )
    page = app_client(app).get("/status", headers={"accept": "text/html"}).text
    assert "store unavailable" in page
