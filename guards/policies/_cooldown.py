"""Cooldowns: a model that answered "rate limited" or "quota exhausted" is left alone for a while.

While a model cools down, chains skip it without a call (and record the skip), so a provider
that asked for a pause is not hammered by every request in the meantime. The cooldown itself
lives in the store (started by a `Report` in `Store.step`), shared by every worker.

A provider's own wait (`Retry-After` in seconds or as an HTTP date, `retry-after-ms`) is taken
as a hint, never at face value: a cooldown lasts at most `Cooldown.max_s` (10 minutes by
default), and so does the wait a client is told (`Retry-After`). Otherwise one answer saying
"a day" would take the model out of every worker's chain for a day. An HTTP date is read
against the store's clock when the cooldown starts (`ProviderError.retry_at`): a worker whose
clock is behind does not stretch it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..contracts._classify import classify
from ..contracts._errors import ConfigurationError
from ..contracts._settings import number, settings
from ..contracts._vocabulary import Kind

__all__ = ["MAX_COOLDOWN_S", "Cooldown", "checked_cooldowns"]

#: The longest cooldown by default, and the longest provider wait a client is told.
MAX_COOLDOWN_S = 600.0


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class Cooldown:
    """How long a model cools down after a rate limit (429) or an exhausted quota (3036).

    The provider's wait (`Retry-After` or `retry-after-ms`) when it sent one; else
    `rate_limited_s` for a rate limit and `quota_s` for a quota. At most `max_s` either way
    (default 600 s): also the most any provider wait is repeated to a client as `Retry-After`.
    A wait given as an HTTP date ends no later than that date on the store's clock.

    Give one to `Guards(cooldown=...)` for every model, and per model in
    `Guards(cooldowns={"provider:model": Cooldown(...)})`. Raises `ConfigurationError` for a duration
    that is not a positive finite number of seconds, or a default longer than `max_s`.
    """

    rate_limited_s: float = 30.0
    quota_s: float = 600.0
    max_s: float = MAX_COOLDOWN_S

    def __post_init__(self) -> None:
        for name in ("rate_limited_s", "quota_s", "max_s"):
            number(f"Cooldown.{name}", getattr(self, name), above=0, unit="seconds")
        for name in ("rate_limited_s", "quota_s"):
            value = getattr(self, name)
            if value > self.max_s:
                raise ConfigurationError(
                    f"Cooldown.{name} ({float(value)} s) is longer than max_s ({float(self.max_s)} s): "
                    f"shorten it or raise max_s"
                )

    def seconds(self, error: BaseException) -> float:
        """The cooldown a failure calls for (0.0: none), at most `max_s`."""
        kind = classify(error).kind
        if kind is Kind.model_rate_limited:
            default = self.rate_limited_s
        elif kind is Kind.model_quota_exhausted:
            default = self.quota_s
        else:
            return 0.0
        hint = getattr(error, "retry_after_s", None)
        return min(self.max_s, hint if hint is not None and hint > 0 else default)

    def wait(self, hint: float | None) -> float | None:
        """A provider's wait as a client may be told it: at most `max_s` (None: none known)."""
        return None if hint is None else min(self.max_s, hint)


def checked_cooldowns(default: Cooldown, cooldowns: Mapping[str, Cooldown]) -> dict[str, Cooldown]:
    """`Guards(cooldowns=...)` as kept; raises `ConfigurationError` for a policy that is not a
    `Cooldown` (the default's too) or a key that is not a model key."""
    if not isinstance(default, Cooldown):
        raise ConfigurationError(f"cooldown must be a Cooldown, not {type(default).__name__}")
    for model, policy in cooldowns.items():
        if not isinstance(model, str) or not model.strip():
            raise ConfigurationError(f"cooldowns: {model!r} is not a model key (`model` or `provider:model`)")
        if not isinstance(policy, Cooldown):
            raise ConfigurationError(
                f"cooldowns[{model!r}] must be a Cooldown(...), not {type(policy).__name__}"
            )
    return dict(cooldowns)
