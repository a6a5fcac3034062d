"""Deployments of one model over real HTTP: a group (`guards.Deployments`) of two deployments,
each a provider of its own (two fake Workers AI servers, or one under both names), in process
(ASGI): spread by weight, skipped behind an open breaker or at their `rpm` (exactly, across two
apps sharing one store: memory, SQLite, Redis, Redis Cluster) and `tpm` (settled to the usage),
failed over within the group before the chain moves on, balanced by the least busy and the
lowest latency, and named in the answer's header, its log line, the ledger and the status page."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import Fail, FakeWorkersAI, Reply
from guards import (
    AI,
    Attempt,
    Breaker,
    ConfigurationError,
    Deployment,
    Deployments,
    Guards,
    Ledger,
    Profile,
    flatten_chain,
)
from guards.providers import WorkersAI
from guards.stores import MemoryStore, RedisStore, SQLiteStore, Store

from ..conftest import STORE_TIMEOUT_S, LogLines, no_sleep

EAST = "@cf/test/east"
WEST = "@cf/test/west"
BACKUP = "@cf/test/backup"
ANSWER = Reply({"label": "shipping"})


class Label(BaseModel):
    label: str


class Ask(BaseModel):
    text: str


def binding(server: FakeWorkersAI) -> WorkersAI:
    return WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url)


@pytest.fixture
def west_server() -> Iterator[FakeWorkersAI]:
    with FakeWorkersAI() as server:
        yield server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def app_of(
    east: FakeWorkersAI,
    west: FakeWorkersAI,
    group: Deployments,
    *,
    store: Store | None = None,
    fallbacks: tuple[str, ...] = (),
    breaker: Breaker | None = Breaker(failure_threshold=1000),
    seed: int | None = 7,
    log_sample: float = 0.0,
    ledger: Ledger | None = None,
    **route: Any,
) -> tuple[FastAPI, Guards]:
    """An app whose `POST /label` calls `group` (deployment `east` at provider `east`, `west` at
    `west`), then `fallbacks` (main-binding models of `east`'s server), and its guards (close
    them: `async with`). Successes write no request line (`log_sample=0.0`): 2,000 of them
    would be kept by pytest's log capture."""
    guards = Guards(
        binding(east),
        providers={"east": binding(east), "west": binding(west)},
        store=store if store is not None else MemoryStore(),
        sleep=no_sleep,
        seed=seed,
        log_sample=log_sample,
        ledger=ledger,
    )
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router())

    @app.post("/label")
    @guards.route(model=group, fallbacks=fallbacks, breaker=breaker, timeout_s=5.0, **route)
    async def label(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run({"prompt": body.text})

    return app, guards


def group(name: str, *, strategy: Any = "weighted", east: dict[str, Any] | None = None) -> Deployments:
    """Deployments `east` (weight 3, `east`'s options) and `west` (weight 1) of one model."""
    return Deployments(
        name,
        [
            Deployment("east", provider="east", model=EAST, weight=3, **(east or {})),
            Deployment("west", provider="west", model=WEST),
        ],
        strategy=strategy,
    )


async def post_all(app: FastAPI, count: int, *, at_once: int = 50) -> list[httpx.Response]:
    """`count` requests to `POST /label`, `at_once` in flight at a time, in process (ASGI)."""
    responses: list[httpx.Response] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        for first in range(0, count, at_once):
            batch = [
                client.post("/label", json={"text": "where"}) for _ in range(min(at_once, count - first))
            ]
            responses.extend(await asyncio.gather(*batch))
    return responses


def served(responses: list[httpx.Response]) -> dict[str, int]:
    """How many answers each deployment served (every answer a 200)."""
    counts: dict[str, int] = {}
    for response in responses:
        assert response.status_code == 200, response.text
        deployment = response.headers["x-ai-deployment"]
        counts[deployment] = counts.get(deployment, 0) + 1
    return counts


@pytest.mark.anyio
async def test_traffic_spreads_by_weight_within_five_percent(fake_workers_ai: FakeWorkersAI) -> None:
    """2,000 requests, 50 at a time; one fake server under both providers (each deployment its
    own binding and model id there: one server thread less than two servers, a quarter faster)."""
    fake_workers_ai.default = ANSWER
    # No first-output limit: a loaded machine's slow answer must not move a request on.
    app, guards = app_of(fake_workers_ai, fake_workers_ai, group("spread"), first_output_s=None)
    async with guards:
        counts = served(await post_all(app, 2000))
    # 3:1 by weight: 75 % and 25 %, each within 5 points (the seed makes the count exact).
    assert abs(counts["spread/east"] / 2000 - 0.75) <= 0.05, counts
    assert abs(counts["spread/west"] / 2000 - 0.25) <= 0.05, counts
    called = [call.model for call in fake_workers_ai.calls]
    assert (called.count(EAST), called.count(WEST)) == (counts["spread/east"], counts["spread/west"])


@pytest.mark.anyio
async def test_the_same_seed_makes_the_same_choices(
    fake_workers_ai: FakeWorkersAI, west_server: FakeWorkersAI
) -> None:
    fake_workers_ai.default = west_server.default = ANSWER
    runs = []
    for _ in range(2):
        app, guards = app_of(fake_workers_ai, west_server, group("seeded"), seed=11)
        async with guards:
            runs.append([r.headers["x-ai-deployment"] for r in await post_all(app, 40, at_once=1)])
    assert runs[0] == runs[1]
    assert set(runs[0]) == {"seeded/east", "seeded/west"}


@pytest.mark.anyio
async def test_a_deployment_whose_breaker_is_open_gets_none(
    fake_workers_ai: FakeWorkersAI, west_server: FakeWorkersAI, guards_log: LogLines
) -> None:
    fake_workers_ai.default = Fail(code=5035, status=403)  # not retried, no cooldown
    west_server.default = ANSWER
    app, guards = app_of(
        fake_workers_ai,
        west_server,
        group("broken"),
        breaker=Breaker(failure_threshold=2, reset_timeout_s=60),
    )
    async with guards:
        first = await post_all(app, 20, at_once=1)
        assert served(first) == {"broken/west": 20}
        assert len(fake_workers_ai.calls) == 2, "east failed twice: its breaker opened"
        # A call that failed on east moved on to west: the same chain entry, no fallback.
        assert all("x-ai-fallback" not in response.headers for response in first)
        assert served(await post_all(app, 200)) == {"broken/west": 200}
    assert len(fake_workers_ai.calls) == 2, "an open breaker: no call"


@pytest.mark.anyio
async def test_a_group_whose_deployments_all_fail_moves_to_the_next_entry(
    fake_workers_ai: FakeWorkersAI, west_server: FakeWorkersAI
) -> None:
    fake_workers_ai.script(EAST, Fail(code=5035, status=403))
    west_server.script(WEST, Fail(code=5035, status=403))
    fake_workers_ai.script(BACKUP, ANSWER)
    app, guards = app_of(fake_workers_ai, west_server, group("down"), fallbacks=(BACKUP,))
    async with guards:
        (response,) = await post_all(app, 1)
    assert response.status_code == 200
    assert response.headers["x-ai-model"] == BACKUP
    assert response.headers["x-ai-fallback"] == BACKUP
    assert "x-ai-deployment" not in response.headers
    # Each deployment once (whichever first), then the next entry.
    assert [call.model for call in fake_workers_ai.calls] == [EAST, BACKUP]
    assert [call.model for call in west_server.calls] == [WEST]


async def rpm_across_two_apps(
    store_a: Store, store_b: Store, east: FakeWorkersAI, west: FakeWorkersAI
) -> None:
    """Two apps (two workers) on one store's state, east limited to 10 requests a minute: 60
    requests, half to each app, 20 at a time; east serves exactly 10, west the rest."""
    east.default = west.default = ANSWER
    limited = group("limited", east={"rpm": 10})
    (app_a, guards_a), (app_b, guards_b) = (
        app_of(east, west, limited, store=store_a, seed=1),
        app_of(east, west, limited, store=store_b, seed=2),
    )
    async with guards_a, guards_b:
        responses = []
        for _ in range(3):
            a, b = await asyncio.gather(post_all(app_a, 10, at_once=10), post_all(app_b, 10, at_once=10))
            responses += a + b
    assert served(responses) == {"limited/east": 10, "limited/west": 50}
    assert len(east.calls) == 10


@pytest.mark.anyio
async def test_a_deployment_at_its_rpm_is_skipped_exactly_across_two_workers(
    fake_workers_ai: FakeWorkersAI, west_server: FakeWorkersAI, guards_log: LogLines
) -> None:
    store = MemoryStore()
    await rpm_across_two_apps(store, store, fake_workers_ai, west_server)
    # Skipped, not failed: a skip per request that found east at its limit (each worker
    # remembers the refusal until the minute frees room, and skips without a store step).
    assert guards_log.skips().keys() == {("limited/east", "rate_limited")}


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "redis", "redis-cluster"])
async def test_a_deployment_at_its_rpm_is_skipped_exactly_across_two_workers_on_a_shared_store(
    fake_workers_ai: FakeWorkersAI,
    west_server: FakeWorkersAI,
    kind: str,
    tmp_path: Path,
    prefix: str,
    request: pytest.FixtureRequest,
) -> None:
    """Two stores on one state: two SQLite stores on one file, two Redis stores on one server
    (or one Redis Cluster) under one prefix."""
    stores: list[Store]
    if kind == "sqlite":
        stores = [SQLiteStore(tmp_path / "guards.db", timeout_s=STORE_TIMEOUT_S) for _ in range(2)]
    else:
        url = request.getfixturevalue("redis_cluster" if kind == "redis-cluster" else "redis_url")
        url = url if isinstance(url, str) else url.url
        stores = [RedisStore(url, prefix=prefix, timeout_s=STORE_TIMEOUT_S) for _ in range(2)]
    try:
        await rpm_across_two_apps(stores[0], stores[1], fake_workers_ai, west_server)
    finally:
        for store in stores:
            await store.aclose()


@pytest.mark.anyio
async def test_least_busy_sends_a_call_to_the_deployment_with_fewer_in_flight(
    fake_workers_ai: FakeWorkersAI, west_server: FakeWorkersAI
) -> None:
    """Ten calls at once, each answered after 0.3 s: each goes where fewer are in flight, so
    five and five (weighted random would send about three in four to east)."""
    fake_workers_ai.default = west_server.default = Reply({"label": "shipping"}, delay_s=0.3)
    app, guards = app_of(fake_workers_ai, west_server, group("busy", strategy="least_busy"))
    async with guards:
        assert served(await post_all(app, 10, at_once=10)) == {"busy/east": 5, "busy/west": 5}
        # Nothing in flight: a tie again, broken by weight.
        fake_workers_ai.default = west_server.default = ANSWER
        spread = served(await post_all(app, 40, at_once=1))
    assert spread["busy/east"] > spread["busy/west"]


@pytest.mark.anyio
async def test_lowest_latency_tries_each_deployment_then_keeps_the_fastest(
    fake_workers_ai: FakeWorkersAI, west_server: FakeWorkersAI
) -> None:
    """East answers in 0.2 s, west at once: one request each while untried (east first or
    second), then west alone, by its lower median time to first output."""
    fake_workers_ai.default = Reply({"label": "shipping"}, delay_s=0.2)
    west_server.default = ANSWER
    app, guards = app_of(fake_workers_ai, west_server, group("fastest", strategy="lowest_latency"))
    async with guards:
        order = [r.headers["x-ai-deployment"] for r in await post_all(app, 12, at_once=1)]
    assert sorted(order[:2]) == ["fastest/east", "fastest/west"]
    assert order[2:] == ["fastest/west"] * 10


class Recorder:
    """A ledger that keeps every record."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)


@pytest.mark.anyio
async def test_the_answer_says_which_deployment_served_and_the_status_page_shows_each(
    fake_workers_ai: FakeWorkersAI, west_server: FakeWorkersAI, guards_log: LogLines
) -> None:
    """East fails once, west answers: the header, the request line, the ledger and the metrics
    (read through the status page) name the deployment (`group/name`); `/status` shows each
    deployment as a model, with its calls, failures and latency."""
    fake_workers_ai.script(EAST, Fail(code=5035, status=403))
    west_server.default = ANSWER
    ledger = Recorder()
    shown = Deployments(
        "shown",
        [
            Deployment("east", provider="east", model=EAST, weight=1_000),
            Deployment("west", provider="west", model=WEST),
        ],
    )
    app, guards = app_of(fake_workers_ai, west_server, shown, log_sample=1.0, ledger=ledger)
    async with (
        guards,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client,
    ):
        assert (await client.get("/status")).status_code == 200  # its counts start here
        (response,) = await post_all(app, 1)
        report = (await client.get("/status")).json()
    assert response.status_code == 200
    assert response.headers["x-ai-deployment"] == "shown/west"
    assert response.headers["x-ai-model"] == WEST
    assert "x-ai-fallback" not in response.headers  # the first entry's group served
    (line,) = guards_log.events("request")
    assert line["deployment"] == "shown/west"
    assert [(a.requested_model, a.model, a.outcome) for a in ledger.attempts] == [
        ("shown/east", "shown/east", "model_incompatible"),
        ("shown/east", "shown/west", "ok"),
    ]
    # The page's calls are `guards_model_attempts_total` by its `model` label.
    models = {entry["model"]: entry for entry in report["models"]}
    assert models["shown/east"]["calls"] == models["shown/west"]["calls"] == 1
    assert models["shown/east"]["failures"] == 1
    assert models["shown/west"]["latency"]["first_outputs"] == 1


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_deployments_tpm_holds_the_estimate_and_settles_to_the_usage(
    fake_workers_ai: FakeWorkersAI, west_server: FakeWorkersAI, kind: str, request: pytest.FixtureRequest
) -> None:
    """East takes 150 tokens a minute; each call holds its estimate (99: the prompt and the
    JSON schema it asks for, plus its 60 `max_tokens`) and settles to the 15 the answer
    reports: four calls fit (15 x 3 + 99 = 144), the fifth would not (159) and goes to west, as
    every later one does. Unsettled, the second would not have fitted (198)."""
    fake_workers_ai.default = west_server.default = ANSWER
    tokens = Deployments(
        "tokens",
        [
            Deployment("east", provider="east", model=EAST, weight=1_000, tpm=150),
            Deployment("west", provider="west", model=WEST),
        ],
    )
    store: Store = MemoryStore()
    if kind == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("prefix")
        store = RedisStore(url, prefix=prefix, timeout_s=STORE_TIMEOUT_S)
    app, guards = app_of(fake_workers_ai, west_server, tokens, store=store, max_tokens=60)
    async with guards:  # (closes the store)
        order = [r.headers["x-ai-deployment"] for r in await post_all(app, 10, at_once=1)]
    assert order == ["tokens/east"] * 4 + ["tokens/west"] * 6


def test_a_group_flattens_to_its_deployments_wherever_a_chain_entry_goes() -> None:
    chat = group("flat")
    keys = [ref.key for ref in flatten_chain([chat, "@cf/x"], providers=("east", "west")).models]
    assert keys == ["flat/east", "flat/west", "@cf/x"]
    profiles = {"main": Profile(model=chat, fallbacks=("small",)), "small": Profile(model="@cf/small")}
    chain = flatten_chain(["main"], profiles=profiles, providers=("east", "west"))
    assert [(ref.key, ref.provider, ref.model) for ref in chain.models] == [
        ("flat/east", "east", EAST),
        ("flat/west", "west", WEST),
        ("@cf/small", None, "@cf/small"),
    ]
    # Twice in one chain: the second is removed, as a duplicate model is.
    assert [ref.key for ref in flatten_chain([chat, chat], providers=("east", "west")).models] == [
        "flat/east",
        "flat/west",
    ]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Deployments("chat", []), "at least one"),
        (lambda: Deployments("chat/x", [Deployment("a", provider="p", model="m")]), "a letter"),
        (lambda: Deployment("a b", provider="p", model="m"), "a letter"),
        (lambda: Deployment("a", provider="p", model="m", weight=0), "weight must be a positive number"),
        (lambda: Deployment("a", provider="p", model="m", rpm=0), "rpm must be a whole number"),
        (lambda: Deployment("a", provider="p", model="m", tpm=1.5), "tpm must be a whole number"),
        (
            lambda: Deployments("c", [Deployment("a", provider="p", model="m")] * 2),
            "each deployment's name once",
        ),
        (
            lambda: Deployments("c", [Deployment("a", provider="p", model="m")], strategy="random"),
            "strategy must be one of weighted, least_busy, lowest_latency",
        ),
        (
            lambda: flatten_chain([Deployments("c", [Deployment("a", provider="nowhere", model="m")])]),
            "names provider 'nowhere', which is not configured",
        ),
    ],
)
def test_a_bad_group_fails_at_start_up(make: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make()
