"""The events of one request, as small frozen records: what the request path tells its
observers (`Observers`, the one seam), and nothing else.

The walk builds a record where something happened and hands it to `Observers`; metrics, log
lines, the usage ledger and traces subscribe there. Records are named tuples: immutable, read by
name anywhere, and unpacked at once by the observers that read every field. The two every
request builds (`AttemptEnded`, `RequestEnded`) are made with `new(Record, (fields...))`, every
field in order: the tuple itself, without the Python frame of the named tuple's `__new__` (a
fifth of the success path's cost of the seam, in `make bench-instructions`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

#: `new(Record, (fields...))`: a record from all its fields, in order (see the docstring).
new = tuple.__new__

if TYPE_CHECKING:
    from .._binding import Usage
    from .._breaker import CircuitState
    from .._errors import GuardTripped
    from .._route_spec import GuardedRoute, Leg
    from .._vocabulary import ErrorCode

__all__ = [
    "new",
    "AttemptEnded",
    "BreakerMoved",
    "Checkpointed",
    "CooldownStarted",
    "RequestEnded",
    "Retried",
    "Skipped",
    "StoreFailed",
]


class AttemptEnded(NamedTuple):
    """One provider call ended (a committed stream: when its stream ended)."""

    route: GuardedRoute
    trace_id: str
    leg: Leg
    #: The request's calls so far, this one included.
    attempt: int
    #: `ok`, a failure kind (`Kind`), or how a stream ended.
    outcome: str
    usage: Usage | None
    #: The model the provider says served (None for a failure).
    served: str | None
    elapsed_s: float
    #: What the reported usage cost, in the price's units (None: no price or no usage).
    cost: float | None = None
    delivered_chars: int | None = None
    status: int | None = None
    code: int | None = None
    resumed_steps: tuple[str, ...] = ()


class Skipped(NamedTuple):
    """A model of the chain passed over without a call (`cooldown`, `circuit_open`)."""

    route: GuardedRoute
    trace_id: str
    leg: Leg
    reason: str
    wait_s: float | None


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


class RequestEnded(NamedTuple):
    """A guarded request ended: its outcome (`ok`, `fallback`, `error`, `cancelled`), status,
    and what served it. `started` is its `time.perf_counter()` start."""

    route: GuardedRoute
    trace_id: str
    outcome: str
    status: int
    started: float
    attempts: int = 0
    attempt_budget: int = 0
    model: str | None = None
    fallback_model: str | None = None
    #: The leg whose answer was served (not the handler's own value), for `guards_served_total`.
    served_leg: Leg | None = None
    tripped: GuardTripped | None = None
    error: ErrorCode | None = None
    #: Each model tried or skipped and how it ended, when the request failed on a chain.
    legs: str | None = None
    resumed_steps: tuple[str, ...] | None = None
    #: The service level the request was served at (read only when it is traced).
    service_level: str | None = None
    #: More fields of the log line (`replayed`, `exc_type`, `where`, `cut`).
    extra: dict[str, Any] | None = None
