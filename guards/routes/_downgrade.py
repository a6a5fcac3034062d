"""Downgrading near a cap: a route with `downgrade_to=` runs a cheaper chain for the callers a
budget's soft limit says are near their cap (`Budget(soft_limit=...)`).

Whether a request is near is known only once the store admitted it, in the step that charges
it (no extra store operation): the request that crosses the soft limit has already been
admitted on the route's own chain. So each worker remembers, per budget key (a scope and its
caller's key, as the store keys it), that the key was past its soft limit at its last
admission on this worker, and runs that key's next requests on the downgrade chain. Every
admission of the key (downgraded or not) tells the store's answer again: a key no longer near
(a new day, a new month, a minute window that emptied) is forgotten at its first admission
after that, which therefore still runs downgraded. The memory is bounded (`MAX_KEYS`, the
oldest dropped first): a key dropped runs its next request on the route's own chain, whose
admission says it is near again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..observe._log import emit

if TYPE_CHECKING:
    from ..spec._route_spec import GuardedRoute
    from ..stores import Charge
    from ..walk._state import RequestState

__all__ = ["MAX_KEYS", "Downgrade"]

#: The most budget keys a route's downgrade remembers as near, per worker.
MAX_KEYS = 10_000


class Downgrade:
    """A route's downgrade chain (`route`, the route with that chain) and the budget keys of
    its callers last seen past a soft limit, with their scope (`near`)."""

    __slots__ = ("near", "route", "soft")

    def __init__(self, soft: Sequence[bool]) -> None:
        #: Whether each of the route's budgets has a soft limit.
        self.soft = tuple(soft)
        self.near: dict[str, str] = {}
        self.route: GuardedRoute | None = None  # set once the downgraded route is made

    def choose(self, state: RequestState) -> GuardedRoute:
        """The route whose chain `state`'s request runs: the downgrade's, when a budget key of
        the request was past its soft limit at its last admission on this worker."""
        route = state._route
        first = state._first
        if not self.near or first is None or first.charge is None or self.route is None:
            return route
        scopes = [self.near[charge.key] for charge in _scoped(first.charge) if charge.key in self.near]
        if not scopes:
            return route
        state._downgraded = ",".join(scopes)
        emit("downgraded", route=route.name, trace_id=state.trace_id, scope=state._downgraded)
        downgraded = state._route = self.route
        state._leg, state.attempt_budget = downgraded.legs[0], downgraded.attempt_budget
        return downgraded

    def saw(self, charge: Charge, scopes: Sequence[str], near: Sequence[int]) -> None:
        """A request's `charge` was admitted, past the soft limits of its budgets `near`: each
        key with a soft limit is remembered as near, or forgotten."""
        remembered = self.near
        for index, (scoped, soft) in enumerate(zip(_scoped(charge), self.soft, strict=False)):
            if not soft:
                continue
            if index in near:
                remembered.pop(scoped.key, None)  # (the newest: last to be dropped)
                if len(remembered) >= MAX_KEYS:
                    del remembered[next(iter(remembered))]
                remembered[scoped.key] = scopes[index]
            else:
                remembered.pop(scoped.key, None)


def _scoped(charge: Charge) -> tuple[Charge, ...]:
    return (charge, *charge.more.also) if charge.more is not None else (charge,)
