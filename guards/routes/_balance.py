"""Groups of deployments on a route (`guards.Deployments`): per walk, the order of each group's
deployments, as the group's strategy chooses it (`guards.policies._deployments.order`).

A group is a run of legs of the route's chain (one per deployment, in the order declared). Each
walk runs the route's chain with each group's legs reordered: the chosen deployment first, then
the others in the order the strategy would choose them next, those this worker knows refused
(an open breaker, a cooldown, a deployment at its `rpm`/`tpm`: `guards.walk._known`) last, so
that a known-refused deployment is never chosen while another may be called. The walk does the
rest as for any chain: a deployment skipped or failed moves on to the next leg, the group's
next deployment. The reordered routes are copies of the route that differ in their legs' order
only, and are kept (`MAX_ORDERS` of them at most, then made per walk).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..policies._deployments import order

if TYPE_CHECKING:
    from ..policies._chain import Deployments
    from ..spec._route_spec import GuardedRoute, Leg
    from ..walk._state import RequestState

__all__ = ["MAX_ORDERS", "Balancer", "balanced", "on_chain"]

#: The most reordered copies of a route kept.
MAX_ORDERS = 256


class Balancer:
    """A route's groups of deployments: (its first leg's index, its end, the group, its keys)."""

    __slots__ = ("groups", "orders", "route")

    def __init__(self, route: GuardedRoute) -> None:
        self.route = route  # the route as declared (replaced once it carries this balancer)
        self.groups: list[tuple[int, int, Deployments, tuple[str, ...]]] = []
        legs, index = route.legs, 0
        while index < len(legs):
            group = legs[index].ref.group
            end = index + 1
            while end < len(legs) and group is not None and legs[end].ref.group is group:
                end += 1
            if group is not None:
                self.groups.append((index, end, group, tuple(leg.ref.key for leg in legs[index:end])))
            index = end
        self.orders: dict[tuple[int, ...], GuardedRoute] = {}

    def choose(self, state: RequestState) -> GuardedRoute:
        """The route `state`'s next walk runs: each group's legs in the order chosen now."""
        route, shared = self.route, state._shared
        legs, balance = route.legs, shared.balance
        now = shared.success_clock()
        placed = list(range(len(legs)))
        for start, end, group, keys in self.groups:
            known = [leg.ref.key for leg in legs[start:end] if leg.known.until > now]
            placed[start:end] = [start + index for index in order(group, balance, keys, known)]
        key = tuple(placed)
        chosen = self.orders.get(key)
        if chosen is None:
            ordered = tuple(legs[index] for index in placed)
            chosen = dataclasses.replace(
                route,
                model=ordered[0].ref.key,  # what the walk asks for first (`requested_model`)
                legs=ordered,
                step_legs=tuple(route.step_legs[index] for index in placed),
                success_ages=route.success_ages.over(ordered),
            )
            if len(self.orders) < MAX_ORDERS:
                self.orders[key] = chosen
        state._route = chosen
        if not state.attempts:
            state._leg = chosen.legs[0]
        return chosen


def balanced(route: GuardedRoute) -> GuardedRoute:
    """`route` with its groups of deployments balanced per walk (itself when it has none)."""
    if not any(leg.ref.group is not None for leg in route.legs):
        return dataclasses.replace(route, deployments=None) if route.deployments is not None else route
    balancer = Balancer(route)
    route = balancer.route = dataclasses.replace(route, deployments=balancer)
    return route


def on_chain(route: GuardedRoute, legs: tuple[Leg, ...], attempt_budget: int) -> GuardedRoute:
    """`route` calling the chain `legs` (an effort tier's, a downgrade's) within `attempt_budget`,
    with what follows from its legs (store step keys, success ages, windows) and balanced."""
    return balanced(
        dataclasses.replace(
            route,
            model=legs[0].ref.key,
            legs=legs,
            step_legs=tuple((leg.cooldown_key, leg.breaker_key) for leg in legs),
            attempt_budget=attempt_budget,
            success_ages=route.success_ages.over(legs),
            windowed=any(leg.window is not None for leg in legs),
        )
    )
