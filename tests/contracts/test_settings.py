"""Settings are checked where they are written: each public settings type, `Guards(...)` and
`route(...)` raise `ConfigurationError` naming the setting, the value and the fix for a value
of the wrong type or out of range, and a misspelled keyword names the closest valid one. One
row per mistake, with what the message must say."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from guards import (
    AI,
    Budget,
    ConfigurationError,
    Cooldown,
    Guards,
    Model,
    Price,
    Profile,
    Retry,
    RetryBudget,
    Task,
)
from guards.testing import FakeBinding


async def handler(ai: AI[str]) -> str:
    return await ai.run({"prompt": "hi"})


def route(**settings: Any) -> Callable[[], object]:
    """Declaring a route with `settings` (and a model, unless they name one)."""
    return lambda: Guards(FakeBinding()).route(**{"model": "@cf/a", **settings})(handler)


def build(kind: Any, *args: Any, **settings: Any) -> Callable[[], object]:
    return lambda: kind(*args, **settings)


MISTAKES = [
    # LiteLLM's habit: a list of models as `model`.
    (
        route(model=["@cf/a", "@cf/b"]),
        "route: model takes one chain entry, not list: the models to try after it go in fallbacks=..., e.g. route(model='@cf/a', fallbacks=['@cf/b'])",
    ),
    (route(model=70), "route: model must be a chain entry"),
    (
        route(fallbacks="@cf/b"),
        "route: fallbacks takes a list of chain entries, e.g. fallbacks=['@cf/b']",
    ),
    (route(fallbacks=["@cf/b", 3]), "route: each of fallbacks must be a chain entry"),
    (
        route(timeout_s="8"),
        "route: timeout_s must be a positive, finite number of seconds; got '8' (a str)",
    ),
    (route(timeout_s=0), "route: timeout_s must be a positive"),
    (route(attempts=2.5), "route: attempts must be a whole number, at least 1"),
    (route(max_tokens="256"), "route: max_tokens must be a whole number"),
    (
        route(max_body_bytes=0),
        "route: max_body_bytes must be a whole number, at least 1, or None (no limit)",
    ),
    (route(retry=3), "route: retry must be a guards.Retry(...)"),
    (route(budget={"per_day": 5}), "route: budget must be a guards.Budget(...), a list of them, or None"),
    (route(breaker=True), "route: breaker must be a guards.Breaker(...) or None"),
    (route(on_rejected="reak"), "did you mean 'reask'?"),
    (route(shed_at="minimum"), "did you mean 'minimal'?"),
    (route(first_output_s="2"), "route: first_output_s must be a positive, finite number of seconds"),
    (route(timout_s=3), "route has no setting 'timout_s': did you mean timeout_s=...?"),
    (build(Guards, FakeBinding(), prcies={}), "Guards has no setting 'prcies': did you mean prices=...?"),
    (
        build(Budget, per_minute="5"),
        "Budget.per_minute must be a whole number, at least 1, or None (no limit); got '5' (a str)",
    ),
    (
        build(Budget, per_day=True),
        "Budget.per_day must be a whole number, at least 1, or None (no limit); got True (a bool)",
    ),
    (build(Budget, per_day=0), "Budget.per_day must be a whole number, at least 1"),
    (
        build(Budget, spend_per_day=-1),
        "Budget.spend_per_day must be a positive, finite number, or None (no cap)",
    ),
    (build(Budget, per_day=5, on_store_failure="clsoed"), "did you mean 'closed'?"),
    (build(Budget, per_day=5, key="x-user-id"), "Budget.key must be a function of the request"),
    (build(Budget, per_mintue=5), "Budget has no setting 'per_mintue': did you mean per_minute=...?"),
    (
        build(Price, input_token="0.1"),
        "Price.input_token must be a finite number, at least 0; got '0.1' (a str)",
    ),
    (build(Price, input_tokens=0.1), "did you mean input_token=...?"),
    (build(Task, ttl_s=0), "Task.ttl_s must be a positive, finite number of seconds; got 0"),
    (build(Task, max_live=1.5), "Task.max_live must be a whole number, at least 1"),
    (
        build(Cooldown, quota_s=True),
        "Cooldown.quota_s must be a positive, finite number of seconds; got True (a bool)",
    ),
    (build(RetryBudget, share=-1), "RetryBudget.share must be a finite number, at least 0; got -1"),
    (build(RetryBudget, windw_s=5), "did you mean window_s=...?"),
    (
        build(Model, "@cf/a", first_output_s="2"),
        "Model.first_output_s must be a positive, finite number of seconds",
    ),
    (build(Model, "@cf/a", first_output=2), "did you mean first_output_s=...?"),
    (build(Profile, model=["@cf/a"]), "the profiles to fall back on go in fallbacks=..."),
    (build(Profile, model="@cf/a", fallbacks="backup"), "Profile.fallbacks must be a tuple of profile names"),
    (build(Retry, atempts=2), "did you mean attempts=...?"),
]


@pytest.mark.parametrize(("declare", "says"), MISTAKES, ids=[says[:60] for _, says in MISTAKES])
def test_a_mistake_fails_where_it_is_written_with_the_fix(declare: Callable[[], object], says: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        declare()
    assert says in str(raised.value)


def test_a_configuration_error_is_a_value_error() -> None:
    """What these checks raised before (`ValueError`) still catches them."""
    with pytest.raises(ValueError, match=r"Budget\.per_day"):
        Budget(per_day=0)
