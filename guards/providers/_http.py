"""Plumbing shared by the provider adapters: the HTTP client and its admission limit, capped
body reads, transport failures, `Retry-After` parsing (each translated once into
`ProviderError`), error objects and token usage.

Bodies are read as sent, never inflated: every request asks for `Accept-Encoding: identity`
(`IDENTITY`, set per request, so a client of the caller's own making asks for it too), and an
answer with any other `Content-Encoding` is refused before its body is read
(`refuse_encoded`). A compressed body is a few KB that can inflate to gigabytes, one network
read at a time and before any size cap can see it; reading it raw keeps the body cap a cap on
what is in memory."""

from __future__ import annotations

import asyncio
import email.utils
import functools
import math
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..contracts._binding import Usage
from ..contracts._errors import ProviderError
from ..waits._admission import ADMITTED_LATE, Admission
from ..waits._first_output import first_output_arrived
from ._httpx import httpx

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "ENCODING_REFUSED",
    "IDENTITY",
    "MAX_RETRY_AFTER_S",
    "bounded_wait",
    "content_filtered",
    "context_exceeded",
    "error_objects",
    "http_client",
    "tls_context",
    "json_mode_not_met",
    "new_client",
    "numeric_code",
    "parse_retry_after",
    "parse_usage",
    "read_capped",
    "refuse_encoded",
    "retry_date",
    "transport_error",
]

DEFAULT_MAX_BODY_BYTES = 1 << 20
#: The request header every provider request carries: the body as sent, not compressed.
IDENTITY = {"accept-encoding": "identity"}
#: The `ProviderError.note` of an answer refused for its `Content-Encoding`.
ENCODING_REFUSED = "content-encoding refused"
#: The longest wait a provider's `Retry-After` is read as (a daily quota resets within a day).
#: What becomes of it is the walk's to decide: a cooldown, and the wait a client is told, are
#: at most the model's `Cooldown.max_s` (10 minutes by default).
MAX_RETRY_AFTER_S = 86_400.0
#: Provider numbers outside these ranges are not numbers anyone sends: token counts past 2**53
#: would overflow a cost computation in floats, codes past 32 bits are no known code.
_MAX_TOKENS = 1 << 53
_MAX_CODE = 1 << 31


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context of every client `http_client` makes in this process, made once: making
    one loads the whole CA bundle (50 to 60 ms of CPU), and a context is safe to share between
    clients. The library's default, as it reads the environment (`SSL_CERT_FILE`,
    `SSL_CERT_DIR`) when the first client is made: `httpx` verifies against `certifi`'s
    bundle, `httpx2` against the system's trust store."""
    return httpx.create_ssl_context()


def http_client(*, max_connections: int = 100) -> httpx.AsyncClient:
    """The HTTP client a provider adapter makes when none is given; pass one of your own
    making (`client=`) to size its pool or share it between bindings.

    At most `max_connections` requests are in flight at once; the others wait for one to
    finish in an O(1) queue, newest first, until their deadline passes (see
    `_AdmittedTransport`). The guards' deadline is the real limit: these timeouts only stop a
    call made without one from hanging forever. No retries here: ours are the only ones.
    Raises `ValueError` for a `max_connections` below 1.
    """
    if max_connections < 1:
        raise ValueError("max_connections must be at least 1")
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=20)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(120.0, connect=10.0),
        transport=_AdmittedTransport(
            httpx.AsyncHTTPTransport(retries=0, limits=limits, verify=tls_context()),
            Admission(max_connections),
        ),
    )


#: The adapters' name for their default client.
new_client = http_client


class _AdmittedTransport(httpx.AsyncBaseTransport):
    """A transport that admits at most its pool's size of requests at once, each holding its
    slot until its response is closed, so httpcore's own queue stays empty (its cost grows with
    queued requests times connections, on every event: see `guards.waits._admission`). A request
    waits at most the client's pool timeout (`httpx.PoolTimeout`), and less when cancelled (a
    deadline)."""

    def __init__(self, transport: httpx.AsyncBaseTransport, admission: Admission) -> None:
        self._transport = transport
        self._admission = admission

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        admission = self._admission
        if admission.in_use < admission.limit:
            waited = await admission.acquire()  # a free slot: taken at once, no timer
        else:
            pool_timeout = request.extensions.get("timeout", {}).get("pool")
            try:
                async with asyncio.timeout(pool_timeout):
                    waited = await admission.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no connection within the pool timeout", request=request) from None
        try:
            response = await self._transport.handle_async_request(request)
        except asyncio.CancelledError:
            admission.release()
            if waited:  # the deadline was spent in the queue: say so (see guards.waits._admission)
                raise asyncio.CancelledError(ADMITTED_LATE) from None
            raise
        except BaseException:
            admission.release()
            raise
        response.stream = (_ReleasedLate if waited else _Released)(response.stream, admission)
        return response

    async def aclose(self) -> None:
        await self._transport.aclose()


class _Released(httpx.AsyncByteStream):
    """A response body that gives its request's admission slot back when closed (once)."""

    def __init__(self, stream: httpx.SyncByteStream | httpx.AsyncByteStream, admission: Admission) -> None:
        assert isinstance(stream, httpx.AsyncByteStream)
        self._stream = stream
        self._admission: Admission | None = admission

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream.__aiter__()  # the body itself: nothing added per chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            admission, self._admission = self._admission, None
            if admission is not None:
                admission.release()


class _ReleasedLate(_Released):
    """The body of a request that waited for admission: cancelled before it is read and closed
    (the answer began, but its deadline, mostly spent in the queue, passed before it ended), it
    says so as a cancellation before the head does (`ADMITTED_LATE`). Only a request that waited
    pays for the wrapper."""

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._late(self._stream)

    @staticmethod
    async def _late(stream: httpx.AsyncByteStream) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        except asyncio.CancelledError:
            raise asyncio.CancelledError(ADMITTED_LATE) from None

    async def aclose(self) -> None:
        try:
            await super().aclose()
        except asyncio.CancelledError:
            raise asyncio.CancelledError(ADMITTED_LATE) from None


def refuse_encoded(response: httpx.Response, provider: str) -> None:
    """Raise `ProviderError` (`model_unavailable`, whatever the status: the body that would say
    more is not read) for an answer whose `Content-Encoding` is anything but none or
    `identity`. Call it before reading any of the body; closing the response then closes the
    connection without reading it."""
    encoding = response.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise ProviderError(
            provider, status=response.status_code, encoding_refused=True, note=ENCODING_REFUSED
        )


async def read_capped(response: httpx.Response, provider: str, max_bytes: int) -> bytes:
    """Read a streamed response body as sent (never inflated: see `refuse_encoded`), failing
    once it passes `max_bytes`."""
    refuse_encoded(response, provider)
    declared = response.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared[:20]) > max_bytes:
        raise ProviderError(provider, status=response.status_code, note=f"body over {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > max_bytes:
            raise ProviderError(provider, status=response.status_code, note=f"body over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def post_capped(
    client: httpx.AsyncClient,
    url: str,
    *,
    provider: str,
    max_bytes: int,
    headers: httpx.Headers | Mapping[str, str],
    json: Any = None,
    content: bytes | None = None,
) -> tuple[httpx.Response, bytes]:
    """The non-streamed call every adapter's `run` makes: POST `json` (or `content`, bytes as
    they are: a signed body) to `url`, never following a redirect (a 3xx is a failure,
    whatever the client), report the answer's head as its first output (a model's limit),
    and read the body as sent, capped (`read_capped`). (The response, its body); raises
    `ProviderError` for a transport failure. Cancelling the task closes the connection."""
    try:
        async with client.stream(
            "POST", url, json=json, content=content, headers=headers, follow_redirects=False
        ) as response:
            first_output_arrived()
            return response, await read_capped(response, provider, max_bytes)
    except httpx.HTTPError as exc:
        raise transport_error(provider, exc) from None


def transport_error(provider: str, exc: httpx.HTTPError) -> ProviderError:
    """A failure with no usable HTTP response: refused, reset, dropped mid-body, protocol error."""
    return ProviderError(provider, note=type(exc).__name__)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` as seconds (delta-seconds or an HTTP date), at most `MAX_RETRY_AFTER_S`;
    None when absent or unreadable (`nan` and `inf` included: a wait must be a finite number)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return bounded_wait(seconds)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return bounded_wait(when.timestamp() - (time.time() if now is None else now))


def retry_date(value: str | None) -> float | None:
    """`Retry-After` as the time it names (seconds since the epoch), when it is an HTTP date;
    None for delta-seconds, an unreadable value or none."""
    if not value:
        return None
    value = value.strip()
    try:
        float(value)
    except ValueError:
        pass
    else:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, OverflowError):
        return None
    return when if math.isfinite(when) else None


def bounded_wait(seconds: float) -> float | None:
    """A provider's wait in seconds, within 0 and `MAX_RETRY_AFTER_S`; None when not finite."""
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds)) if math.isfinite(seconds) else None


def parse_usage(raw: Any) -> Usage | None:
    """`{prompt_tokens, completion_tokens, total_tokens}` (Workers AI and OpenAI agree), and the
    input tokens read from the prompt cache, `prompt_tokens_details.cached_tokens` (OpenAI's;
    `prompt_tokens` includes them, and they are capped to it); counts that are not integers
    from 0 to 2**53 are left at 0, and anything but an object is no usage at all."""
    if not isinstance(raw, dict):
        return None
    numbers = {k: _count(raw.get(k)) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    details = raw.get("prompt_tokens_details")
    if isinstance(details, dict) and (cached := _count(details.get("cached_tokens"))):
        numbers["cached_input_tokens"] = min(cached, numbers["prompt_tokens"])
    return Usage(**numbers)


def _count(value: Any) -> int:
    """`value` if it is an integer from 0 to 2**53, else 0."""
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKENS else 0
    )


def error_objects(found: Any) -> list[dict[str, Any]]:
    """A body's error field as a list of error objects: one object, a list, or nothing."""
    if isinstance(found, dict):
        return [found]
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def numeric_code(errors: list[dict[str, Any]]) -> int | None:
    """The first integer `code` of `errors` (Cloudflare's numeric codes, known to the classifier);
    a number past 32 bits is no code."""
    codes = (e.get("code") for e in errors)
    return next(
        (c for c in codes if isinstance(c, int) and not isinstance(c, bool) and -_MAX_CODE <= c < _MAX_CODE),
        None,
    )


def json_mode_not_met(errors: list[dict[str, Any]]) -> bool:
    """Whether a message says "JSON Mode couldn't be met" (Workers AI; any apostrophe). The
    messages are only searched, never kept."""
    messages = " ".join(str(e.get("message", "")) for e in errors)
    return "json mode couldn't be met" in messages.lower().replace("\u2019", "'")


#: OpenAI-compatible error codes that say the input does not fit: the model's context window
#: (`context_length_exceeded`), or OpenAI's longest string (`string_above_max_length`).
CONTEXT_CODES = frozenset({"context_length_exceeded", "string_above_max_length"})
#: What a compatible server without the code says (vLLM, and the Workers AI models it serves:
#: "This model's maximum context length is ..."; Anthropic's "prompt is too long"), lowercase.
_CONTEXT_PHRASES = ("context length", "context window", "prompt is too long")
#: Error codes of a provider's content policy: OpenAI's and Azure's, and Azure's `innererror`.
CONTENT_FILTER_CODES = frozenset(
    {"content_filter", "content_policy_violation", "ResponsibleAIPolicyViolation"}
)


def _string_codes(errors: list[dict[str, Any]]) -> set[str]:
    """The string `code`s of `errors`, and of their `innererror` (Azure's)."""
    codes: set[str] = set()
    for error in errors:
        for found in (error, error.get("innererror")):
            if isinstance(found, dict) and isinstance(found.get("code"), str):
                codes.add(found["code"])
    return codes


def context_exceeded(errors: list[dict[str, Any]]) -> bool:
    """Whether `errors` say the input does not fit the model's context window: a code of
    `CONTEXT_CODES`, or a message naming the context length or window. The messages are only
    searched, never kept."""
    if not CONTEXT_CODES.isdisjoint(_string_codes(errors)):
        return True
    messages = " ".join(str(e.get("message", "")) for e in errors).lower()
    return any(phrase in messages for phrase in _CONTEXT_PHRASES)


def content_filtered(errors: list[dict[str, Any]]) -> bool:
    """Whether `errors` are a content-policy refusal: a code of `CONTENT_FILTER_CODES` (also as
    Azure's `innererror.code`)."""
    return not CONTENT_FILTER_CODES.isdisjoint(_string_codes(errors))
