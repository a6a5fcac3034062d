"""The request path: what one guarded request does between its handler's `ai.run` (or `step`,
`stream`) and its answer, one stage per module.

    _handle.py       `AI`: the handle a handler is given; run, step, stream compose the stages
    _state.py        `RequestState`: the request's state, each field written by one stage
    _chain_walk.py   the walk along the fallback chain, its deadline, the client watcher
    _store_steps.py  one store operation between calls; the store-down policy
    _holds.py        a request's spend and token holds, and what they settle to
    _known.py        the refusals a worker knows of (open breakers, cooldowns): skipped locally
    _retries.py      a leg's share of the attempt budget; the retry budget's admission; hedges
    _accounting.py   attempts, tokens, cost (the spend settles to it)
    _verdicts.py     every ending without an answer, as a `GuardTripped` (pure)
    _streaming.py    a streamed attempt, its hold's check, the committed stream's relay and its
                     accounting; the empty-stream recovery
    _checkpoints.py  a task's saved steps (`TaskRun`)
    _events.py       the events of a request, as frozen records
    _observers.py    `Observers`: the one seam where metrics, logs, the ledger and traces subscribe
    _outcome.py      a request's end: its metrics, span end and log line, from a record

The stages call no metric, logger or tracer: they hand records to `Observers`.
"""

from ._checkpoints import TASK_SCOPE, TaskRun
from ._handle import AI
from ._observers import Observers
from ._store_steps import walk_step

__all__ = ["AI", "TASK_SCOPE", "Observers", "TaskRun", "walk_step"]
