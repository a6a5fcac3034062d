"""A fake Gemini API server on a loopback port, the sibling of `FakeOpenAI`: the same scripted
outcomes, on Gemini's wire (`gemini_wire`, `gemini_stream_wire`), which the in-process
`FakeBinding(wire="gemini")` also speaks.

How an outcome looks on this wire:

- `Reply`: one candidate whose parts are the text (an object as its JSON text) and a
  `functionCall` per tool call, finished `STOP`; `finish_reason` `"length"` is `MAX_TOKENS`,
  `"content_filter"` is `SAFETY` (the candidate then has no content, as Gemini sends it) and
  an upper-case reason is sent as it is (`"RECITATION"`, `"PROHIBITED_CONTENT"`...); a
  `refusal` is a blocked prompt (`promptFeedback.blockReason: SAFETY`, no candidate). The
  usage is `usageMetadata` (scripted in OpenAI's names or Gemini's own).
- `Fail`: a google.rpc status object `{"error": {"code", "message", "status", "details"}}`,
  `status` the HTTP status and `error_type` the rpc status (default: the one Gemini sends
  with that status); `retry_after` (seconds) is a `google.rpc.RetryInfo` detail; a 429
  carries a `google.rpc.QuotaFailure` whose `quotaId` is `error_code` (default: a per-minute
  quota; `"insufficient_quota"`, as on OpenAI's wire, is the per-day one); `error_code`
  `"context_length_exceeded"` is Gemini's 400 for an input over the model's window.
- `Stream`: one `data:` event per part (text, thought for `Reasoning`, a whole
  `functionCall` for `ToolCall`: Gemini sends no partial calls, so `ToolName` and `ToolArgs`
  are refused), then, when `done`, one event with the finish reason and the usage; no
  `[DONE]`. The in-band error is an `{"error": ...}` event, with `error_code` as its code
  (default 500, `INTERNAL`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ._server import FakeServer, Wire
from .script import (
    Call,
    Chooser,
    Fail,
    Meta,
    Outcome,
    Part,
    Raw,
    Reasoning,
    Refusal,
    Reply,
    Stream,
    Text,
    ToolCall,
    flat_tool_call,
    sse_event,
)

__all__ = ["FakeGemini", "gemini_error_event", "gemini_stream_wire", "gemini_wire"]

_JSON = {"content-type": "application/json; charset=UTF-8"}
#: `/{version}/models/{model}:{method}`, the versions the SDKs call (`v1beta`; `v1` is the
#: google-genai SDK's default).
_PATH = re.compile(
    r"^/(?P<version>v1|v1beta)/models/(?P<model>[^/:?]+):(?P<method>[A-Za-z]+)(?:\?(?P<query>.*))?$"
)
#: The google.rpc status Gemini sends with each HTTP status.
RPC_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}
_FILTERED = frozenset({"SAFETY", "RECITATION", "PROHIBITED_CONTENT", "BLOCKLIST", "SPII"})
PER_MINUTE_QUOTA = "GenerateRequestsPerMinutePerProjectPerModel-FreeTier"
PER_DAY_QUOTA = "GenerateRequestsPerDayPerProjectPerModel-FreeTier"
_SAFETY_RATINGS = [
    {"category": "HARM_CATEGORY_HARASSMENT", "probability": "NEGLIGIBLE"},
    {"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH", "blocked": True},
]


def _messages(status: int, model: str, code: str | None) -> str:
    """What Gemini says with `status` and `error_code` (its wording; the numbers are the fake's)."""
    if code == "context_length_exceeded":
        return "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576)."
    if status == 429:
        return (
            "You exceeded your current quota, please check your plan and billing details. For more "
            "information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits."
        )
    if status == 404:
        return (
            f"models/{model} is not found for API version v1beta, or is not supported for "
            "generateContent. Call ListModels to see the list of available models and their "
            "supported methods."
        )
    if status == 403:
        return "The caller does not have permission"
    if status == 503:
        return "The model is overloaded. Please try again later."
    if status == 504:
        return "Deadline expired before operation could complete."
    if status >= 500:
        return "An internal error has occurred. Please retry or report in https://developers.generativeai.google/guide/troubleshooting"
    return "Request contains an invalid argument."


def _error(status: int, rpc: str, message: str, details: list[dict[str, Any]] | None = None) -> Wire:
    error: dict[str, Any] = {"code": status, "message": message, "status": rpc}
    if details:
        error["details"] = details
    return status, dict(_JSON), json.dumps({"error": error}).encode()


def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """A script's usage as `usageMetadata`: Gemini's own names as they are, OpenAI's mapped."""
    if any(key.endswith("TokenCount") for key in usage):
        return dict(usage)
    return {
        "promptTokenCount": usage.get("prompt_tokens", 0),
        "candidatesTokenCount": usage.get("completion_tokens", 0),
        "totalTokenCount": usage.get("total_tokens", 0),
    }


def _finish(reason: str) -> str:
    return _FINISH.get(reason, reason if reason.isupper() else "OTHER")


def _function_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call scripted in either shape as a `functionCall` part (its arguments an object)."""
    flat = flat_tool_call(call)
    arguments = flat["arguments"]
    return {"functionCall": {"name": flat["name"], "args": arguments if isinstance(arguments, dict) else {}}}


def _answer(model: str, candidate: dict[str, Any] | None, usage: Mapping[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if candidate is not None:
        body["candidates"] = [{**candidate, "index": 0}]
    body["usageMetadata"] = _usage(usage)
    body["modelVersion"] = model
    body["responseId"] = "fake-response-0001"
    return body


def gemini_wire(outcome: Reply | Fail | Raw, model: str) -> Wire:
    """How the Gemini API would answer `generateContent` for `model` with `outcome`: status,
    headers, body (see the module's docstring)."""
    if isinstance(outcome, Raw):
        return outcome.status, {"content-type": outcome.content_type, **outcome.headers}, outcome.body
    if isinstance(outcome, Reply):
        served = outcome.model or model
        if outcome.refusal is not None:  # the prompt blocked: no candidate at all
            feedback = {"blockReason": "SAFETY", "safetyRatings": _SAFETY_RATINGS}
            body = {**_answer(served, None, outcome.usage), "promptFeedback": feedback}
            return 200, dict(_JSON), json.dumps(body).encode()
        finish = _finish(outcome.finish_reason)
        candidate: dict[str, Any] = {"finishReason": finish}
        if finish in _FILTERED:
            candidate["safetyRatings"] = _SAFETY_RATINGS
        else:
            answer = outcome.response
            text = answer if isinstance(answer, str) else None if answer is None else json.dumps(answer)
            parts: list[dict[str, Any]] = [{"text": text}] if text else []
            parts += [_function_call(call) for call in outcome.tool_calls]
            candidate["content"] = {"role": "model", "parts": parts or [{"text": ""}]}
        return 200, dict(_JSON), json.dumps(_answer(served, candidate, outcome.usage)).encode()
    return _failure(outcome, model)


def _failure(outcome: Fail, model: str) -> Wire:
    status = outcome.status
    rpc = outcome.error_type or RPC_STATUS.get(status, "INTERNAL" if status >= 500 else "UNKNOWN")
    details: list[dict[str, Any]] = []
    if status == 429:
        quota = outcome.error_code or PER_MINUTE_QUOTA
        if quota == "insufficient_quota":
            quota = PER_DAY_QUOTA
        violation = {
            "quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
            "quotaId": quota,
            "quotaDimensions": {"location": "global", "model": model},
            "quotaValue": "15",
        }
        details.append({"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [violation]})
    headers = dict(_JSON)
    if outcome.retry_after is not None:
        try:
            seconds = float(outcome.retry_after)
        except ValueError:
            headers["retry-after"] = outcome.retry_after  # an HTTP date: only a header can say it
        else:
            delay = f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"  # a Duration: never 1e+07s
            details.append({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay})
    message = outcome.message or _messages(status, model, outcome.error_code)
    wire_status, _, body = _error(status, rpc, message, details)
    return wire_status, headers, body


def gemini_error_event(outcome: Stream) -> dict[str, Any]:
    """The in-band error of `outcome` as a Gemini stream sends it: `error_code` as its code
    (an HTTP error status; default 500) with the rpc status Gemini sends with it."""
    code = outcome.error_code if outcome.error_code is not None and 400 <= outcome.error_code < 600 else 500
    return {
        "error": {"code": code, "message": outcome.error_message, "status": RPC_STATUS.get(code, "INTERNAL")}
    }


def _part(part: Part) -> dict[str, Any]:
    if isinstance(part, Text):
        return {"text": part.text}
    if isinstance(part, Reasoning):
        return {"text": part.text, "thought": True}
    if isinstance(part, ToolCall):
        return _function_call({"name": part.name, "arguments": part.arguments})
    if isinstance(part, Meta | Refusal):
        return {"text": ""}
    raise ValueError(f"{type(part).__name__}: Gemini streams each function call whole (script a ToolCall)")


def gemini_stream_wire(outcome: Stream, model: str) -> list[bytes]:
    """Every event of `outcome` as `streamGenerateContent?alt=sse` sends it for `model`."""
    served = outcome.model or model
    usage = {key: value for key, value in _usage(outcome.usage).items() if key == "promptTokenCount"}
    events = [
        sse_event(_answer(served, {"content": {"role": "model", "parts": [_part(part)]}}, usage))
        for part in outcome.parts
    ]
    if outcome.done:
        refused = any(isinstance(part, Refusal) and part.text for part in outcome.parts)
        finish = "SAFETY" if refused else _finish(outcome.finish_reason)
        last = {"content": {"role": "model", "parts": [{"text": ""}]}, "finishReason": finish}
        events.append(sse_event(_answer(served, last, outcome.usage)))
    if outcome.error_after is not None:
        events = [*events[: outcome.error_after], sse_event(gemini_error_event(outcome))]
    return events


class FakeGemini(FakeServer):
    """`with FakeGemini() as server:` serves `POST {server.base_url}/{v1beta,v1}/models/{model}:
    generateContent` and `:streamGenerateContent?alt=sse` (use `base_url` as the adapter's).

    The model is the path's; script outcomes with `server.script(model, ...)` and read
    `server.calls` (each with the whole JSON body as `inputs`, and the headers). A request
    without `x-goog-api-key: <api_key>` (or `?key=`) gets Gemini's 400 `API_KEY_INVALID`
    (403 `PERMISSION_DENIED` without any key). A `Reply` to `streamGenerateContent` plays as
    its stream.
    """

    thread_name = "fake-gemini"

    def __init__(self, default: Outcome | Chooser | None = None, *, api_key: str = "test-gemini-key") -> None:
        super().__init__(default)
        self.api_key = api_key

    def route(self, method: str, path: str, headers: Mapping[str, str], inputs: Any) -> str | Wire:
        match = _PATH.match(path)
        if (
            method != "POST"
            or match is None
            or match["method"] not in ("generateContent", "streamGenerateContent")
        ):
            return _error(404, "NOT_FOUND", f"Method not found: {method} {path.split('?')[0]}")
        key = headers.get("x-goog-api-key") or _query_key(match["query"] or "")
        if not key:
            return _error(
                403,
                "PERMISSION_DENIED",
                "Method doesn't allow unregistered callers (callers without established identity). "
                "Please use API Key or other form of API consumer identity to call this API.",
            )
        if key != self.api_key:
            info = {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "API_KEY_INVALID",
                "domain": "googleapis.com",
            }
            return _error(400, "INVALID_ARGUMENT", "API key not valid. Please pass a valid API key.", [info])
        if not isinstance(inputs, dict) or not isinstance(inputs.get("contents"), list):
            return _error(
                400, "INVALID_ARGUMENT", "* GenerateContentRequest.contents: contents is not specified"
            )
        return match["model"]

    def streams(self, path: str, inputs: Any) -> bool:
        return ":streamGenerateContent" in path

    def wire(self, outcome: Reply | Fail | Raw, call: Call) -> Wire:
        return gemini_wire(outcome, call.model)

    def stream_wire(self, outcome: Stream, call: Call) -> list[bytes]:
        return gemini_stream_wire(outcome, call.model)


def _query_key(query: str) -> str:
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        if name == "key":
            return value
    return ""
