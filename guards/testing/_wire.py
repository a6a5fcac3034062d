"""How the fakes put an outcome on a provider's wire: Workers AI's REST envelope and its native
events, OpenAI's chat completions and `chat.completion.chunk`s, AI Gateway's error envelope,
with each provider's own error texts and headers. Imported from `guards.testing.script`."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Mapping
from typing import Any

from ._outcomes import Fail, Part, Raw, Reasoning, Refusal, Reply, Stream, Text, ToolArgs, ToolCall, ToolName

__all__ = [
    "DONE_EVENT",
    "OPENAI_ERROR_TYPES",
    "SYSTEM_FINGERPRINT",
    "flat_tool_call",
    "openai_headers",
    "openai_stream_wire",
    "openai_tool_call",
    "openai_wire",
    "sse_event",
    "tool_call_spec",
    "wants_usage",
    "workers_ai_stream_wire",
    "workers_ai_wire",
]


def workers_ai_wire(outcome: Reply | Fail | Raw) -> tuple[int, dict[str, str], bytes]:
    """How Workers AI would put `outcome` on the wire: status, headers, body (a `Fail`'s fields
    this wire cannot carry are left out: `FakeBinding` refuses them first, see `check_wire`)."""
    if isinstance(outcome, Raw):
        return _raw(outcome)
    if isinstance(outcome, Reply):
        result = {"response": outcome.response, "usage": dict(outcome.usage)}
        if outcome.tool_calls:
            result["tool_calls"] = [flat_tool_call(t) for t in outcome.tool_calls]
        body: dict[str, Any] = {"result": result, "success": True, "errors": [], "messages": []}
        return 200, {"content-type": "application/json"}, json.dumps(body).encode()
    headers = _failure_headers(outcome)
    if outcome.shape == "gateway":
        body = _gateway_error(outcome)
    elif outcome.shape == "aierror":
        message = _workers_ai_message(outcome)
        body = {
            "name": "AiError",
            "internalCode": outcome.code,
            "httpCode": outcome.status,
            "description": message,
            "message": message,
        }
    else:
        body = {"result": None, "success": False, "errors": [_coded_error(outcome)], "messages": []}
    return outcome.status, headers, json.dumps(body).encode()


#: The `error.type` OpenAI sends with each status (`server_error` for the rest of 5xx).
OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "requests",
}


def openai_wire(outcome: Reply | Fail | Raw, model: str) -> tuple[int, dict[str, str], bytes]:
    """How an OpenAI-compatible server would answer a chat completion for `model` with
    `outcome`: status, headers, body. A `Reply` is a `chat.completion` whose message content is
    the text (an object as its JSON text; `None` as `null`). A `Fail`'s fields this wire
    cannot carry are left out (`FakeBinding` refuses them first, see `check_wire`)."""
    if isinstance(outcome, Raw):
        return _raw(outcome)
    if isinstance(outcome, Reply):
        answer = outcome.response
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None
            if outcome.refusal is not None or answer is None
            else answer
            if isinstance(answer, str)
            else json.dumps(answer),
            "refusal": outcome.refusal,
        }
        if outcome.tool_calls:
            message["tool_calls"] = [openai_tool_call(i, t) for i, t in enumerate(outcome.tool_calls)]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": outcome.finish_reason}
        body: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": outcome.model or model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice],
            "usage": dict(outcome.usage),
        }
        return 200, {"content-type": "application/json", **openai_headers()}, json.dumps(body).encode()
    if outcome.shape == "gateway":
        body = _gateway_error(outcome)
    else:
        error_type = outcome.error_type or OPENAI_ERROR_TYPES.get(
            outcome.status, "server_error" if outcome.status >= 500 else "invalid_request_error"
        )
        error_code = outcome.error_code
        if error_code is None and outcome.error_type is None and outcome.status == 429:
            error_code = "rate_limit_exceeded"
        error: dict[str, Any] = {
            "message": outcome.message or _openai_message(outcome.status, model, error_code),
            "type": error_type,
            "code": error_code,
            "param": "messages" if error_code in _INPUT_CODES else None,
        }
        if error_code == "content_filter":  # Azure OpenAI's content filter: its `innererror`
            error["param"], error["status"] = "prompt", outcome.status
            error["innererror"] = {
                "code": "ResponsibleAIPolicyViolation",
                "content_filter_result": {
                    "hate": {"filtered": True, "severity": "high"},
                    "self_harm": {"filtered": False, "severity": "safe"},
                    "sexual": {"filtered": False, "severity": "safe"},
                    "violence": {"filtered": False, "severity": "safe"},
                },
            }
        body = {"error": error}
    return outcome.status, {**_failure_headers(outcome), **openai_headers()}, json.dumps(body).encode()


#: What OpenAI sends as `system_fingerprint` in every answer and chunk (the fake's constant).
SYSTEM_FINGERPRINT = "fp_fake0000"


def openai_headers() -> dict[str, str]:
    """The headers OpenAI puts on every answer: a fresh `x-request-id`."""
    return {"x-request-id": f"req_{uuid.uuid4().hex}"}


#: The OpenAI error codes about the request's input (sent with `param: "messages"`).
_INPUT_CODES = frozenset({"context_length_exceeded", "string_above_max_length", "content_policy_violation"})


def _openai_message(status: int, model: str, code: str | None = None) -> str:
    """What OpenAI (or Azure OpenAI) says with `status` and `code` (their wording; the numbers
    are the fake's)."""
    if code == "context_length_exceeded":
        return (
            "This model's maximum context length is 8192 tokens. However, your messages resulted "
            "in 9000 tokens. Please reduce the length of the messages."
        )
    if code == "content_filter":
        return (
            "The response was filtered due to the prompt triggering Azure OpenAI's content "
            "management policy. Please modify your prompt and retry."
        )
    if code == "content_policy_violation":
        return "Your request was rejected as a result of our safety system."
    if status == 429:
        return (
            f"Rate limit reached for {model} in organization org-fake on requests per min (RPM): "
            "Limit 3, Used 3, Requested 1. Please try again in 20s. Visit "
            "https://platform.openai.com/account/rate-limits to learn more."
        )
    if status == 401:
        return "Incorrect API key provided: sk-fake. You can find your API key at https://platform.openai.com/account/api-keys."
    if status == 404:
        return f"The model `{model}` does not exist or you do not have access to it."
    if status >= 500:
        return "The server had an error while processing your request. Sorry about that!"
    return "We could not parse the JSON body of your request."


#: What Cloudflare says with a code, when the script gives no message.
_CLOUDFLARE_MESSAGES = {
    3006: "AiError: AiError: Request is too large (00000000-0000-0000-0000-000000000000)",
    2016: "Prompt blocked due to security configurations",
    2017: "Response blocked due to security configurations",
}


def _workers_ai_message(outcome: Fail) -> str:
    if outcome.message:
        return outcome.message
    known = _CLOUDFLARE_MESSAGES.get(outcome.code) if outcome.code is not None else None
    return known or "AiError: AiError: something went wrong (00000000-0000-0000-0000-000000000000)"


def tool_call_spec(call: Mapping[str, Any], index: int) -> tuple[str, str, Any]:
    """(id, name, arguments) of a tool call scripted in either shape."""
    function = call.get("function")
    spec: Mapping[str, Any] = function if isinstance(function, Mapping) else call
    return str(call.get("id") or f"call_{index}"), str(spec.get("name", "")), spec.get("arguments", {})


def flat_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call in Workers AI's flat shape: `{"name", "arguments": {...}}` (arguments as an
    object, parsed from JSON text when they were scripted as text)."""
    _, name, arguments = tool_call_spec(call, 0)
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return {"name": name, "arguments": arguments}


def openai_tool_call(index: int, call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call in OpenAI's shape: `{"id", "type": "function", "function": {"name",
    "arguments": "<JSON text>"}}`."""
    call_id, name, arguments = tool_call_spec(call, index)
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _raw(outcome: Raw) -> tuple[int, dict[str, str], bytes]:
    return outcome.status, {"content-type": outcome.content_type, **outcome.headers}, outcome.body


def _failure_headers(outcome: Fail) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if outcome.retry_after is not None:
        headers["retry-after"] = outcome.retry_after
    if outcome.retry_after_ms is not None:
        headers["retry-after-ms"] = outcome.retry_after_ms
    return headers


def _gateway_error(outcome: Fail) -> dict[str, Any]:
    """Cloudflare AI Gateway's error envelope (note the singular key `error`, a list)."""
    return {"success": False, "name": "AiGatewayError", "error": [_coded_error(outcome)]}


def _coded_error(outcome: Fail) -> dict[str, Any]:
    """Cloudflare's error object: `message`, and the numeric `code` when there is one."""
    error: dict[str, Any] = {"message": _workers_ai_message(outcome)}
    if outcome.code is not None:
        error["code"] = outcome.code
    return error


# --- streams on the wire ------------------------------------------------------------------------

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    """One SSE event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(model: str, delta: Mapping[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish_reason}],
    }


def _openai_delta(part: Part) -> dict[str, Any]:
    if isinstance(part, Text):
        return {"content": part.text}
    if isinstance(part, Reasoning):
        return {"reasoning_content": part.text}
    if isinstance(part, ToolName):
        call = {"index": part.index, "id": part.id, "type": "function"}
        return {"tool_calls": [{**call, "function": {"name": part.name, "arguments": ""}}]}
    if isinstance(part, ToolArgs):
        return {"tool_calls": [{"index": part.index, "function": {"arguments": part.arguments}}]}
    if isinstance(part, ToolCall):
        call = openai_tool_call(part.index, {"id": part.id, "name": part.name, "arguments": part.arguments})
        return {"tool_calls": [{"index": part.index, **call}]}
    if isinstance(part, Refusal):
        return {"refusal": part.text}
    return {"role": "assistant", "content": ""}


def _chunk_events(outcome: Stream, model: str, *, usage: str = "always") -> list[bytes]:
    """The events of `outcome` as OpenAI `chat.completion.chunk`s, without any error. `usage`:
    `"always"` ends with a usage chunk (Workers AI's OpenAI-style streams); `"asked"` does too,
    and every other chunk carries `"usage": null` (OpenAI, when the request asks for usage);
    `"never"`: no usage anywhere (OpenAI, when it does not)."""
    served = outcome.model or model

    def chunk(delta: Mapping[str, Any], finish_reason: str | None = None) -> bytes:
        body = _chunk(served, delta, finish_reason)
        if usage == "asked":
            body["usage"] = None
        return sse_event(body)

    events = [chunk(_openai_delta(part)) for part in outcome.parts]
    if outcome.done:
        events.append(chunk({}, outcome.finish_reason))
        if usage != "never":
            events.append(sse_event({**_chunk(served, {}), "choices": [], "usage": dict(outcome.usage)}))
        events.append(DONE_EVENT)
    return events


def _with_error(events: list[bytes], outcome: Stream, error: Mapping[str, Any]) -> list[bytes]:
    if outcome.error_after is None:
        return events
    return [*events[: outcome.error_after], sse_event(error)]


def _stream_error(outcome: Stream) -> dict[str, Any]:
    error: dict[str, Any] = {"message": outcome.error_message}
    if outcome.error_code is not None:
        error["code"] = outcome.error_code
    return error


def openai_stream_wire(outcome: Stream, model: str, *, include_usage: bool = True) -> list[bytes]:
    """Every event of `outcome` as an OpenAI-compatible server streams it for `model` (the
    in-band error as `{"error": {"message", "type": "server_error", "code", "param"}}`). The
    usage chunk comes only with `include_usage` (the request's `stream_options`), and then
    every other chunk carries `"usage": null`, as OpenAI does."""
    error = {
        "error": {
            "message": outcome.error_message,
            "type": "server_error",
            "code": outcome.error_code,
            "param": None,
        }
    }
    events = _chunk_events(outcome, model, usage="asked" if include_usage else "never")
    return _with_error(events, outcome, error)


def wants_usage(inputs: Any) -> bool:
    """Whether a chat completion request asks for the usage chunk
    (`"stream_options": {"include_usage": true}`)."""
    options = inputs.get("stream_options") if isinstance(inputs, Mapping) else None
    return isinstance(options, Mapping) and options.get("include_usage") is True


def _native(part: Part, model: str) -> dict[str, Any]:
    if isinstance(part, Text):
        return {"response": part.text}
    if isinstance(part, ToolName):
        call = {"index": part.index, "id": part.id, "type": "function", "function": {"name": part.name}}
        return {"response": "", "tool_calls": [call]}
    if isinstance(part, ToolArgs):
        return {
            "response": "",
            "tool_calls": [{"index": part.index, "function": {"arguments": part.arguments}}],
        }
    if isinstance(part, ToolCall):
        return {
            "response": "",
            "tool_calls": [flat_tool_call({"name": part.name, "arguments": part.arguments})],
        }
    if isinstance(part, Reasoning | Refusal):
        # No native shape is known for reasoning or a refusal: sent as the OpenAI-style chunk
        # Workers AI also streams (the adapter detects the shape per event).
        return _chunk(model, _openai_delta(part))
    return {"response": ""}


def workers_ai_stream_wire(outcome: Stream, model: str, *, openai_chunks: bool = False) -> list[bytes]:
    """Every event of `outcome` as Workers AI streams it: native `{"response": ...}` events
    (in-band error `{"errors": [{"code", "message"}]}`), or with `openai_chunks` the
    `chat.completion.chunk`s some models stream (in-band error `{"error": {"code", "message"}}`)."""
    if openai_chunks:
        return _with_error(_chunk_events(outcome, model), outcome, {"error": _stream_error(outcome)})
    events = [sse_event(_native(part, outcome.model or model)) for part in outcome.parts]
    if outcome.done:
        events += [sse_event({"response": "", "usage": dict(outcome.usage)}), DONE_EVENT]
    return _with_error(events, outcome, {"errors": [_stream_error(outcome)]})
