"""A fake Anthropic Messages API on a loopback port, the sibling of `FakeOpenAI`: the same
scripted outcomes, on Anthropic's wire (`anthropic_wire`, `anthropic_stream_wire`), and the
in-process play of a `Stream` on that wire (`play_anthropic`, for `FakeBinding`), read by the
real adapter's decoder."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncGenerator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.lowlevel

from guards.contracts._errors import ProviderError
from guards.contracts._stream import StreamEvent
from guards.providers._anthropic import messages_request
from guards.providers._anthropic_wire import ERROR_STATUSES, MessagesDecoder
from guards.providers._sse import SSEParser

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
    ToolArgs,
    ToolCall,
    ToolName,
)

__all__ = [
    "ANTHROPIC_ERROR_TYPES",
    "FakeAnthropic",
    "anthropic_stream_wire",
    "anthropic_wire",
    "play_anthropic",
]

_JSON = {"content-type": "application/json"}
#: The error `type` Anthropic sends with each status (`api_error` for the rest of 5xx).
ANTHROPIC_ERROR_TYPES = {status: kind for kind, status in ERROR_STATUSES.items()}
#: What Anthropic says with each error type (the fake's numbers).
_MESSAGES = {
    "invalid_request_error": "messages: field required",
    "authentication_error": "invalid x-api-key",
    "billing_error": "Your credit balance is too low to access the Anthropic API.",
    "permission_error": "Your API key does not have permission to use the specified resource.",
    "not_found_error": "model: claude-fake",
    "request_too_large": "Request exceeds the maximum allowed number of bytes.",
    "rate_limit_error": "This request would exceed the rate limit for your organization of 50 requests per minute.",
    "api_error": "Internal server error",
    "timeout_error": "Request timeout",
    "overloaded_error": "Overloaded",
}
#: guards' finish reasons (a `Reply`'s, a `Stream`'s) as Anthropic's `stop_reason`.
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def anthropic_headers() -> dict[str, str]:
    """The headers Anthropic puts on every answer: a fresh `request-id`."""
    return {"request-id": f"req_{uuid.uuid4().hex[:24]}"}


def _error_body(kind: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": f"req_{uuid.uuid4().hex[:24]}",
    }


def _error(status: int, kind: str, message: str) -> Wire:
    return status, {**_JSON, **anthropic_headers()}, json.dumps(_error_body(kind, message)).encode()


def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """A scripted usage in Anthropic's words: its own keys as they are, OpenAI's translated."""
    if "input_tokens" in usage or "output_tokens" in usage:
        return {"input_tokens": 0, "output_tokens": 0, **usage}
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _forced_tool(request: Any) -> str | None:
    """The tool a request forces (`tool_choice: {"type": "tool", "name"}`): a JSON route's
    answer, which the fake sends as that tool's `input`."""
    choice = request.get("tool_choice") if isinstance(request, Mapping) else None
    if isinstance(choice, Mapping) and choice.get("type") == "tool" and isinstance(choice.get("name"), str):
        return str(choice["name"])
    return None


def _tool_spec(call: Mapping[str, Any], index: int) -> tuple[str, str, Any]:
    """(id, name, arguments as an object) of a tool call scripted in either shape."""
    function = call.get("function")
    spec: Mapping[str, Any] = function if isinstance(function, Mapping) else call
    arguments = spec.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    return str(call.get("id") or f"toolu_fake{index}"), str(spec.get("name", "")), arguments


def anthropic_wire(outcome: Reply | Fail | Raw, model: str, request: Any = None) -> Wire:
    """How Anthropic would answer a Messages `request` for `model` with `outcome`: status,
    headers, body. A `Reply`'s object answers a request that forces a tool (a JSON route) as
    that tool's `input`; otherwise the answer is a text block (an object as its JSON text), its
    tool calls `tool_use` blocks, its refusal a text block with `stop_reason: "refusal"`. A
    `Fail` is `{"type": "error", "error": {"type", "message"}}` with `error_type` (default: the
    type Anthropic sends with the status) and `retry-after`; a 429 with a wait in seconds also
    says which limit is spent (`anthropic-ratelimit-requests-remaining: 0` and its `-reset`)."""
    if isinstance(outcome, Raw):
        return outcome.status, {"content-type": outcome.content_type, **outcome.headers}, outcome.body
    if isinstance(outcome, Fail):
        return _failure(outcome)
    blocks: list[dict[str, Any]] = []
    answer, forced = outcome.response, _forced_tool(request)
    if forced is not None and isinstance(answer, dict) and outcome.refusal is None:
        blocks.append({"type": "tool_use", "id": "toolu_fake", "name": forced, "input": answer})
    elif outcome.refusal is not None:
        blocks.append({"type": "text", "text": outcome.refusal, "citations": None})
    elif answer is not None and answer != "":
        text = answer if isinstance(answer, str) else json.dumps(answer)
        blocks.append({"type": "text", "text": text, "citations": None})
    for index, call in enumerate(outcome.tool_calls):
        call_id, name, arguments = _tool_spec(call, index)
        blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments})
    stop = _STOP_REASONS.get(outcome.finish_reason, outcome.finish_reason)
    if outcome.refusal is not None:
        stop = "refusal"
    elif stop == "end_turn" and any(b["type"] == "tool_use" for b in blocks):
        stop = "tool_use"
    body = {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": outcome.model or model,
        "content": blocks,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": _usage(outcome.usage),
    }
    return 200, {**_JSON, **anthropic_headers()}, json.dumps(body).encode()


def _failure(outcome: Fail) -> Wire:
    status = outcome.status
    kind = (
        outcome.error_type
        or ANTHROPIC_ERROR_TYPES.get(status)
        or ("api_error" if status >= 500 else "invalid_request_error")
    )
    headers = {**_JSON, **anthropic_headers()}
    if outcome.retry_after is not None:
        headers["retry-after"] = outcome.retry_after
        if status == 429 and outcome.retry_after.isdigit():
            reset = _reset_time(int(outcome.retry_after))
            headers["anthropic-ratelimit-requests-remaining"] = "0"
            headers["anthropic-ratelimit-requests-reset"] = reset
    if outcome.retry_after_ms is not None:
        headers["retry-after-ms"] = outcome.retry_after_ms
    body = _error_body(kind, outcome.message or _MESSAGES.get(kind, "Error"))
    return status, headers, json.dumps(body).encode()


def _reset_time(seconds: int) -> str:
    """The RFC 3339 time `seconds` from now, as Anthropic's `-reset` headers name it."""
    when = datetime.now(UTC) + timedelta(seconds=seconds)
    return when.replace(microsecond=0).isoformat().replace("+00:00", "Z")


# --- streams on the wire ---------------------------------------------------------------------------


def _sse(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"


class _Blocks:
    """The content blocks a stream has opened: a part opens a block when it is not of the block
    already open (closing that one first)."""

    def __init__(self) -> None:
        self.key: tuple[str, int] | None = None
        self.kind = ""
        self.index = -1

    def open(self, key: tuple[str, int], block: dict[str, Any]) -> bytes:
        if key == self.key:
            return b""
        framing = self.close()
        self.key, self.kind = key, block["type"]
        self.index += 1
        return framing + _sse(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def close(self) -> bytes:
        if self.key is None:
            return b""
        framing = b""
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": "fake-signature"}
            framing = _sse(
                "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
            )
        self.key = None
        return framing + _sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _sse(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )


def _part(part: Part, blocks: _Blocks, forced: str | None) -> bytes:
    """One part as the events that carry it (the blocks it opens or closes included)."""
    if isinstance(part, Text | Refusal):
        if forced is not None and isinstance(part, Text):  # a JSON route's answer: the tool's input
            start = blocks.open(
                ("json", 0), {"type": "tool_use", "id": "toolu_fake", "name": forced, "input": {}}
            )
            return start + blocks.delta({"type": "input_json_delta", "partial_json": part.text})
        start = blocks.open(("text", 0), {"type": "text", "text": "", "citations": None})
        return start + blocks.delta({"type": "text_delta", "text": part.text})
    if isinstance(part, Reasoning):
        start = blocks.open(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""})
        return start + blocks.delta({"type": "thinking_delta", "thinking": part.text})
    if isinstance(part, ToolName | ToolArgs | ToolCall):
        call_id = getattr(part, "id", None) or f"toolu_fake{part.index}"
        name = getattr(part, "name", "") or "tool"
        start = blocks.open(
            ("tool", part.index), {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        )
        if isinstance(part, ToolName):
            return start
        arguments = part.arguments if isinstance(part.arguments, str) else json.dumps(part.arguments)
        return start + blocks.delta({"type": "input_json_delta", "partial_json": arguments})
    assert isinstance(part, Meta)
    return _sse("ping", {"type": "ping"})


def anthropic_stream_wire(outcome: Stream, model: str, request: Any = None) -> list[bytes]:
    """Every event of `outcome` as Anthropic streams it for `model`, grouped as `Stream` counts
    them: one group per part (with the `content_block_start` / `_stop` around it, and
    `message_start` before the first), then, when `done`, `message_delta` (`stop_reason` and
    usage) and `message_stop` (2 groups). A `Meta` is a `ping`; a `Refusal` is text, and the
    stream stops for `refusal`; a request that forces a tool (a JSON route) gets its text as
    that tool's `input_json_delta`. The in-band error is an `error` event of type
    `overloaded_error`, or of the type Anthropic sends with the status `error_code` names."""
    served, forced = outcome.model or model, _forced_tool(request)
    usage = _usage(outcome.usage)
    message: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": served,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 1},
    }
    pending = _sse("message_start", {"type": "message_start", "message": message})
    blocks = _Blocks()
    groups: list[bytes] = []
    for part in outcome.parts:
        groups.append(pending + _part(part, blocks, forced))
        pending = b""
    if outcome.done:
        stop = _STOP_REASONS.get(outcome.finish_reason, outcome.finish_reason)
        if any(isinstance(p, Refusal) for p in outcome.parts):
            stop = "refusal"
        delta = {"stop_reason": stop, "stop_sequence": None}
        end = {"type": "message_delta", "delta": delta, "usage": {"output_tokens": usage["output_tokens"]}}
        groups.append(pending + blocks.close() + _sse("message_delta", end))
        groups.append(_sse("message_stop", {"type": "message_stop"}))
    if outcome.error_after is None:
        return groups
    kind = ANTHROPIC_ERROR_TYPES.get(outcome.error_code or 529, "overloaded_error")
    error = _sse("error", _error_body(kind, outcome.error_message))
    return [*groups[: outcome.error_after], error]


async def play_anthropic(
    outcome: Stream, model: str, inputs: Mapping[str, Any], provider: str
) -> AsyncGenerator[StreamEvent, None]:
    """`outcome` played in process on Anthropic's wire: its groups of events (as the fake server
    sends them, cuts, stalls and delays included) read by the adapter's own decoder."""
    request, json_mode = messages_request(model, inputs)
    decoder = MessagesDecoder(provider, model, json_mode=json_mode)
    parser = SSEParser()
    if outcome.endless:
        groups = anthropic_stream_wire(
            dataclasses.replace(outcome, done=False, error_after=None), model, request
        )
        while True:
            for group in groups:
                if outcome.interval_s:
                    await anyio.sleep(outcome.interval_s)
                for sse in parser.feed(group):
                    for event in decoder.decode(sse):
                        yield event
            await anyio.lowlevel.checkpoint()
    groups = anthropic_stream_wire(outcome, model, request)
    if outcome.delay_s:
        await anyio.sleep(outcome.delay_s)
    for index, group in enumerate(groups):
        if outcome.cut_after is not None and index >= outcome.cut_after:
            break
        if outcome.stall_after is not None and index >= outcome.stall_after:
            if outcome.stall_s is None:
                await anyio.sleep_forever()
            await anyio.sleep(outcome.stall_s or 0.0)
            raise ProviderError(provider, note="stream stalled")
        if outcome.interval_s:
            await anyio.sleep(outcome.interval_s)
        for sse in parser.feed(group):
            for event in decoder.decode(sse):
                yield event
            if decoder.complete:
                return
    raise ProviderError(provider, note="stream truncated")


class FakeAnthropic(FakeServer):
    """`with FakeAnthropic() as server:` serves `POST {server.base_url}/v1/messages` (use
    `base_url` as the adapter's, and as the official SDK's).

    As strict as the API where an adapter could go wrong: a request without `x-api-key:
    <api_key>` (or `authorization: Bearer <api_key>`, as the official SDK 2.x sends it) gets
    401 `authentication_error`; without `anthropic-version`, or without
    `model`, `max_tokens` or `messages`, or with a turn whose role is not `user` or
    `assistant` (a `system` turn: the API wants the top-level `system`), 400
    `invalid_request_error`; any other path 404 `not_found_error`. The model is the body's
    `model`; script outcomes with `server.script(model, ...)` and read `server.calls` (each
    with the whole JSON body as `inputs`, and the headers). Outcomes are rendered by
    `anthropic_wire` and `anthropic_stream_wire`; a `Reply` to a request with `"stream":
    true` plays as its stream. Every answer carries a `request-id`.
    """

    thread_name = "fake-anthropic"

    def __init__(self, default: Outcome | Chooser | None = None, *, api_key: str = "test-key") -> None:
        super().__init__(default)
        self.api_key = api_key

    def route(self, method: str, path: str, headers: Mapping[str, str], inputs: Any) -> str | Wire:
        if method != "POST" or path.split("?", 1)[0] != "/v1/messages":
            return _error(404, "not_found_error", "Not found")
        refused = self.authorize(headers)
        if refused is not None:
            return refused
        if not headers.get("anthropic-version"):
            return _error(400, "invalid_request_error", "anthropic-version: header is required")
        problem = _invalid(inputs)
        if problem is not None:
            return _error(400, "invalid_request_error", problem)
        return str(inputs["model"])

    def authorize(self, headers: Mapping[str, str]) -> Wire | None:
        # The key as `x-api-key`, or as a bearer token (the official SDK 2.x sends it so).
        if (
            headers.get("x-api-key") != self.api_key
            and headers.get("authorization") != f"Bearer {self.api_key}"
        ):
            return _error(401, "authentication_error", "invalid x-api-key")
        return None

    def wire(self, outcome: Reply | Fail | Raw, call: Call) -> Wire:
        return anthropic_wire(outcome, call.model, call.inputs)

    def stream_wire(self, outcome: Stream, call: Call) -> list[bytes]:
        return anthropic_stream_wire(outcome, call.model, call.inputs)

    def stream_headers(self, call: Call) -> dict[str, str]:
        return anthropic_headers()


def _invalid(body: Any) -> str | None:
    """What the API would refuse in a request body (its wording), or None."""
    if not isinstance(body, dict):
        return "The request body is not valid JSON."
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model: Field required"
    tokens = body.get("max_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        return "max_tokens: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: Field required"
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            return (
                f"messages.{index}.role: Unexpected role {json.dumps(role)}. The Messages API accepts "
                'a top-level `system` parameter, not "system" as an input message role.'
            )
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        return "system: Input should be a valid string"
    return None
