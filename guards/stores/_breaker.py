"""Circuit breaker: the policy and its pure state transitions.

Stores hold a `BreakerState` per key and apply `admit` / `record` atomically; the functions here
do no I/O, so every store shares the same semantics and they are tested with tables of cases.

States: closed (calls flow, failures counted) → open (calls skipped until `reset_timeout_s`
passes) → half-open (at most `half_open_probes` calls in flight; `success_threshold` successes
close it, one failure reopens it, for `probe_interval_s`: 5 s by default). Failures count either
consecutively (`window_s=None`: a success resets the count) or within a sliding window of
`window_s` seconds; with `slow_call_s`, a slow success counts as a failure once the window holds
`minimum_calls` calls (`BreakerState.calls`).

The open period is decided once, by the policy of the call whose failure opened the breaker, and
kept in its state (`BreakerState.open_s`): every reader of a shared breaker (another worker,
another app with a policy of its own) then agrees on when it half-opens, and on when a probe
slot held too long is reclaimed.

Consecutive failures are failures with no success ending between them, in the order the store
sees calls end. A success admitted while the breaker counted no failure is not recorded (a
closed breaker's success writes nothing: `BreakerDecision.record_success`); its caller tells
the store when it ended at its next operation about that model instead, and `forget_before`
drops the failures counted before that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

from ..contracts._errors import ConfigurationError
from ..contracts._settings import UNSET, Unset, choice, number, settings, whole
from ..contracts._vocabulary import CircuitState

__all__ = [
    "Breaker",
    "BreakerDecision",
    "BreakerState",
    "CircuitState",
    "DEFAULT_PROBE_INTERVAL_S",
    "Outcome",
    "half_open_at",
    "keep_s",
    "open_period",
]

#: The most calls `Breaker.minimum_calls` may ask for: the state keeps that many end times and
#: is rewritten at every call, so it stays small.
MAX_MINIMUM_CALLS = 1000
#: How long a failed probe reopens a breaker whose `probe_interval_s` is left unset (at most
#: its `reset_timeout_s`): a model that recovers is back within a few seconds.
DEFAULT_PROBE_INTERVAL_S = 5.0


class Outcome(StrEnum):
    """What a guarded call (after its retries) tells the breaker."""

    success = "success"
    failure = "failure"
    #: A success slower than the policy's `Breaker.slow_call_s` (only a route whose breaker
    #: sets it reports one): a failure once the window holds `minimum_calls` calls, else a
    #: success; a slow probe is a failed probe. A policy without `slow_call_s` takes it as a
    #: success.
    slow = "slow"
    #: The call ended without a verdict on the provider (cancelled): free its probe slot only.
    released = "released"


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class Breaker:
    """Circuit breaker policy, one breaker per model.

    `failure_threshold` failures (consecutive, or within `window_s` seconds when set) open the
    breaker; after `reset_timeout_s` (of the policy whose failure opened it: see
    `BreakerState.open_s`) it half-opens and lets `half_open_probes` calls through at
    a time; `success_threshold` probe successes close it, any probe failure reopens it.
    Consecutive failures are failures with no success ending between them, calls in flight
    included: exact within one worker; a success in another worker ends the run at that
    worker's next store operation about the model (see `guards.stores.Step.success_ages`).

    `slow_call_s` (None: off): a call slower than this counts as a failure toward
    `failure_threshold`, once at least `minimum_calls` calls (of any outcome, this one
    included) ended within the window, which it needs (`window_s`); fewer, and it counts as a
    success. A slow probe is a failed probe. The time is the guarded call's, from its first
    attempt's start until its answer (retries and their waits included; a stream's first
    output). Counting calls takes a store write per call, successes included, on this breaker
    only (a closed breaker's success is otherwise not written).

    `probe_interval_s`: after a failed probe the breaker reopens for this long, not
    `reset_timeout_s` (at most that), so a model that recovers is back within one interval;
    a probe slot held too long is still reclaimed after `reset_timeout_s`. Unset (the
    default): `DEFAULT_PROBE_INTERVAL_S` (5 s), or `reset_timeout_s` when shorter; None: a
    failed probe reopens the breaker for a whole `reset_timeout_s` (the behaviour before 5 s
    became the default). `reopen_after_probe_s` is the interval in force.

    `on_store_failure`: `"open"` (default) lets calls through while the store is unreachable:
    the breaker only saves calls to a provider that is failing anyway, and the deadline and
    bounded retry still limit each call; refusing everything would turn a store outage into an
    outage of every route. `"closed"` skips the calls (`circuit_open`).
    """

    failure_threshold: int = 5
    window_s: float | None = None
    reset_timeout_s: float = 30.0
    half_open_probes: int = 1
    success_threshold: int = 2
    on_store_failure: Literal["open", "closed"] = "open"
    slow_call_s: float | None = None
    minimum_calls: int = 10
    probe_interval_s: float | Unset | None = UNSET

    def __post_init__(self) -> None:
        for name in ("failure_threshold", "half_open_probes", "success_threshold"):
            whole(f"Breaker.{name}", getattr(self, name))
        number("Breaker.reset_timeout_s", self.reset_timeout_s, above=0, unit="seconds")
        number("Breaker.window_s", self.window_s, above=0, unit="seconds", none="consecutive failures")
        choice("Breaker.on_store_failure", self.on_store_failure, ("open", "closed"))
        number(
            "Breaker.slow_call_s", self.slow_call_s, above=0, unit="seconds", none="no call counts as slow"
        )
        if self.slow_call_s is not None and self.window_s is None:
            raise ConfigurationError(
                "Breaker.slow_call_s needs window_s: slow calls count among the calls of a "
                "window of window_s seconds (e.g. Breaker(slow_call_s=20, window_s=60))"
            )
        whole("Breaker.minimum_calls", self.minimum_calls, most=MAX_MINIMUM_CALLS)
        interval = self.probe_interval_s
        if interval is not UNSET:
            none = "a failed probe reopens the breaker for reset_timeout_s"
            number("Breaker.probe_interval_s", interval, above=0, unit="seconds", none=none)
            if interval is not None and interval > self.reset_timeout_s:
                raise ConfigurationError(
                    f"Breaker.probe_interval_s must be at most reset_timeout_s ({self.reset_timeout_s:g}), "
                    f"or None ({none}); got {interval!r}"
                )

    @property
    def reopen_after_probe_s(self) -> float | None:
        """The probe interval in force: `probe_interval_s`, its default when unset
        (`DEFAULT_PROBE_INTERVAL_S`, at most `reset_timeout_s`), or None when set to None (a
        failed probe reopens the breaker for `reset_timeout_s`)."""
        interval = self.probe_interval_s
        if interval is UNSET:
            return min(DEFAULT_PROBE_INTERVAL_S, self.reset_timeout_s)
        return interval

    @property
    def ttl_s(self) -> float:
        """How long a breaker key may sit untouched before it is forgotten (back to closed).

        Longer than any timing the policy relies on, so expiry never changes a decision except
        to forget consecutive failures older than this.
        """
        return 2 * max(self.window_s or 0.0, self.reset_timeout_s) + 600.0


@dataclass(frozen=True, slots=True)
class BreakerState:
    state: CircuitState = CircuitState.closed
    #: Timestamps of counted failures, newest last, at most `failure_threshold` of them.
    failures: tuple[float, ...] = ()
    opened_at: float = 0.0
    probes: int = 0
    last_probe_at: float = 0.0
    successes: int = 0
    #: When the current generation of probes began (half-opening, or reclaiming lost slots).
    #: A probe's ticket; reports carrying an older ticket are stale and ignored.
    probe_since: float = 0.0
    #: The open period (`reset_timeout_s`) of the policy that opened the breaker, kept while
    #: it is open and half-open; 0.0 when closed (or written by a version that did not keep
    #: it: then the reader's policy decides).
    open_s: float = 0.0
    #: End times of the calls counted toward `Breaker.minimum_calls` (recorded by a policy with
    #: `slow_call_s`), newest last, at most `minimum_calls` of them, all within its window.
    calls: tuple[float, ...] = ()
    #: When a failed probe reopened the breaker under a policy with a probe interval
    #: (`Breaker.reopen_after_probe_s`): that interval, after which it half-opens (rather than
    #: `open_s`); 0.0 otherwise.
    probe_s: float = 0.0


CLOSED = BreakerState()


def _positive(x: float) -> bool:
    return 0 < x < math.inf  # (NaN fails both)


@dataclass(frozen=True, slots=True)
class BreakerDecision:
    allowed: bool
    #: Set when the call is a half-open probe: a ticket to pass back as `record(probe=...)`.
    probe: float | None = None
    state: CircuitState = CircuitState.closed
    retry_after_s: float | None = None
    #: False when recording a success would change nothing now (closed, no failures counted,
    #: or failures that only age out of a window): the caller may skip that store operation.
    #: Failures counted while the call runs are then forgotten at the caller's next operation
    #: about the model, which carries when the success ended (see `forget_before`).
    record_success: bool = True


#: The closed breaker's two answers (decisions are immutable: one shared instance each, so the
#: common case allocates nothing).
ADMIT_CLOSED = BreakerDecision(True, record_success=False)
ADMIT_CLOSED_RECORD = BreakerDecision(True, record_success=True)


def open_period(s: BreakerState, policy: Breaker) -> float:
    """How long the breaker `s` stays open before it half-opens (and how long a probe slot
    may be held): the period stored when it opened, else `policy`'s."""
    return s.open_s or policy.reset_timeout_s


def half_open_at(s: BreakerState, policy: Breaker) -> float:
    """When the open breaker `s` half-opens: `probe_s` after it opened when a failed probe
    reopened it under a probe interval, else its open period after."""
    return s.opened_at + (s.probe_s or open_period(s, policy))


def keep_s(s: BreakerState, policy: Breaker) -> float:
    """How long a store keeps `s` after writing it: `policy.ttl_s`, or longer when the
    breaker was opened for longer than `policy` would (by another app's policy)."""
    return max(policy.ttl_s, 2 * s.open_s + 600.0)


def admit(s: BreakerState, policy: Breaker, now: float) -> tuple[BreakerState, BreakerDecision]:
    """May a call go through now? Returns the new state and the decision."""
    if s.state is CircuitState.closed:
        return s, ADMIT_CLOSED_RECORD if policy.window_s is None and s.failures else ADMIT_CLOSED
    if s.state is CircuitState.open:
        reopen_at = half_open_at(s, policy)
        if now < reopen_at:
            return s, BreakerDecision(False, state=s.state, retry_after_s=reopen_at - now)
        s = BreakerState(CircuitState.half_open, opened_at=s.opened_at, probe_since=now, open_s=s.open_s)
    if s.probes < policy.half_open_probes:
        s = replace(s, probes=s.probes + 1, last_probe_at=now)
        return s, BreakerDecision(True, probe=s.probe_since, state=s.state)
    # Every slot is taken. Slots held longer than the reset timeout belong to calls that never
    # reported (their worker died): start a new generation of probes rather than stay
    # half-open forever; the lost probes' tickets go stale.
    reclaim_at = s.last_probe_at + open_period(s, policy)
    if now < reclaim_at:
        return s, BreakerDecision(False, state=s.state, retry_after_s=reclaim_at - now)
    s = replace(s, probes=1, last_probe_at=now, probe_since=now)
    return s, BreakerDecision(True, probe=s.probe_since, state=s.state)


def forget_before(s: BreakerState, policy: Breaker, ended_at: float) -> BreakerState:
    """`s` once a success that ended at `ended_at` (store time) is known: a closed breaker
    counting consecutive failures forgets those counted before it (strictly before: a failure
    counted at the same instant stays). Anything else is returned as it is (an open or
    half-open breaker ignores closed-phase successes; a window's failures only age out)."""
    failures = s.failures
    if (
        not failures
        or failures[0] >= ended_at
        or s.state is not CircuitState.closed
        or policy.window_s is not None
    ):
        return s
    kept = tuple(t for t in failures if t >= ended_at)
    return BreakerState(failures=kept, calls=s.calls) if kept or s.calls else CLOSED


def record(
    s: BreakerState, policy: Breaker, now: float, outcome: Outcome, *, probe: float | None
) -> BreakerState:
    """Apply one guarded call's outcome; `probe` is the ticket `admit` gave (None if none).
    Outcomes of calls admitted in another phase (a closed-phase call finishing after the
    breaker opened, a probe whose slot was reclaimed) change nothing."""
    if outcome is Outcome.slow and policy.slow_call_s is None:
        outcome = Outcome.success
    if probe is not None:
        if s.state is not CircuitState.half_open or probe != s.probe_since:
            return s
        s = replace(s, probes=max(0, s.probes - 1))
        if outcome is Outcome.failure or outcome is Outcome.slow:
            return _opened(policy, now, policy.reopen_after_probe_s or 0.0)
        if outcome is Outcome.success:
            if s.successes + 1 >= policy.success_threshold:
                return CLOSED
            return replace(s, successes=s.successes + 1)
        return s
    if s.state is not CircuitState.closed or outcome is Outcome.released:
        return s
    calls = s.calls
    if policy.slow_call_s is not None and policy.window_s is not None:
        # The calls that ended within the window, this one included: the newest
        # `minimum_calls` are all it takes to tell whether there were that many.
        calls = (*(t for t in calls if t > now - policy.window_s), now)[-policy.minimum_calls :]
        if outcome is Outcome.slow:
            outcome = Outcome.failure if len(calls) >= policy.minimum_calls else Outcome.success
    if outcome is Outcome.success:
        if policy.window_s is None:
            return CLOSED
        return s if calls is s.calls else replace(s, calls=calls)
    failures = (*s.failures, now)
    if policy.window_s is not None:
        failures = tuple(t for t in failures if t > now - policy.window_s)
    failures = failures[-policy.failure_threshold :]
    if len(failures) >= policy.failure_threshold:
        return _opened(policy, now, 0.0)
    return BreakerState(failures=failures, calls=calls)


def _opened(policy: Breaker, now: float, probe_s: float) -> BreakerState:
    """The breaker `policy` opens at `now`: for its `reset_timeout_s`, or `probe_s` when set (a
    failed probe under a probe interval)."""
    return BreakerState(CircuitState.open, opened_at=now, open_s=policy.reset_timeout_s, probe_s=probe_s)
