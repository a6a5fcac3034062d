"""Cloudflare Workers AI over its REST API (PROTOCOLS.md, "Cloudflare Workers AI").

Every failure shape ends as a `ProviderError` with the provider's code and the HTTP status:
`success: false` even with HTTP 200, the `AiError` object shape, non-JSON bodies (a proxy's HTML
on 5xx), a redirect (any 3xx: never followed, its body never the answer), oversized bodies and
dropped connections; while streaming, also an error object in an
event, a cut body and a stall. Provider messages are read only to spot "JSON Mode couldn't be
met" and a context window exceeded ("This model's maximum context length is ..."); they are
never kept (they may echo the prompt).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any
from urllib.parse import quote

from ..contracts._binding import AIResult
from ..contracts._errors import ConfigurationError, ProviderError
from ..contracts._stream import StreamEvent
from ._http import (
    DEFAULT_MAX_BODY_BYTES,
    IDENTITY,
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
from ._stream_http import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_RECONNECTS, ChunkDecoder, stream_sse

__all__ = ["WorkersAI", "parse_workers_ai_response"]

DEFAULT_BASE_URL = "https://api.cloudflare.com/client/v4"
PROVIDER = "workers-ai"


class WorkersAI:
    """A binding that runs Workers AI models through `POST {base}/accounts/{id}/ai/run/{model}`.

    Pass an `httpx.AsyncClient` to share one across bindings; otherwise the binding makes its own
    and closes it in `aclose`. Bodies are read up to `max_body_bytes` (while streaming: each
    event, and each line), as sent: every request asks for `Accept-Encoding: identity`, and an
    answer with another `Content-Encoding` fails unread (`ProviderError`, `model_unavailable`).

    Streaming (`stream`): a stream with no complete event for `idle_timeout_s` fails as stalled
    (comments, blank lines and part of a line do not count). With
    `resume_base` set (an AI Gateway address, `{gateway}/v1/{account}/{gateway_id}`), a stream
    whose answer carries `cf-aig-run-id` survives up to `max_reconnects` cuts by resuming from
    `{resume_base}/run/{id}/resume`; without it, a cut fails the stream.

    `run` reports its answer's first byte (`guards.first_output_arrived`) when the status line
    and headers arrived: a model's `first_output_s` bounds the wait for them, not the body.
    """

    #: OpenTelemetry's `gen_ai.provider.name` (the conventions list no value for Workers AI).
    gen_ai_provider_name = "cloudflare.workers_ai"

    def __init__(
        self,
        *,
        account_id: str,
        api_token: str,
        base_url: str = DEFAULT_BASE_URL,
        client: httpx.AsyncClient | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_reconnects: int = DEFAULT_MAX_RECONNECTS,
        resume_base: str | None = None,
    ) -> None:
        missing = [
            name for name, value in (("account_id", account_id), ("api_token", api_token)) if not value
        ]
        if missing:
            raise ConfigurationError(f"WorkersAI needs {' and '.join(missing)}")
        if not idle_timeout_s > 0:
            raise ConfigurationError("WorkersAI needs idle_timeout_s > 0")
        if max_reconnects < 0:
            raise ConfigurationError("WorkersAI needs max_reconnects >= 0")
        check_client(client, "WorkersAI")
        self._options: dict[str, Any] = {
            "account_id": account_id,
            "api_token": api_token,
            "base_url": base_url,
            "client": client,
            "max_body_bytes": max_body_bytes,
            "idle_timeout_s": idle_timeout_s,
            "max_reconnects": max_reconnects,
            "resume_base": resume_base,
        }
        self._url = f"{base_url.rstrip('/')}/accounts/{account_id}/ai/run/"
        # Identity per request: a client of the caller's own making asks for it too.
        self._headers = {"authorization": f"Bearer {api_token}", **IDENTITY}
        self._stream_headers = {**self._headers, "accept": "text/event-stream"}
        self._owns_client = client is None
        self._client = client or new_client()
        self._max_body_bytes = max_body_bytes
        self._idle_timeout_s = idle_timeout_s
        self._max_reconnects = max_reconnects
        self._resume_base = resume_base.rstrip("/") if resume_base else None

    def __repr__(self) -> str:  # never show the token
        return f"WorkersAI(url={self._url!r})"

    def replace(self, **changes: Any) -> WorkersAI:
        """A new binding made with this one's arguments, `changes` applied: e.g. the same
        binding pointed at another server for a test (`base_url`, `account_id`, `api_token`; a
        new `base_url` without a `resume_base` leaves no resume). The new binding shares this
        one's `client` when one was given (else it makes its own, unless `client` is among the
        changes); this one is left as it is. An unknown argument raises `TypeError`."""
        options = {**self._options, **changes}
        if "base_url" in changes and "resume_base" not in changes:
            options["resume_base"] = None
        return WorkersAI(**options)

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        response, body = await post_capped(
            self._client,
            self._url + quote(model, safe="/@:"),
            provider=PROVIDER,
            max_bytes=self._max_body_bytes,
            headers=self._headers,
            json=dict(inputs),
        )
        return parse_workers_ai_response(
            response.status_code, body, model=model, retry_after=response.headers.get("retry-after")
        )

    def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        """Run `model` on `inputs` with `"stream": true` and yield its events as they arrive
        (the `guards.StreamingBinding` contract: deltas, then one `StreamEnd`; every failure a
        `ProviderError`). Both shapes Workers AI streams are read, detected per event: its own
        `{"response": ...}` events (text, top-level `tool_calls`, `usage`) and OpenAI-style
        `chat.completion.chunk`s. `[DONE]` completes the stream, and so does the end of the body
        after a `finish_reason`. A JSON answer (JSON mode does not stream) comes as one text
        delta and the end. `StreamEnd.model` is the model requested unless a chunk names one.
        Closing the iterator, or cancelling its consumer, closes the connection."""

        def parse_whole(response: httpx.Response, body: bytes) -> AIResult:
            return parse_workers_ai_response(
                response.status_code, body, model=model, retry_after=response.headers.get("retry-after")
            )

        return stream_sse(
            self._client,
            self._url + quote(model, safe="/@:"),
            body={**inputs, "stream": True},
            headers=self._stream_headers,
            provider=PROVIDER,
            decoder=ChunkDecoder(PROVIDER, model, in_band_error, native=True),
            parse_whole=parse_whole,
            idle_timeout_s=self._idle_timeout_s,
            max_reconnects=self._max_reconnects,
            resume_base=self._resume_base,
            max_event_bytes=self._max_body_bytes,
        )

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def in_band_error(event: dict[str, Any]) -> ProviderError | None:
    """The error an event of a Workers AI stream carries after HTTP 200 (`errors`, `error`,
    `success: false`, the `AiError` shape), with its numeric code; None for a normal event."""
    errors = _errors(event)
    if not errors and event.get("success") is not False:
        return None
    return ProviderError(
        PROVIDER,
        code=numeric_code(errors),
        status=200,
        json_mode_failed=json_mode_not_met(errors),
        context_exceeded=context_exceeded(errors),
        content_filtered=content_filtered(errors),
        note="error event",
    )


def parse_workers_ai_response(
    status: int, body: bytes, *, model: str, retry_after: str | None = None
) -> AIResult:
    """Turn one Workers AI HTTP answer into a result, or raise `ProviderError`."""
    wait, at = parse_retry_after(retry_after), retry_date(retry_after)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        raise ProviderError(
            PROVIDER, status=status, retry_after_s=wait, retry_at=at, note="non-JSON body"
        ) from None
    if not isinstance(data, dict):
        raise ProviderError(PROVIDER, status=status, retry_after_s=wait, retry_at=at, note="unexpected body")
    errors = _errors(data)
    result = data.get("result")
    # Only a 2xx is an answer: a redirect is never followed, so its body is never the result.
    if 200 <= status < 300 and data.get("success") is not False and not errors and isinstance(result, dict):
        return AIResult(
            response=result.get("response"),
            model=model,
            usage=parse_usage(result.get("usage")),
            tool_calls=tuple(t for t in result.get("tool_calls") or () if isinstance(t, dict)),
        )
    raise ProviderError(
        PROVIDER,
        code=numeric_code(errors),
        status=status,
        retry_after_s=wait,
        retry_at=at,
        json_mode_failed=json_mode_not_met(errors),
        context_exceeded=context_exceeded(errors),
        content_filtered=content_filtered(errors),
    )


def _errors(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The error objects of any known failure shape: `errors` (REST), `error` (AI Gateway), or
    the `AiError` object itself."""
    errors = error_objects(data.get("errors") or data.get("error"))
    if data.get("name") == "AiError" or "internalCode" in data:
        code = data.get("internalCode")
        message = f"{data.get('description', '')} {data.get('message', '')}"
        errors.append({"code": code if isinstance(code, int) else None, "message": message})
    return errors
