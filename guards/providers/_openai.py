"""OpenAI-compatible chat completions (PROTOCOLS.md, "OpenAI-compatible chat completions").

One adapter for OpenAI itself, Cloudflare AI Gateway's `compat` endpoint, and local servers
(Ollama, llama.cpp, vLLM). It translates the Workers-AI-shaped inputs of the binding protocol
into a chat completion request and the answer back into an `AIResult`.

Every failure shape ends as a `ProviderError` carrying the HTTP status: an error status, an
`{"error": {...}}` object (even with HTTP 200, also as an event of a stream), a redirect (any
3xx: never followed, its body never the answer), AI Gateway's
`{"success": false, "error": [...]}` envelope, a 2xx without a usable choice, non-JSON bodies (a
proxy's HTML page), oversized bodies and dropped connections; while streaming, also a cut body
and a stall. Provider messages are read only to spot "JSON Mode couldn't be met"
(Workers AI models behind an OpenAI-compatible endpoint) and a context window exceeded (servers
that send no code); they are never kept (they may echo the prompt).

No retries here and no sleeping: the call guard's classifier is the only retry policy, so
`x-should-retry` is ignored and `retry-after-ms` / `retry-after` only become
`ProviderError.retry_after_s`, a hint the call guard honours when it fits in the deadline.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from ..contracts._binding import AIResult
from ..contracts._errors import ConfigurationError, ProviderError
from ..contracts._stream import StreamEvent
from ._http import (
    DEFAULT_MAX_BODY_BYTES,
    IDENTITY,
    bounded_wait,
    content_filtered,
    context_exceeded,
    error_objects,
    json_mode_not_met,
    new_client,
    numeric_code,
    parse_retry_after,
    parse_usage,
    post_capped,
    retry_date,
)
from ._httpx import check_client, httpx
from ._identifiers import identifier
from ._stream_http import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_RECONNECTS, ChunkDecoder, stream_sse

__all__ = ["OpenAICompatible"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_PROVIDER = "openai"

#: Inputs sent as they are. Every other key is dropped, because OpenAI answers 400 to an
#: argument it does not know (Workers AI's `raw`, `lora`, `top_k`, `repetition_penalty`...).
#: `n` is dropped on purpose (only the first choice is read, the others would be paid for), and
#: so is `stream`: `run` reads one JSON answer, `stream` sets it itself.
PASSTHROUGH_KEYS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "presence_penalty",
        "frequency_penalty",
    }
)

#: An OpenAI `error.type` / `error.code` we may repeat in a note: a bounded lowercase token.
_SAFE_TOKEN = re.compile(r"[a-z_]{1,40}")
_UNSAFE_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_-]+")
_QUOTA = "insufficient_quota"
#: AI Gateway's OpenAI-compatible endpoint is `{gateway}/v1/{account}/{gateway_id}/compat`.
_GATEWAY_COMPAT_SUFFIX = "/compat"


class OpenAICompatible:
    """A binding that runs models through `POST {base_url}/chat/completions`.

    `api_key` travels as `Authorization: Bearer <key>`; pass `None` for a server without
    authentication (Ollama, llama.cpp), never an empty string (that is a missing setting and
    raises `ConfigurationError`). `headers` are added to every request (e.g.
    `cf-aig-authorization` for Cloudflare AI Gateway). `provider` names the provider in
    `ProviderError`s and logs. Pass an `httpx.AsyncClient` to share one across bindings;
    otherwise the binding makes its own and closes it in `aclose`. Bodies are read up to
    `max_body_bytes` (while streaming: each event, and each line), as sent: every request asks
    for `Accept-Encoding: identity`, and an answer with another `Content-Encoding` fails unread
    (`ProviderError`, `model_unavailable`).

    `run` translates Workers-AI-shaped inputs: `messages` pass through, a `prompt` becomes one
    user message, `response_format` `{"type": "json_schema", "json_schema": <JSON Schema>}`
    becomes OpenAI's `{"name", "schema", "strict": false}` wrapper, and the usual sampling keys
    pass through; other keys are dropped and `stream` is never sent. The answer's text (a JSON
    string in JSON mode) is `AIResult.response`; `model` is the model that served.

    `stream` sends the same request with `"stream": true` and usage included. A stream with no
    complete event for `idle_timeout_s` fails as stalled (comments, blank lines and part of a
    line do not count). Behind Cloudflare AI Gateway, a stream whose
    answer carries `cf-aig-run-id` survives up to `max_reconnects` cuts by resuming from
    `{resume_base}/run/{id}/resume`; `resume_base` defaults to `base_url` without its trailing
    `/compat` (the gateway's compat endpoint), and to no resume for any other `base_url`.

    `run` reports its answer's first byte (`guards.first_output_arrived`) when the status line
    and headers arrived: a model's `first_output_s` bounds the wait for them, not the body.
    """

    #: OpenTelemetry's `gen_ai.provider.name`: the conventions' well-known value for the
    #: OpenAI API, which compatible servers speak (their `gen_ai.response.model` tells them apart).
    gen_ai_provider_name = "openai"

    def __init__(
        self,
        *,
        api_key: str | None,
        base_url: str = DEFAULT_BASE_URL,
        client: httpx.AsyncClient | None = None,
        headers: Mapping[str, str] | None = None,
        provider: str = DEFAULT_PROVIDER,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_reconnects: int = DEFAULT_MAX_RECONNECTS,
        resume_base: str | None = None,
    ) -> None:
        if api_key is not None and not api_key:
            raise ConfigurationError(
                "OpenAICompatible got an empty api_key (pass None for a server without authentication)"
            )
        if not base_url.startswith(("http://", "https://")):
            raise ConfigurationError("OpenAICompatible needs an http:// or https:// base_url")
        if not provider:
            raise ConfigurationError("OpenAICompatible needs a provider name")
        if not idle_timeout_s > 0:
            raise ConfigurationError("OpenAICompatible needs idle_timeout_s > 0")
        if max_reconnects < 0:
            raise ConfigurationError("OpenAICompatible needs max_reconnects >= 0")
        check_client(client, "OpenAICompatible")
        self._options: dict[str, Any] = {
            "api_key": api_key,
            "base_url": base_url,
            "client": client,
            "headers": headers,
            "provider": provider,
            "max_body_bytes": max_body_bytes,
            "idle_timeout_s": idle_timeout_s,
            "max_reconnects": max_reconnects,
            "resume_base": resume_base,
        }
        self.provider = provider
        base = base_url.rstrip("/")
        self._url = f"{base}/chat/completions"
        self._headers = httpx.Headers(headers or {})
        # Identity per request (over any `headers` given): a client of the caller's own making
        # asks for it too.
        self._headers.update(IDENTITY)
        if api_key is not None:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._stream_headers = httpx.Headers(self._headers)
        self._stream_headers["accept"] = "text/event-stream"
        self._owns_client = client is None
        self._client = client or new_client()
        self._max_body_bytes = max_body_bytes
        self._idle_timeout_s = idle_timeout_s
        self._max_reconnects = max_reconnects
        if resume_base is None and base.endswith(_GATEWAY_COMPAT_SUFFIX):
            # Unconfirmed: that the resume address of a run started on the compat endpoint is
            # the gateway's own base, `{gateway}/v1/{account}/{gateway_id}/run/{id}/resume`.
            resume_base = base.removesuffix(_GATEWAY_COMPAT_SUFFIX)
        self._resume_base = resume_base.rstrip("/") if resume_base else None

    def __repr__(self) -> str:  # never show the key or the extra headers (gateway tokens)
        return f"OpenAICompatible(provider={self.provider!r}, url={self._url!r})"

    def replace(self, **changes: Any) -> OpenAICompatible:
        """A new binding made with this one's arguments, `changes` applied: e.g. the same
        binding pointed at another server for a test (`base_url`, `api_key`; `resume_base`
        defaults again from the new `base_url` unless given). The new binding shares this
        one's `client` when one was given (else it makes its own, unless `client` is among the
        changes); this one is left as it is. An unknown argument raises `TypeError`."""
        options = {**self._options, **changes}
        if "base_url" in changes and "resume_base" not in changes:
            options["resume_base"] = None
        return OpenAICompatible(**options)

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        """Run `model` on `inputs`; raises `ProviderError` for every failure. Cancelling the task
        closes the streamed response, and with it the connection."""
        body = chat_request(model, inputs)
        headers = await self._authorized(self._headers)
        response, raw = await post_capped(
            self._client,
            self._url_for(model),
            provider=self.provider,
            max_bytes=self._max_body_bytes,
            headers=headers,
            json=body,
        )
        return parse_chat_answer(
            response.status_code, response.headers, raw, model=model, provider=self.provider
        )

    def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        """Run `model` on `inputs` as a streamed chat completion and yield its events as they
        arrive (the `guards.StreamingBinding` contract: deltas, then one `StreamEnd`; every
        failure a `ProviderError`).

        `choices[0].delta` gives `content` (text), `reasoning_content` / `reasoning`
        (reasoning) and `tool_calls` pieces; a role-only chunk gives nothing. `finish_reason`
        (`content_filter` included, and a refusal reported as `content_filter`), the final
        usage chunk and the served `model` end up in `StreamEnd`. `[DONE]` completes the
        stream, and so does the end of the body after a `finish_reason`. An `{"error": ...}`
        event raises `ProviderError` with status 200, the numeric code if any, and never the
        provider's text. Closing the iterator, or cancelling its consumer, closes the
        connection."""
        return self._stream(model, inputs, self._stream_headers)

    def _stream(
        self, model: str, inputs: Mapping[str, Any], headers: httpx.Headers
    ) -> AsyncGenerator[StreamEvent, None]:
        """`stream` with these request headers."""
        body = chat_request(model, inputs)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        provider = self.provider

        def parse_whole(response: httpx.Response, raw: bytes) -> AIResult:
            return parse_chat_answer(
                response.status_code, response.headers, raw, model=model, provider=provider
            )

        return stream_sse(
            self._client,
            self._url_for(model),
            body=body,
            headers=headers,
            provider=provider,
            decoder=ChunkDecoder(provider, model, functools.partial(in_band_error, provider)),
            parse_whole=parse_whole,
            idle_timeout_s=self._idle_timeout_s,
            max_reconnects=self._max_reconnects,
            resume_base=self._resume_base,
            max_event_bytes=self._max_body_bytes,
        )

    def _url_for(self, model: str) -> str:
        """Where a request for `model` goes (one address here; Azure's deployments differ)."""
        return self._url

    async def _authorized(self, headers: httpx.Headers) -> httpx.Headers:
        """The headers of one request (the same here; Azure's Entra ID token is asked per request)."""
        return headers

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def chat_request(model: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion request body for Workers-AI-shaped `inputs`."""
    body: dict[str, Any] = {"model": model}
    if "messages" in inputs:
        body["messages"] = inputs["messages"]
    elif "prompt" in inputs:
        body["messages"] = [{"role": "user", "content": inputs["prompt"]}]
    response_format = _response_format(inputs.get("response_format"))
    if response_format is not None:
        body["response_format"] = response_format
    body.update((key, value) for key, value in inputs.items() if key in PASSTHROUGH_KEYS)
    return body


def _response_format(given: Any) -> dict[str, Any] | None:
    """Workers AI's JSON mode in OpenAI's words; OpenAI's own shapes pass; anything else is dropped.

    `strict` is false: strict mode demands every property be `required` and
    `additionalProperties: false` on every object, and refuses keywords pydantic emits
    (`default`, `minLength`, `maximum`, `format`...), so a route's schema would be rejected
    with 400. Without it the schema still steers the model, and the output guard validates.
    """
    if not isinstance(given, Mapping):
        return None
    kind = given.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema" or not isinstance(given.get("json_schema"), Mapping):
        return None
    schema = dict(given["json_schema"])
    if isinstance(schema.get("schema"), Mapping) and isinstance(schema.get("name"), str):
        return {"type": "json_schema", "json_schema": schema}  # already OpenAI's wrapper
    return {
        "type": "json_schema",
        "json_schema": {"name": _schema_name(schema.get("title")), "schema": schema, "strict": False},
    }


def _schema_name(title: Any) -> str:
    """OpenAI wants a name matching `[a-zA-Z0-9_-]{1,64}`: the schema's title made to fit."""
    name = _UNSAFE_NAME_CHARS.sub("_", title).strip("_")[:64] if isinstance(title, str) else ""
    return name or "output"


def _retry_hint(headers: httpx.Headers) -> float | None:
    """`retry-after-ms` (OpenAI's, in milliseconds) wins over `retry-after`; seconds or None."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            ms = float(raw_ms)
        except ValueError:
            pass
        else:
            wait = bounded_wait(ms / 1000)
            if wait is not None:
                return wait
    return parse_retry_after(headers.get("retry-after"))


def _retry_at(headers: httpx.Headers) -> float | None:
    """The time `retry-after` names when it is an HTTP date (and no `retry-after-ms` wins)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            ms = float(raw_ms)
        except ValueError:
            pass
        else:
            if bounded_wait(ms / 1000) is not None:
                return None
    return retry_date(headers.get("retry-after"))


def in_band_error(provider: str, event: dict[str, Any]) -> ProviderError | None:
    """The error an event of a chat completion stream carries after HTTP 200 (`{"error": ...}`,
    or AI Gateway's `success: false`), as the adapter named `provider` raises it; None for a
    normal event."""
    if event.get("error") or event.get("success") is False:
        return _failure(provider, 200, event, None)
    return None


def parse_chat_answer(
    status: int, headers: httpx.Headers | Mapping[str, str], body: bytes, *, model: str, provider: str
) -> AIResult:
    """One chat completion HTTP answer (its status, headers and body) as the adapter named
    `provider` reads it: a result, or raises `ProviderError` (with the wait its headers ask for)."""
    given = headers if isinstance(headers, httpx.Headers) else httpx.Headers(headers)
    return parse_chat_response(
        status,
        body,
        model=model,
        provider=provider,
        retry_after_s=_retry_hint(given),
        retry_at=_retry_at(given),
    )


def parse_chat_response(
    status: int,
    body: bytes,
    *,
    model: str,
    provider: str = DEFAULT_PROVIDER,
    retry_after_s: float | None = None,
    retry_at: float | None = None,
) -> AIResult:
    """Turn one chat completion HTTP answer into a result, or raise `ProviderError`."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        # The status decides (a proxy's HTML 502 is transient, a 200 of garbage is not).
        raise ProviderError(
            provider, status=status, retry_after_s=retry_after_s, retry_at=retry_at, note="non-JSON body"
        ) from None
    failed = (
        not 200 <= status < 300
        or not isinstance(data, dict)
        or bool(data.get("error"))
        or data.get("success") is False
    )
    if failed:
        raise _failure(provider, status, data, retry_after_s, retry_at)
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise ProviderError(
            provider,
            status=status,
            retry_after_s=retry_after_s,
            retry_at=retry_at,
            note="no choice in the answer",
        )
    message: dict[str, Any] = choice["message"]
    finish = choice.get("finish_reason")
    return AIResult(
        response=_content(message.get("content")),
        model=identifier(data.get("model")) or model,
        usage=parse_usage(data.get("usage")),
        tool_calls=tuple(t for t in message.get("tool_calls") or () if isinstance(t, dict)),
        # A refusal (structured outputs) is the model's own safety filter speaking.
        moderated=finish == "content_filter" or bool(message.get("refusal")),
        truncated=finish == "length",
        finish_reason=identifier(finish),
    )


def _content(content: Any) -> Any:
    """The message's text. A list of content parts (some compatible servers) is joined."""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(p for p in parts if isinstance(p, str))
    return content


def _failure(
    provider: str, status: int, data: Any, retry_after_s: float | None, retry_at: float | None = None
) -> ProviderError:
    """The `ProviderError` for a failed answer: OpenAI's `{"error": {...}}` object, AI Gateway's
    `{"success": false, "error": [...]}` (or Cloudflare's `errors`) list, or any other body.

    Only integers become `ProviderError.code` (Cloudflare's numeric codes, which the classifier
    knows); OpenAI's string `code` / `type` never do, and appear only as the note when they
    are a short lowercase token. `insufficient_quota` (sent with 429) marks quota exhaustion;
    `context_length_exceeded` (or a message naming the context length) an input too long for
    the model; `content_filter` / `content_policy_violation` a content-policy refusal.
    """
    if not isinstance(data, dict):
        return ProviderError(
            provider, status=status, retry_after_s=retry_after_s, retry_at=retry_at, note="unexpected body"
        )
    errors = error_objects(data.get("error") or data.get("errors"))
    tokens = [e.get(key) for e in errors for key in ("code", "type")]
    return ProviderError(
        provider,
        code=numeric_code(errors),
        status=status,
        retry_after_s=retry_after_s,
        retry_at=retry_at,
        json_mode_failed=json_mode_not_met(errors),
        quota_exhausted=_QUOTA in tokens,
        context_exceeded=context_exceeded(errors),
        content_filtered=content_filtered(errors),
        note=next((t for t in tokens if isinstance(t, str) and _SAFE_TOKEN.fullmatch(t)), ""),
    )
