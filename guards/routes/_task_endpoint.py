"""The endpoint of a task route (`Guards.route(task=Task())`, see `guards.policies._tasks`): a request
with an `Idempotency-Key` claims its task in the store before the route's endpoint runs, and
stores its success (or releases the task) after it; a completed task's answer is replayed, a
task another request holds or made with another body is refused (409, 422)."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import TypeAdapter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..contracts._responses import PublicError, error_response
from ..contracts._vocabulary import ErrorCode
from ..observe._metrics import TASK_STEPS, counter
from ..policies._tasks import KEY_PARAMETER, lease_s
from ..stores import StoreUnavailable, TaskClaim, TaskStatus
from ..walk import TASK_SCOPE, Observers, TaskRun
from ..walk._events import RequestEnded, StoreFailed
from ._prepared import PreparedJSON

if TYPE_CHECKING:
    from ..spec._route_spec import GuardedRoute
    from ..spec._shared import Shared

__all__ = ["task_endpoint"]

#: Headers that describe one request, not the task's answer: never stored or replayed.
_PER_REQUEST = frozenset({b"x-trace-id", b"content-length", b"x-service-level"})


def task_endpoint(
    guards: Shared,
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
    lease = lease_s(route.timeout_s)
    observe = Observers(guards)
    replayed = counter(TASK_STEPS, route.name, "replayed")
    conflict = counter(TASK_STEPS, route.name, "conflict")

    @functools.wraps(endpoint)
    async def run_task(**kwargs: Any) -> Any:
        idempotency_key: str | None = kwargs.pop(KEY_PARAMETER)
        if idempotency_key is None:
            return await endpoint(**kwargs)
        request: Request = kwargs[request_param]
        started = time.perf_counter()
        key, owner = _task_keys(route, request, idempotency_key)
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
            observe.store_failed(StoreFailed(route, None, "task", mode="open"))
            return await endpoint(**kwargs)
        if (error := _refusal(claim)) is not None:
            conflict.add()
            return _answer(route, guards, request, started, error, trace_id_of)
        if claim.status is TaskStatus.done:
            assert claim.response is not None
            replayed.add()
            trace_id = trace_id_of(request)
            answer = _response(claim.response, trace_id, replayed=True)
            observe.request_ended(
                _ended(route, trace_id, "ok", answer.status_code, started, extra={"replayed": True})
            )
            return answer
        assert claim.lease is not None
        run = request.scope[TASK_SCOPE] = TaskRun(guards.store, route, key, claim.lease, claim.steps, observe)
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


def _task_keys(route: GuardedRoute, request: Request, idempotency_key: str) -> tuple[str, str]:
    """The store key of the request's task (its caller's, under its `Idempotency-Key`), and
    the key of the caller whose live tasks are capped (`Task.max_live`)."""
    caller = route.budget.key(request) if route.budget is not None else ""
    name = hashlib.sha256(f"{caller}\n{idempotency_key}".encode("utf-8", "surrogatepass")).hexdigest()
    caller_digest = hashlib.sha256(caller.encode("utf-8", "surrogatepass")).hexdigest()
    return f"guards:task:{route.name}:{name}", f"guards:tasks:{route.name}:{caller_digest}"


def _refusal(claim: TaskClaim) -> PublicError | None:
    """The public error of a claim the store refused (None: claimed, or done): the key reused
    with another body (422), the task held by another request (409), or too many live tasks
    (429: a rate of new tasks, spent)."""
    if claim.status is TaskStatus.reused:
        return PublicError(422, ErrorCode.idempotency_key_reused, False)
    if claim.status is TaskStatus.busy:
        return PublicError(409, ErrorCode.task_in_progress, True, 1.0)
    if claim.status is TaskStatus.full:
        return PublicError(429, ErrorCode.rate_limited, False, claim.retry_after_s)
    return None


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
    if isinstance(result, PreparedJSON):
        return None  # a fallback envelope (`GuardedEndpoint`): the task resumes next time
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
    guards: Shared,
    request: Request,
    started: float,
    error: PublicError,
    trace_id_of: Callable[[Request], str],
) -> Response:
    """A task refused before its handler ran (409, 422): logged and counted like any request."""
    trace_id = trace_id_of(request)
    Observers(guards).request_ended(
        _ended(route, trace_id, "error", error.status, started, error=error.error)
    )
    return error_response(error, trace_id)


def _ended(
    route: GuardedRoute,
    trace_id: str,
    outcome: str,
    status: int,
    started: float,
    *,
    error: ErrorCode | None = None,
    extra: dict[str, Any] | None = None,
) -> RequestEnded:
    """The end of a task's request that called no model (a replay, a refusal)."""
    return (
        route,
        trace_id,
        outcome,
        status,
        started,
        0,
        route.attempt_budget,
        None,
        None,
        None,
        None,
        error,
        None,
        None,
        extra,
        None,
    )
