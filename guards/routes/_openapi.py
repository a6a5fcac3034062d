"""OpenAPI for guarded routes: every status a guarded route can answer, with its body.

FastAPI documents the success shape from the return annotation (the envelope for a degrading
route), and a task route's `Idempotency-Key` header from its endpoint's signature. This adds
the error statuses (each limited to the tokens it can carry), the `x-trace-id`,
`x-service-level` and `Retry-After` headers, and removes FastAPI's 422, which a guarded route
answers only as a task's `idempotency_key_reused`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.routing import APIRoute
from pydantic import TypeAdapter

from ..contracts._envelope import MAX_PROBLEMS, ErrorBody
from ..contracts._responses import STRICT_STATUSES
from ..contracts._vocabulary import ErrorCode, GuardName, Reason
from ..spec._route_spec import GuardedRoute, route_of

if TYPE_CHECKING:
    from fastapi import FastAPI


__all__ = ["document_guarded_routes"]

_REF = "#/components/schemas/{model}"
_TRACE_HEADER = {"description": "Trace id of the request, also in logs.", "schema": {"type": "string"}}
_RETRY_AFTER = {"description": "Seconds to wait before retrying, when known.", "schema": {"type": "integer"}}
_LEVEL_HEADER = {
    "description": "The service level, while it is not full: degraded (some model is down) or "
    "minimal (every model is down).",
    "schema": {"type": "string", "enum": ["degraded", "minimal"]},
}
_REPLAYED = {
    "idempotent-replayed": {
        "description": "`true` when the answer is a completed task's, answered again without a call.",
        "schema": {"type": "string", "enum": ["true"]},
    }
}
_ATTRIBUTION = {
    "detailed": {
        "x-ai-model": {
            "description": "The model that answered, as its provider named it.",
            "schema": {"type": "string"},
        },
        "x-ai-fallback": {
            "description": "The fallback chain entry that answered, when it was not the first model.",
            "schema": {"type": "string"},
        },
    },
    "redacted": {
        "x-ai-fallback": {
            "description": "`true` when a fallback model answered.",
            "schema": {"type": "string", "enum": ["true"]},
        },
    },
}
#: `x-ai-rejected`, per attribution mode, on a route whose rejected answers move on.
_REJECTED = {
    "detailed": {
        "x-ai-rejected": {
            "description": (
                "The chain entries whose answers the output guard rejected, comma-separated, one "
                "per answer, in order (`route(on_rejected=...)`)."
            ),
            "schema": {"type": "string"},
        },
    },
    "redacted": {
        "x-ai-rejected": {
            "description": "How many answers the output guard rejected (`route(on_rejected=...)`).",
            "schema": {"type": "string", "pattern": "^[0-9]+$"},
        },
    },
}
#: `x-ai-budget`, on a route with a soft limit (`Budget(soft_limit=...)`).
_NEAR = {
    "x-ai-budget": {
        "description": (
            "`near; scope=<scope>[,<scope>...]` when the request was admitted past the soft limit "
            "of the named budgets (`Budget(soft_limit=...)`)."
        ),
        "schema": {"type": "string", "pattern": "^near; scope=[^ ,;]+(,[^ ,;]+)*$"},
    }
}
#: `x-ai-downgraded`, on a route with `downgrade_to`.
_DOWNGRADED = {
    "x-ai-downgraded": {
        "description": (
            "The budget scopes (comma-separated) whose soft limits sent the request to the "
            "route's downgrade chain (`route(downgrade_to=...)`)."
        ),
        "schema": {"type": "string"},
    }
}
_STREAM_DESCRIPTION = (
    "Server-Sent Events: `delta` {text}, `reasoning` {text}, `tool_call` {index, id, name, "
    "arguments}, then exactly one of `done` {finish_reason, usage, model, fallback_model, "
    "attempts, trace_id} (and `object` on a structured stream) or `error` {guard, reason, "
    "detail, trace_id}. Sent once the first "
    "output is ready: a failure before it is an error status instead. Each event is described "
    "as an object with its `event` name and its `data`, a JSON text (OpenAPI 3.1 practice)."
)
_NULLABLE_STRING = {"type": ["string", "null"]}
_USAGE = {
    "type": "object",
    "properties": {
        name: {"type": "integer"} for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
}
#: `fallback_model` of the `done` event, per attribution mode (see `guards.walk._streaming`).
_FALLBACK_MODEL = {
    "detailed": _NULLABLE_STRING,
    "redacted": {"type": "boolean"},
    "off": {"type": "null"},
}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


def stream_events(attribution: str, answer: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The JSON Schema of each event's `data`, by event name (the vocabulary of
    `guards.EventStream`); `answer`: a structured stream's output type, which its `done`
    carries as `object`."""
    text = _object({"text": {"type": "string"}})
    done = {
        "finish_reason": _NULLABLE_STRING,
        "usage": {"anyOf": [_USAGE, {"type": "null"}]},
        "model": _NULLABLE_STRING if attribution == "detailed" else {"type": "null"},
        "fallback_model": _FALLBACK_MODEL[attribution],
        "attempts": {"type": "integer"},
        "trace_id": {"type": "string"},
    }
    if answer is not None:
        done["object"] = answer
    return {
        "delta": text,
        "reasoning": text,
        "tool_call": _object(
            {
                "index": {"type": "integer"},
                "id": _NULLABLE_STRING,
                "name": _NULLABLE_STRING,
                "arguments": {"type": "string"},
            }
        ),
        "done": _object(done),
        "error": _object(
            {
                "guard": {"type": "string", "enum": [g.value for g in GuardName]},
                "reason": {"type": "string", "enum": [r.value for r in Reason]},
                "detail": {"type": "string"},
                "trace_id": {"type": "string"},
            }
        ),
    }


def _ui_stream_response(answer: dict[str, Any] | None) -> dict[str, Any]:
    """The 200 of a route answering the Vercel AI SDK's UI message stream (`UI_MESSAGE_STREAM`):
    events without a name, each `data` a JSON chunk with its `type`, the last `[DONE]`
    (`answer`: a structured stream's output type, its `data-object` chunk's `data`)."""
    chunk = {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"]}
    events = [
        {
            "type": "object",
            "properties": {
                "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": chunk}
            },
            "required": ["data"],
        },
        {"type": "object", "properties": {"data": {"const": "[DONE]"}}, "required": ["data"]},
    ]
    return {
        "description": (
            "The Vercel AI SDK's UI message stream (v1, header `x-vercel-ai-ui-message-stream`): "
            "`start`, the text, reasoning and tool-input parts, then exactly one of `finish` "
            "(`messageMetadata.guards`: the `done` data) and `error` (`errorText`: the reason), "
            "then `[DONE]`."
            + (
                ""
                if answer is None
                else " A structured stream sends its validated object as a `data-object` chunk "
                "(`data`) just before `finish`."
            )
        ),
        "headers": {"x-vercel-ai-ui-message-stream": {"schema": {"const": "v1"}}},
        "content": {"text/event-stream": {"schema": {"oneOf": events}}},
    }


def _stream_response(attribution: str, answer: dict[str, Any] | None) -> dict[str, Any]:
    """The 200 of a streaming route: one of the five events, each `{event, data}` with its
    `data` a JSON text of the event's schema (`answer`: a structured stream's output type)."""
    events = [
        {
            "type": "object",
            "properties": {
                "event": {"const": name},
                "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data},
            },
            "required": ["event", "data"],
        }
        for name, data in stream_events(attribution, answer).items()
    ]
    return {
        "description": _STREAM_DESCRIPTION,
        "content": {"text/event-stream": {"schema": {"oneOf": events}}},
    }


_DESCRIPTIONS = {
    400: (
        "Invalid input (missing, wrong-typed or oversized); no model call was made. `problems` "
        "names each field and what is wrong with it (a pydantic error type), never the input. "
        "On a strict route, also `context_length_exceeded`: the input does not fit the context "
        "window of any model the route may call (`problems`: `body`, `too_long`); shorten it."
    ),
    409: "Another request holds this Idempotency-Key's task; retry after `Retry-After`.",
    422: "This Idempotency-Key was used with another request body.",
    429: (
        "A per-key budget is spent, or (a task route) the caller has as many live tasks as the "
        "route allows; retry after `Retry-After`."
    ),
    500: "The route's own code failed; the model's answer was fine.",
    502: "The model cannot serve this route, or answered in the wrong shape.",
    503: "The model is unavailable now; `retryable` and `Retry-After` say whether and when to retry.",
}


def error_statuses(route: GuardedRoute) -> dict[int, list[ErrorCode]]:
    """The error statuses `route` can answer and the tokens each can carry."""
    statuses = {400: [ErrorCode.invalid_request], 500: [ErrorCode.application_failure]}
    if route.task is not None:
        statuses[409] = [ErrorCode.task_in_progress]
        statuses[422] = [ErrorCode.idempotency_key_reused]
        statuses[429] = [ErrorCode.rate_limited]  # too many live tasks (`Task.max_live`)
    if route.degrading:
        return dict(sorted(statuses.items()))
    for status, codes in STRICT_STATUSES.items():
        allowed = [c for c in codes if _possible(route, c)]
        if allowed:
            statuses[status] = [*statuses.get(status, ()), *allowed]
    return dict(sorted(statuses.items()))


def _possible(route: GuardedRoute, code: ErrorCode) -> bool:
    budget = route.budget
    if code is ErrorCode.rate_limited:  # a per-minute limit, a shared limit, or too many live tasks
        return (
            (budget is not None and budget.per_minute is not None)
            or route.task is not None
            or any(each.shared is not None for each in route.budgets)
        )
    if code is ErrorCode.budget_exceeded:
        return budget is not None and budget.per_day is not None
    if code is ErrorCode.circuit_open:
        return route.breaker is not None or route.shed_at is not None
    return True


def document_guarded_routes(app: FastAPI, schema: dict[str, Any], attribution: str) -> None:
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    body_schema = ErrorBody.model_json_schema(ref_template=_REF)
    schemas.update(body_schema.pop("$defs", {}))
    schemas.setdefault("ErrorBody", body_schema)
    for api_route in app.routes:
        route = route_of(getattr(api_route, "endpoint", None))
        if route is None or not isinstance(api_route, APIRoute):
            continue
        for method in api_route.methods or ():
            operation = schema.get("paths", {}).get(api_route.path_format, {}).get(method.lower())
            if operation is None:
                continue
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if route.streaming:
                answer = _answer_schema(route, schemas)
                guards_events = route.stream_format.name == "guards"
                responses["200"] = (
                    _stream_response(attribution, answer) if guards_events else _ui_stream_response(answer)
                )
            if route.task is not None:
                responses.setdefault("200", {}).setdefault("headers", {}).update(_REPLAYED)
            for status, codes in error_statuses(route).items():
                responses[str(status)] = _error_response(status, codes)
            if route.max_body_bytes is not None:
                responses["400"]["description"] += (
                    f" A request body over {route.max_body_bytes} bytes is refused without being read."
                )
            if attribution != "off":
                # Whenever a model answered: its answer served, was rejected by the output
                # guard (a fallback, 502), or the route's own code failed after it (500).
                moves_on = route.answers is not None and route.answers.on_rejected != "fallback"
                # A rejected answer that moved on may end in any failure of the next model.
                for answered in ("200", "500", "502", "503") if moves_on else ("200", "500", "502"):
                    if answered in responses:
                        headers = responses[answered].setdefault("headers", {})
                        headers.update(_ATTRIBUTION[attribution])
                        if moves_on:
                            headers.update(_REJECTED[attribution])
            if route.soft_limited:  # any answer of a request the budget admitted
                for admitted in ("200", "500", "502", "503"):
                    if admitted in responses:
                        responses[admitted].setdefault("headers", {}).update(_NEAR)
                        if route.downgrade is not None:
                            responses[admitted]["headers"].update(_DOWNGRADED)
            for response in responses.values():
                headers = response.setdefault("headers", {})
                headers["x-trace-id"] = _TRACE_HEADER
                headers["x-service-level"] = _LEVEL_HEADER
            if route.resumable is not None and route.streaming:
                responses["200"]["headers"]["x-stream-id"] = _STREAM_ID_HEADER
                resume = _resume_operation(route, responses["200"])
                schema["paths"].setdefault(f"{api_route.path_format}/{{id}}/stream", {})["get"] = resume


_STREAM_ID_HEADER = {
    "description": "The stream's id: resume it at `GET <path>/<id>/stream`.",
    "schema": {"type": "string"},
}


def _resume_operation(route: GuardedRoute, stream: dict[str, Any]) -> dict[str, Any]:
    """The resume route of a resumable route (`guards.routes._resume`): its stream again."""
    trace = {"x-trace-id": _TRACE_HEADER}
    return {
        "summary": f"Resume a stream of {route.name}",
        "operationId": f"resume_{route.name}",
        "parameters": [
            {
                "name": "id",
                "in": "path",
                "required": True,
                "description": "A stream's id (`x-stream-id`) or a chat's id.",
                "schema": {"type": "string"},
            },
            {
                "name": "last-event-id",
                "in": "header",
                "required": False,
                "description": "The id of the last event the client has (`<stream id>:<n>`).",
                "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}:[0-9]{1,9}$"},
            },
        ],
        "responses": {
            "200": {**stream, "headers": {**trace, "x-stream-id": _STREAM_ID_HEADER}},
            "204": {
                "description": "Nothing to resume: no such stream, past its TTL, or none left.",
                "headers": trace,
            },
            "400": {**_error_response(400, [ErrorCode.invalid_request]), "headers": trace},
        },
    }


def _answer_schema(route: GuardedRoute, schemas: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema of a structured stream's validated output as its `done` carries it
    (its models among the document's `schemas`); None for a text stream."""
    if route.output.json_schema is None:
        return None
    schema = TypeAdapter(route.output.output_type).json_schema(mode="serialization", ref_template=_REF)
    for name, model in schema.pop("$defs", {}).items():
        schemas.setdefault(name, model)
    return schema


def _error_response(status: int, codes: list[ErrorCode]) -> dict[str, Any]:
    narrowed: dict[str, Any] = {"properties": {"error": {"type": "string", "enum": [c.value for c in codes]}}}
    if status == 400:
        # A 400 always says what to fix.
        narrowed["properties"]["problems"] = {
            "type": "array",
            "items": {"$ref": _REF.format(model="Problem")},
            "minItems": 1,
            "maxItems": MAX_PROBLEMS,
        }
        narrowed["required"] = ["problems"]
    body = {"allOf": [{"$ref": _REF.format(model="ErrorBody")}, narrowed]}
    response: dict[str, Any] = {
        "description": _DESCRIPTIONS[status] + " Errors: " + ", ".join(c.value for c in codes) + ".",
        "content": {"application/json": {"schema": body}},
    }
    if status in (409, 429, 503):
        response["headers"] = {"retry-after": _RETRY_AFTER}
    return response
