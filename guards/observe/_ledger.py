"""The usage ledger: one record per provider call, accepted or rejected.

Cost attribution reads the ledger, never the final answer alone: a request that fell back made
several billable calls, and a timed-out call may be billed too. The default sink writes each
record as a JSON log line (`event: attempt`); give `Guards(ledger=...)` any object with a
`record` method to send them elsewhere (a queue, a database writer). `record` is called on the
request's task and must not block: buffer, and write from elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..contracts._binding import Usage
from ._log import emit

__all__ = ["Attempt", "Ledger", "LogLedger"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """One provider call.

    `attempt` counts the calls of one guarded call (1, 2, ...), across the chain's models.
    `requested_model` is the chain's first model, `model` the one this call asked for (its key,
    `provider:model`), `entry` that model's chain entry as written (`hint:fast` for a model a
    routing hint resolved to, else the same as `model`), and `served_model` the one the
    provider says answered (None when it did not answer). `outcome`
    is `"ok"` or the classifier's kind (`"cancelled"` when the caller stopped waiting).
    `usage` is the provider's token count, when it sent one. `delivered_chars` counts the
    characters a streamed attempt delivered to the client (for a stream cut or cancelled
    before the provider's usage arrived); None for a non-streaming call. A failed call carries
    the provider's HTTP `status` and numeric error `code` when it sent them (never its message):
    a 401 reads as a credential problem, not an outage.
    `resumed_steps` names the steps its request had loaded from its task's checkpoints
    (`AI.step`) instead of calling, when the call was made. An answer the output guard
    rejected, on a route that moves rejected answers on (`route(on_rejected=...)`), has
    `outcome` `"rejected"` and its `problems` (field paths and problem tokens, such as
    `answer.score: missing`; never the answer's text). `downgraded` is True for a call of a
    route's downgrade chain (`route(downgrade_to=...)`: its caller was near a budget's cap);
    `requested_model` is then the downgrade chain's first model. `hedge` is True for a hedge: the
    second attempt a hedged call started on the next model while its first still ran
    (`route(hedge=...)`; the `attempt` line's `"hedge": true`).
    """

    trace_id: str
    route: str
    attempt: int
    requested_model: str
    model: str
    served_model: str | None
    outcome: str
    latency_ms: float
    usage: Usage | None
    delivered_chars: int | None = None
    status: int | None = None
    code: int | None = None
    entry: str | None = None
    resumed_steps: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    downgraded: bool = False
    hedge: bool = False


@runtime_checkable
class Ledger(Protocol):
    """Where per-call usage records go."""

    def record(self, attempt: Attempt) -> None: ...


class LogLedger:
    """The default ledger: one JSON line per call on the `guards` logger (`event: attempt`)."""

    def record(self, attempt: Attempt) -> None:
        usage = attempt.usage
        emit(
            "attempt",
            route=attempt.route,
            trace_id=attempt.trace_id,
            attempt=attempt.attempt,
            requested_model=attempt.requested_model,
            model=attempt.model,
            entry=attempt.entry if attempt.entry != attempt.model else None,
            served_model=attempt.served_model,
            outcome=attempt.outcome,
            latency_ms=attempt.latency_ms,
            prompt_tokens=usage.prompt_tokens if usage is not None else None,
            completion_tokens=usage.completion_tokens if usage is not None else None,
            delivered_chars=attempt.delivered_chars,
            status=attempt.status,
            code=attempt.code,
            resumed_steps=list(attempt.resumed_steps) if attempt.resumed_steps else None,
            problems=list(attempt.problems) if attempt.problems else None,
            hedge=True if attempt.hedge else None,
        )
