"""Deployments of one model: a chain entry that is a group of deployments (`Deployments`), each
its own binding, weight and optional limits (`Deployment`), and the one choice of a deployment
(`pick`).

A group flattens into one chain model per deployment (`ModelRef.deployment`), keyed
`group/name` (`chat/east`): its breaker, cooldown, metrics' `model` label, log lines and ledger
records. Per walk the group's deployments are put in an order (`order`: `pick` again and again,
each time excluding those already placed), so that a failure or a skip moves on to another
deployment of the group, and the chain moves past the group only when each one was skipped or
failed.

Strategies (`Deployments.strategy`):

- `"weighted"` (the default): weighted random, by `Deployment.weight`, from a generator seeded
  per `Guards` (`Guards(seed=...)`);
- `"least_busy"`: the deployment with the fewest calls in flight in this worker (ties: weighted);
- `"lowest_latency"`: the lowest median time to first output over the last `LATENCY_WINDOW_S`
  seconds, read from this worker's latency histogram with the status page's function
  (`guards.observe._latency.latency_figures`); a deployment with no call in the window first
  (ties: weighted).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from ..observe._families import FIRST_OUTPUT_SECONDS
from ..observe._latency import Counts, latency_figures
from ..observe._metrics import histogram
from ..stores import Charge, MoreLimits
from ._chain import Deployment, Deployments

__all__ = [
    "LATENCY_COPY_S",
    "LATENCY_WINDOW_S",
    "Balance",
    "counted",
    "limit_charge",
    "order",
    "pick",
]

#: `lowest_latency` reads the median over this window (the status page's default window)...
LATENCY_WINDOW_S = 300.0
R = TypeVar("R")
#: ... from copies of the histogram's counts taken at most this often.
LATENCY_COPY_S = 10.0


class Balance:
    """What an app's strategies read (one per `Guards`): the seeded generator of `"weighted"`,
    the calls in flight per deployment key in this worker (`busy`), and copies of each
    deployment's first-output histogram (`first_output_p50`). Bounded: one count and at most
    `LATENCY_WINDOW_S / LATENCY_COPY_S + 1` copies per deployment key."""

    __slots__ = ("_copies", "clock", "in_flight", "random")

    def __init__(self, seed: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.random = random.Random(seed)
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._copies: dict[str, deque[tuple[float, Counts]]] = {}

    @contextmanager
    def busy(self, key: str) -> Iterator[None]:
        """A call to deployment `key` is in flight while inside."""
        in_flight = self.in_flight
        in_flight[key] = in_flight.get(key, 0) + 1
        try:
            yield
        finally:
            in_flight[key] -= 1

    def first_output_p50(self, key: str) -> float | None:
        """The median time to first output of deployment `key` over the last
        `LATENCY_WINDOW_S` (None: no call produced one in the window)."""
        tally = histogram(FIRST_OUTPUT_SECONDS, key)
        now: Counts = {(FIRST_OUTPUT_SECONDS, labels): count for labels, count in tally.cumulative()}
        at = self.clock()
        copies = self._copies.get(key)
        if copies is None:
            copies = self._copies[key] = deque()
        while len(copies) > 1 and copies[1][0] <= at - LATENCY_WINDOW_S:
            copies.popleft()  # the oldest copy still covering the window is kept
        if not copies or at - copies[-1][0] >= LATENCY_COPY_S:
            copies.append((at, now))
        base = copies[0][1]
        figures = latency_figures(now, base).get(key)
        return None if figures is None else figures.first_output_p50_s


def pick(
    group: Deployments, balance: Balance, exclude: Collection[str] = (), *, keys: Sequence[str] | None = None
) -> int | None:
    """The index in `group.deployments` of the deployment a call goes to, by the group's
    strategy, among those whose key (`group/name`) is not in `exclude`; None when none is left.
    `keys`: the deployments' keys, when the caller has them. The one place a deployment is
    chosen: the walk's order (`order`) calls it, and so may a hedge."""
    deployments = group.deployments
    if keys is None:
        keys = [group.key(each) for each in deployments]
    left = [index for index, key in enumerate(keys) if key not in exclude]
    if len(left) <= 1:
        return left[0] if left else None
    if group.strategy == "least_busy":
        in_flight = balance.in_flight
        fewest = min(in_flight.get(keys[index], 0) for index in left)
        left = [index for index in left if in_flight.get(keys[index], 0) == fewest]
    elif group.strategy == "lowest_latency":
        medians = {index: balance.first_output_p50(keys[index]) for index in left}
        untried = [index for index, median in medians.items() if median is None]
        if untried:
            left = untried
        else:
            lowest = min(median for median in medians.values() if median is not None)
            left = [index for index, median in medians.items() if median == lowest]
    if len(left) == 1:
        return left[0]
    weights = [deployments[index].weight for index in left]
    return balance.random.choices(left, weights)[0]


def order(group: Deployments, balance: Balance, keys: Sequence[str], last: Collection[str] = ()) -> list[int]:
    """The group's deployments in the order a walk tries them: `pick` again and again, those
    whose key is in `last` (known refused by this worker) after the others, in their order."""
    placed: list[int] = []
    chosen: set[str] = set(last)
    while (index := pick(group, balance, chosen, keys=keys)) is not None:
        placed.append(index)
        chosen.add(keys[index])
    placed.extend(index for index, key in enumerate(keys) if key in last)
    return placed


def counted(
    balance: Balance, key: str, call: Callable[[str, Mapping[str, Any]], Awaitable[R]]
) -> Callable[[str, Mapping[str, Any]], Awaitable[R]]:
    """`call` (a binding's `run`), each attempt counted in flight on deployment `key` while it
    runs (what `"least_busy"` reads)."""

    async def busy(model: str, inputs: Mapping[str, Any]) -> R:
        with balance.busy(key):
            return await call(model, inputs)

    return busy


def limit_charge(key: str, deployment: Deployment, tokens: int) -> Charge:
    """The charge a call to `deployment` (model key `key`) pays in its own store step: one
    request of its `rpm` and `tokens` of its `tpm`, each in a sliding minute under
    `guards:deployment:{key}`, all or nothing."""
    more = None
    if deployment.tpm is not None:
        more = MoreLimits(tokens=tokens, tokens_per_minute=deployment.tpm)
    return Charge(f"guards:deployment:{key}", deployment.rpm, None, None, 0.0, 0.0, more)
