"""The status page's route: `GET /status` (`Guards.status_router()`), JSON for machines and one
self-contained HTML page for people, chosen by the request's `Accept` (`negotiate`), kept
private by an operator token (`OperatorToken`, `bearer_token`). What it shows, and where each
number comes from: `_report`; how it looks: `_html`. Read-only: a view reads the
store once and the counters, and writes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from ..contracts._errors import ConfigurationError
from ._html import CSP, render_html, render_sign_in
from ._report import StatusPage, StatusProblem, StatusReport

if typing.TYPE_CHECKING:
    from ..spec._shared import Shared

__all__ = ["OperatorToken", "StatusReport", "bearer_token", "negotiate", "status_router"]

#: An `Accept` header is read up to this many characters and media ranges (a bound, not a limit
#: any browser or client comes near).
_ACCEPT_CHARS = 4096
_ACCEPT_RANGES = 64


# --- content negotiation ---------------------------------------------------------------------------

#: How specific a media range is for each answer: the most specific range that matches decides
#: its quality (RFC 9110, 12.5.1).
_HTML_RANGES = {"text/html": 2, "application/xhtml+xml": 2, "text/*": 1, "*/*": 0}
_JSON_RANGES = {"application/json": 2, "application/*": 1, "*/*": 0}


def negotiate(accept: str | None) -> Literal["json", "html"] | None:
    """Which answer `accept` prefers: "html" when it rates HTML above JSON (a browser), "json"
    otherwise (no header, `*/*`, `application/json`, a tie), None when it accepts neither (406).
    Linear in the header, read up to 4,096 characters and 64 ranges."""
    if not accept:
        return "json"
    best = {"html": (-1, 0.0), "json": (-1, 0.0)}
    for part in accept[:_ACCEPT_CHARS].split(",")[:_ACCEPT_RANGES]:
        media, *params = part.split(";")
        media = media.strip().lower()
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value.strip())
                except ValueError:
                    quality = math.nan
        if not 0.0 <= quality <= 1.0:  # malformed (nan, inf, out of range): the range is ignored
            continue
        for answer, ranges in (("html", _HTML_RANGES), ("json", _JSON_RANGES)):
            rank = ranges.get(media)
            if rank is not None and rank > best[answer][0]:
                best[answer] = (rank, quality)
    html_q, json_q = best["html"][1], best["json"][1]
    if html_q > json_q:
        return "html"
    return "json" if json_q > 0 else ("html" if html_q > 0 else None)


# --- keeping it private ----------------------------------------------------------------------------


class OperatorToken:
    """An operator token, kept as its SHA-256 digest: `matches` takes the same time whatever
    was sent (digests of equal length, compared with `hmac.compare_digest`)."""

    __slots__ = ("_digest",)

    def __init__(self, token: str) -> None:
        if not token:
            raise ConfigurationError("an operator token must not be empty: it would admit nobody")
        self._digest = hashlib.sha256(token.encode()).digest()

    def matches(self, credentials: HTTPAuthorizationCredentials | None) -> bool:
        sent = credentials.credentials if credentials is not None else ""
        matched = hmac.compare_digest(hashlib.sha256(sent.encode()).digest(), self._digest)
        return credentials is not None and matched


#: The 401's answer: the scheme to use, and nothing a cache may keep.
_UNAUTHORIZED_HEADERS = {"www-authenticate": "Bearer", "cache-control": "no-store"}
_UNAUTHORIZED = "a valid operator token is required"


def bearer_token(token: str) -> HTTPBearer:
    """A FastAPI dependency that answers 401 (with `WWW-Authenticate: Bearer`) unless the
    request carries `Authorization: Bearer <token>`: `Depends(bearer_token(token))`, for any
    operator route (say, `/metrics`). The comparison takes the same time whatever token was
    sent. In an OpenAPI document it is an HTTP bearer security scheme. Raises
    `ConfigurationError` for an empty token."""
    return _BearerToken(OperatorToken(token))


class _BearerToken(HTTPBearer):
    def __init__(self, token: OperatorToken) -> None:
        super().__init__(auto_error=False, description="The operator token.")
        self._token = token

    async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
        credentials = await super().__call__(request)  # None: no header, or not `Bearer ...`
        if not self._token.matches(credentials):
            raise HTTPException(401, _UNAUTHORIZED, headers=_UNAUTHORIZED_HEADERS)
        return credentials


# --- the router ------------------------------------------------------------------------------------

#: Every answer of the page: it changes with each view and may be private.
_HEADERS = {"cache-control": "no-store", "vary": "Accept, Authorization"}
_HTML_HEADERS = {
    **_HEADERS,
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
_UNAUTHORIZED_HTML_HEADERS = {**_HTML_HEADERS, **_UNAUTHORIZED_HEADERS}


def status_router(
    shared: Shared,
    *,
    path: str,
    token: str | None,
    dependencies: Sequence[Any],
    refresh_s: float,
    window_s: float,
    include_in_schema: bool,
) -> APIRouter:
    """See `Guards.status_router`."""
    if not path.startswith("/"):
        raise ConfigurationError("the status page's path must start with '/'")
    if not refresh_s >= 1:
        raise ConfigurationError("refresh_s must be at least 1 (seconds between reloads of the page)")
    if not window_s >= 1:
        raise ConfigurationError("window_s must be at least 1 (seconds of recent counts)")
    page = StatusPage(shared, refresh_s=refresh_s, window_s=window_s)
    required = OperatorToken(token) if token is not None else None
    credentials_of = _credentials_of(required)
    router = APIRouter(dependencies=list(dependencies), lifespan=_copying(page))

    @router.get(
        path,
        include_in_schema=include_in_schema,
        response_model=StatusReport,
        summary="Status page",
        description="The service level, every model's breaker, cooldown and last failure, recent "
        "rates per route and today's spend: JSON (`application/json`, and the default), or one "
        "HTML page for a browser (`text/html` preferred in `Accept`).",
        responses=_responses(required),
    )
    async def status(
        request: Request,
        credentials: HTTPAuthorizationCredentials | None = Security(credentials_of),  # noqa: B008
    ) -> Response:
        answer = negotiate(request.headers.get("accept"))
        if required is not None and not required.matches(credentials):
            if answer == "html":
                refused = credentials is not None
                return HTMLResponse(
                    render_sign_in(refused), status_code=401, headers=_UNAUTHORIZED_HTML_HEADERS
                )
            return JSONResponse({"detail": _UNAUTHORIZED}, status_code=401, headers=_UNAUTHORIZED_HEADERS)
        if answer is None:
            return JSONResponse(
                {"detail": "ask for application/json or text/html"}, status_code=406, headers=_HEADERS
            )
        report = await page.report()
        if answer == "html":
            return HTMLResponse(render_html(report, window_s), headers=_HTML_HEADERS)
        return JSONResponse(report.model_dump(mode="json"), headers=_HEADERS)

    return router


def _credentials_of(required: OperatorToken | None) -> Any:
    """The page's dependency for its caller's credentials: with a token, one that parses
    `Authorization: Bearer ...` (None for anything else) and documents the bearer scheme in
    OpenAPI (the page checks the token itself, to answer a browser's 401 with the page that
    asks for it); without, one that reads nothing."""
    if required is not None:
        return HTTPBearer(auto_error=False, description="The operator token (STATUS_TOKEN).")

    async def no_credentials() -> None:
        return None

    return no_credentials


def _copying(page: StatusPage) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """The router's lifespan: the page's recent window fills from the app's start, not from
    its first view."""

    @asynccontextmanager
    async def copying(app: Any) -> AsyncIterator[None]:
        await page.history.start()
        try:
            yield
        finally:
            page.history.stop()

    return copying


def _responses(required: OperatorToken | None) -> dict[int | str, dict[str, Any]]:
    """The page's answers besides its JSON, as OpenAPI documents them."""
    responses: dict[int | str, dict[str, Any]] = {
        200: {"content": {"text/html": {"schema": {"type": "string"}}}},
        406: {
            "description": "The request accepts neither application/json nor text/html.",
            "model": StatusProblem,
        },
    }
    if required is not None:
        responses[401] = {
            "description": "No operator token, or a wrong one (`WWW-Authenticate: Bearer`); a "
            "browser gets the page that asks for it.",
            "model": StatusProblem,
            "content": {"text/html": {"schema": {"type": "string"}}},
            "headers": {"WWW-Authenticate": {"schema": {"type": "string", "const": "Bearer"}}},
        }
    return responses
