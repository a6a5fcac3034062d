"""The events of one request, as small frozen records: what the request path tells its
observers (`Observers`, the one seam), and nothing else.

The walk builds a record where something happened and hands it to `Observers`; metrics, log
lines, the usage ledger and traces subscribe there. Records are tuples: immutable. Most are
named tuples, read by name. The two that every request builds, `AttemptEnded` and
`RequestEnded`, and the one every refused request builds, `Skipped`, are plain tuples of the fields their comments name, in that order, built and
unpacked in one place each: building a named tuple costs about 1,500 CPU instructions more
than a plain one, and unpacking it 500 more (valgrind), which on the success path (68k
instructions in all, `make bench-instructions`) is the difference between a seam that costs
nothing and one that costs 6 %. mypy checks every field's type and position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

if TYPE_CHECKING:
    from ..contracts._binding import Usage
    from ..contracts._errors import GuardTripped
    from ..contracts._vocabulary import ErrorCode
    from ..spec._route_spec import GuardedRoute, Leg
    from ..stores._breaker import CircuitState

__all__ = [
    "AttemptEnded",
    "BreakerMoved",
    "Checkpointed",
    "CooldownStarted",
    "RequestEnded",
    "Retried",
    "Skipped",
    "StoreFailed",
]


#: One provider call ended (a committed stream: when its stream ended):
#: `(route, trace_id, leg, attempt, outcome, usage, served, elapsed_s, cost, delivered_chars,
#: status, code, resumed_steps, problems, hedge)`. `attempt`: the request's calls so far, this one
#: included; `outcome`: `ok`, `rejected` (an answer the output guard rejected, on a route that
#: moves rejected answers on), a failure kind (`Kind`) or how a stream ended; `served`: the
#: model the provider says served (None for a failure); `cost`: what the reported usage cost,
#: in the price's units (None: no price or no usage); `status`, `code`: a provider error's;
#: `problems`: a rejected answer's (`GuardTripped.problems`), else None; `hedge`: the call was a
#: hedge (`_retries`).
AttemptEnded: TypeAlias = """tuple[
    GuardedRoute, str, Leg, int, str, Usage | None, str | None, float, float | None, int | None,
    int | None, int | None, tuple[str, ...], tuple[str, ...] | None, bool
]"""


#: A model of the chain passed over without a call: `(route, trace_id, leg, reason, wait_s)`,
#: `reason`: `cooldown` or `circuit_open`. A plain tuple too: in an outage, every request
#: builds one.
Skipped: TypeAlias = "tuple[GuardedRoute, str, Leg, str, float | None]"


class Retried(NamedTuple):
    """A failed call is about to be made again on the same model, or the model's retry
    budget refused it (`skipped`)."""

    route: GuardedRoute
    trace_id: str
    leg: Leg
    #: The attempt on the model that failed (1: its first call).
    attempt: int
    kind: str
    #: The wait before the retry (None when it was refused).
    delay_s: float | None
    #: Why the retry was not made after all (`retry_budget`), or None.
    skipped: str | None = None


class StoreFailed(NamedTuple):
    """The store did not answer a guard: `mode` when a check was open or closed for it, `op`
    when a report of it was lost."""

    route: GuardedRoute
    #: None for a task's store operation outside a call.
    trace_id: str | None
    guard: str
    mode: str | None = None
    op: str | None = None


class BudgetCounted(NamedTuple):
    """What a request `held` against a budget's scope before its first call, or what that
    hold `settled` to: `amount` of `unit` (`tokens`, or `spend` in cost units)."""

    stage: str
    scope: str
    unit: str
    amount: float


class BudgetNear(NamedTuple):
    """A request was admitted past the soft limit of each of `scopes` (`Budget.soft_limit`)."""

    route: GuardedRoute
    trace_id: str
    scopes: tuple[str, ...]


class Checkpointed(NamedTuple):
    """A task's step was `saved` after its call, or `resumed` from the store instead of one."""

    route: GuardedRoute
    action: str


class CooldownStarted(NamedTuple):
    """A store step started a model's cooldown (the provider asked for a pause)."""

    route: GuardedRoute
    trace_id: str
    model: str
    seconds: float


class BreakerMoved(NamedTuple):
    """A store step moved a model's breaker (the store tells exactly one caller of each)."""

    leg: Leg
    state: CircuitState


#: A guarded request ended: `(route, trace_id, outcome, status, started, attempts,
#: attempt_budget, model, fallback_model, served_leg, tripped, error, legs, resumed_steps,
#: extra, held)`. `outcome`: `ok`, `fallback`, `error` or `cancelled`; `started`: its
#: `time.perf_counter()` start; `served_leg`: the leg whose answer was served (None: the
#: handler's own value), for `guards_served_total`; `legs`: each model tried or skipped and how
#: it ended, when the request failed on a chain; `extra`: more fields of its log line
#: (`replayed`, `exc_type`, `where`, `cut`); `held`: the record of the request's only attempt,
#: when no `attempt` line was written for it (`Observers.attempt_ended`): its line carries it.
RequestEnded: TypeAlias = """tuple[
    GuardedRoute, str, str, int, float, int, int, str | None, str | None, Leg | None,
    GuardTripped | None, ErrorCode | None, str | None, tuple[str, ...] | None, dict[str, Any] | None,
    AttemptEnded | None
]"""
