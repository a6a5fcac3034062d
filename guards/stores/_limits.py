"""A charge's `MoreLimits` in Python, shared by `MemoryStore` and `SQLiteStore` (RedisStore runs
the same rules in its Lua script): monthly counts, held counters (monthly spend, tokens per day
and month) and the weighted minute window of tokens, over several scopes, all or nothing.

A held counter is a settled total and live holds `(reservation, amount, until)` under one key;
it admits a hold while settled + live holds + the hold stays within its cap. The minute window
of tokens is a held counter whose holds last 60 s and are never moved to a total: settling one
replaces its amount in place, so the window is exact to the usage reported.

Every scope's charge is checked with nothing written, then every one is written: the caller
(`run_step`'s store) makes the whole atomic, so a refusal by any scope charges none. (A
shared limit's fair share, `_share`, is checked and charged likewise; the one write a refusal
makes is the tenant of a share that refused it counted active in the minute: it charges
nothing.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from ._base import (
    DAILY_TTL_S,
    DAY_S,
    MINUTE_S,
    MONTHLY_TTL_S,
    TOKEN_WINDOW_CAP,
    Admission,
    Charge,
    MoreLimits,
    Share,
    bounded_key,
    next_month_s,
    utc_day,
    utc_month,
)
from ._share import ShareState, share_apply, share_check, share_settle, share_touch

__all__ = ["LimitState", "charge_with_more", "later", "near_scopes", "settle_charge"]


class LimitState(ShareState, Protocol):
    """The primitives a store gives `charge_with_more` and `settle_charge`, inside its atomic
    operation; each key is one `bounded_key` plus a suffix."""

    def charge(
        self,
        charge: Charge,
        now: float,
        *,
        dry: bool = False,
        reservation: str | None = None,
        alone: bool = False,
    ) -> tuple[Admission | None, str | None]:
        """The store's charge of `charge`'s rate, daily count and daily spend (`alone`: its
        `more` ignored); `dry`: checked, nothing written; `reservation`: the daily spend hold's."""
        ...

    def settle(self, key: str, reservation: str, actual: float, now: float) -> None:
        """Settle the daily spend hold `reservation` of `key` to `actual`."""
        ...

    def count(self, key: str, now: float) -> int:
        """The live counter under `key` (0: none)."""
        ...

    def add_count(self, key: str, ttl_s: float, now: float) -> None:
        """Add one to the counter under `key` (a new one lives `ttl_s`)."""
        ...

    def holds(self, key: str, now: float) -> tuple[float, list[tuple[float, float]]]:
        """The held counter under `key`: its settled total and its live holds (amount, until)."""
        ...

    def hold(self, key: str, reservation: str, amount: float, until: float, ttl_s: float, now: float) -> None:
        """Add the hold `reservation` of `amount` until `until` (the key kept `ttl_s` from now)."""
        ...

    def settle_hold(self, key: str, reservation: str, actual: float, ttl_s: float, now: float) -> None:
        """Drop the hold `reservation` (if still there) and add `actual` to the settled total."""
        ...

    def replace_hold(self, key: str, reservation: str, actual: float, now: float) -> None:
        """Give the live hold `reservation` the amount `actual` (nothing if it left)."""
        ...


def later(refusal: Admission | None, other: Admission | None) -> Admission | None:
    """Of two refusals, the one that frees up last (None: never frees up, the latest of all)."""
    if other is None:
        return refusal
    if refusal is None or (
        refusal.retry_after_s is not None
        and (other.retry_after_s is None or other.retry_after_s > refusal.retry_after_s)
    ):
        return other
    return refusal


def _sub(reservation: str, index: int) -> str:
    """The reservation of the `index`th scope's holds (one id per row on SQLite)."""
    return reservation if index == 0 else f"{reservation}.{index}"


def _held_limits(key: str, more: MoreLimits, now: float) -> list[tuple[str, str, float, float]]:
    """The held counters `more` charges under `key` (bounded): (counter key, limit, amount, cap)."""
    held = []
    if more.spend is not None and more.spend_per_month is not None:
        held.append((f"{key}:spend:{utc_month(now)}", "spend_per_month", more.spend, more.spend_per_month))
    if more.tokens is not None:
        tokens = float(more.tokens)
        if more.tokens_per_minute is not None:
            held.append((f"{key}:tokens:minute", "tokens_per_minute", tokens, float(more.tokens_per_minute)))
        if more.tokens_per_day is not None:
            held.append(
                (f"{key}:tokens:{utc_day(now)}", "tokens_per_day", tokens, float(more.tokens_per_day))
            )
        if more.tokens_per_month is not None:
            held.append(
                (f"{key}:tokens:{utc_month(now)}", "tokens_per_month", tokens, float(more.tokens_per_month))
            )
    return held


def _check_more(state: LimitState, charge: Charge, more: MoreLimits, now: float) -> Admission | None:
    key = bounded_key(charge.key)
    refusal: Admission | None = None
    if more.per_month is not None and state.count(f"{key}:month:{utc_month(now)}", now) >= more.per_month:
        refusal = Admission(False, "per_month", next_month_s(now))
    for counter, limit, amount, cap in _held_limits(key, more, now):
        settled, holds = state.holds(counter, now)
        if amount > cap:  # larger than the limit itself: never fits
            refusal = later(refusal, Admission(False, limit, None))
            continue
        held = settled + sum(hold for hold, _ in holds)
        if limit == "tokens_per_minute":
            if held + amount > cap or len(holds) >= TOKEN_WINDOW_CAP:
                # Room comes back as the oldest holds leave the window.
                wait, freed, live = 0.0, 0.0, len(holds)
                for hold, until in sorted(holds, key=lambda item: item[1]):
                    freed, live, wait = freed + hold, live - 1, until - now
                    if held - freed + amount <= cap and live < TOKEN_WINDOW_CAP:
                        break
                refusal = later(refusal, Admission(False, limit, max(wait, 0.0)))
        elif held + amount > cap:
            wait = DAY_S - now % DAY_S if limit == "tokens_per_day" else next_month_s(now)
            refusal = later(refusal, Admission(False, limit, wait))
    return refusal


def _apply_more(state: LimitState, charge: Charge, more: MoreLimits, reservation: str, now: float) -> None:
    key = bounded_key(charge.key)
    if more.share is not None:
        share_apply(state, charge.key, more.share, more.tokens, reservation, now)
    if more.per_month is not None:
        state.add_count(f"{key}:month:{utc_month(now)}", MONTHLY_TTL_S, now)
    for counter, limit, amount, _ in _held_limits(key, more, now):
        if limit == "tokens_per_minute":
            state.hold(counter, reservation, amount, now + MINUTE_S, MINUTE_S, now)
        else:
            ttl = DAILY_TTL_S if limit == "tokens_per_day" else MONTHLY_TTL_S
            state.hold(counter, reservation, amount, now + charge.hold_s, ttl, now)


def _holds(charge: Charge) -> bool:
    more = charge.more
    return charge.spend is not None or (
        more is not None
        and (more.tokens is not None or (more.spend is not None and more.spend_per_month is not None))
    )


def charge_with_more(state: LimitState, charge: Charge, now: float) -> tuple[Admission | None, str | None]:
    """Charge `charge`, whose `more` is set, and every scope of `more.also`: all, or none when
    any limit of any scope refuses (the refusal that frees up last, naming its scope in
    `Admission.charge`). Returns what `StepState.charge` does."""
    assert charge.more is not None
    charges: Sequence[Charge] = (charge, *charge.more.also)
    refusal: Admission | None = None
    unfair: list[tuple[str, Share]] = []  # the shares that refused (see `share_touch`)
    for index, scoped in enumerate(charges):
        found, _ = state.charge(scoped, now, dry=True, alone=True)
        if scoped.more is not None:
            found = later(found, _check_more(state, scoped, scoped.more, now))
            if scoped.more.share is not None:
                shared = share_check(state, scoped.key, scoped.more.share, scoped.more.tokens, now)
                if shared is not None:
                    unfair.append((scoped.key, scoped.more.share))
                    found = later(found, shared)
        if found is not None and later(refusal, found) is found:
            refusal = Admission(False, found.refused_by, found.retry_after_s, index)
    if refusal is not None:
        for key, share in unfair:  # refused by its share: still active in the minute
            share_touch(state, key, share, now)
        return refusal, None
    reservation = os.urandom(8).hex() if any(_holds(scoped) for scoped in charges) else None
    for index, scoped in enumerate(charges):
        sub = None if reservation is None else _sub(reservation, index)
        state.charge(scoped, now, reservation=sub, alone=True)
        if scoped.more is not None:  # (no reservation: no scope holds anything)
            _apply_more(state, scoped, scoped.more, sub or "", now)
    return None, reservation


def settle_charge(
    state: LimitState, charge: Charge, reservation: str, actual: float, tokens: int, now: float
) -> None:
    """Settle every hold `charge_with_more` made for `charge` (see `Report.charge`)."""
    assert charge.more is not None
    for index, scoped in enumerate((charge, *charge.more.also)):
        sub = _sub(reservation, index)
        if scoped.spend is not None:
            state.settle(scoped.key, sub, actual, now)
        more = scoped.more
        if more is None:
            continue
        if more.share is not None and more.share.tokens_per_minute is not None:
            share_settle(state, scoped.key, sub, float(tokens), now)
        key = bounded_key(scoped.key)
        for counter, limit, _, _ in _held_limits(key, more, now):
            if limit == "tokens_per_minute":
                state.replace_hold(counter, sub, float(tokens), now)
            elif limit == "spend_per_month":
                state.settle_hold(counter, sub, actual, MONTHLY_TTL_S, now)
            else:
                ttl = DAILY_TTL_S if limit == "tokens_per_day" else MONTHLY_TTL_S
                state.settle_hold(counter, sub, float(tokens), ttl, now)


def near_scopes(state: LimitState, charge: Charge, now: float) -> tuple[int, ...]:
    """The scopes of `charge` (just written) past their soft limits (`MoreLimits.soft`): those
    whose soft charge the store would refuse now. Reads only."""
    more = charge.more
    if more is None or not more.watched:
        return ()
    near = []
    for index, scoped in enumerate((charge, *more.also)):
        soft = scoped.more.soft if scoped.more is not None else None
        if soft is None:
            continue
        found, _ = state.charge(soft, now, dry=True, alone=True)
        if found is None and soft.more is not None:
            found = _check_more(state, soft, soft.more, now)
        if found is not None:
            near.append(index)
    return tuple(near)
