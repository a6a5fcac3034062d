"""HTTP plumbing shared by the provider adapters: capped body reads, transport failures and
`Retry-After` parsing, each translated once into `ProviderError`."""

from __future__ import annotations

import email.utils
import time

import httpx

from .._errors import ProviderError

__all__ = ["DEFAULT_MAX_BODY_BYTES", "new_client", "parse_retry_after", "read_capped"]

DEFAULT_MAX_BODY_BYTES = 1 << 20


def new_client() -> httpx.AsyncClient:
    """The client an adapter makes when none is given. The guards' deadline is the real limit;
    these timeouts only stop a call made without one from hanging forever. No retries here:
    ours are the only ones."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(120.0, connect=10.0),
        limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
        transport=httpx.AsyncHTTPTransport(retries=0),
    )


async def read_capped(response: httpx.Response, provider: str, max_bytes: int) -> bytes:
    """Read a streamed response body, failing once it passes `max_bytes`."""
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise ProviderError(provider, status=response.status_code, note=f"body over {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise ProviderError(provider, status=response.status_code, note=f"body over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def transport_error(provider: str, exc: httpx.HTTPError) -> ProviderError:
    """A failure with no usable HTTP response: refused, reset, dropped mid-body, protocol error."""
    return ProviderError(provider, note=type(exc).__name__)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` as seconds (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
