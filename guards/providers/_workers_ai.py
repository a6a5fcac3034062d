"""Cloudflare Workers AI over its REST API (PROTOCOLS.md, "Cloudflare Workers AI").

Every failure shape ends as a `ProviderError` with the provider's code and the HTTP status:
`success: false` even with HTTP 200, the `AiError` object shape, non-JSON bodies (a proxy's HTML
on 5xx), oversized bodies and dropped connections. Provider messages are read only to spot
"JSON Mode couldn't be met"; they are never kept (they may echo the prompt).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

from .._binding import AIResult, Usage
from .._errors import ConfigurationError, ProviderError
from ._http import DEFAULT_MAX_BODY_BYTES, new_client, parse_retry_after, read_capped, transport_error

__all__ = ["WorkersAI", "parse_workers_ai_response"]

DEFAULT_BASE_URL = "https://api.cloudflare.com/client/v4"
PROVIDER = "workers-ai"


class WorkersAI:
    """A binding that runs Workers AI models through `POST {base}/accounts/{id}/ai/run/{model}`.

    Pass an `httpx.AsyncClient` to share one across bindings; otherwise the binding makes its own
    and closes it in `aclose`. Bodies are read up to `max_body_bytes`.
    """

    def __init__(
        self,
        *,
        account_id: str,
        api_token: str,
        base_url: str = DEFAULT_BASE_URL,
        client: httpx.AsyncClient | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        missing = [
            name for name, value in (("account_id", account_id), ("api_token", api_token)) if not value
        ]
        if missing:
            raise ConfigurationError(f"WorkersAI needs {' and '.join(missing)}")
        self._url = f"{base_url.rstrip('/')}/accounts/{account_id}/ai/run/"
        self._headers = {"authorization": f"Bearer {api_token}"}
        self._owns_client = client is None
        self._client = client or new_client()
        self._max_body_bytes = max_body_bytes

    def __repr__(self) -> str:  # never show the token
        return f"WorkersAI(url={self._url!r})"

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        try:
            async with self._client.stream(
                "POST", self._url + quote(model, safe="/@:"), json=dict(inputs), headers=self._headers
            ) as response:
                body = await read_capped(response, PROVIDER, self._max_body_bytes)
        except httpx.HTTPError as exc:
            raise transport_error(PROVIDER, exc) from None
        return parse_workers_ai_response(
            response.status_code, body, model=model, retry_after=response.headers.get("retry-after")
        )

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def parse_workers_ai_response(
    status: int, body: bytes, *, model: str, retry_after: str | None = None
) -> AIResult:
    """Turn one Workers AI HTTP answer into a result, or raise `ProviderError`."""
    wait = parse_retry_after(retry_after)
    try:
        data = json.loads(body)
    except ValueError:
        raise ProviderError(PROVIDER, status=status, retry_after_s=wait, note="non-JSON body") from None
    if not isinstance(data, dict):
        raise ProviderError(PROVIDER, status=status, retry_after_s=wait, note="unexpected body")
    errors = _errors(data)
    result = data.get("result")
    if status < 400 and data.get("success") is not False and not errors and isinstance(result, dict):
        return AIResult(
            response=result.get("response"),
            model=model,
            usage=_usage(result.get("usage")),
            tool_calls=tuple(t for t in result.get("tool_calls") or () if isinstance(t, dict)),
        )
    code = next((e["code"] for e in errors if isinstance(e.get("code"), int)), None)
    messages = " ".join(str(e.get("message", "")) for e in errors)
    raise ProviderError(
        PROVIDER,
        code=code,
        status=status,
        retry_after_s=wait,
        json_mode_failed="json mode couldn't be met" in messages.lower().replace("\u2019", "'"),
    )


def _errors(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The error objects of any known failure shape: `errors` (REST), `error` (AI Gateway), or
    the `AiError` object itself."""
    found = data.get("errors") or data.get("error") or []
    if isinstance(found, dict):
        found = [found]
    errors = [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []
    if data.get("name") == "AiError" or "internalCode" in data:
        code = data.get("internalCode")
        message = f"{data.get('description', '')} {data.get('message', '')}"
        errors.append({"code": code if isinstance(code, int) else None, "message": message})
    return errors


def _usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    numbers = {k: raw.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return Usage(**{k: v for k, v in numbers.items() if isinstance(v, int)})
