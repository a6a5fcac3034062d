"""The last good answer: a degrading route's fallback that serves what the model last answered
to the same question, while it is fresh (HTTP's `stale-if-error`, on a guarded route).

    fallback=LastGood(key=normalized_question, max_age_s=600, otherwise=keyword_label)

Every validated success of the route stores its data under `key(arguments)` in the route's
store (shared by the workers that share the store), kept `max_age_s`. When a guard trips, a
stored answer younger than `max_age_s` is served, `fallback.detail` saying how old it is; else
`otherwise` (a value, or a function of the arguments and the tripped guard, as `fallback=`).

Keys are hashed (SHA-256, with the route's scope) before they reach the store: a store never
holds a question. Stored answers are user data: never logged, never a metric label. An answer
whose JSON exceeds `max_bytes` is not stored. A store that fails costs the answer, not the
request: a failed read serves `otherwise`, a failed write is skipped; both are logged
(`store_unavailable`, guard `last_good`) and counted like every store failure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ..contracts._errors import ConfigurationError, GuardTripped
from ..observe._log import emit_warning
from ..observe._metrics import STORE_UNAVAILABLE
from ..stores import Store, StoreUnavailable

__all__ = ["LastGood", "LastGoodCache"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LastGood:
    """A degrading route's fallback: its last good answer to the same `key`, else `otherwise`.

    - `key(arguments)`: the route's arguments (by parameter name, as a fallback function gets
      them) to the text answers are shared by, e.g. the question with its whitespace and case
      normalized; None: this request neither stores nor reads an answer.
    - `max_age_s`: how long an answer is kept and served.
    - `otherwise`: the fallback when no fresh answer is stored (a value, or a function of the
      arguments and the `GuardTripped`, sync or async).
    - `max_bytes`: answers whose JSON is longer are not stored.
    - `scope`: routes of the same scope share answers (default: the route's name).

    Raises `ConfigurationError` for a `max_age_s` or `max_bytes` that is not positive.
    """

    key: Callable[[Mapping[str, Any]], str | None]
    max_age_s: float
    otherwise: Any
    max_bytes: int = 65_536
    scope: str | None = None

    def __post_init__(self) -> None:
        if not self.max_age_s > 0 or self.max_bytes < 1:
            raise ConfigurationError("LastGood: max_age_s and max_bytes must be positive")
        if not callable(self.key):
            raise ConfigurationError("LastGood: key must be a function of the route's arguments")


class LastGoodCache:
    """A route's `LastGood`, bound at start-up to its store key prefix and data type."""

    __slots__ = ("_adapter", "_policy", "_prefix", "_route")

    def __init__(self, policy: LastGood, route: str, adapter: TypeAdapter[Any]) -> None:
        self._policy = policy
        self._route = route
        self._adapter = adapter
        self._prefix = f"{policy.scope or route}\0"

    async def remember(self, store: Store, arguments: Mapping[str, Any], data: Any, trace_id: str) -> None:
        """Store `data` (a validated success) under the arguments' key, if it has one."""
        key = self._key(arguments)
        if key is None:
            return
        value = self._adapter.dump_json(data)
        if len(value) > self._policy.max_bytes:
            return
        try:
            await store.put_answer(key, value.decode(), ttl_s=self._policy.max_age_s)
        except StoreUnavailable:
            self._lost("put_answer", trace_id)

    async def recall(
        self, store: Store, arguments: Mapping[str, Any], tripped: GuardTripped, trace_id: str
    ) -> tuple[Any, str] | None:
        """The stored answer to the arguments' key, younger than `max_age_s`, and the fallback's
        detail saying how old it is; None when there is none (or it no longer validates)."""
        key = self._key(arguments)
        if key is None:
            return None
        try:
            found = await store.get_answer(key, max_age_s=self._policy.max_age_s)
        except StoreUnavailable:
            self._lost("get_answer", trace_id)
            return None
        if found is None:
            return None
        try:
            data = self._adapter.validate_json(found.value)
        except ValidationError:  # stored by an older version of the route
            return None
        return data, f"the last good answer, {found.age_s:.0f} s old ({tripped.detail})"

    def _key(self, arguments: Mapping[str, Any]) -> str | None:
        text = self._policy.key(arguments)
        if text is None:
            return None
        digest = hashlib.sha256((self._prefix + text).encode("utf-8", "surrogatepass")).hexdigest()
        return f"guards:last_good:{digest}"

    def _lost(self, op: str, trace_id: str) -> None:
        emit_warning("store_unavailable", guard="last_good", route=self._route, trace_id=trace_id, op=op)
        STORE_UNAVAILABLE.labels(guard="last_good", action=op).inc()
