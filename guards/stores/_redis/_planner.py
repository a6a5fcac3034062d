"""The script's arguments for a step, and its replies (`Planner`, one per store): a step (the
walk's whole passage through the budget, the breakers and the cooldowns, see
`guards.stores.Step`) becomes one `step` script's KEYS and fields, its reply a `Passage`. The
fields travel joined by '|' in one argument (each packed argument costs the client more than
the script's split), the reply as one string (one reply to parse, not a dozen); the usual
answer (no report, the first leg admitted with nothing to record, no hold) is one letter,
`P`. A step with nothing of its own in it (a request's first step, which the route keeps per
caller) has its keys and fixed arguments made once. Also the replies of the breakers'
operations and of `task_claim`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from .._base import Admission, Charge, MoreLimits, Passage, Step, TaskClaim, TaskStatus, bounded_key
from .._breaker import Breaker, BreakerDecision, BreakerState, CircuitState
from .._epoch import Epoch
from ._keys import Keys
from ._scripts import num

__all__ = [
    "MAX_FIXED",
    "Planner",
    "decision_of",
    "holds",
    "more_fields",
    "passage",
    "policy_args",
    "refusal_of",
    "state_of",
    "task_claim_of",
]

#: The most steps a store keeps the fixed arguments of (a route keeps one per caller), and
#: the longest budget key of a step kept: what they hold stays within a few megabytes.
MAX_FIXED = 4096
MAX_FIXED_KEY = 128


class Planner:
    """The script's arguments for the steps of a store whose keys `keys` names."""

    def __init__(self, keys: Keys) -> None:
        self._key = keys.key
        self._epoch_key = keys.epoch
        #: Per step without anything of its own (see `command`): its keys and fixed arguments.
        self._fixed: dict[int, tuple[Step, list[str], str]] = {}

    def command(self, step: Step, known: str) -> tuple[list[str], tuple[str, ...]]:
        """`step` as one server's `step` script: its KEYS and its fields from ARGV[3] (after the
        time argument), `known` (the store's epoch as the worker knows it) last."""
        report, charge = step.report, step.charge
        if report is None and (
            charge is None
            or (charge.spend is None and len(charge.key) <= MAX_FIXED_KEY and charge.more is None)
        ):
            # Nothing of its own in it (a request's first step, which the route keeps per
            # caller): its keys and fixed arguments are made once.
            # (The entry holds the step: no other object can have its id while it is kept.)
            fixed = self._fixed.get(id(step)) or self._fix(step)
            keys, args = fixed[1], fixed[2]
        else:
            keys, args = self.arguments(step)
        keys, fields = self.completed(step, keys, args)
        return keys, (*fields, known)

    def completed(self, step: Step, keys: list[str], args: str) -> tuple[list[str], tuple[str, ...]]:
        """`step`'s keys and fields (`arguments`) with what the fixed arguments leave out: the
        legs' success ages after the fields, and the charges with `MoreLimits` (their tags
        before the epoch marker's key, which stays last; their fields ARGV[4], before the epoch
        the worker knows, last). The fields: ARGV[3] (and ARGV[4])."""
        ages = step.success_ages
        if ages:
            args = "|".join([args, *[num(age) for age in ages[: len(step.legs)]]])
        charge, report = step.charge, step.report
        if (charge is not None and charge.more is not None) or (
            report is not None and report.charge is not None
        ):
            more_keys, more = self._more_arguments(step, args)
            return [*keys[:-1], *more_keys, keys[-1]], (args, more)
        return keys, (args,)

    def _fix(self, step: Step) -> tuple[Step, list[str], str]:
        if len(self._fixed) >= MAX_FIXED:
            del self._fixed[next(iter(self._fixed))]  # the oldest
        fixed = self._fixed[id(step)] = (step, *self.arguments(step))
        return fixed

    def arguments(self, step: Step, reservation: str | None = None) -> tuple[list[str], str]:
        """The script's keys for `step`, and its fields joined by '|' up to the legs' success
        ages (see the script's `step`). `reservation`: the hold's (made here when None)."""
        legs, report, charge = step.legs, step.report, step.charge
        keys = [self._key(cooldown_key) + ":cooldown" for cooldown_key, _ in legs]
        keys += [self._key(breaker_key) + ":breaker" for _, breaker_key in legs]
        args: list[str] = [str(len(legs)), *policy_args(step.breaker)]
        if reservation is None:
            reservation = os.urandom(8).hex() if charge is not None and holds(charge) else ""
        if charge is None:
            keys += ["", "", ""]
            args += ["", "", "", "", "", "", ""]
        else:
            tag = self._key(charge.key)
            keys += [tag + ":window", tag + ":day:", tag + ":spend:"]
            args += ["1" if charge.more is None else "2", num(charge.per_minute), num(charge.per_day)]
            args += [num(charge.spend), num(charge.spend_cap), num(charge.hold_s), reservation]
        record = report is not None and report.breaker_key is not None and report.breaker is not None
        if report is None:
            keys += ["", "", ""]
            args += [*policy_args(None), "", "", "", "", ""]
        else:
            keys += [
                self._key(report.breaker_key) + ":breaker" if record and report.breaker_key else "",
                self._key(report.cooldown_key) + ":cooldown" if report.cooldown_key else "",
                self._key(report.spend_key) + ":spend:" if report.spend_key else "",
            ]
            args += [*policy_args(report.breaker if record else None), report.outcome.value]
            cooling = report.cooldown_key is not None
            cooldown = num(report.cooldown_s if cooling else None)
            if cooling and report.cooldown_until is not None:
                cooldown += " " + num(report.cooldown_until)
            args += [num(report.probe), cooldown]
            settle = report.spend_key is not None and report.reservation is not None
            args += [report.reservation or "" if settle else "", num(report.actual)]
        args.append(num(report.success_age if record and report is not None else None))
        keys.append(self._epoch_key)  # always the last key (the script's `check_epoch`)
        # Every field is a number, a token or a hex reservation: none holds a '|'.
        return keys, "|".join(args)

    def _more_arguments(self, step: Step, args: str) -> tuple[list[str], str]:
        """The script's keys and ARGV[4] for the charges with `MoreLimits` of `step` (its
        charge's scopes) and of its report (to settle): the tag of each charge's keys, and
        their fields (see the script's `step`)."""
        charge, report = step.charge, step.report
        charged = () if charge is None or charge.more is None else (charge, *charge.more.also)
        settled = (
            ()
            if report is None or report.charge is None or report.reservation is None
            else (
                report.charge,
                *(report.charge.more.also if report.charge.more is not None else ()),
            )
        )
        keys = [self._key(each.key) for each in (*charged, *settled)]
        fields = [str(len(charged)), *[f for each in charged for f in more_fields(each)], str(len(settled))]
        if report is not None:
            fields += [report.reservation or "", num(report.actual), num(report.tokens)]
        else:
            fields += ["", "", ""]
        fields += [f for each in settled for f in more_fields(each)]
        if charge is not None and charge.more is not None and charge.more.watched:
            softs = [
                (index, each.more.soft)
                for index, each in enumerate(charged)
                if each.more is not None and each.more.soft is not None
            ]
            fields.append(str(len(softs)))
            for index, soft in softs:
                fields += [str(index), *more_fields(soft)]
        return keys, "|".join(fields)


def passage(step: Step, reply: list[str]) -> Passage:
    """A step's `Passage` from the script's reply (its fields, split at '|')."""
    legs, report = step.legs, step.report
    admitted, refused_by, retry_after, held, recorded, report_to, admit_to = reply[:7]
    n = len(legs)
    waits = tuple(float(wait) for wait in reply[7 : 7 + n])
    decisions = tuple(
        decision_of(reply[7 + n + 5 * i : 12 + n + 5 * i]) if reply[7 + n + 5 * i] else None for i in range(n)
    )
    transitions: list[tuple[str, CircuitState]] = []
    if report_to and report is not None and report.breaker_key is not None:
        transitions.append((report.breaker_key, CircuitState(report_to)))
    if admit_to and admitted:
        transitions.append((legs[int(admitted)][1], CircuitState(admit_to)))
    if admitted:
        decisions = decisions[: int(admitted) + 1]
    else:
        last = max((i for i, d in enumerate(decisions) if d is not None), default=-1)
        decisions = decisions[: max(last + 1, n)]
    return Passage(
        waits,
        decisions,
        int(admitted) if admitted else None,
        refusal_of(refused_by, retry_after) if refused_by else None,
        held or None,
        state_of(recorded.split(" ")) if recorded else None,
        tuple(transitions),
        near=tuple(int(index) for index in reply[7 + 6 * n].split(" ")) if len(reply) > 7 + 6 * n else (),
    )


def task_claim_of(reply: list[str], epoch: Epoch, slot: int | None) -> TaskClaim:
    """`task_claim`'s answer from the script's reply (its epoch, if any, told to `epoch`, for
    `slot`: Redis Cluster; None: the store's one marker)."""
    status, lease, response, retry_after = reply[:4]
    pairs = reply[4:]
    if len(pairs) % 2:  # the store's epoch, after the steps' pairs: not the one this worker knew
        if slot is None:
            epoch.found(pairs.pop())
        else:
            epoch.found_in(slot, pairs.pop())
    elif slot is not None:
        epoch.seen_in(slot)
    return TaskClaim(
        TaskStatus(status),
        lease or None,
        dict(zip(pairs[::2], pairs[1::2], strict=True)),
        response if status == TaskStatus.done else None,
        float(retry_after) if retry_after and retry_after != "new" else None,
    )


def holds(charge: Charge) -> bool:
    """Whether `charge` (any of its scopes) holds spend or tokens."""
    return any(
        each.spend is not None
        or (
            (more := each.more) is not None
            and (more.tokens is not None or (more.spend is not None and more.spend_per_month is not None))
        )
        for each in (charge, *(charge.more.also if charge.more is not None else ()))
    )


def more_fields(charge: Charge) -> list[str]:
    """A charge's 15 fields in the script's ARGV[4] (see `more_charges` in the script); a
    shared limit's tenant travels in hex (a key may hold a '|')."""
    more = charge.more or MoreLimits()
    share = more.share
    return [
        num(charge.per_minute),
        num(charge.per_day),
        num(charge.spend),
        num(charge.spend_cap),
        num(more.per_month),
        num(more.spend),
        num(more.spend_per_month),
        num(more.tokens),
        num(more.tokens_per_minute),
        num(more.tokens_per_day),
        num(more.tokens_per_month),
        num(None if share is None else share.per_minute),
        num(None if share is None else share.tokens_per_minute),
        num(None if share is None else share.weight),
        "" if share is None else bounded_key(share.tenant).encode("utf-8", "surrogatepass").hex(),
    ]


def refusal_of(refused_by: str, retry_after: str) -> Admission:
    """A step's refusal: '<retry>' (one charge), or '<retry or none> <scope index>'."""
    retry, _, index = retry_after.partition(" ")
    return Admission(False, refused_by, None if retry == "none" else float(retry), int(index or 0))


def decision_of(fields: Sequence[str]) -> BreakerDecision:
    allowed, probe, state, retry_after, record_success = fields
    return BreakerDecision(
        allowed == "1",
        probe=float(probe) if probe else None,
        state=CircuitState(state),
        retry_after_s=float(retry_after) if retry_after else None,
        record_success=record_success == "1",
    )


def state_of(fields: Sequence[str]) -> BreakerState:
    state, opened_at, probes, last_probe_at, successes, probe_since, failures, open_s, calls, probe_s = fields
    return BreakerState(
        CircuitState(state),
        failures=_times(failures),
        opened_at=float(opened_at),
        probes=int(probes),
        last_probe_at=float(last_probe_at),
        successes=int(successes),
        probe_since=float(probe_since),
        open_s=float(open_s),
        calls=_times(calls),
        probe_s=float(probe_s),
    )


def _times(word: str) -> tuple[float, ...]:
    """A list of times as the script writes it (comma-separated, or '-' for none)."""
    return tuple(float(t) for t in word.split(",")) if word != "-" else ()


@functools.lru_cache(maxsize=64)  # a route's policy, formatted for each of its requests once
def policy_args(policy: Breaker | None) -> tuple[str, ...]:
    if policy is None:
        return ("", "", "", "", "", "")
    window, reset = num(policy.window_s), num(policy.reset_timeout_s)
    if policy.slow_call_s is not None:  # (the script's `read_policy`: words after the window)
        window += f" {num(policy.slow_call_s)} {num(policy.minimum_calls)}"
    if (interval := policy.reopen_after_probe_s) is not None:
        reset += " " + num(interval)
    return (
        num(policy.failure_threshold),
        window,
        reset,
        num(policy.half_open_probes),
        num(policy.success_threshold),
        num(policy.ttl_s),
    )
