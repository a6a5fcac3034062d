"""AWS Bedrock's Converse API (PROTOCOLS.md, "AWS Bedrock Converse"): `POST
{endpoint}/model/{modelId}/converse` and `/converse-stream`, each request SigV4-signed.

Signing and credentials are botocore's (the `bedrock` extra): its `SigV4Auth`, and its
credential chain (environment variables, shared config and credentials files, SSO, web
identity, container and instance roles), whose refreshable credentials are refreshed off the
event loop. botocore is imported when a `Bedrock` binding is made, never by a plain app. A
Bedrock API key (`api_key=`, or `AWS_BEARER_TOKEN_BEDROCK`) is sent as a bearer token instead,
with no signing and no botocore.

The stream's binary frames are read by `guards.providers._eventstream` (not botocore's parser:
see there), through the same stream engine as the SSE wires (stalls, cuts, caps, yielding).
The wire itself, request and answer, errors and stream events, is `guards.providers._converse`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator, Mapping
from typing import Any
from urllib.parse import quote

from ..contracts._binding import AIResult
from ..contracts._errors import ConfigurationError
from ..contracts._extras import missing_extra
from ..contracts._stream import StreamEvent
from ._converse import ConverseDecoder, converse_request, parse_converse_answer
from ._eventstream import EventStreamParser
from ._http import DEFAULT_MAX_BODY_BYTES, IDENTITY, new_client, post_capped
from ._httpx import check_client, httpx
from ._stream_http import DEFAULT_IDLE_TIMEOUT_S, stream_sse

__all__ = ["Bedrock"]

DEFAULT_PROVIDER = "bedrock"
#: The signing name of Bedrock's runtime (its endpoint prefix is `bedrock-runtime`).
SIGNING_NAME = "bedrock"
EVENT_STREAM = "application/vnd.amazon.eventstream"


class Bedrock:
    """A binding that runs models through Bedrock's Converse API in `region`.

    `region` defaults to `AWS_REGION`, then `AWS_DEFAULT_REGION`, then the AWS profile's;
    the endpoint to `endpoint_url`, then `AWS_ENDPOINT_URL_BEDROCK_RUNTIME`, then
    `https://bedrock-runtime.{region}.amazonaws.com`. Credentials, in order: `api_key` (a
    Bedrock API key, sent as `Authorization: Bearer`); `aws_access_key_id` and
    `aws_secret_access_key` (and `aws_session_token`); `AWS_BEARER_TOKEN_BEDROCK`; else
    botocore's credential chain (with `profile`, else `AWS_PROFILE`). Raises
    `ConfigurationError` when no region or no credentials are found, and `ModuleNotFoundError`
    naming the `bedrock` extra when signing is needed and botocore is not installed.

    `run` translates Workers-AI-shaped inputs (see `guards.providers._converse`); `stream`
    reads the binary event stream. Bodies and each event are read up to `max_body_bytes`; a
    stream with no complete event for `idle_timeout_s` fails as stalled. Every failure is a
    `ProviderError`; the provider's messages are never kept.
    """

    #: OpenTelemetry's `gen_ai.provider.name` for Bedrock.
    gen_ai_provider_name = "aws.bedrock"

    def __init__(
        self,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        profile: str | None = None,
        api_key: str | None = None,
        client: httpx.AsyncClient | None = None,
        provider: str = DEFAULT_PROVIDER,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if not idle_timeout_s > 0:
            raise ConfigurationError("Bedrock needs idle_timeout_s > 0")
        check_client(client, "Bedrock")
        self._options: dict[str, Any] = {
            "region": region,
            "endpoint_url": endpoint_url,
            "aws_access_key_id": aws_access_key_id,
            "aws_secret_access_key": aws_secret_access_key,
            "aws_session_token": aws_session_token,
            "profile": profile,
            "api_key": api_key,
            "client": client,
            "provider": provider,
            "max_body_bytes": max_body_bytes,
            "idle_timeout_s": idle_timeout_s,
        }
        self.provider = provider
        self._headers = httpx.Headers({"content-type": "application/json", **IDENTITY})
        keys = aws_access_key_id is not None or aws_secret_access_key is not None
        bearer = (
            api_key if api_key is not None or keys else os.environ.get("AWS_BEARER_TOKEN_BEDROCK") or None
        )
        self._signer: _Signer | None = None
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if bearer is not None:
            if not bearer:
                raise ConfigurationError("Bedrock got an empty api_key")
            self._headers["authorization"] = f"Bearer {bearer}"
        else:
            self._signer = _Signer(
                aws_access_key_id, aws_secret_access_key, aws_session_token, profile, region
            )
            region = region or self._signer.region
        if not region:
            raise ConfigurationError("Bedrock needs a region: region=... or AWS_REGION")
        self.region = region
        if self._signer is not None:
            self._signer.region = region
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_BEDROCK_RUNTIME")
        endpoint = endpoint or f"https://bedrock-runtime.{region}.amazonaws.com"
        if not endpoint.startswith(("http://", "https://")):
            raise ConfigurationError("Bedrock needs an http:// or https:// endpoint_url")
        self._endpoint = endpoint.rstrip("/")
        self._owns_client = client is None
        self._client = client or new_client()
        self._max_body_bytes = max_body_bytes
        self._idle_timeout_s = idle_timeout_s

    def __repr__(self) -> str:  # never a credential
        return f"Bedrock(provider={self.provider!r}, endpoint={self._endpoint!r})"

    def replace(self, **changes: Any) -> Bedrock:
        """A new binding made with this one's arguments, `changes` applied (e.g. pointed at a
        test server: `endpoint_url`, and credentials). An unknown argument raises `TypeError`."""
        return Bedrock(**{**self._options, **changes})

    def _url(self, model: str, operation: str) -> str:
        return f"{self._endpoint}/model/{quote(model, safe='')}/{operation}"

    async def _request_headers(self, url: str, body: bytes, accept: str) -> httpx.Headers:
        """The headers of one request: signed over its exact body when signing."""
        headers = httpx.Headers(self._headers)
        if self._signer is not None:
            headers.update(await self._signer.sign(url, body))
        headers["accept"] = accept
        return headers

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        """Run `model` (a model id, inference profile or ARN) on `inputs`; raises
        `ProviderError` for every failure. Cancelling the task closes the connection."""
        url = self._url(model, "converse")
        body = _encode(converse_request(inputs))
        headers = await self._request_headers(url, body, "application/json")
        response, raw = await post_capped(
            self._client,
            url,
            provider=self.provider,
            max_bytes=self._max_body_bytes,
            headers=headers,
            content=body,
        )
        return parse_converse_answer(
            response.status_code, response.headers, raw, model=model, provider=self.provider
        )

    def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        """Run `model` on `inputs` through `converse-stream` and yield its events as they
        arrive (the `guards.StreamingBinding` contract: deltas, then one `StreamEnd`; every
        failure a `ProviderError`, an exception event included). Closing the iterator, or
        cancelling its consumer, closes the connection."""
        return self._stream(model, inputs)

    async def _stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        url = self._url(model, "converse-stream")
        body = _encode(converse_request(inputs))
        headers = await self._request_headers(url, body, EVENT_STREAM)
        provider = self.provider

        def parse_whole(response: httpx.Response, raw: bytes) -> AIResult:
            return parse_converse_answer(
                response.status_code, response.headers, raw, model=model, provider=provider
            )

        events = stream_sse(
            self._client,
            url,
            body=body,
            headers=headers,
            provider=provider,
            decoder=ConverseDecoder(provider, model),
            parse_whole=parse_whole,
            idle_timeout_s=self._idle_timeout_s,
            max_reconnects=0,
            resume_base=None,
            max_event_bytes=self._max_body_bytes,
            new_parser=_event_stream_parser,
        )
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _encode(body: dict[str, Any]) -> bytes:
    """The exact bytes sent, and signed."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _event_stream_parser(max_event_bytes: int) -> EventStreamParser:
    return EventStreamParser(max_event_bytes=max_event_bytes)


class _Signer:
    """botocore's SigV4 signer and credential chain, loaded when first made."""

    def __init__(
        self,
        key_id: str | None,
        secret: str | None,
        token: str | None,
        profile: str | None,
        region: str | None,
    ) -> None:
        try:
            import botocore.auth  # type: ignore[import-untyped,unused-ignore]
            import botocore.awsrequest  # type: ignore[import-untyped,unused-ignore]
            import botocore.credentials  # type: ignore[import-untyped,unused-ignore]
            import botocore.session  # type: ignore[import-untyped,unused-ignore]
        except ModuleNotFoundError as error:
            raise missing_extra(error, "bedrock", "guards.providers.Bedrock") from None
        self._auth = botocore.auth.SigV4Auth
        self._request = botocore.awsrequest.AWSRequest
        if (key_id is None) != (secret is None) or key_id == "" or secret == "":
            raise ConfigurationError("Bedrock needs both aws_access_key_id and aws_secret_access_key")
        session = botocore.session.Session(profile=profile)
        self.region: str | None = region or session.get_config_variable("region")
        if key_id is not None and secret is not None:
            self._credentials: Any = botocore.credentials.Credentials(key_id, secret, token)
        else:
            self._credentials = session.get_credentials()
        if self._credentials is None:
            raise ConfigurationError(
                "Bedrock found no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, a role, or AWS_BEARER_TOKEN_BEDROCK"
            )

    async def sign(self, url: str, body: bytes) -> dict[str, str]:
        """The SigV4 headers (`Authorization`, `X-Amz-Date`, `X-Amz-Security-Token`) of a POST
        of `body` to `url`; credentials near their expiry are refreshed in a thread (a refresh
        may call STS or the instance metadata service)."""
        credentials = self._credentials
        refresh_needed = getattr(credentials, "refresh_needed", None)
        if refresh_needed is not None and refresh_needed():
            frozen = await asyncio.to_thread(credentials.get_frozen_credentials)
        else:
            frozen = credentials.get_frozen_credentials()
        request = self._request(
            method="POST", url=url, data=body, headers={"content-type": "application/json"}
        )
        self._auth(frozen, SIGNING_NAME, self.region).add_auth(request)
        return {name: value for name, value in request.headers.items() if name.lower() != "content-type"}
