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

import functools
import hashlib
import inspect
import json
import time
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import Header
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ._ai import AI, TASK_SCOPE, finish_request
from ._log import emit_warning
from ._metrics import STORE_UNAVAILABLE, TASK_STEPS, counter
from ._output import OutputGuard
from ._responses import PublicError, error_response
from ._vocabulary import ErrorCode
from .stores import Store, StoreUnavailable, TaskStatus

if typing.TYPE_CHECKING:
    from ._guards import Guards
    from ._route_spec import GuardedRoute

__all__ = ["IDEMPOTENCY_KEY", "Task", "TaskRun", "key_parameter", "task_endpoint"]

IDEMPOTENCY_KEY = "Idempotency-Key"
#: The endpoint parameter FastAPI fills with the header (validated and documented by FastAPI).
KEY_PARAMETER = "guards_idempotency_key_"
#: The most steps one task saves; later steps run without a checkpoint.
MAX_STEPS = 64
#: Headers that describe one request, not the task's answer: never stored or replayed.
_PER_REQUEST = frozenset({b"x-trace-id", b"content-length", b"x-service-level"})


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
        if not self.ttl_s > 0:
            raise ValueError("Task.ttl_s must be positive")
        if self.max_live < 1 or self.max_bytes < 1:
            raise ValueError("Task.max_live and Task.max_bytes must be at least 1")


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


class TaskRun:
    """The task one request holds: its saved steps, and the lease to write them with."""

    __slots__ = (
        "_bytes",
        "_key",
        "_lease",
        "_lease_s",
        "_max_bytes",
        "_route",
        "_steps",
        "_store",
        "ai",
        "resumed",
    )

    def __init__(
        self, store: Store, route: GuardedRoute, key: str, lease: str, steps: Mapping[str, str]
    ) -> None:
        assert route.task is not None
        self._store = store
        self._route = route
        self._key = key
        self._lease = lease
        self._lease_s = lease_s(route)
        self._steps = dict(steps)
        self._max_bytes = route.task.max_bytes
        #: Bytes of the steps saved (as the store holds them).
        self._bytes = sum(len(value.encode()) for value in self._steps.values())
        #: The steps loaded instead of called, in order (`AI.resumed_steps`).
        self.resumed: tuple[str, ...] = ()
        #: The request's `AI`, once its endpoint made it: what it called (`release`).
        self.ai: AI[Any] | None = None

    def load(self, name: str, output: OutputGuard) -> tuple[Any] | None:
        """The value saved for step `name`, validated against `output` (in a 1-tuple: a step
        may return None), or None when there is none or it no longer validates."""
        saved = self._steps.get(name)
        if saved is None:
            return None
        try:
            value = output.load(saved)
        except ValidationError:  # the step's type changed since: run it again
            self._bytes -= len(self._steps.pop(name).encode())
            return None
        counter(TASK_STEPS, self._route.name, "resumed").add()
        self.resumed = (*self.resumed, name)
        return (value,)

    async def save(self, name: str, output: OutputGuard, value: Any) -> None:
        """Save step `name`'s `value` (a failure to save is logged, and the request goes on:
        the step only runs again if the request fails later)."""
        text = output.dump(value)
        size, before = len(text.encode()), self._steps.get(name)
        grown = self._bytes + size - (len(before.encode()) if before is not None else 0)
        if grown > self._max_bytes or (before is None and len(self._steps) >= MAX_STEPS):
            return
        try:
            saved = await self._store.task_save(self._key, self._lease, name, text, lease_s=self._lease_s)
        except StoreUnavailable:
            self._lost("task_save")
            return
        if saved:
            self._steps[name], self._bytes = text, grown
            counter(TASK_STEPS, self._route.name, "saved").add()

    async def complete(self, stored: str) -> None:
        try:
            await self._store.task_complete(self._key, self._lease, stored)
        except StoreUnavailable:
            self._lost("task_complete")

    async def release(self) -> None:
        """The request ended without a success to keep: a request that called no model (it
        was refused before any call, or loaded every step) drops the task (`Store.task_drop`:
        a task with no saved step leaves nothing behind); any other releases its lease."""
        try:
            if self.ai is None or self.ai.attempts == 0:
                await self._store.task_drop(self._key, self._lease)
            else:
                await self._store.task_release(self._key, self._lease)
        except StoreUnavailable:  # the lease lapses by itself
            self._lost("task_release")

    def _lost(self, op: str) -> None:
        emit_warning("store_unavailable", guard="task", route=self._route.name, op=op)
        STORE_UNAVAILABLE.labels(guard="task", action=op).inc()


def task_endpoint(
    guards: Guards,
    route: GuardedRoute,
    endpoint: Callable[..., Awaitable[Any]],
    *,
    response_type: Any,
    trace_id_of: Callable[[Request], str],
    request_param: str,
    response_param: str,
) -> Callable[..., Awaitable[Any]]:
    """Wrap a task route's endpoint (whose `request_param` and `response_param` are the request
    and FastAPI's sub-response): claim the request's task before it, store its success (or
    release the task) after it. A request without the header goes straight through."""
    task = route.task
    assert task is not None
    dump = TypeAdapter(response_type).dump_json
    lease = lease_s(route)
    replayed = counter(TASK_STEPS, route.name, "replayed")
    conflict = counter(TASK_STEPS, route.name, "conflict")

    @functools.wraps(endpoint)
    async def run_task(**kwargs: Any) -> Any:
        idempotency_key: str | None = kwargs.pop(KEY_PARAMETER)
        if idempotency_key is None:
            return await endpoint(**kwargs)
        request: Request = kwargs[request_param]
        started = time.perf_counter()
        caller = route.budget.key(request) if route.budget is not None else ""
        name = hashlib.sha256(f"{caller}\n{idempotency_key}".encode("utf-8", "surrogatepass")).hexdigest()
        key = f"guards:task:{route.name}:{name}"
        caller_digest = hashlib.sha256(caller.encode("utf-8", "surrogatepass")).hexdigest()
        owner = f"guards:tasks:{route.name}:{caller_digest}"  # whose live tasks are capped
        try:
            claim = await guards.store.task_claim(
                key,
                fingerprint=await _fingerprint(request),
                lease_s=lease,
                ttl_s=task.ttl_s,
                owner=owner,
                max_live=task.max_live,
            )
        except StoreUnavailable:
            emit_warning("store_unavailable", guard="task", route=route.name, mode="open")
            STORE_UNAVAILABLE.labels(guard="task", action="open").inc()
            return await endpoint(**kwargs)
        if claim.status is TaskStatus.reused:
            conflict.add()
            error = PublicError(422, ErrorCode.idempotency_key_reused, False)
            return _answer(route, guards, request, started, error, trace_id_of)
        if claim.status is TaskStatus.busy:
            conflict.add()
            error = PublicError(409, ErrorCode.task_in_progress, True, 1.0)
            return _answer(route, guards, request, started, error, trace_id_of)
        if claim.status is TaskStatus.full:  # too many live tasks: a rate of new tasks, spent
            conflict.add()
            error = PublicError(429, ErrorCode.rate_limited, False, claim.retry_after_s)
            return _answer(route, guards, request, started, error, trace_id_of)
        if claim.status is TaskStatus.done:
            assert claim.response is not None
            replayed.add()
            trace_id = trace_id_of(request)
            answer = _response(claim.response, trace_id, replayed=True)
            ai: AI[Any] = AI(guards, route, first=None, trace_id=trace_id)
            finish_request(route, ai, started, "ok", answer.status_code, replayed=True)
            return answer
        assert claim.lease is not None
        run = request.scope[TASK_SCOPE] = TaskRun(guards.store, route, key, claim.lease, claim.steps)
        try:
            result = await endpoint(**kwargs)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await run.release()
            raise
        stored = _stored(route, result, kwargs[response_param], request, dump, task.max_bytes)
        if stored is None:
            await run.release()
            return result
        await run.complete(stored[0])
        return _response(stored[0], stored[1], replayed=False)

    return run_task


def lease_s(route: GuardedRoute) -> float:
    """How long a task's lease lasts after its claim or its last saved step: a crashed
    worker's task waits this long for the next request (each call of a step is bounded by the
    route's deadline)."""
    return 2 * route.timeout_s + 60


async def _fingerprint(request: Request) -> str:
    """The request a task is bound to: method, path, query and body (read already)."""
    digest = hashlib.sha256()
    for part in (
        request.method.encode(),
        request.scope.get("raw_path") or b"",
        request.scope["query_string"],
    ):
        digest.update(part + b"\n")
    digest.update(await request.body())
    return digest.hexdigest()


def _stored(
    route: GuardedRoute,
    result: Any,
    sub: Response,
    request: Request,
    dump: Callable[..., bytes],
    max_bytes: int,
) -> tuple[str, str] | None:
    """What a task keeps of a successful answer (status, the headers the route set, body), as
    JSON text, and the answer's trace id; None when the request did not succeed, or its answer
    cannot be kept."""
    if isinstance(result, Response):
        body = getattr(result, "body", None)
        if isinstance(result, StreamingResponse) or not isinstance(body, bytes):
            return None
        status, headers = result.status_code, result.raw_headers
    else:
        if route.degrading and getattr(result, "fallback", None) is not None:
            return None  # a guard tripped: the task resumes next time
        body = dump(result, by_alias=True)
        status = sub.status_code or getattr(request.scope.get("route"), "status_code", None) or 200
        headers = [(b"content-type", b"application/json"), *sub.raw_headers]
    if not 200 <= status < 300 or len(body) > max_bytes:
        return None
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return None
    trace_id = next((v.decode("latin-1") for k, v in headers if k == b"x-trace-id"), "")
    kept = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers if k.lower() not in _PER_REQUEST]
    # ASCII (`ensure_ascii`): its length is its size in bytes.
    stored = json.dumps({"status": status, "headers": kept, "body": text}, separators=(",", ":"))
    return (stored, trace_id) if len(stored) <= max_bytes else None


def _response(stored: str, trace_id: str, *, replayed: bool) -> Response:
    """The response a task stored, for this request (its trace id)."""
    answer = json.loads(stored)
    response = Response(answer["body"].encode(), status_code=answer["status"])
    response.raw_headers.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in answer["headers"])
    response.raw_headers.append((b"x-trace-id", trace_id.encode()))
    if replayed:
        response.raw_headers.append((b"idempotent-replayed", b"true"))
    return response


def _answer(
    route: GuardedRoute,
    guards: Guards,
    request: Request,
    started: float,
    error: PublicError,
    trace_id_of: Callable[[Request], str],
) -> Response:
    """A task refused before its handler ran (409, 422): logged and counted like any request."""
    trace_id = trace_id_of(request)
    ai: AI[Any] = AI(guards, route, first=None, trace_id=trace_id)
    finish_request(route, ai, started, "error", error.status, error=error.error)
    return error_response(error, trace_id)
