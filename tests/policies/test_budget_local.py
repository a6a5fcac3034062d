"""`Budget(on_store_failure="local", workers=N)`: while the store does not answer, a worker admits
its share of each limit (the limit divided by N) from its own memory, says so on every request
that falls back, and goes back to the shared counts when the store answers. A real Redis,
stopped and started again on its port; requests over ASGI."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY

from fixtures import FakeBinding, Reply
from guards import AI, Budget, ConfigurationError, Guards, header_key
from guards.stores import RedisStore
from guards.testing.redis_server import RedisServer

from ..conftest import AppClient, LogLines

WORKERS = 4


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(options=["--appendonly", "yes", "--maxmemory-policy", "noeviction"]) as started:
        yield started


def local_app(store: RedisStore, **limits: int) -> FastAPI:
    guards = Guards(FakeBinding(Reply("ok")), store=store)
    app = FastAPI()
    guards.install(app)
    budget = Budget(
        key=header_key("x-user-id"), scope="labels", on_store_failure="local", workers=WORKERS, **limits
    )

    @app.post("/label")
    @guards.route(model="@cf/test/model", budget=budget, breaker=None)
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label"})

    @app.post("/tag")
    @guards.route(model="@cf/test/model", budget=budget, breaker=None)
    async def tag(ai: AI[str]) -> str:
        return await ai.run({"prompt": "tag"})

    return app


def local_fallbacks() -> float:
    return (
        REGISTRY.get_sample_value("guards_store_unavailable_total", {"guard": "budget", "action": "local"})
        or 0.0
    )


def test_a_worker_admits_its_share_while_the_store_is_down_then_the_store_again(
    server: RedisServer, app_client: AppClient, guards_log: LogLines
) -> None:
    user = {"x-user-id": f"ada-{uuid.uuid4().hex[:8]}"}
    client = app_client(local_app(RedisStore(server.url, timeout_s=0.2), per_day=10))
    assert [client.post("/label", headers=user).status_code for _ in range(3)] == [200] * 3  # in the store
    counted = local_fallbacks()
    server.stop()
    # 10 // 4 = 2 a worker, shared by the routes of the budget's scope; then budget_exceeded.
    down = [client.post(path, headers=user) for path in ("/label", "/tag", "/label", "/tag")]
    assert [r.status_code for r in down] == [200, 200, 429, 429]
    assert {r.json()["error"] for r in down[2:]} == {"budget_exceeded"}
    assert local_fallbacks() == counted + 4
    lines = guards_log.events("store_unavailable")
    assert {(line["guard"], line["mode"]) for line in lines if line["guard"] == "budget"} == {
        ("budget", "local")
    }
    server.start()  # the same port: the store answers again, with its own counts (3 of 10)
    back = [client.post("/label", headers=user).status_code for _ in range(8)]
    assert back == [200] * 7 + [429]


def test_the_default_still_fails_closed(server: RedisServer, app_client: AppClient) -> None:
    guards = Guards(FakeBinding(Reply("ok")), store=RedisStore(server.url, timeout_s=0.2))
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model="@cf/test/model", budget=Budget(per_day=10), breaker=None)
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label"})

    client = app_client(app)
    server.stop()
    refused = client.post("/label")
    assert refused.status_code == 503
    assert refused.json()["error"] == "circuit_open"


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"per_day": 10, "on_store_failure": "local"}, "needs workers=N"),
        ({"per_day": 3, "on_store_failure": "local", "workers": 4}, "per_day=3 split among workers=4"),
        ({"per_minute": 2, "on_store_failure": "local", "workers": 4}, "per_minute=2 split among workers=4"),
        ({"per_day": 10, "workers": 4}, 'only with on_store_failure="local"'),
        ({"per_day": 10, "on_store_failure": "local", "workers": 0}, "needs workers=N"),
    ],
)
def test_a_local_fallback_that_cannot_work_is_refused_at_start_up(
    options: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        Budget(**options)  # type: ignore[arg-type]
