"""The store interface: the few atomic operations the guards need.

Each operation is one atomic step with respect to every other caller of the same store (other
tasks, other workers, other machines, depending on the implementation): a check and its charge
never interleave with another check. Every key a store writes expires. An operation that cannot
reach its store raises `StoreUnavailable`, never anything else and never after hanging: each
store bounds its operations by its own short timeout.
"""

from __future__ import annotations

import calendar
import functools
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from ..contracts._errors import GuardsError
from ._breaker import Breaker, BreakerDecision, BreakerState, CircuitState, Outcome


class StoreUnavailable(GuardsError):
    """The store did not answer (down, unreachable, or slower than its own timeout).

    Raised by every store operation in that case, and only then. Guards answer it with their
    configured failure mode (`fail_open` or `fail_closed`). The message never carries the
    store's URL or password.
    """


__all__ = [
    "ADMITTED",
    "DAILY_TTL_S",
    "DAY_S",
    "MAX_KEY_CHARS",
    "MINUTE_S",
    "MONTHLY_TTL_S",
    "SHARE_TENANTS_CAP",
    "TOKEN_WINDOW_CAP",
    "Admission",
    "BreakerDecision",
    "BreakerState",
    "Charge",
    "Health",
    "MoreLimits",
    "Outcome",
    "Passage",
    "Report",
    "Share",
    "SpendReservation",
    "Step",
    "Store",
    "StoreUnavailable",
    "StoredAnswer",
    "TaskClaim",
    "TaskStatus",
    "bounded_key",
    "next_month_s",
    "utc_day",
    "utc_month",
]


DAY_S = 86_400.0
#: Daily counters outlive their day by this much, so none expires while its day is current.
DAILY_TTL_S = DAY_S + 3_600.0
#: The window of `per_minute` limits.
MINUTE_S = 60.0
#: Monthly counters outlive their UTC calendar month (31 days at most) by a day and an hour.
MONTHLY_TTL_S = 32 * DAY_S + 3_600.0
#: The most token holds a key's `tokens_per_minute` window keeps: a charge that would add one
#: more is refused (`tokens_per_minute`) until the oldest leaves the window.
TOKEN_WINDOW_CAP = 10_000
#: The most tenants a shared limit's minute tracks (`Share`): past it, a tenant the minute has
#: not seen yet is counted in one overflow bucket (`SHARE_OVERFLOW`, weight 1) with every other
#: such tenant.
SHARE_TENANTS_CAP = 256
#: The overflow bucket's name in a shared limit's minute (no tenant's hex name can be it).
SHARE_OVERFLOW = "*"


#: The longest key a store keeps as it is given; a longer one is hashed (see `bounded_key`).
MAX_KEY_CHARS = 200
#: A hashed key keeps this many characters of the caller's key, so it stays recognisable.
_KEPT_CHARS = MAX_KEY_CHARS - 64


def bounded_key(key: str) -> str:
    """The key a store writes for the caller's `key`: `key` itself when it has at most
    `MAX_KEY_CHARS` characters; else its first 136 characters, `#` and the SHA-256 of the whole
    key in hex (201 characters). Every store passes every key through this, so a key's size is
    bounded whatever the caller's, and a long key cannot collide with a short one (no kept key
    has 201 characters) nor, short of a SHA-256 collision, with another long one."""
    if len(key) <= MAX_KEY_CHARS:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{key[:_KEPT_CHARS]}#{digest}"


@functools.lru_cache(maxsize=4)
def _day_name(day_number: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(day_number * DAY_S))


def utc_day(now: float) -> str:
    """The UTC day of `now` (seconds since the epoch) as `YYYY-MM-DD`: part of daily keys."""
    return _day_name(int(now // DAY_S))


def utc_month(now: float) -> str:
    """The UTC calendar month of `now` as `YYYY-MM`: part of monthly keys."""
    return _day_name(int(now // DAY_S))[:7]


def next_month_s(now: float) -> float:
    """Seconds from `now` to the start of the next UTC calendar month."""
    year, month = time.gmtime(now)[:2]
    year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0)) - now


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer of a budget check. When refused, `refused_by` names the limit (`"per_minute"`,
    `"per_day"`, `"per_month"`, `"spend_per_day"`, `"spend_per_month"`, `"tokens_per_minute"`,
    `"tokens_per_day"` or `"tokens_per_month"`), `retry_after_s` says when it frees up (None: a
    hold larger than the limit itself, which never fits), and `charge` which of the step's
    charges refused (0: `Step.charge` itself; i: `Step.charge.more.also[i - 1]`)."""

    allowed: bool
    refused_by: str | None = None
    retry_after_s: float | None = None
    charge: int = 0


ADMITTED = Admission(True)


@dataclass(frozen=True, slots=True)
class SpendReservation:
    """The answer of a built-in store's `reserve_spend` (a spend hold on its own, outside a
    `Step`). When allowed, `reservation` identifies the hold to settle; when refused,
    `retry_after_s` is the time until the next UTC day."""

    allowed: bool
    reservation: str | None = None
    retry_after_s: float | None = None


# Charge, Report, Step and Passage are built for every request: plain slotted dataclasses, not
# frozen ones, whose `__init__` sets each field through `object.__setattr__` (about 1,200 CPU
# instructions a field, four times a plain one's). Nothing changes them once built: treat them
# as read-only values (`dataclasses.replace` makes a changed copy). Charge and Step take their
# fields by position too, in the order declared: the walk builds them so, as a call to a class
# with keywords costs about twice a positional one on CPython 3.11 (about 4,000 instructions
# for four fields: the keywords travel in a dict through `type.__call__`).


@dataclass(slots=True)
class Charge:
    """The budget a request pays once, in the step that admits its first call, under `key`:

    - `per_minute`: admitted if fewer than this many requests were charged under `key` in the
      last 60 seconds (a sliding window: never more than `per_minute` in any 60 seconds);
    - `per_day`: admitted if fewer than this many were charged during the current UTC day, as
      the store's clock tells it (counter `{key}:day:{YYYY-MM-DD}`, kept `DAILY_TTL_S`);
    - `spend`, when set: holds that many cost units of the UTC day's spend under `key` if
      settled spend plus live holds plus `spend` stays within `spend_cap`; a hold not settled
      within `hold_s` seconds (its worker crashed) lapses and frees its room.

    `more`, when set, adds monthly periods, token limits and other scopes (see `MoreLimits`).

    `None` disables a limit. The charge is all or nothing: a refusal by any limit (of any of
    its scopes) charges none of them; when several are spent, the refusal names the one that
    frees up last."""

    key: str
    per_minute: int | None = None
    per_day: int | None = None
    spend: float | None = None
    spend_cap: float = 0.0
    hold_s: float = 0.0
    more: MoreLimits | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MoreLimits:
    """What a `Charge` pays beyond a rate, a daily count and a daily spend (issue 29), under
    the charge's `key`, in the same all-or-nothing step:

    - `per_month`: admitted if fewer than this many were charged during the current UTC
      calendar month (counter `{key}:month:{YYYY-MM}`, kept `MONTHLY_TTL_S`);
    - `spend` with `spend_per_month`: holds `spend` cost units of the month's spend
      (`{key}:spend:{YYYY-MM}`) as `Charge.spend` does of the day's;
    - `tokens` with `tokens_per_minute`, `tokens_per_day`, `tokens_per_month`: holds `tokens`
      tokens in each window set: a sliding 60 seconds (`{key}:tokens:minute`: each hold counts
      until 60 s after it was made, at most `TOKEN_WINDOW_CAP` holds), the UTC day
      (`{key}:tokens:{YYYY-MM-DD}`) and the UTC month (`{key}:tokens:{YYYY-MM}`), the day's and
      month's holds lapsing after `Charge.hold_s` as spend holds do;
    - `also`: the charges of the request's other scopes (each under its own key, with no
      `also` of its own), admitted with this one or not at all;
    - `soft`: the scope's soft limit, as a charge under the same key whose limits are the soft
      ones (each count limit `floor(fraction x limit) + 1`, each held limit `fraction x limit`,
      a token limit its floor, its amounts 0): once the charge passed, the step checks it with nothing written, and a
      refusal means the scope is past its soft limit, this charge included
      (`Passage.near`); `watched` (on the first charge's `more` only): some scope has one.

    A hold (spend or tokens) is settled by a `Report` carrying the charge (`Report.charge`)."""

    per_month: int | None = None
    spend: float | None = None
    spend_per_month: float | None = None
    tokens: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    also: tuple[Charge, ...] = ()
    soft: Charge | None = None
    watched: bool = False
    share: Share | None = None


@dataclass(frozen=True, slots=True)
class Share:
    """A shared upstream limit's fair share (issue 43), charged under its charge's key (the
    shared limit's, not the tenant's), in the same all-or-nothing step as the rest: the UTC
    minute of the store's clock (a fixed window) counts each active tenant's requests and
    tokens (`MoreLimits.tokens`, held, then settled to the usage); a tenant is active once it
    was admitted or refused by the share in the minute, and its share of a limit `L` is
    `L x weight / (the weights of the minute's active tenants)`.

    A request that fits in its tenant's share is admitted while the minute's total stays within
    `L`; any other only from what no other active tenant's unused share needs (admitted when
    `total + amount <= L - sum(max(0, share_j - used_j))` over the other active tenants). A
    refusal (`shared_per_minute`, `shared_tokens_per_minute`) waits for the minute's end.
    `tenant` is the tenant's key (bounded as any key is: `bounded_key`), `weight` its weight
    (above 0). At most `SHARE_TENANTS_CAP` tenants a minute, then one overflow bucket."""

    tenant: str
    weight: float = 1.0
    per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(slots=True, kw_only=True)
class Report:
    """What became of a call that an earlier step admitted, applied first in a step.

    - `breaker_key` (with `breaker`, `outcome`, `probe`): record the call's outcome on that
      breaker (`guards.Breaker`'s transitions; `probe` is the ticket the admission returned);
      None: nothing to record;
    - `cooldown_key`, `cooldown_s`: cool the key down for `cooldown_s` seconds from now (the
      store's clock; 0: none), never shortening a cooldown already running; the key expires
      when its cooldown ends. `cooldown_until` (the provider's HTTP date, seconds since the
      epoch), when set, ends it no later than that on the store's clock: it lasts
      `min(cooldown_s, cooldown_until - now)`, and a date already past starts none;
    - `spend_key`, `reservation`, `actual`: settle the request's spend hold, made on the same
      UTC day: the hold is replaced by the `actual` cost, which is added even if the hold
      already lapsed (the call happened); None: no hold;
    - `success_age`: how many seconds ago the caller's last success on the breaker's model
      ended (None: none known), applied before the outcome, as `Step.success_ages` is;
    - `charge` (with `reservation`, `actual` and `tokens`): settle every hold of a charge with
      `more` (every scope's): each spend hold is replaced by `actual` in its period, each
      token hold of the day and month by `tokens` (added even if the hold lapsed, as spend
      is), and the hold in the minute window takes `tokens` in its place while it is still in
      the window. `spend_key` is then None.
    """

    breaker_key: str | None = None
    breaker: Breaker | None = None
    outcome: Outcome = Outcome.released
    probe: float | None = None
    success_age: float | None = None
    cooldown_key: str | None = None
    cooldown_s: float = 0.0
    cooldown_until: float | None = None
    spend_key: str | None = None
    reservation: str | None = None
    actual: float = 0.0
    charge: Charge | None = None
    tokens: int = 0


@dataclass(slots=True)
class Step:
    """One step of a request's walk along its fallback chain, done as one atomic store
    operation (see `Store.step`).

    `report` (optional) is applied first. Then, when `legs` is not empty, the first leg that
    is not cooling down and whose breaker (`breaker`; None: no breaker) lets a call through is
    admitted; each leg is `(cooldown_key, breaker_key)`. When `charge` is set, the admission
    also pays it; if the charge is refused, nothing of the admission is written.

    `success_ages` (one per leg, or none): how many seconds ago, by the caller's clock, the
    caller's last success on each leg's model ended (None: none known). A success admitted
    while its breaker counted no failure is not reported (a closed breaker's success writes
    nothing); this is how it still ends a run of failures: a closed breaker counting
    consecutive failures forgets those counted before `now - age` (store time) when the step
    reads it, whether or not the leg is then admitted. The age is a difference, so the
    caller's clock need not agree with the store's; it is exact to within the step's transit.
    The walk's ages are computed as they are read (so a store reads them only when it needs
    them), and its first step is shared by the requests of a caller: a store treats a step
    as read-only.
    """

    report: Report | None = None
    legs: Sequence[tuple[str, str]] = ()
    breaker: Breaker | None = None
    charge: Charge | None = None
    success_ages: Sequence[float | None] = ()


@dataclass(slots=True)
class Passage:
    """The answer of `Store.step`.

    - `waits`: seconds of cooldown left for each leg of the step (0.0: not cooling down);
    - `decisions`: the breaker's decision for each leg up to the one admitted (None for a leg
      skipped for its cooldown, and for every leg when the step has no breaker);
    - `admitted`: the index in `legs` of the leg admitted, or None (every leg skipped, or the
      charge refused);
    - `refusal`: why the charge was refused (see `Admission`), or None;
    - `reservation`: the hold to settle later, when the charge held spend or tokens;
    - `recorded`: the reported breaker's state after the report, when one was recorded;
    - `transitions`: each breaker state change this step made, as (breaker key, the state
      entered): the report's (to open, or to closed), then the admission's (open to half_open).
      The store makes a change once, so exactly one caller, among every worker sharing the
      store, is told of it: what `guards_breaker_transitions_total` counts;
    - `plain`: True when the step did only the usual, which the rest then says: no report, no
      leg cooling down, the first leg admitted with no probe and no success to record (a closed
      breaker counting no failure, or no breaker), the charge (if any) passed without a spend
      hold and with no scope past its soft limit. A caller may then skip reading the rest; a
      store may always leave it False;
    - `near`: the index of each scope of the charge (0: `Step.charge` itself; i: its
      `more.also[i - 1]`) past its soft limit after this charge (`MoreLimits.soft`).
    """

    waits: tuple[float, ...] = ()
    decisions: tuple[BreakerDecision | None, ...] = ()
    admitted: int | None = None
    refusal: Admission | None = None
    reservation: str | None = None
    recorded: BreakerState | None = None
    transitions: tuple[tuple[str, CircuitState], ...] = ()
    plain: bool = False
    near: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    """The answer of `Store.get_answer`: the value kept, and its age in seconds (store time)."""

    value: str
    age_s: float


@dataclass(frozen=True, slots=True)
class Health:
    """The answer of `Store.health`: the store's time `now`, and for each model asked about,
    its breaker's state (`BreakerState()`, closed, when it has none) and the seconds left on
    its cooldown (0.0: not cooling down), read together."""

    now: float
    breakers: tuple[BreakerState, ...]
    cooldowns: tuple[float, ...]


class TaskStatus(StrEnum):
    """What `Store.task_claim` found under a task's key."""

    #: The caller holds the task's lease now (a new task, or one whose lease was released or
    #: lapsed): run it; `TaskClaim.steps` holds the steps saved so far.
    claimed = "claimed"
    #: Another caller holds the lease; `TaskClaim.retry_after_s` says when it lapses.
    busy = "busy"
    #: The task was started with another fingerprint (another request body).
    reused = "reused"
    #: The task completed; `TaskClaim.response` is the response it stored.
    done = "done"
    #: No such task, and its owner has `max_live` live tasks already: none is made;
    #: `TaskClaim.retry_after_s` says when the owner's oldest live task expires.
    full = "full"


@dataclass(frozen=True, slots=True)
class TaskClaim:
    """The answer of `Store.task_claim` (see `TaskStatus`). `lease` is the caller's lease
    token when `claimed`; `steps` maps each saved step's name to its value."""

    status: TaskStatus
    lease: str | None = None
    steps: Mapping[str, str] = field(default_factory=dict)
    response: str | None = None
    retry_after_s: float | None = None


@runtime_checkable
class Store(Protocol):
    """The methods guards calls on a store, and all that a store of your own implements:
    `now`, `step`, `put_answer`, `get_answer`, `health`, the five task operations (`task_claim`,
    `task_save`, `task_complete`, `task_release`, `task_drop`) and `aclose`;
    `isinstance(store, Store)` checks that each is there. Each but `aclose` is one atomic
    operation that raises `StoreUnavailable`, and nothing else, when the store cannot be reached
    (see the module's docstring). `MemoryStore`, `SQLiteStore` and `RedisStore` also do each
    guard's operation on its own (`charge_budget`, `start_cooldown`, ...), which guards never
    calls.

    A store may also have a `clock` attribute (a `guards.Clock`, as the built-in stores do):
    then the age of a success (`Step.success_ages`) is measured on it, and the pytest plugin's
    `use_fake_ai` gives its fresh `MemoryStore` the same clock."""

    async def now(self) -> float:
        """Seconds since the Unix epoch as the store sees it: all workers sharing the store
        agree on days and timeouts even when their own clocks drift."""
        ...

    async def step(self, step: Step) -> Passage:
        """Do `step` in one atomic operation (one transaction on SQLite, one script call on
        Redis, one synchronous call in memory): report the last call, then admit the next
        one and charge the request's budget (see `Step`). What a guard needs per request:
        one operation to admit its first call, and one more per call that failed or must
        report (a probe, a success after counted failures, a spend or token hold to settle).

        A breaker whose state does not change is not written: a closed breaker's success,
        an open breaker's refusal. A success that is not reported still ends a run of
        failures, at the caller's next step about its model (`Step.success_ages`,
        `Report.success_age`). Raises `StoreUnavailable` when the store cannot be
        reached, and then nothing of the step was done."""
        ...

    async def put_answer(self, key: str, value: str, *, ttl_s: float) -> None:
        """Keep `value` (a route's last good answer) under `key`, replacing what was there, for
        `ttl_s` seconds from now (store time), in one atomic step. The caller hashes `key`."""
        ...

    async def get_answer(self, key: str, *, max_age_s: float) -> StoredAnswer | None:
        """The value kept under `key` with its age, if it was put less than `max_age_s` seconds
        ago and has not expired; else None."""

    async def health(self, legs: Sequence[tuple[str, str]]) -> Health:
        """Read the health of models in one operation, writing nothing: for each leg
        `(cooldown_key, breaker_key)`, the breaker's state and the seconds of cooldown left,
        with the store's time. What the service level is derived from (at most once a second
        per worker, off the request path)."""
        ...

    # --- tasks: a multi-step request's checkpoints under one key, each operation atomic ------
    # A task lives `ttl_s` from its creation (every part of it expires then), bound to the
    # fingerprint it was created with. One caller at a time holds its lease. A task may count
    # against an owner (a route's caller), whose live tasks are capped.

    async def task_claim(
        self,
        key: str,
        *,
        fingerprint: str,
        lease_s: float,
        ttl_s: float,
        owner: str | None = None,
        max_live: int | None = None,
    ) -> TaskClaim:
        """Claim the task `key` for `lease_s` seconds, in one atomic step: create it (kept
        `ttl_s`) when there is none; else answer `reused` when its fingerprint differs, `done`
        with its response when it completed, `busy` while another caller's lease runs; else
        (its lease released or lapsed) take the lease and answer its saved steps.

        With `owner`, a new task counts as one of `owner`'s live tasks until it expires (or
        is dropped: `task_drop`); with `max_live` too, when `owner` has that many live tasks
        already, no task is made and the claim answers `full`."""
        ...

    async def task_save(self, key: str, lease: str, name: str, value: str, *, lease_s: float) -> bool:
        """Save step `name`'s `value` (replacing an earlier one) and renew the lease for
        `lease_s`, if `lease` still holds the task and it has not completed. False: not saved."""
        ...

    async def task_complete(self, key: str, lease: str, response: str) -> bool:
        """Complete the task held by `lease`: keep `response` (to its expiry) for replays, drop
        its steps and its lease. False if `lease` no longer holds it (nothing written)."""
        ...

    async def task_release(self, key: str, lease: str) -> None:
        """Give up the lease `lease` (the request failed): the next claim resumes at once."""
        ...

    async def task_drop(self, key: str, lease: str) -> None:
        """Give up the lease `lease` of a request that called nothing (refused before any
        model call): a task that saved no step and did not complete is deleted, with its place
        among its owner's live tasks, as if never claimed; any other is released
        (`task_release`). Nothing happens if `lease` no longer holds the task."""
        ...

    async def aclose(self) -> None:
        """Release what the store holds (connections, threads), at the app's shutdown
        (`Guards.aclose`)."""
        ...
