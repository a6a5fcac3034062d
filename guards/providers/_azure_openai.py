"""Azure OpenAI (PROTOCOLS.md, "Azure OpenAI"): OpenAI's chat completions wire at Azure's
addresses, with Azure's credentials.

The wire is OpenAI's, so the adapter is `OpenAICompatible` with two things of Azure's own: where
a request goes (the v1 endpoint, or a deployment's with `api-version`) and how it is
authorized (the `api-key` header, or an Entra ID bearer token asked for per request). Azure's
failures are read by the OpenAI-compatible parser, which already knows them: a refused prompt
(`error.code: content_filter`, `innererror.code: ResponsibleAIPolicyViolation`) and a filtered
answer (`finish_reason: content_filter`) are content filters, `context_length_exceeded` a
context window, and `retry-after-ms` / `retry-after` the wait of a 429.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote

from ..contracts._errors import ConfigurationError, ProviderError
from ..contracts._stream import StreamEvent
from ._http import DEFAULT_MAX_BODY_BYTES
from ._httpx import httpx
from ._openai import OpenAICompatible
from ._stream_http import DEFAULT_IDLE_TIMEOUT_S

__all__ = ["AzureOpenAI", "TokenProvider"]

DEFAULT_PROVIDER = "azure-openai"
#: An Entra ID token source: an async callable returning a bearer token (e.g.
#: `azure.identity.aio.get_bearer_token_provider(credential, "https://cognitiveservices.azure.com/.default")`).
TokenProvider = Callable[[], Awaitable[str]]


class AzureOpenAI(OpenAICompatible):
    """A binding that runs chat completions on an Azure OpenAI resource at `endpoint`
    (`https://{resource}.openai.azure.com`).

    Without `api_version`, requests go to the v1 endpoint,
    `POST {endpoint}/openai/v1/chat/completions`, the model (the deployment's name) in the body.
    With `api_version`, they go to the deployment endpoint,
    `POST {endpoint}/openai/deployments/{model}/chat/completions?api-version={api_version}`.

    Exactly one credential: `api_key` travels as the `api-key` header; `token_provider`, an
    async callable returning an Entra ID token, is awaited before each request (no cache
    here: `azure.identity`'s token providers keep the token until near its expiry) and the
    token travels as `Authorization: Bearer`. A token provider that raises, or returns no
    token, fails the call as a `ProviderError` with no status (`note="token provider failed"`),
    which the call guard treats as a transient failure. Everything else is as for
    `OpenAICompatible` (no AI Gateway resume: `max_reconnects` is 0).
    """

    #: OpenTelemetry's `gen_ai.provider.name` for Azure OpenAI.
    gen_ai_provider_name = "azure.ai.openai"

    def __init__(
        self,
        *,
        endpoint: str,
        api_key: str | None = None,
        token_provider: TokenProvider | None = None,
        api_version: str | None = None,
        client: httpx.AsyncClient | None = None,
        headers: Mapping[str, str] | None = None,
        provider: str = DEFAULT_PROVIDER,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if (api_key is None) == (token_provider is None) or api_key == "":
            raise ConfigurationError(
                "AzureOpenAI needs exactly one credential: api_key (AZURE_OPENAI_API_KEY) or token_provider"
            )
        if api_version is not None and not api_version:
            raise ConfigurationError("AzureOpenAI got an empty api_version (pass None for the v1 endpoint)")
        base = endpoint.rstrip("/")
        given = dict(headers or {})
        if api_key is not None:
            given["api-key"] = api_key
        super().__init__(
            api_key=None,
            base_url=f"{base}/openai/v1",
            client=client,
            headers=given,
            provider=provider,
            max_body_bytes=max_body_bytes,
            idle_timeout_s=idle_timeout_s,
            max_reconnects=0,
        )
        self._azure: dict[str, Any] = {
            "endpoint": endpoint,
            "api_key": api_key,
            "token_provider": token_provider,
            "api_version": api_version,
            "client": client,
            "headers": headers,
            "provider": provider,
            "max_body_bytes": max_body_bytes,
            "idle_timeout_s": idle_timeout_s,
        }
        self._token_provider = token_provider
        self._deployments = f"{base}/openai/deployments/" if api_version is not None else None
        self._query = f"/chat/completions?api-version={quote(api_version, safe='')}" if api_version else ""

    def __repr__(self) -> str:  # never the key
        return f"AzureOpenAI(provider={self.provider!r}, endpoint={self._azure['endpoint']!r})"

    def replace(self, **changes: Any) -> AzureOpenAI:
        """A new binding made with this one's arguments, `changes` applied (as
        `OpenAICompatible.replace`)."""
        return AzureOpenAI(**{**self._azure, **changes})

    def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        if self._token_provider is None:
            return super().stream(model, inputs)
        return self._token_stream(model, inputs)

    async def _token_stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        events = self._stream(model, inputs, await self._authorized(self._stream_headers))
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    def _url_for(self, model: str) -> str:
        if self._deployments is None:
            return self._url
        return f"{self._deployments}{quote(model, safe='')}{self._query}"

    async def _authorized(self, headers: httpx.Headers) -> httpx.Headers:
        if self._token_provider is None:
            return headers
        try:
            token = await self._token_provider()
        except Exception:  # the credential's own error may name the tenant or the account
            raise ProviderError(self.provider, note="token provider failed") from None
        if not isinstance(token, str) or not token:
            raise ProviderError(self.provider, note="token provider failed")
        authorized = httpx.Headers(headers)
        authorized["authorization"] = f"Bearer {token}"
        return authorized
