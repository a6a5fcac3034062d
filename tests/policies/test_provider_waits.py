"""A provider's wait is a cooldown of at most a stated maximum.

A `Retry-After` of a day, or an HTTP date months ahead, would otherwise take a model out of
every worker's chain for that long (the cooldown lives in the store) and be repeated to every
client as the public `Retry-After`. The cooldown, and the public `Retry-After`, are at most
`Cooldown.max_s` (600 s by default), settable per model (`Guards(cooldowns=...)`); an HTTP date
is read against the store's clock, so a worker whose clock is behind does not stretch it.

An app in process (ASGI) whose Workers AI adapter talks to the fake provider over HTTP, its
state in each store (memory, SQLite, Redis) on a `ManualClock`, the cooldown seen through the
public `Retry-After`, `/health` and the status route.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fixtures import Fail, FakeWorkersAI, ManualClock, Reply
from guards import AI, ConfigurationError, Cooldown, Guards, Retry
from guards.providers import WorkersAI
from guards.stores import Store

from ..conftest import AppClient, assert_error, no_sleep, wait_until

MODEL = "@cf/test/model"
OTHER = "@cf/test/other"
DAY_S = 86_400


def app_for(
    server: FakeWorkersAI, store: Store, *, cooldowns: Mapping[str, Cooldown] | None = None, **options: Any
) -> FastAPI:
    binding = WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url)
    guards = Guards(binding, store=store, sleep=no_sleep, cooldowns=cooldowns, **options)
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        level = guards.service_level()
        return {"level": level.level.value, "down": {m.model: m.until for m in level.down}}

    for model in (MODEL, OTHER):

        @app.post(f"/ask/{model.rsplit('/', 1)[-1]}")
        @guards.route(model=model, breaker=None, name=model.rsplit("/", 1)[-1])
        async def ask(ai: AI[str]) -> str:
            return await ai.run({"prompt": "Hi"})

    return app


def cooldown_of(client: httpx.Client, model: str) -> float:
    """The model's cooldown left, as the status route reads it from the store."""
    report = client.get("/status").json()
    (shown,) = [m for m in report["models"] if m["model"] == model]
    return float(shown["cooldown_s"] or 0.0)


def ask(client: httpx.Client, model: str = MODEL) -> httpx.Response:
    return client.post(f"/ask/{model.rsplit('/', 1)[-1]}")


def http_date(epoch: float) -> str:
    return email.utils.formatdate(epoch, usegmt=True)


@pytest.mark.parametrize(
    "failure",
    [
        Fail(status=429, retry_after=str(DAY_S)),
        Fail(code=3036, status=429, retry_after=str(DAY_S)),
        Fail(status=429, retry_after="1e300"),
        Fail(status=429, retry_after=http_date(time.time() + 30 * DAY_S)),
    ],
    ids=["rate-limited-a-day", "quota-a-day", "huge-number", "a-date-a-month-ahead"],
)
def test_a_long_wait_is_a_cooldown_of_at_most_ten_minutes(
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
    store: Store,
    clock: ManualClock,
    failure: Fail,
) -> None:
    clock.set(time.time())  # the store's clock agrees with the worker's
    client = app_client(app_for(fake_workers_ai, store))
    fake_workers_ai.script(MODEL, failure)
    fake_workers_ai.default = Reply("Hello.")
    first = ask(client)
    assert first.status_code == 503
    assert first.json()["retryable"] is False
    assert int(first.headers["retry-after"]) == 600
    # The cooldown in the store: the next request skips the model, with the same wait.
    again = ask(client)
    assert_error(again, 503, "circuit_open", True)
    assert 590 <= int(again.headers["retry-after"]) <= 600
    assert 590 <= cooldown_of(client, MODEL) <= 600
    # The health route reads the level in the background, at most once a second.
    wait_until(lambda: MODEL in client.get("/health").json()["down"])
    assert 590 <= client.get("/health").json()["down"][MODEL] - clock.time() <= 600
    assert len(fake_workers_ai.calls) == 1
    # Ten minutes later the model is called again.
    clock.advance(601)
    assert ask(client).status_code == 200
    assert len(fake_workers_ai.calls) == 2


def test_a_transient_failure_s_wait_is_capped_too(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, clock: ManualClock
) -> None:
    """A 503 asking for a day: too long to retry within the deadline, and the public
    `Retry-After` says at most the maximum."""
    client = app_client(app_for(fake_workers_ai, store))
    fake_workers_ai.default = Fail(status=503, retry_after=str(DAY_S))
    response = ask(client)
    assert_error(response, 503, "model_temporarily_unavailable", True)
    assert int(response.headers["retry-after"]) == 600
    assert len(fake_workers_ai.calls) == 1


def test_the_maximum_is_set_per_model(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, clock: ManualClock
) -> None:
    short = Cooldown(rate_limited_s=10, quota_s=60, max_s=60)
    client = app_client(app_for(fake_workers_ai, store, cooldowns={MODEL: short}))
    fake_workers_ai.default = Fail(status=429, retry_after=str(DAY_S))
    assert int(ask(client, MODEL).headers["retry-after"]) == 60
    assert int(ask(client, OTHER).headers["retry-after"]) == 600  # the default maximum
    assert 0 < cooldown_of(client, MODEL) <= 60
    assert 590 <= cooldown_of(client, OTHER) <= 600
    clock.advance(61)
    assert cooldown_of(client, MODEL) == 0.0
    fake_workers_ai.default = Reply("Hello.")
    assert ask(client, MODEL).status_code == 200
    assert_error(ask(client, OTHER), 503, "circuit_open", True)


def test_the_default_maximum_is_set_for_every_model(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, clock: ManualClock
) -> None:
    client = app_client(
        app_for(fake_workers_ai, store, cooldown=Cooldown(rate_limited_s=5, quota_s=120, max_s=120))
    )
    fake_workers_ai.default = Fail(status=429, retry_after=http_date(time.time() + 365 * DAY_S))
    assert int(ask(client).headers["retry-after"]) == 120
    assert 0 < cooldown_of(client, MODEL) <= 120


def test_a_date_is_read_against_the_store_s_clock(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, clock: ManualClock
) -> None:
    """The worker's clock is 500 s behind the store's (and the provider's): a date 100 s
    ahead reads as 600 s on the worker, and is a 100 s cooldown in the store."""
    clock.set(time.time() + 500)
    client = app_client(app_for(fake_workers_ai, store))
    fake_workers_ai.default = Fail(status=429, retry_after=http_date(clock.time() + 100))
    assert ask(client).status_code == 503
    assert 90 <= cooldown_of(client, MODEL) <= 100
    again = ask(client)
    assert_error(again, 503, "circuit_open", True)
    assert 90 <= int(again.headers["retry-after"]) <= 100
    clock.advance(101)
    fake_workers_ai.default = Reply("Hello.")
    assert ask(client).status_code == 200


def test_a_date_already_past_on_the_store_s_clock_starts_no_cooldown(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, clock: ManualClock
) -> None:
    """The worker's clock is an hour behind: a date the worker reads as 30 s ahead is past."""
    clock.set(time.time() + 3600)
    client = app_client(app_for(fake_workers_ai, store))
    fake_workers_ai.script(MODEL, Fail(status=429, retry_after=http_date(time.time() + 30)))
    fake_workers_ai.default = Reply("Hello.")
    assert ask(client).status_code == 503
    assert cooldown_of(client, MODEL) == 0.0
    assert ask(client).status_code == 200


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"max_s": 0}, "positive"),
        ({"max_s": float("inf")}, "finite"),
        ({"rate_limited_s": float("nan")}, "finite"),
        ({"quota_s": -1}, "positive"),
        ({"quota_s": 3600}, "quota_s (3600.0 s) is longer than max_s (600.0 s)"),
        ({"max_s": 20}, "rate_limited_s (30.0 s) is longer than max_s (20.0 s)"),
    ],
)
def test_a_cooldown_is_checked(options: dict[str, float], problem: str) -> None:
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        Cooldown(**options)


def test_the_default_maximum_is_ten_minutes() -> None:
    assert Cooldown().max_s == 600.0
    with pytest.raises(TypeError):
        Cooldown(30.0)  # type: ignore[misc]  # keyword-only


def test_per_model_cooldowns_are_checked(fake_workers_ai: FakeWorkersAI, store: Store) -> None:
    binding = WorkersAI(account_id="a", api_token="t", base_url=fake_workers_ai.base_url)
    with pytest.raises(ConfigurationError, match=r"cooldowns\['@cf/test/model'\] must be a Cooldown"):
        Guards(binding, store=store, cooldowns={MODEL: 600})  # type: ignore[dict-item]


# --- a short wait, waited out when no other model can answer (`Retry.wait_out_s`) --------------

SHORT = Fail(status=429, retry_after="2")


def waiting_app(
    server: FakeWorkersAI, store: Store, waited: list[float], clock: ManualClock, **route: Any
) -> FastAPI:
    """A strict route on `MODEL` (then `route`'s fallbacks) and one on `OTHER` alone; its
    waits are recorded in `waited` and pass on the store's clock, not for real."""

    async def sleep(seconds: float) -> None:
        waited.append(seconds)
        clock.advance(seconds)

    binding = WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url)
    guards = Guards(binding, store=store, sleep=sleep)
    app = FastAPI()
    guards.install(app)
    app.include_router(guards.status_router())

    @app.post("/ask/model")
    @guards.route(**{"model": MODEL, "breaker": None, "timeout_s": 8, **route})
    async def ask_model(ai: AI[str]) -> str:
        return await ai.run({"prompt": "Hi"})

    @app.post("/ask/other")
    @guards.route(model=OTHER, breaker=None, retry=Retry(wait_out_s=0))
    async def ask_other(ai: AI[str]) -> str:
        return await ai.run({"prompt": "Hi"})

    return app


def test_a_short_wait_is_waited_out_then_the_same_model_answers(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, clock: ManualClock
) -> None:
    """The model cools down for the wait (every other request skips it), and its retry,
    made after the wait, is not skipped by that cooldown."""
    waited: list[float] = []
    client = app_client(waiting_app(fake_workers_ai, store, waited, clock))
    fake_workers_ai.script(MODEL, SHORT, Reply("After the wait."))
    response = ask(client)
    assert response.status_code == 200, response.text
    assert response.json() == "After the wait."
    assert waited == [2.0]
    assert [call.model for call in fake_workers_ai.calls] == [MODEL, MODEL]
    assert cooldown_of(client, MODEL) == 0.0  # over, as the wait is
    assert ask(client).status_code == 200  # the next request calls the model at once
    assert len(fake_workers_ai.calls) == 3


@pytest.mark.parametrize(
    ("failure", "route"),
    [
        (Fail(status=429, retry_after="3"), {}),  # longer than the default bound, 2 s
        (SHORT, {"retry": Retry(wait_out_s=0)}),  # off
        (SHORT, {"retry": Retry(wait_out_s=1.5)}),  # longer than the route's bound
        (SHORT, {"timeout_s": 2.4}),  # no room for a call after the wait (min_room_s, 0.5 s)
        (SHORT, {"retry": Retry(attempts=1)}),  # no retry allowed
        (SHORT, {"attempts": 1}),  # the request's attempt budget
        (Fail(status=429), {}),  # no wait known
        (Fail(code=3036, status=429, retry_after="2"), {}),  # a quota: not a rate limit
    ],
    ids=[
        "too-long",
        "off",
        "over-the-route-s-bound",
        "no-room",
        "no-retry",
        "attempt-budget",
        "no-wait",
        "quota",
    ],
)
def test_otherwise_a_rate_limit_ends_the_request_as_before(
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
    store: Store,
    clock: ManualClock,
    failure: Fail,
    route: dict[str, Any],
) -> None:
    waited: list[float] = []
    client = app_client(waiting_app(fake_workers_ai, store, waited, clock, **route))
    fake_workers_ai.script(MODEL, failure)
    response = ask(client)
    assert response.status_code == 503, response.text
    assert (waited, len(fake_workers_ai.calls)) == ([], 1)


def test_with_another_model_the_walk_moves_on_without_waiting(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, clock: ManualClock
) -> None:
    waited: list[float] = []
    client = app_client(waiting_app(fake_workers_ai, store, waited, clock, fallbacks=[OTHER]))
    fake_workers_ai.script(MODEL, SHORT)
    fake_workers_ai.script(OTHER, Reply("From the other."))
    assert ask(client).json() == "From the other."
    assert waited == []
    assert [call.model for call in fake_workers_ai.calls] == [MODEL, OTHER]


def test_with_every_other_model_cooling_down_the_wait_is_waited_out(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, store: Store, clock: ManualClock
) -> None:
    """The chain's other model cools down (a rate limit of a minute): no model is left to
    answer but the first, whose short wait is waited out."""
    waited: list[float] = []
    client = app_client(waiting_app(fake_workers_ai, store, waited, clock, fallbacks=[OTHER]))
    fake_workers_ai.script(OTHER, Fail(status=429, retry_after="60"))
    assert client.post("/ask/other").status_code == 503  # OTHER cools down for a minute
    fake_workers_ai.script(MODEL, SHORT, Reply("After the wait."))
    assert ask(client).json() == "After the wait."
    assert waited == [2.0]
    assert [call.model for call in fake_workers_ai.calls] == [OTHER, MODEL, MODEL]


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), True, "2"])
def test_wait_out_s_is_checked(value: Any) -> None:
    with pytest.raises(ValueError, match=r"Retry\.wait_out_s must be a finite number of seconds, at least 0"):
        Retry(wait_out_s=value)
