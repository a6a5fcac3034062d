"""A shared upstream limit's fair shares (`Share`) in Python, shared by `MemoryStore` and
`SQLiteStore` (RedisStore runs the same rules in its Lua script, `share_check`).

The state of a shared limit is one small hash per UTC minute of the store's clock (a fixed
window), `{key}:share:{minute}`: one field per active tenant (its name in hex, or the overflow
bucket `*`), `"<weight> <requests> <tokens>"`, at most `SHARE_TENANTS_CAP` tenants and the
bucket; and `{key}:share:{minute}:h`, the token holds of the minute awaiting their settlement,
one field per hold, `"<tenant> <tokens held>"`. Both live two minutes. A check reads the
minute's tenants (bounded), decides with `decide` (pure), and the charge writes one field.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Protocol

from ._base import MINUTE_S, SHARE_OVERFLOW, SHARE_TENANTS_CAP, Admission, Share, bounded_key

__all__ = [
    "ShareState",
    "decide",
    "share_apply",
    "share_check",
    "share_settle",
    "share_touch",
]

#: A minute's keys live this long: the minute, and one more for late settlements to find none.
_TTL_S = 2 * MINUTE_S

#: Per active tenant: (weight, requests, tokens) in the minute.
Tenants = Mapping[str, tuple[float, float, float]]


class ShareState(Protocol):
    """The hash primitives a store gives the shares, inside its atomic operation."""

    def hash_all(self, key: str, now: float) -> dict[str, str]:
        """Every field of the live hash `key` ({}: none)."""
        ...

    def hash_put(self, key: str, name: str, value: str, ttl_s: float, now: float) -> None:
        """Set the field `name` of `key` (a new hash lives `ttl_s` from now)."""
        ...

    def hash_pop(self, key: str, name: str, now: float) -> str | None:
        """The field `name` of the live hash `key`, deleted (None: not there)."""
        ...


def _minute_key(key: str, now: float) -> str:
    return f"{bounded_key(key)}:share:{int(now // MINUTE_S)}"


@functools.lru_cache(maxsize=4096)
def _parsed(value: str) -> tuple[float, float, float]:
    # Most of a minute's entries are read unchanged by each request: parsed once (bounded).
    weight, requests, tokens = value.split(" ")
    return float(weight), float(requests), float(tokens)


def _tenants(state: ShareState, key: str, now: float) -> dict[str, tuple[float, float, float]]:
    return {name: _parsed(value) for name, value in state.hash_all(key, now).items()}


def _entry(weight: float, requests: float, tokens: float) -> str:
    return f"{weight!r} {requests!r} {tokens!r}"


def _name(share: Share, tenants: Tenants) -> tuple[str, float]:
    """The tenant's field and weight: its hex name, or the overflow bucket when the minute
    already tracks `SHARE_TENANTS_CAP` other tenants."""
    name = bounded_key(share.tenant).encode("utf-8", "surrogatepass").hex()
    if name in tenants or len(tenants) < SHARE_TENANTS_CAP:
        return name, float(share.weight)
    return SHARE_OVERFLOW, 1.0


def decide(
    tenants: Tenants, name: str, weight: float, share: Share, tokens: float | None, now: float
) -> Admission | None:
    """Whether the tenant `name` (of `weight`) may take one request and `tokens` more in the
    minute whose active tenants are `tenants` (the tenant counted active): None when it may,
    else the refusal, which waits for the minute's end (None: a hold larger than the limit)."""
    entries = dict(tenants)
    _, requests, held = entries.get(name, (weight, 0.0, 0.0))
    entries[name] = (weight, requests, held)
    total_weight = sum(entry[0] for entry in entries.values())
    limits = (
        ("shared_per_minute", share.per_minute, 1.0, 1),
        ("shared_tokens_per_minute", share.tokens_per_minute, tokens, 2),
    )
    for refused_by, limit, amount, at in limits:
        if limit is None or amount is None:
            continue
        if amount > limit:
            return Admission(False, refused_by, None)
        total = sum(entry[at] for entry in entries.values())
        mine = entries[name][at]
        room = float(limit)
        if mine + amount > limit * weight / total_weight:  # past its share: only what no one needs
            room -= sum(
                max(0.0, limit * entry[0] / total_weight - entry[at])
                for other, entry in entries.items()
                if other != name
            )
        if total + amount > room:
            return Admission(False, refused_by, MINUTE_S - now % MINUTE_S)
    return None


def share_check(
    state: ShareState, key: str, share: Share, tokens: float | None, now: float
) -> Admission | None:
    """Check the tenant's request against the shared limit under `key`, nothing written."""
    tenants = _tenants(state, _minute_key(key, now), now)
    name, weight = _name(share, tenants)
    return decide(tenants, name, weight, share, tokens, now)


def share_touch(state: ShareState, key: str, share: Share, now: float) -> None:
    """Count the tenant active in the minute (it was refused: it still wants its share)."""
    minute = _minute_key(key, now)
    tenants = _tenants(state, minute, now)
    name, weight = _name(share, tenants)
    _, requests, held = tenants.get(name, (weight, 0.0, 0.0))
    state.hash_put(minute, name, _entry(weight, requests, held), _TTL_S, now)


def share_apply(
    state: ShareState, key: str, share: Share, tokens: float | None, reservation: str, now: float
) -> None:
    """Charge the tenant's request (checked by `share_check`): one request, and `tokens` held
    under `reservation` until settled (`share_settle`)."""
    minute = _minute_key(key, now)
    tenants = _tenants(state, minute, now)
    name, weight = _name(share, tenants)
    _, requests, held = tenants.get(name, (weight, 0.0, 0.0))
    amount = tokens if share.tokens_per_minute is not None and tokens is not None else 0.0
    state.hash_put(minute, name, _entry(weight, requests + 1, held + amount), _TTL_S, now)
    if amount:
        state.hash_put(f"{minute}:h", reservation, f"{name} {amount!r}", _TTL_S, now)


def share_settle(state: ShareState, key: str, reservation: str, tokens: float, now: float) -> None:
    """Settle the tenant's token hold `reservation` to `tokens`, if made this minute (a hold of
    a minute gone is gone with it)."""
    minute = _minute_key(key, now)
    hold = state.hash_pop(f"{minute}:h", reservation, now)
    if hold is None:
        return
    name, amount = hold.split(" ")
    entry = state.hash_all(minute, now).get(name)
    if entry is not None:
        weight, requests, held = _parsed(entry)
        state.hash_put(
            minute, name, _entry(weight, requests, max(held + tokens - float(amount), 0.0)), _TTL_S, now
        )
