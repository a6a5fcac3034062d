"""Multi-step tasks: a route's model calls as named steps, checkpointed in the store under the
client's `Idempotency-Key`, so a retried request resumes where the last one failed and a
completed one answers again, without paying twice.

A route declared with `task=Task()` reads the `Idempotency-Key` header (1 to 255 printable
ASCII characters, else `400 invalid_request`; without it the route runs as any other). The
request then claims its task in the store (`Store.task_claim`, one operation):

    new, or released, or its holder's lease lapsed  → run the handler, holding the lease;
                                                       `ai.step(name, ...)` loads each step
                                                       saved before instead of calling
    another request holds it                        → 409 task_in_progress, Retry-After: 1
    created with another request body               → 422 idempotency_key_reused
    completed                                       → its stored response again, with
                                                       `idempotent-replayed: true`
    none, and the caller has `Task.max_live` live   → 429 rate_limited, Retry-After: until
    tasks on the route already                         its oldest task expires (none made)

A task is keyed by the route, the caller (the route's budget key, when it has a budget) and the
key's SHA-256, and bound to a fingerprint of the request (method, path, query and body). Only a
success is stored (a strict route's 2xx, a degrading route's envelope without fallback); any
other ending releases the lease, so the retry resumes at once. A request that called no model
(refused by the budget, the breaker, shedding, or its input) leaves no task state at all: the
task it claimed is deleted (unless it holds steps saved earlier), so refusals, however many
fresh keys they carry, do not grow the store. A worker that crashed holding a lease leaves it
to lapse `2 x timeout_s + 60` seconds after its last saved step. Everything of a task expires
`Task.ttl_s` after its creation. Step values are user data: stored, never logged and never a
metric label.

Footprint: a caller (the budget key; every request of a route without a budget is one caller)
has at most `Task.max_live` live tasks per route, and a task keeps at most `Task.max_bytes` of
saved steps (together; a step past it is not saved, and runs again on a retry) or, once
completed, of stored response (status, headers and body as JSON; a longer one is not kept),
besides its record (key, fingerprint, lease, times, owner: under 1 KiB) and its steps' names
(the handler's own: at most `MAX_STEPS`, of at most 100 characters). So a route's tasks take at
most callers x `max_live` x (`max_bytes` + 1 KiB + the route's step names).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Annotated

from fastapi import Header

from ..contracts._settings import number, settings, whole

__all__ = ["IDEMPOTENCY_KEY", "KEY_PARAMETER", "MAX_STEPS", "Task", "key_parameter", "lease_s"]

IDEMPOTENCY_KEY = "Idempotency-Key"
#: The endpoint parameter FastAPI fills with the header (validated and documented by FastAPI).
KEY_PARAMETER = "guards_idempotency_key_"
#: The most steps one task saves; later steps run without a checkpoint.
MAX_STEPS = 64


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """Run a route's requests that carry an `Idempotency-Key` as multi-step tasks (see
    `AI.step`). `ttl_s`: how long a task, its saved steps and its stored response live from
    its first request (default 24 h). `max_live`: the most live (unexpired) tasks one caller
    (the route's budget key) has on the route; a request for a new task past it is refused
    with 429 `rate_limited` and `Retry-After` (until the caller's oldest task expires), while
    the caller's existing tasks still resume and replay. `max_bytes`: the most a task keeps
    of its saved steps together, or of its stored response (UTF-8 bytes of JSON); past it, a
    step is not saved (it runs again on a retry) and a response not kept (the task is
    released, as after a failure).

    When the store cannot be reached to claim a task, the request runs without checkpoints,
    as if it had no key (a warning and `guards_store_unavailable_total{guard="task"}`): the
    budget guard, which fails closed by default, is what bounds spend during an outage."""

    ttl_s: float = 86_400.0
    max_live: int = 1_000
    max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        number("Task.ttl_s", self.ttl_s, above=0, unit="seconds")
        whole("Task.max_live", self.max_live)
        whole("Task.max_bytes", self.max_bytes)


def key_parameter() -> inspect.Parameter:
    """The `Idempotency-Key` header as a parameter of a task route's endpoint."""
    header = Header(
        alias=IDEMPOTENCY_KEY,
        min_length=1,
        max_length=255,
        pattern="^[ -~]+$",
        description=(
            "Makes the request a task: a retry with the same key resumes after the steps that "
            "completed, and once the task succeeded its answer is replayed "
            "(`idempotent-replayed: true`), with no provider call and no charge. 1 to 255 "
            "printable ASCII characters; the same key with another body is 422."
        ),
    )
    return inspect.Parameter(
        KEY_PARAMETER,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[str | None, header],
    )


def lease_s(timeout_s: float) -> float:
    """How long a task's lease lasts after its claim or its last saved step, for a route whose
    deadline is `timeout_s`: a crashed worker's task waits this long for the next request (each
    call of a step is bounded by the route's deadline)."""
    return 2 * timeout_s + 60
