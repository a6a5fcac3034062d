"""What Anthropic's Messages API sends back (PROTOCOLS.md, "Anthropic Messages"), read without
I/O: a whole answer (`parse_messages_answer`), a failure (`failure`, `in_band_error`) and a
stream's named events (`MessagesDecoder`).

Every failure shape ends as a `ProviderError` with the HTTP status: `{"type": "error",
"error": {"type", "message"}}` with an error status (or any other body), a redirect (never
followed), a 2xx without a message, non-JSON bodies; while streaming, an `error` event after
HTTP 200, read as the status Anthropic documents for its type (`overloaded_error` 529...).
Messages are read only to spot a context window exceeded ("prompt is too long") and a spent
credit balance; they are never kept. `retry-after` (and, on a 429 without it, the
`anthropic-ratelimit-*-reset` time of the limit that is spent) only becomes
`ProviderError.retry_after_s`.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from ..contracts._binding import AIResult, Usage
from ..contracts._errors import ProviderError
from ..contracts._stream import ReasoningDelta, StreamEnd, StreamEvent, TextDelta, ToolCallDelta
from ._http import bounded_wait, context_exceeded, error_objects, parse_retry_after, retry_date
from ._httpx import httpx
from ._identifiers import identifier
from ._sse import SSEEvent

__all__ = [
    "ERROR_STATUSES",
    "FINISH_REASONS",
    "JSON_TOOL",
    "JsonMode",
    "MessagesDecoder",
    "failure",
    "in_band_error",
    "parse_anthropic_usage",
    "parse_messages_answer",
]

PROVIDER = "anthropic"
#: The tool a JSON route's answer is asked for by (its `input` is the answer).
JSON_TOOL = "json_answer"
#: How a JSON route's answer comes back: the answer tool's whole `input`, or the text (None:
#: the request asked for no JSON).
JsonMode = Literal["tool", "text"] | None
#: `stop_reason` in guards' (OpenAI's) words, which streams and the UI stream read.
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
#: The status Anthropic documents for each error type: an `error` event after HTTP 200 is
#: classified as that status (an overload mid-stream is as transient as a 529).
ERROR_STATUSES = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
_LIMITS = ("requests", "tokens", "input-tokens", "output-tokens")
#: An error type we may repeat in a note: a bounded lowercase token.
_SAFE_TOKEN = re.compile(r"[a-z_]{1,40}")
#: Open tool blocks one stream may hold in its index map (a stream of more is hostile).
_MAX_TOOL_BLOCKS = 1024
_MAX_TOKENS = 1 << 53


# --- the answer -----------------------------------------------------------------------------------


def parse_messages_answer(
    status: int,
    headers: httpx.Headers | Mapping[str, str],
    body: bytes,
    *,
    model: str,
    provider: str = PROVIDER,
    json_mode: JsonMode = None,
) -> AIResult:
    """One Messages HTTP answer (status, headers, body) as a result, or raises `ProviderError`
    (with the wait its headers ask for). `json_mode` as `messages_request` returned it."""
    given = headers if isinstance(headers, httpx.Headers) else httpx.Headers(headers)
    wait, at = _retry_hint(given, status)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        raise ProviderError(
            provider, status=status, retry_after_s=wait, retry_at=at, note="non-JSON body"
        ) from None
    if (
        not 200 <= status < 300
        or not isinstance(data, dict)
        or data.get("type") == "error"
        or data.get("error")
    ):
        raise failure(provider, status, data, wait, at)
    content = data.get("content")
    if not isinstance(content, list):
        raise ProviderError(
            provider, status=status, retry_after_s=wait, retry_at=at, note="no content in the answer"
        )
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    answer: Any = None
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if json_mode == "tool" and block.get("name") == JSON_TOOL and answer is None:
                answer = block.get("input")
            else:
                calls.append(_tool_call(block))
    stop = data.get("stop_reason")
    finish = FINISH_REASONS.get(stop) if isinstance(stop, str) else None
    if answer is not None and not calls:
        finish = "stop" if finish == "tool_calls" else finish  # the answer, not a tool call
    return AIResult(
        response=answer if answer is not None else "".join(texts),
        model=identifier(data.get("model")) or model,
        usage=parse_anthropic_usage(data.get("usage")),
        tool_calls=tuple(calls),
        moderated=stop == "refusal",
        truncated=finish == "length",
        finish_reason=finish or identifier(stop),
    )


def _tool_call(block: dict[str, Any]) -> dict[str, Any]:
    """A `tool_use` block as guards' tool call (OpenAI's shape, the arguments as JSON text)."""
    arguments = block.get("input")
    return {
        "id": block.get("id") if isinstance(block.get("id"), str) else None,
        "type": "function",
        "function": {
            "name": block.get("name") if isinstance(block.get("name"), str) else "",
            "arguments": json.dumps(arguments if isinstance(arguments, dict) else {}),
        },
    }


def _count(value: Any) -> int:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKENS else 0
    )


def parse_anthropic_usage(raw: Any, previous: Usage | None = None) -> Usage | None:
    """Anthropic's `usage` as guards' `Usage`: `input_tokens` excludes the tokens read from the
    prompt cache (`cache_read_input_tokens`) and written to it
    (`cache_creation_input_tokens`), so `prompt_tokens` adds them up. A count absent from
    `raw` keeps its value in `previous` (a stream's `message_delta` after `message_start`)."""
    if not isinstance(raw, dict):
        return previous
    before = previous or Usage()
    fresh = _count(raw["input_tokens"]) if "input_tokens" in raw else None
    read = _count(raw["cache_read_input_tokens"]) if "cache_read_input_tokens" in raw else None
    written = _count(raw["cache_creation_input_tokens"]) if "cache_creation_input_tokens" in raw else None
    cached = before.cached_input_tokens if read is None else read
    writes = before.cache_write_tokens if written is None else written
    uncached = before.prompt_tokens - before.cached_input_tokens - before.cache_write_tokens
    prompt = (uncached if fresh is None else fresh) + cached + writes
    output = _count(raw["output_tokens"]) if "output_tokens" in raw else before.completion_tokens
    return Usage(prompt, output, prompt + output, cached, writes)


def failure(
    provider: str,
    status: int,
    data: Any,
    retry_after_s: float | None = None,
    retry_at: float | None = None,
    *,
    event: bool = False,
) -> ProviderError:
    """The `ProviderError` for a failed answer: Anthropic's `{"type": "error", "error": {"type",
    "message"}}`, or any other body (`event`: an `error` event of a stream). `billing_error`, a
    spend limit reached (`error.details.error_code`) or a credit balance too low marks a spent
    quota; a message saying "prompt is too long" a context window exceeded; the error type is
    the note."""
    errors = error_objects(data.get("error")) if isinstance(data, dict) else []
    kind = errors[0].get("type") if errors else None
    details = errors[0].get("details") if errors else None
    code = details.get("error_code") if isinstance(details, dict) else None
    messages = " ".join(str(e.get("message", "")) for e in errors).lower()
    note = kind if isinstance(kind, str) and _SAFE_TOKEN.fullmatch(kind) else ""
    return ProviderError(
        provider,
        status=status,
        retry_after_s=retry_after_s,
        retry_at=retry_at,
        quota_exhausted=kind == "billing_error"
        or (isinstance(code, str) and code.endswith("spend_limit_reached"))
        or "credit balance is too low" in messages,
        context_exceeded=context_exceeded(errors),
        note=f"{note} event".lstrip() if event else note,
    )


def in_band_error(provider: str, event: dict[str, Any]) -> ProviderError:
    """An `error` event of a stream (after HTTP 200), classified as the status Anthropic
    documents for its type (200 for a type it does not document)."""
    error = event.get("error")
    kind = error.get("type") if isinstance(error, dict) else None
    status = ERROR_STATUSES.get(kind, 200) if isinstance(kind, str) else 200
    return failure(provider, status, event, event=True)


def _retry_hint(headers: httpx.Headers, status: int) -> tuple[float | None, float | None]:
    """The wait an answer asks for (seconds) and, when it names a time, that time: `retry-after`;
    on a 429 without it, the `anthropic-ratelimit-*-reset` of the limits spent (`-remaining:
    0`; the latest of them), else the earliest reset sent."""
    retry_after = headers.get("retry-after")
    wait = parse_retry_after(retry_after)
    if wait is not None or status != 429:
        return wait, retry_date(retry_after) if wait is not None else None
    resets: list[tuple[bool, float]] = []
    for limit in _LIMITS:
        at = _rfc3339(headers.get(f"anthropic-ratelimit-{limit}-reset"))
        if at is not None:
            resets.append((headers.get(f"anthropic-ratelimit-{limit}-remaining") == "0", at))
    if not resets:
        return None, None
    spent = [at for exhausted, at in resets if exhausted]
    at = max(spent) if spent else min(at for _, at in resets)
    return bounded_wait(at - time.time()), at


def _rfc3339(value: str | None) -> float | None:
    """An RFC 3339 time (seconds since the epoch; UTC when it names no zone), or None."""
    if not value or len(value) > 64:
        return None
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    stamp = (when if when.tzinfo is not None else when.replace(tzinfo=UTC)).timestamp()
    return stamp if math.isfinite(stamp) else None


# --- the stream -----------------------------------------------------------------------------------


class MessagesDecoder:
    """Turns the named events of one Messages stream into `StreamEvent`s.

    `content_block_delta` gives `text_delta` (text), `thinking_delta` (reasoning) and
    `input_json_delta` (a tool call's arguments; a JSON route's answer tool's as text);
    `content_block_start` of a `tool_use` block the call's id and name (`ToolCallDelta.index`
    counts the answer's tool calls from 0, whatever the block's index); `message_start` the
    model and the input tokens; `message_delta` the `stop_reason` and the usage;
    `message_stop` completes the stream (`StreamEnd`). `ping`, `content_block_stop`,
    `signature_delta` and unknown events give nothing; an `error` event raises `ProviderError`
    (see `in_band_error`). The end of the body before `message_stop` is a truncation.
    """

    __slots__ = (
        "_json_block",
        "_json_mode",
        "_requested",
        "_tools",
        "complete",
        "finish_reason",
        "model",
        "provider",
        "usage",
    )

    def __init__(self, provider: str, model: str, *, json_mode: JsonMode = None) -> None:
        self.provider = provider
        self._requested = model
        self._json_mode = json_mode
        self._json_block: int | None = None
        self._tools: dict[int, int] = {}  # a tool_use block's index: the call's index
        self.complete = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.model: str | None = None

    def decode(self, sse: SSEEvent) -> list[StreamEvent]:
        """The stream events one SSE event carries (often one, sometimes none)."""
        try:
            data = json.loads(sse.data)
        except (ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            if sse.event == "error":
                raise ProviderError(self.provider, status=200, note="error event")
            return []
        kind = data.get("type")
        if kind == "content_block_delta":  # the most frequent by far
            return self._delta(data)
        if kind == "error" or sse.event == "error":
            raise in_band_error(self.provider, data)
        if kind == "content_block_start":
            return self._start(data)
        if kind == "message_start":
            message = data.get("message")
            if isinstance(message, dict):
                self.model = identifier(message.get("model"))
                self.usage = parse_anthropic_usage(message.get("usage"), self.usage)
        elif kind == "message_delta":
            delta = data.get("delta")
            stop = delta.get("stop_reason") if isinstance(delta, dict) else None
            if isinstance(stop, str):
                finish = FINISH_REASONS.get(stop) or identifier(stop)
                answered = self._json_block is not None and finish == "tool_calls" and not self._tools
                self.finish_reason = "stop" if answered else finish
            self.usage = parse_anthropic_usage(data.get("usage"), self.usage)
        elif kind == "message_stop":
            self.complete = True
            return [StreamEnd(self.finish_reason, self.usage, self.model or self._requested)]
        return []

    def end_at_eof(self) -> StreamEnd | None:
        """None: a Messages stream is complete only at `message_stop`."""
        return None

    def _delta(self, data: dict[str, Any]) -> list[StreamEvent]:
        delta = data.get("delta")
        if not isinstance(delta, dict):
            return []
        kind = delta.get("type")
        if kind == "text_delta":
            text = delta.get("text")
            return [TextDelta(text)] if isinstance(text, str) and text else []
        if kind == "thinking_delta":
            thinking = delta.get("thinking")
            return [ReasoningDelta(thinking)] if isinstance(thinking, str) and thinking else []
        if kind == "input_json_delta":
            piece, index = delta.get("partial_json"), data.get("index")
            if not isinstance(piece, str) or not piece:
                return []
            if index is not None and index == self._json_block:
                return [TextDelta(piece)]
            call = self._tools.get(index) if isinstance(index, int) else None
            return [ToolCallDelta(call, arguments=piece)] if call is not None else []
        return []

    def _start(self, data: dict[str, Any]) -> list[StreamEvent]:
        block, index = data.get("content_block"), data.get("index")
        if not isinstance(block, dict) or not isinstance(index, int) or isinstance(index, bool):
            return []
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            return [TextDelta(block["text"])]
        if kind != "tool_use":
            return []
        name = block.get("name")
        if self._json_mode == "tool" and name == JSON_TOOL and self._json_block is None:
            self._json_block = index
            return []
        if len(self._tools) >= _MAX_TOOL_BLOCKS:
            raise ProviderError(self.provider, status=200, note="too many tool calls")
        call = self._tools[index] = len(self._tools)
        call_id = block.get("id")
        return [
            ToolCallDelta(
                call,
                id=call_id if isinstance(call_id, str) and call_id else None,
                name=name if isinstance(name, str) and name else None,
            )
        ]
