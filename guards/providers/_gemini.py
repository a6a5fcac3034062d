"""Google's Gemini API (PROTOCOLS.md, "Google Gemini API"): `generateContent` and
`streamGenerateContent?alt=sse`, the key in `x-goog-api-key`.

The request is translated here (`_gemini_request`), the answer read here: text parts are the
answer, parts marked `thought` are reasoning (never the answer), `functionCall` parts are tool
calls, `usageMetadata` is the usage. A candidate finished for a content filter (`SAFETY`,
`RECITATION`, `PROHIBITED_CONTENT`, `BLOCKLIST`, `SPII`, the `IMAGE_*` filters) or a prompt
blocked in `promptFeedback.blockReason` is a filtered answer (`moderated`), never an answer.

Every failure ends as a `ProviderError` with the HTTP status: a google.rpc status object
(`{"error": {"code", "message", "status", "details"}}`, also as an event of a stream), a
redirect (never followed), a 2xx without a candidate, non-JSON bodies, oversized bodies and
dropped connections; while streaming, also a cut body and a stall. What is read from it:

- the wait: `google.rpc.RetryInfo.retryDelay` (`"30s"`), else a `retry-after` header;
- a spent quota rather than a rate limit: a `google.rpc.QuotaFailure` violation whose
  `quotaId` (or `quotaMetric`) names a per-day quota (`...PerDay...`): it resets with the day,
  so the wait of a minute's quota would be a lie (`quota_exhausted`);
- an input over the model's window: `INVALID_ARGUMENT` whose message says the input token
  count "exceeds the maximum number of tokens" (the first `_SEARCHED_CHARS` characters are
  searched, never kept: messages may echo the prompt);
- the google.rpc status itself, as the error's note, when it is one of the documented ones.

No retries here and no sleeping: the call guard's classifier is the only retry policy.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Mapping
from typing import Any
from urllib.parse import quote

from ..contracts._binding import AIResult, Usage
from ..contracts._errors import ConfigurationError, ProviderError
from ..contracts._stream import ReasoningDelta, StreamEnd, StreamEvent, TextDelta, ToolCallDelta
from ._gemini_request import gemini_request
from ._http import (
    DEFAULT_MAX_BODY_BYTES,
    IDENTITY,
    bounded_wait,
    new_client,
    parse_retry_after,
    post_capped,
    retry_date,
)
from ._httpx import check_client, httpx
from ._identifiers import identifier
from ._sse import SSEEvent
from ._stream_http import DEFAULT_IDLE_TIMEOUT_S, stream_sse

__all__ = ["Gemini", "GeminiDecoder", "gemini_failure", "gemini_usage", "parse_gemini_answer"]

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com"
DEFAULT_API_VERSION = "v1beta"
DEFAULT_PROVIDER = "gemini"

#: The finish reasons of a candidate a content filter stopped (images' included): no answer.
FILTER_FINISHES = frozenset(
    {
        "SAFETY",
        "RECITATION",
        "PROHIBITED_CONTENT",
        "BLOCKLIST",
        "SPII",
        "IMAGE_SAFETY",
        "IMAGE_PROHIBITED_CONTENT",
        "IMAGE_RECITATION",
    }
)
#: google.rpc statuses the Gemini API documents, repeated as a `ProviderError.note`.
RPC_STATUSES = frozenset(
    {
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "NOT_FOUND",
        "RESOURCE_EXHAUSTED",
        "CANCELLED",
        "INTERNAL",
        "UNAVAILABLE",
        "DEADLINE_EXCEEDED",
    }
)
#: What Gemini says of an input over the model's window ("The input token count (N) exceeds
#: the maximum number of tokens allowed (M)."), lowercase; searched in the message's start.
_CONTEXT_PHRASE = "exceeds the maximum number of tokens"
_SEARCHED_CHARS = 2000
#: A `google.protobuf.Duration` in JSON: seconds with up to 9 decimals and an `s`.
_DURATION = re.compile(r"(\d{1,12}(?:\.\d{1,9})?)s")
_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_QUOTA_FAILURE = "type.googleapis.com/google.rpc.QuotaFailure"
_MAX_TOKENS = 1 << 53


class Gemini:
    """A binding that runs Gemini models through
    `POST {base_url}/{api_version}/models/{model}:generateContent` (and
    `:streamGenerateContent?alt=sse` for `stream`), the key sent as `x-goog-api-key`.

    `provider` names the provider in `ProviderError`s and logs (and chains: `gemini:<model>`).
    Pass an `httpx.AsyncClient` to share one across bindings; otherwise the binding makes its
    own and closes it in `aclose`. Bodies are read up to `max_body_bytes` (while streaming:
    each event, and each line), as sent: every request asks for `Accept-Encoding: identity`,
    and an answer with another `Content-Encoding` fails unread.

    `run` translates Workers-AI-shaped inputs (see `docs/providers/gemini.md`): `system`
    messages become `systemInstruction`, `assistant` turns the `model` role, tool calls and
    tool results `functionCall` / `functionResponse` parts, `response_format` JSON mode
    `responseMimeType: application/json` with the schema as `responseJsonSchema`, the OpenAI
    tools `functionDeclarations`, and the sampling keys their `generationConfig` names. The
    answer's text is `AIResult.response` (thought parts left out), function calls its
    `tool_calls` in OpenAI's shape, `modelVersion` its `model`.

    `stream` yields text, reasoning (thought parts) and whole tool calls as they arrive; the
    stream is complete when the body ends after a finish reason (Gemini sends no `[DONE]`).
    A stream with no complete event for `idle_timeout_s` fails as stalled. `run` reports its
    answer's first byte (`guards.first_output_arrived`) when the status line and headers
    arrived.
    """

    #: OpenTelemetry's `gen_ai.provider.name` for the Gemini API.
    gen_ai_provider_name = "gcp.gemini"

    def __init__(
        self,
        *,
        api_key: str,
        base_url: str = DEFAULT_BASE_URL,
        api_version: str = DEFAULT_API_VERSION,
        client: httpx.AsyncClient | None = None,
        provider: str = DEFAULT_PROVIDER,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if not api_key:
            raise ConfigurationError("Gemini needs an api_key (GEMINI_API_KEY)")
        if not base_url.startswith(("http://", "https://")):
            raise ConfigurationError("Gemini needs an http:// or https:// base_url")
        if not re.fullmatch(r"v\d+(?:alpha|beta)?\d*", api_version):
            raise ConfigurationError(f"Gemini: api_version must look like v1beta or v1; got {api_version!r}")
        if not provider:
            raise ConfigurationError("Gemini needs a provider name")
        if not idle_timeout_s > 0:
            raise ConfigurationError("Gemini needs idle_timeout_s > 0")
        check_client(client, "Gemini")
        self._options: dict[str, Any] = {
            "api_key": api_key,
            "base_url": base_url,
            "api_version": api_version,
            "client": client,
            "provider": provider,
            "max_body_bytes": max_body_bytes,
            "idle_timeout_s": idle_timeout_s,
        }
        self.provider = provider
        self._models = f"{base_url.rstrip('/')}/{api_version}/models/"
        # Identity per request: a client of the caller's own making asks for it too.
        self._headers = {"x-goog-api-key": api_key, **IDENTITY}
        self._stream_headers = {**self._headers, "accept": "text/event-stream"}
        self._owns_client = client is None
        self._client = client or new_client()
        self._max_body_bytes = max_body_bytes
        self._idle_timeout_s = idle_timeout_s

    def __repr__(self) -> str:  # never show the key
        return f"Gemini(provider={self.provider!r}, url={self._models!r})"

    def replace(self, **changes: Any) -> Gemini:
        """A new binding made with this one's arguments, `changes` applied (e.g. `base_url` and
        `api_key` of a test's server); it shares this one's `client` when one was given. An
        unknown argument raises `TypeError`."""
        return Gemini(**{**self._options, **changes})

    def _url(self, model: str, method: str) -> str:
        name = model.removeprefix("models/")
        return f"{self._models}{quote(name, safe='-._')}:{method}"

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        """Run `model` on `inputs`; raises `ProviderError` for every failure. Cancelling the
        task closes the response, and with it the connection."""
        response, raw = await post_capped(
            self._client,
            self._url(model, "generateContent"),
            provider=self.provider,
            max_bytes=self._max_body_bytes,
            headers=self._headers,
            json=gemini_request(inputs),
        )
        return parse_gemini_answer(
            response.status_code, response.headers, raw, model=model, provider=self.provider
        )

    def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        """Run `model` on `inputs` as `streamGenerateContent?alt=sse` and yield its events as
        they arrive (the `guards.StreamingBinding` contract: deltas, then one `StreamEnd`;
        every failure a `ProviderError`, an `error` object in an event included). Closing the
        iterator, or cancelling its consumer, closes the connection."""
        provider = self.provider

        def parse_whole(response: httpx.Response, raw: bytes) -> AIResult:
            return parse_gemini_answer(
                response.status_code, response.headers, raw, model=model, provider=provider
            )

        return stream_sse(
            self._client,
            self._url(model, "streamGenerateContent") + "?alt=sse",
            body=gemini_request(inputs),
            headers=self._stream_headers,
            provider=provider,
            decoder=GeminiDecoder(provider, model),
            parse_whole=parse_whole,
            idle_timeout_s=self._idle_timeout_s,
            max_reconnects=0,  # no resume: Gemini keeps no run to resume
            resume_base=None,
            max_event_bytes=self._max_body_bytes,
        )

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


# --- answers ------------------------------------------------------------------------------------


def parse_gemini_answer(
    status: int, headers: httpx.Headers | Mapping[str, str], body: bytes, *, model: str, provider: str
) -> AIResult:
    """One `generateContent` HTTP answer as the adapter named `provider` reads it: a result, or
    raises `ProviderError` (with the wait the answer asks for)."""
    given = headers if isinstance(headers, httpx.Headers) else httpx.Headers(headers)
    header_wait = parse_retry_after(given.get("retry-after"))
    header_at = retry_date(given.get("retry-after"))
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        raise ProviderError(
            provider, status=status, retry_after_s=header_wait, retry_at=header_at, note="non-JSON body"
        ) from None
    if isinstance(data, list) and len(data) == 1:  # an error is sometimes sent as a list of one
        data = data[0]
    if not 200 <= status < 300 or not isinstance(data, dict) or data.get("error"):
        raise gemini_failure(provider, status, data, header_wait, header_at)
    usage = gemini_usage(data.get("usageMetadata"))
    served = identifier(data.get("modelVersion")) or model
    candidate = _first_candidate(data)
    if candidate is None:
        if _prompt_blocked(data):
            return AIResult(None, served, usage, moderated=True, finish_reason="content_filter")
        raise ProviderError(provider, status=status, note="no candidate in the answer")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in _parts(candidate):
        text = part.get("text")
        if isinstance(text, str) and part.get("thought") is not True:
            texts.append(text)
        call = _tool_call(part, len(calls))
        if call is not None:
            calls.append(call)
    finish = finish_reason(candidate.get("finishReason"), bool(calls))
    return AIResult(
        response="".join(texts) if texts else None,
        model=served,
        usage=usage,
        tool_calls=tuple(calls),
        moderated=finish == "content_filter",
        truncated=finish == "length",
        finish_reason=finish,
    )


def _first_candidate(data: Mapping[str, Any]) -> dict[str, Any] | None:
    candidates = data.get("candidates")
    first = candidates[0] if isinstance(candidates, list) and candidates else None
    return first if isinstance(first, dict) else None


def _prompt_blocked(data: Mapping[str, Any]) -> bool:
    feedback = data.get("promptFeedback")
    return isinstance(feedback, dict) and bool(feedback.get("blockReason"))


def _parts(candidate: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = candidate.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def _tool_call(part: Mapping[str, Any], index: int) -> dict[str, Any] | None:
    """A `functionCall` part as an OpenAI tool call (`id` Gemini's, else `call_<index>`; its
    `thoughtSignature` kept, to be sent back with the call in a later turn)."""
    function = part.get("functionCall")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    args = function.get("args")
    call_id = function.get("id")
    call: dict[str, Any] = {
        "id": call_id if isinstance(call_id, str) and call_id else f"call_{index}",
        "type": "function",
        "function": {"name": function["name"], "arguments": json.dumps(args if args is not None else {})},
    }
    signature = part.get("thoughtSignature")
    if isinstance(signature, str):
        call["thought_signature"] = signature
    return call


def finish_reason(reason: Any, called: bool) -> str | None:
    """Gemini's finish reason in guards' (OpenAI's) words: `STOP` is `stop` (`tool_calls` when
    the answer called a function), `MAX_TOKENS` `length`, a content filter `content_filter`;
    any other reason lowercased (`malformed_function_call`, `other`...); None when absent."""
    if not isinstance(reason, str) or not reason:
        return None
    if reason == "STOP":
        return "tool_calls" if called else "stop"
    if reason == "MAX_TOKENS":
        return "length"
    if reason in FILTER_FINISHES:
        return "content_filter"
    return identifier(reason.lower())


def _count(value: Any) -> int:
    """`value` if it is an integer from 0 to 2**53, else 0."""
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKENS else 0
    )


def gemini_usage(raw: Any) -> Usage | None:
    """`usageMetadata` as a `Usage`. Gemini counts the thoughts apart from the answer
    (`thoughtsTokenCount`, billed as output): they are added to `completion_tokens`. The
    prompt's count includes the cached tokens (`cachedContentTokenCount`, capped to it) and the
    tool-use prompt's (`toolUsePromptTokenCount`) is added to it. Not an object: no usage."""
    if not isinstance(raw, dict):
        return None
    prompt = _count(raw.get("promptTokenCount")) + _count(raw.get("toolUsePromptTokenCount"))
    completion = _count(raw.get("candidatesTokenCount")) + _count(raw.get("thoughtsTokenCount"))
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=_count(raw.get("totalTokenCount")) or prompt + completion,
        cached_input_tokens=min(_count(raw.get("cachedContentTokenCount")), prompt),
    )


# --- failures -----------------------------------------------------------------------------------


def gemini_failure(
    provider: str,
    status: int,
    data: Any,
    retry_after_s: float | None = None,
    retry_at: float | None = None,
    *,
    note: str = "",
) -> ProviderError:
    """The `ProviderError` for a failed answer (or an error event), read from its google.rpc
    status object (see the module's docstring); any other body gives the status alone."""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return ProviderError(
            provider,
            status=status,
            retry_after_s=retry_after_s,
            retry_at=retry_at,
            note=note or "unexpected body",
        )
    rpc = error.get("status")
    details = error.get("details")
    details = [d for d in details if isinstance(d, dict)] if isinstance(details, list) else []
    message = error.get("message")
    searched = message[:_SEARCHED_CHARS].lower() if isinstance(message, str) else ""
    delay = _retry_delay(details)
    known = rpc if isinstance(rpc, str) and rpc in RPC_STATUSES else ""
    return ProviderError(
        provider,
        status=status,
        retry_after_s=delay if delay is not None else retry_after_s,
        retry_at=None if delay is not None else retry_at,
        quota_exhausted=_per_day_quota(details),
        context_exceeded=rpc == "INVALID_ARGUMENT" and _CONTEXT_PHRASE in searched,
        note=" ".join(n for n in (known, note) if n),
    )


def _retry_delay(details: list[dict[str, Any]]) -> float | None:
    """The wait of a `google.rpc.RetryInfo` detail (`"retryDelay": "30s"`), in seconds."""
    for detail in details:
        if detail.get("@type") == _RETRY_INFO:
            delay = detail.get("retryDelay")
            found = _DURATION.fullmatch(delay) if isinstance(delay, str) else None
            if found is not None:
                return bounded_wait(float(found[1]))
    return None


def _per_day_quota(details: list[dict[str, Any]]) -> bool:
    """Whether a `google.rpc.QuotaFailure` violation names a per-day quota (`quotaId`
    `GenerateRequestsPerDayPerProjectPerModel-FreeTier`, or such a `quotaMetric`)."""
    for detail in details:
        violations = detail.get("violations") if detail.get("@type") == _QUOTA_FAILURE else None
        for violation in violations if isinstance(violations, list) else ():
            if not isinstance(violation, dict):
                continue
            names = (violation.get("quotaId"), violation.get("quotaMetric"))
            if any(isinstance(name, str) and "perday" in name[:200].lower() for name in names):
                return True
    return False


# --- streams ------------------------------------------------------------------------------------


class GeminiDecoder:
    """Turns the events of one `streamGenerateContent?alt=sse` body into `StreamEvent`s.

    Each event is a partial `generateContent` answer: text parts are `TextDelta`s, thought
    parts `ReasoningDelta`s, each `functionCall` part a whole `ToolCallDelta`; the finish
    reason, the usage (cumulative: the last one counts) and `modelVersion` are kept for the
    end. Gemini sends no `[DONE]`: the end of the body after a finish reason (or a blocked
    prompt) completes the stream, and the end of the body before one is a truncation. An
    `error` object raises `ProviderError` (its `code` as the status when it is an HTTP error
    status, else 200), never with the provider's text.
    """

    __slots__ = ("_calls", "_requested", "_usage", "complete", "finish_reason", "model", "provider")

    def __init__(self, provider: str, model: str) -> None:
        self.provider = provider
        self._requested = model
        self._calls = 0
        self.complete = False
        self.finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None  # the last `usageMetadata`, read at the end
        self.model: str | None = None

    def decode(self, sse: SSEEvent) -> list[StreamEvent]:
        try:
            chunk = json.loads(sse.data)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            chunk = None
        if isinstance(chunk, list) and len(chunk) == 1:
            chunk = chunk[0]
        if not isinstance(chunk, dict):
            return []  # a keep-alive or an unknown event: liberal in what we accept
        if chunk.get("error"):
            raise in_band_error(self.provider, chunk)
        if self.model is None:
            self.model = identifier(chunk.get("modelVersion"))
        usage = chunk.get("usageMetadata")
        if isinstance(usage, dict):
            self._usage = usage
        if _prompt_blocked(chunk):
            self.finish_reason = "content_filter"
        candidate = _first_candidate(chunk)
        if candidate is None:
            return []
        out: list[StreamEvent] = []
        for part in _parts(candidate):
            text = part.get("text")
            if isinstance(text, str) and text:
                out.append(ReasoningDelta(text) if part.get("thought") is True else TextDelta(text))
            call = _tool_call(part, self._calls) if "functionCall" in part else None
            if call is not None:
                function = call["function"]
                out.append(ToolCallDelta(self._calls, call["id"], function["name"], function["arguments"]))
                self._calls += 1
        reason = finish_reason(candidate.get("finishReason"), self._calls > 0)
        if reason is not None:
            self.finish_reason = reason
        return out

    def end_at_eof(self) -> StreamEnd | None:
        if self.finish_reason is None or self.complete:
            return None
        self.complete = True
        return StreamEnd(
            finish_reason=self.finish_reason,
            usage=gemini_usage(self._usage),
            model=self.model or self._requested,
        )


def in_band_error(provider: str, event: Mapping[str, Any]) -> ProviderError:
    """The `ProviderError` of an `{"error": {...}}` event of a stream (after HTTP 200): the
    error's `code` as its status when it is an HTTP error status (so an `UNAVAILABLE` before
    the first output is retried, a `RESOURCE_EXHAUSTED` waits), else 200."""
    error = event.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 200
    return gemini_failure(provider, status, event, note="error event")
