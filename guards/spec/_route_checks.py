"""The checks of `Guards.route`'s settings, at decoration time: each value's type and range,
before anything is built from it, with `ConfigurationError` naming the setting, the value and
the fix (`guards.contracts._settings` has the checks of one value; the settings types check their own).
What depends on the handler or on other routes (its signature, its chain, its scopes) is
checked where it is built (`guards.routes._route`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..contracts._errors import ConfigurationError
from ..contracts._settings import choice, number, whole
from ..contracts._tokens import MAX_TOKENS
from ..contracts._vocabulary import Level
from ..policies._budget import Budget
from ..policies._call import Retry
from ..policies._chain import Model
from ..policies._tasks import Task
from ..stores._breaker import Breaker

__all__ = ["check_route_settings"]


def _entry(setting: str, entry: object) -> None:
    if not isinstance(entry, str | Model):
        raise ConfigurationError(
            f"{setting} must be a chain entry (a model id, 'provider:model', 'hint:name' or a "
            f"profile name, or a guards.Model); got {entry!r} (a {type(entry).__name__})"
        )


def check_route_settings(
    *,
    model: object,
    fallbacks: object,
    attempts: object,
    timeout_s: object,
    retry: object,
    budget: object,
    breaker: object,
    moderation: object,
    name: object,
    max_tokens: object,
    stream_max_s: object,
    stream_max_chars: object,
    max_body_bytes: object,
    task: object,
    content_filter_fallback: object,
    on_rejected: object,
    downgrade_to: object,
    shed_at: object,
) -> None:
    """The types and ranges of `Guards.route`'s settings, checked before anything is built
    from them: `ConfigurationError` naming the setting, the value and the fix."""
    if isinstance(model, list | tuple):
        first = repr(model[0]) if model else "'...'"
        rest = repr(list(model[1:])) if len(model) > 1 else "[...]"
        raise ConfigurationError(
            f"route: model takes one chain entry, not {type(model).__name__}: the models to "
            f"try after it go in fallbacks=..., e.g. route(model={first}, fallbacks={rest})"
        )
    if model is not None:
        _entry("route: model", model)
    if isinstance(fallbacks, str | Model) or not isinstance(fallbacks, Sequence):
        raise ConfigurationError(
            f"route: fallbacks takes a list of chain entries, e.g. fallbacks=[{fallbacks!r}]; "
            f"got {fallbacks!r} (a {type(fallbacks).__name__})"
        )
    for entry in fallbacks:
        _entry("route: each of fallbacks", entry)
    if downgrade_to is not None:
        _entry("route: downgrade_to", downgrade_to)
    whole("route: attempts", attempts, none="the chain's length plus one retry")
    number("route: timeout_s", timeout_s, above=0, unit="seconds")
    for setting, value, kind in (
        ("retry", retry, Retry),
        ("breaker", breaker, Breaker),
        ("task", task, Task),
    ):
        if value is not None and not isinstance(value, kind):
            raise ConfigurationError(
                f"route: {setting} must be a guards.{kind.__name__}(...)"
                + (" or None" if setting != "retry" else "")
                + f"; got {value!r}"
            )
    if retry is None:
        raise ConfigurationError(
            "route: retry must be a guards.Retry(...): Retry(attempts=1) retries nothing"
        )
    budgets = budget if isinstance(budget, list | tuple) else [budget] if budget is not None else []
    for each in budgets:
        if not isinstance(each, Budget):
            raise ConfigurationError(
                f"route: budget must be a guards.Budget(...), a list of them, or None; got {each!r}"
            )
    if moderation is not None and not callable(moderation):
        raise ConfigurationError(
            f"route: moderation must be a function of the output, or None; got {moderation!r}"
        )
    if name is not None and not (isinstance(name, str) and name):
        raise ConfigurationError(f"route: name must be a name (or None: the handler's); got {name!r}")
    whole("route: max_tokens", max_tokens, most=MAX_TOKENS, none="the provider's default")
    number("route: stream_max_s", stream_max_s, above=0, unit="seconds")
    whole("route: stream_max_chars", stream_max_chars)
    whole("route: max_body_bytes", max_body_bytes, none="no limit")
    if not isinstance(content_filter_fallback, bool):
        raise ConfigurationError(
            f"route: content_filter_fallback must be True or False; got {content_filter_fallback!r}"
        )
    choice("route: on_rejected", on_rejected, ("fallback", "next_model", "reask"))
    choice("route: shed_at", shed_at, (Level.degraded, Level.minimal), none="never shed")
