"""Redis Cluster: the store's operations split per hash slot (`Slots`). A script reaches the keys
of one hash slot only, and each operation goes to the primary of its keys' slot (the slot of
its first key's hash tag: `key_slot`) through the loop's cluster client
(`guards.stores._cluster.Cluster`), which follows `MOVED`, `ASK` and `TRYAGAIN`. An operation
whose keys all share a slot (a one-model route without a budget: a model's breaker and cooldown
share the model's slot, see `Keys.key`) is the one script it is on one server, with that
slot's epoch marker. A step whose keys span slots is split (`Slots.step`):

1. one round trip, a script per slot, all sent together: each part of its report in its slot
   (written whatever follows); the legs of each slot peeked ('peek': decided in order, success
   ages applied, nothing of an admission written); and the charge paid ('pay'): one script
   when every scope shares a slot, all or nothing as on one server, else one per scope;
2. the charge given back ('refund', one round trip, in each slot that took it) when the step
   admits no leg, or when a scope refused: so a refusal charges nothing, as on one server;
3. when the first leg that may be admitted is a half-open probe: that leg admitted for real,
   alone in its slot, once the charge passed (another worker may have taken the probe
   meanwhile: the next legs are then admitted one at a time, for real; none: 2).

Atomic: each script. Across slots: the legs' decision and the charge are made at the same
instant, not as one (a breaker that opens in between lets that one request through, as if it
had come a moment earlier), and a charge given back was there meanwhile (a request of the same
caller in that round trip may be refused for it: never admitted over a cap). `health` is one
script per slot of the legs, in one round trip; `task_claim` claims the task in its slot and
enters a new one in its owner's set (another slot) with a script of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...contracts._clock import Clock
from .._base import Admission, Charge, Health, Passage, Report, Step, TaskClaim, TaskStatus
from .._breaker import ADMIT_CLOSED, BreakerDecision, BreakerState, CircuitState
from .._cluster import key_slot
from .._epoch import Epoch
from .._step import plainly_admitted
from .._task import new_lease
from ._connection import Connections
from ._keys import Keys
from ._planner import MAX_FIXED, Planner, holds, passage, state_of, task_claim_of
from ._scripts import now_arg, num, pack

__all__ = ["Slots"]


@dataclass(slots=True)
class _Plan:
    """A step's scripts on Redis Cluster (`Slots._plan`): `whole`, the one script of a
    step whose keys share a slot; else `scripts`, the report's `parts` first, then a peek per
    group of legs (`grouped`: the legs' indices, per slot), then a pay per scope (`scopes`),
    all holds under `reservation`."""

    whole: tuple[Step, bytes, int] | None
    scripts: list[tuple[Step, bytes, int]] = field(default_factory=list)
    parts: int = 0
    grouped: list[list[int]] = field(default_factory=list)
    scopes: list[Charge] = field(default_factory=list)
    reservation: str = ""


@dataclass(slots=True)
class _Legs:
    """What a split step's scripts said of its legs (each leg's wait and decision, in the legs'
    order), of the state its report recorded, and of the breakers they moved."""

    waits: list[float]
    decisions: list[BreakerDecision | None]
    recorded: BreakerState | None
    transitions: list[tuple[str, CircuitState]]


class Slots:
    """A store's operations on Redis Cluster (see the module docstring): its keys' names, its
    steps' arguments, its connections, its epoch and its clock (tests: None for Redis' time)."""

    def __init__(
        self, keys: Keys, planner: Planner, connections: Connections, epoch: Epoch, clock: Clock | None
    ) -> None:
        self._keys = keys
        self._key = keys.key
        self._planner = planner
        self._connections = connections
        self._epoch = epoch
        self._clock = clock
        #: Per step without anything of its own: its scripts (`step`).
        self._plans: dict[int, tuple[Step, _Plan]] = {}

    async def step(self, step: Step) -> Passage:
        """`step` on a cluster (see the module docstring)."""
        plan = self._planned(step)
        if plan.whole is not None:
            return (await self._send([plan.whole]))[0][0]
        answers = await self._send(plan.scripts)
        legs = _legs(step, plan, answers)
        paid = answers[plan.parts + len(plan.grouped) :]
        refusal: Admission | None = None
        if len(paid) == 1:
            refusal = paid[0][0].refusal  # (its scope already named: one script for them all)
        elif paid:
            refusal = _latest([charged for charged, _ in paid])
        admitted = await self._admit(step, legs, refusal)
        if admitted is None:
            refusal = None  # no leg: the charge is not the answer (as on one server)
        if (admitted is None or refusal is not None) and any(receipt for _, receipt in paid):
            await self._refund(plan, paid)  # given back: no leg admitted, or a scope refused
        if refusal is not None:
            admitted = None
        return _passage(step, legs, admitted, refusal, paid, plan.reservation)

    async def _admit(self, step: Step, legs: _Legs, refusal: Admission | None) -> int | None:
        """The first leg that may be admitted (None: none), after the first round trip: a
        probe taken for real once the charge passed, and, once a probe was lost to another
        worker, each next leg decided for real (what those say written into `legs`)."""
        policy, ages = step.breaker, step.success_ages
        waits, decisions = legs.waits, legs.decisions
        lost = False
        for index in range(len(step.legs)):
            decision = decisions[index]
            if not lost:
                if waits[index] > 0:
                    continue
                if policy is None or (decision is not None and decision.allowed and decision.probe is None):
                    return index
                if decision is None or not decision.allowed:
                    continue
                if refusal is not None:  # a probe the charge refused: nothing of it taken
                    return index
            real = Step(None, [step.legs[index]], policy, None, [ages[index]] if index < len(ages) else ())
            taken = (await self._send([self._one_slot("step", real)]))[0][0]
            waits[index] = taken.waits[0]
            decisions[index] = taken.decisions[0] if taken.decisions else None
            legs.transitions += taken.transitions
            if taken.admitted is not None:
                return index
            lost = True
        return None

    async def _refund(self, plan: _Plan, paid: Sequence[tuple[Passage, str]]) -> None:
        """The charge given back in each slot that took it (its 'pay' answered a receipt)."""
        await self._send(
            [
                self._one_slot("refund", Step(None, (), None, scope), plan.reservation, receipt)
                for scope, (_, receipt) in zip(plan.scopes, paid, strict=True)
                if receipt
            ]
        )

    def _planned(self, step: Step) -> _Plan:
        """`step`'s scripts (`_plan`), made once for a step with nothing of its own in it."""
        if step.report is not None or step.success_ages or self._clock is not None:
            return self._plan(step)  # (ages read now; a clock's time)
        planned = self._plans.get(id(step))
        if planned is not None and planned[0] is step:
            return planned[1]
        plan = self._plan(step)
        if not plan.reservation:
            # Nothing of its own in it (a request's first step, which the route keeps per
            # caller): its scripts are made once (until an epoch changes: `_send`).
            # (The entry holds the step: no other object can have its id while it is kept.)
            if len(self._plans) >= MAX_FIXED:
                del self._plans[next(iter(self._plans))]  # the oldest
            self._plans[id(step)] = (step, plan)
        return plan

    async def health(self, legs: Sequence[tuple[str, str]]) -> Health:
        """`health` on a cluster: one script per slot of the legs, in one round trip."""
        groups: dict[int, list[int]] = {}
        for index, (cooldown_key, breaker_key) in enumerate(legs):
            slot = key_slot(self._key(breaker_key))
            if key_slot(self._key(cooldown_key)) != slot:
                raise ValueError(
                    "on Redis Cluster, a leg's cooldown and breaker keys share a slot: name them "
                    "guards:cooldown:<model> and guards:breaker:<model>"
                )
            groups.setdefault(slot, []).append(index)
        if not groups:
            return Health(float((await self._run("health", []))[0]), (), ())
        grouped = list(groups.items())
        sent = []
        for slot, indices in grouped:
            keys = [self._key(legs[i][0]) + ":cooldown" for i in indices]
            keys += [self._key(legs[i][1]) + ":breaker" for i in indices]
            sent.append(self._connections.call(pack("health", keys, now_arg(self._clock), ()), slot))
        replies = await asyncio.gather(*sent, return_exceptions=True)
        n = len(legs)
        waits = [0.0] * n
        breakers = [BreakerState()] * n
        for (_, indices), reply in zip(grouped, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply
            m = len(indices)
            for j, i in enumerate(indices):
                waits[i] = float(reply[1 + j])
                breakers[i] = state_of(reply[1 + m + 10 * j : 11 + m + 10 * j])
        first = replies[0]
        assert not isinstance(first, BaseException)
        return Health(float(first[0]), tuple(breakers), tuple(waits))

    async def task_claim(
        self,
        key: str,
        fingerprint: str,
        lease_s: float,
        ttl_s: float,
        owner: str | None,
        max_live: int | None,
    ) -> TaskClaim:
        """`task_claim` on a cluster: one script when the task and its owner's set share a
        slot; else the task claimed in its slot, and a new one entered in its owner's set
        (`task_track`) in a second round trip, undone when the owner has `max_live` already
        (meanwhile the task is there: a retry with the same key is told `busy`)."""
        task = self._key(key) + ":task"
        owned = self._key(owner) + ":tasks" if owner is not None else ""
        lease = new_lease()
        args = [fingerprint, lease, num(lease_s), num(ttl_s), num(max_live)]
        keys, slot = self._slot_keys([task, owned, ""])
        elsewhere = slot is None
        if elsewhere:
            keys, slot = self._slot_keys([task, "", ""])
            args.append(owned)
        assert slot is not None
        args.append(self._epoch.known_in(slot))
        reply = await self._connections.call(pack("task_claim", keys, now_arg(self._clock), args), slot)
        claim = task_claim_of(reply, self._epoch, slot)
        if elsewhere and reply[3] == "new":
            tracked = await self._run("task_track", [owned], task, num(ttl_s), num(max_live))
            if tracked:  # the owner's live tasks are at `max_live`: the new task undone
                await self._run("task_drop", [task], lease, "c")
                return TaskClaim(TaskStatus.full, None, {}, None, float(tracked[1]))
        return claim

    async def _run(self, op: str, keys: Sequence[str], *args: str) -> list[str]:
        """One operation: one script, sent to its first key's slot."""
        command = pack(op, keys, now_arg(self._clock), args)
        return await self._connections.call(command, key_slot(keys[0]) if keys else None)

    def _plan(self, step: Step) -> _Plan:
        """`step`'s scripts on a cluster: the one script when its keys share a slot; else the
        report's parts, the legs' peeks (one per slot) and the charge's pays, in that order."""
        whole = self._script("step", step)
        if whole is not None:
            return _Plan(whole)
        legs, report, policy, charge = step.legs, step.report, step.breaker, step.charge
        ages = step.success_ages
        scripts = []
        for part in _report_parts(report):
            script = self._script("step", Step(part))
            if script is None:  # a breaker and a cooldown in two slots: one script each
                scripts += [self._one_slot("step", Step(half)) for half in _halves(part)]
            else:
                scripts.append(script)
        parts = len(scripts)
        groups: dict[int, list[int]] = {}
        for index, (_, breaker_key) in enumerate(legs):
            groups.setdefault(key_slot(self._key(breaker_key)), []).append(index)
        grouped = list(groups.values())
        for indices in grouped:
            peeked = Step(
                None,
                [legs[i] for i in indices],
                policy,
                None,
                [ages[i] if i < len(ages) else None for i in indices] if ages else (),
            )
            scripts.append(self._one_slot("peek", peeked))
        reservation = os.urandom(8).hex() if charge is not None and holds(charge) else ""
        scopes: list[Charge] = []
        if charge is not None and legs:
            whole_charge = self._script("pay", Step(None, (), None, charge), reservation)
            if whole_charge is not None:
                scopes = [charge]
                scripts.append(whole_charge)
            else:
                assert charge.more is not None  # (scopes in several slots)
                scopes = [_alone(each, charge.hold_s) for each in (charge, *charge.more.also)]
                scripts += [self._one_slot("pay", Step(None, (), None, each), reservation) for each in scopes]
        return _Plan(None, scripts, parts, grouped, scopes, reservation)

    def _slot_keys(self, keys: list[str]) -> tuple[list[str], int | None]:
        """A script's `keys` (the epoch marker's last) on a cluster: the keys with the marker
        and every unused key ('': the script never touches those) turned into the slot's
        marker, and the slot (None when the keys span slots)."""
        slots = {key_slot(key) for key in keys[:-1] if key}
        if len(slots) > 1:
            return keys, None
        slot = slots.pop() if slots else 0
        marker = self._keys.marker(slot)
        return [key or marker for key in keys[:-1]] + [marker], slot

    def _script(
        self, op: str, step: Step, reservation: str | None = None, receipt: str | None = None
    ) -> tuple[Step, bytes, int] | None:
        """`step` as the script's `op` in one slot (None when its keys span slots): the step,
        the packed command and the slot. `receipt` (a 'refund'): the 'pay' receipt's time and
        window entries, in place of the time and the epoch."""
        keys, fields = self._planner.completed(step, *self._planner.arguments(step, reservation))
        keys, slot = self._slot_keys(keys)
        if slot is None:
            return None
        now, last = now_arg(self._clock), self._epoch.known_in(slot)
        if receipt is not None:
            now, _, last = receipt.partition(" ")
        return step, pack(op, keys, now, (*fields, last)), slot

    def _one_slot(
        self, op: str, step: Step, reservation: str | None = None, receipt: str | None = None
    ) -> tuple[Step, bytes, int]:
        script = self._script(op, step, reservation, receipt)
        if script is None:
            raise ValueError(
                "on Redis Cluster, a leg's cooldown and breaker keys share a slot: name them "
                "guards:cooldown:<model> and guards:breaker:<model>"
            )
        return script

    async def _send(self, scripts: Sequence[tuple[Step, bytes, int]]) -> list[tuple[Passage, str]]:
        """Each script sent to its slot, all in one round trip; their passages, and each
        'pay' receipt ('' for other scripts, and for a refused charge)."""
        replies = await asyncio.gather(
            *(self._connections.call(command, slot) for _, command, slot in scripts), return_exceptions=True
        )
        answers = []
        for (step, _, slot), replies_ in zip(scripts, replies, strict=True):
            if isinstance(replies_, BaseException):
                raise replies_
            if len(replies_) > 1:  # the slot's epoch is not the one this worker knew
                self._epoch.found_in(slot, replies_[1])
                self._plans.clear()  # (their scripts carry the epoch they knew)
            else:
                self._epoch.seen_in(slot)
            reply, _, receipt = replies_[0].partition("#")
            if not reply:  # a 'refund': nothing to say
                answers.append((Passage(), receipt))
            elif reply == "P":
                answers.append((plainly_admitted(len(step.legs), step.breaker is not None), receipt))
            else:
                answers.append((passage(step, reply.split("|")), receipt))
        return answers


def _legs(step: Step, plan: _Plan, answers: Sequence[tuple[Passage, str]]) -> _Legs:
    """What the first round trip's scripts said of `step`'s legs: its report's parts (the
    state recorded, the transitions), then the peeks (each leg's wait and decision, put back
    in the legs' order)."""
    recorded = None
    transitions: list[tuple[str, CircuitState]] = []
    for reported, _ in answers[: plan.parts]:
        if reported.recorded is not None:
            recorded = reported.recorded
        transitions += reported.transitions
    n = len(step.legs)
    waits = [0.0] * n
    decisions: list[BreakerDecision | None] = [None] * n
    peeks = answers[plan.parts : plan.parts + len(plan.grouped)]
    for indices, (peeked, _) in zip(plan.grouped, peeks, strict=True):
        for j, i in enumerate(indices):
            waits[i] = peeked.waits[j]
            if j < len(peeked.decisions):
                decisions[i] = peeked.decisions[j]
    return _Legs(waits, decisions, recorded, transitions)


def _passage(
    step: Step,
    legs: _Legs,
    admitted: int | None,
    refusal: Admission | None,
    paid: Sequence[tuple[Passage, str]],
    reservation: str,
) -> Passage:
    """A split step's answer: the leg `admitted` (None: none), the charge's `refusal`, and
    what the charge's scripts (`paid`) held and found near a soft limit."""
    reserved: str | None = None
    near: tuple[int, ...] = ()
    if admitted is not None and paid:
        reserved = reservation if any(charged.reservation for charged, _ in paid) else None
        if len(paid) == 1:
            near = paid[0][0].near
        else:
            near = tuple(index for index, (charged, _) in enumerate(paid) if charged.near)
    waits, policy = legs.waits, step.breaker
    kept = legs.decisions[: admitted + 1] if admitted is not None else legs.decisions
    if (
        step.report is None
        and admitted == 0
        and reserved is None
        and not near
        and not any(waits)
        and (policy is None or kept[0] == ADMIT_CLOSED)
    ):
        return plainly_admitted(len(step.legs), policy is not None)
    return Passage(
        tuple(waits),
        tuple(kept),
        admitted,
        refusal,
        reserved,
        legs.recorded,
        tuple(legs.transitions),
        near=near,
    )


def _report_parts(report: Report | None) -> list[Report]:
    """Redis Cluster: `report` in parts that each touch one key's slot: the model's (its
    breaker and cooldown), the day's spend, and each scope of a charge to settle."""
    if report is None:
        return []
    parts = []
    if (report.breaker_key is not None and report.breaker is not None) or report.cooldown_key is not None:
        parts.append(
            Report(
                breaker_key=report.breaker_key,
                breaker=report.breaker,
                outcome=report.outcome,
                probe=report.probe,
                success_age=report.success_age,
                cooldown_key=report.cooldown_key,
                cooldown_s=report.cooldown_s,
                cooldown_until=report.cooldown_until,
            )
        )
    if report.spend_key is not None and report.reservation is not None:
        parts.append(Report(spend_key=report.spend_key, reservation=report.reservation, actual=report.actual))
    if report.charge is not None and report.reservation is not None:
        scopes = (report.charge, *(report.charge.more.also if report.charge.more is not None else ()))
        for scope in scopes:
            parts.append(
                Report(
                    charge=_alone(scope, report.charge.hold_s),
                    reservation=report.reservation,
                    actual=report.actual,
                    tokens=report.tokens,
                )
            )
    return parts


def _halves(part: Report) -> list[Report]:
    """A model's report part as its breaker's and its cooldown's (keys in two slots)."""
    return [
        dataclasses.replace(part, cooldown_key=None, cooldown_s=0.0, cooldown_until=None),
        Report(
            cooldown_key=part.cooldown_key, cooldown_s=part.cooldown_s, cooldown_until=part.cooldown_until
        ),
    ]


def _alone(charge: Charge, hold_s: float) -> Charge:
    """One scope of a charge on its own (no other scope), with the request's `hold_s` (the
    first scope's, which one script gives every scope)."""
    more = charge.more
    if more is not None:
        more = dataclasses.replace(more, also=(), watched=more.soft is not None)
    return dataclasses.replace(charge, hold_s=hold_s, more=more)


def _latest(passages: Sequence[Passage]) -> Admission | None:
    """The refusal among `passages` (one per scope, in order) that frees up last (a hold that
    never fits: last of all), its `charge` the scope's index; None when none refused."""
    refusals = [
        dataclasses.replace(passage.refusal, charge=index)
        for index, passage in enumerate(passages)
        if passage.refusal is not None
    ]
    if not refusals:
        return None
    return max(refusals, key=lambda r: float("inf") if r.retry_after_s is None else r.retry_after_s)
