"""A degrading route's fallback envelope, prepared once: its bytes and their headers.

In an outage every request of a degrading route is refused alike (its breaker open or its model
cooling down, known to the worker): the same reason, detail and, when the fallback is static,
the same data. Returned as a model, the envelope would be validated against the route's
response model and serialized again by FastAPI for each request. The endpoint keeps instead, per
reason and detail, the data it last served and that envelope serialized as FastAPI serializes
it (pydantic's JSON, by alias), and answers each request with a `PreparedJSON`: those bytes,
their `content-length` and `content-type`, then the request's own headers (its trace id, which
model answered), in FastAPI's order. Only where FastAPI would render the envelope that way
(`renders_as_json`): a route declared with its own response class, status code, response model
or field filters gets the envelope model, for FastAPI to render as the route says.
"""

from __future__ import annotations

from typing import Any

from fastapi.datastructures import DefaultPlaceholder
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask
from starlette.responses import Response

__all__ = ["PreparedJSON", "json_head", "renders_as_json"]


class PreparedJSON(Response):
    """A JSON answer whose body, and the headers that describe it (`head`: `json_head`), were
    built before; `headers`, the request's own, follow them. `Response.__init__` (which renders
    the content and builds those headers) is not run."""

    media_type = "application/json"

    def __init__(
        self, body: bytes, head: list[tuple[bytes, bytes]], headers: list[tuple[bytes, bytes]], status: int
    ) -> None:
        self.status_code = status
        self.body = body
        self.background: BackgroundTask | None = None
        self.raw_headers = [*head, *headers]


def json_head(body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers Starlette's `Response` gives a JSON `body`: its length, its type."""
    return [(b"content-length", str(len(body)).encode("latin-1")), (b"content-type", b"application/json")]


def renders_as_json(route: object, envelope_type: Any) -> bool:
    """Whether FastAPI renders an envelope the endpoint of `route` (the `APIRoute` of the
    request's scope) returns as `PreparedJSON` does: its response model the envelope, status
    200, no response class of its own (FastAPI's `dump_json` path), no field filters."""
    return (
        isinstance(route, APIRoute)
        and route.response_model is envelope_type
        and isinstance(route.response_class, DefaultPlaceholder)
        and route.status_code in (None, 200)
        and route.response_model_include is None
        and route.response_model_exclude is None
        and route.response_model_by_alias
        and not route.response_model_exclude_unset
        and not route.response_model_exclude_defaults
        and not route.response_model_exclude_none
    )
