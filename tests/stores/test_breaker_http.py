"""The breaker over real HTTP with calls in flight at once: the example app under uvicorn, the
fake Workers AI server, and requests that overlap as they do under load (`make soak`)."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import pytest

from app.service import create_app
from app.settings import SettingsError, load_settings
from fixtures import Fail, FakeWorkersAI, Reply
from guards.stores import MemoryStore, RedisStore, SQLiteStore, Store

from ..conftest import Serve, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
#: A failure the breaker counts and the call guard does not retry (model_incompatible).
INCOMPATIBLE = Fail(code=5007, status=400)


def real_store(kind: str, tmp_path: Path, prefix: str, request: pytest.FixtureRequest) -> Store:
    """A store of `kind` on the real clock (the calls here take real time)."""
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "guards.db")
    return RedisStore(request.getfixturevalue("redis_url"), prefix=prefix, timeout_s=1.0)


def post(client: httpx.Client) -> httpx.Response:
    return client.post("/draft-reply", json={"message": "Where is my parcel?"})


def test_failures_between_successes_do_not_open_the_breaker(
    fake_workers_ai: FakeWorkersAI,
    serve: Serve,
    store_kind: str,
    tmp_path: Path,
    prefix: str,
    request: pytest.FixtureRequest,
) -> None:
    """Consecutive failures are failures with no success ending between them. Here three
    failures alternate with two successes (in the order the calls end), with a threshold of
    three: the breaker must stay closed, on every store. The two successes are slow calls that
    started before the first failure, as most calls in flight do when a failure lands under
    load: admitted while the breaker counted nothing, they are not reported when they end (no
    store operation), and the next request's step tells the store they ended."""
    settings = workers_ai_settings(fake_workers_ai, breaker_failure_threshold=3, ai_timeout_s=10.0)
    store = real_store(store_kind, tmp_path, prefix, request)
    client = serve(create_app(settings, store=store, sleep=no_sleep))
    fake_workers_ai.script(MODEL, Reply("First.", delay_s=1.0), Reply("Second.", delay_s=2.0))
    with ThreadPoolExecutor(2) as pool:
        running = {pool.submit(post, client) for _ in range(2)}
        assert fake_workers_ai.wait_for(lambda calls: len(calls) == 2, timeout=5)
        ended = []
        while running:
            fake_workers_ai.script(MODEL, INCOMPATIBLE)
            ended.append(post(client).status_code)  # a failure, while the slow calls run
            assert not any(call.done() for call in running)
            done, running = wait(running, timeout=10, return_when=FIRST_COMPLETED)
            ended += [call.result().status_code for call in done]  # then a success ends
        fake_workers_ai.script(MODEL, INCOMPATIBLE)
        ended.append(post(client).status_code)
    assert ended == [502, 200, 502, 200, 502]  # failure, success, failure, success, failure
    fake_workers_ai.script(MODEL, Reply("Still up."))
    response = post(client)
    assert response.status_code == 200, response.json()  # not 503 circuit_open
    assert len(fake_workers_ai.calls) == 6


def test_a_slow_model_opens_the_breaker_of_the_example_app(
    fake_workers_ai: FakeWorkersAI,
    serve: Serve,
    store_kind: str,
    tmp_path: Path,
    prefix: str,
    request: pytest.FixtureRequest,
) -> None:
    """BREAKER_SLOW_CALL_S over real HTTP: every answer comes, slowly. The first two calls are
    fewer than BREAKER_MINIMUM_CALLS (3) and count as successes; the third and fourth count as
    failures and open the breaker: the fifth request is answered 503 `circuit_open` with no
    call."""
    settings = workers_ai_settings(
        fake_workers_ai,
        breaker_failure_threshold=2,
        breaker_window_s=60.0,
        breaker_slow_call_s=0.15,
        breaker_minimum_calls=3,
        ai_timeout_s=5.0,
    )
    store = real_store(store_kind, tmp_path, prefix, request)
    client = serve(create_app(settings, store=store, sleep=no_sleep))
    fake_workers_ai.script(MODEL, *[Reply("Slowly.", delay_s=0.3)] * 4)
    assert [post(client).status_code for _ in range(4)] == [200] * 4
    refused = post(client)
    assert (refused.status_code, refused.json()["error"]) == (503, "circuit_open")
    assert len(fake_workers_ai.calls) == 4


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"BREAKER_SLOW_CALL_S": "20"}, "BREAKER_SLOW_CALL_S needs BREAKER_WINDOW_S"),
        ({"BREAKER_PROBE_INTERVAL_S": "31"}, "BREAKER_PROBE_INTERVAL_S must be at most BREAKER_RESET_S"),
        ({"BREAKER_MINIMUM_CALLS": "0"}, "BREAKER_MINIMUM_CALLS"),
        ({"BREAKER_WINDOW_S": "-1"}, "BREAKER_WINDOW_S"),
    ],
)
def test_bad_breaker_settings_fail_start_up_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=named):
        load_settings()
