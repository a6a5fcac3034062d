"""A degrading route's fallback envelope, prepared once: its bytes and their headers.

In an outage every request of a degrading route is refused alike (its breaker open or its model
cooling down, known to the worker): the same reason, detail and, when the fallback is static,
the same data. Returned as a model, the envelope would be validated against the route's
response model and serialized again by FastAPI for each request. The endpoint keeps instead
(`FallbackAnswers`), per reason and detail, the data it last served and that envelope serialized
as FastAPI serializes it (pydantic's JSON, by alias), and answers each request with a
`PreparedJSON`: those bytes, their `content-length` and `content-type`, then the request's own
headers (its trace id, which model answered), in FastAPI's order. A fallback function makes a
new value for each request, most often the same one: the bytes answer a new value that
serializes as the kept one does (compared as JSON, not with `==`: `0.0 == -0.0`, `1 == True`).
Only where FastAPI would render the envelope that way (`renders_as_json`): a route declared
with its own response class, status code, response model or field filters gets the envelope
model, for FastAPI to render as the route says.
"""

from __future__ import annotations

from typing import Any

from fastapi.datastructures import DefaultPlaceholder
from fastapi.routing import APIRoute
from pydantic import TypeAdapter
from starlette.background import BackgroundTask
from starlette.responses import Response

from ..contracts._envelope import FallbackInfo
from ..contracts._vocabulary import Reason

__all__ = ["FallbackAnswers", "PreparedJSON", "json_head", "renders_as_json"]

#: The most fallback envelopes a route keeps.
_MAX_ANSWERS = 64


class _Kept:
    """A kept fallback answer: its data, the envelope, and when prepared the envelope's JSON
    with its headers, and the data's own JSON when the data is made per request."""

    __slots__ = ("body", "data", "envelope", "head", "own")

    def __init__(self, data: Any, envelope: Any, body: bytes | None, own: bytes | None) -> None:
        self.data, self.envelope, self.body, self.own = data, envelope, body, own
        self.head = json_head(body) if body is not None else []


class FallbackAnswers:
    """A degrading route's fallback envelopes (`envelope_type` of the data `data_adapter`
    validates), kept per reason and detail, prepared where FastAPI would render them as JSON;
    `made`: whether its fallback data is made per request (a function, or the last good
    answer), else the same object every time."""

    __slots__ = ("_answers", "_envelope_type", "_made", "_prepared", "_rendered_by", "_serializer")

    def __init__(self, envelope_type: Any, data_adapter: TypeAdapter[Any], made: bool) -> None:
        self._envelope_type = envelope_type
        self._serializer = data_adapter.serializer
        self._made = made
        self._answers: dict[tuple[Reason, str], _Kept] = {}
        #: The FastAPI route that last served a fallback, and whether it renders the envelope
        #: as a `PreparedJSON` does (`renders_as_json`): checked once per route.
        self._rendered_by: object = None
        self._prepared = False

    def answer(self, route: object, reason: Reason, detail: str, data: Any, response: Response) -> Any:
        """The answer of `data` substituted for `reason` (`detail`) on `route` (the request's
        `APIRoute`), with `response`'s headers and status: a `PreparedJSON`, else the envelope
        for FastAPI to render. A new `data` that serializes as the kept one's (`own`) shares
        its bytes."""
        if route is not self._rendered_by:
            self._rendered_by, self._prepared = route, renders_as_json(route, self._envelope_type)
        prepared = self._prepared
        kept = self._answers.get((reason, detail))
        if kept is None or (prepared and kept.body is None) or kept.data is not data:
            own = self._serializer.to_json(data, by_alias=True) if prepared and self._made else None
            if kept is None or own is None or own != kept.own or kept.body is None:
                kept = self._keep(reason, detail, data, prepared, own)
        if kept.body is None or not prepared:
            return kept.envelope
        return PreparedJSON(kept.body, kept.head, response.raw_headers, response.status_code or 200)

    def _keep(self, reason: Reason, detail: str, data: Any, prepared: bool, own: bytes | None) -> _Kept:
        """The envelope of `data` and, when `prepared`, its JSON as FastAPI serializes it (by
        alias) with their headers, built and kept with `own` (the data's JSON), never written
        after: the requests refused alike share them (emptied when full)."""
        info = FallbackInfo(guard=reason.guard, reason=reason, detail=detail)
        envelope = self._envelope_type(ok=True, data=data, fallback=info)
        body = envelope.__pydantic_serializer__.to_json(envelope, by_alias=True) if prepared else None
        kept = _Kept(data, envelope, body, own)
        if len(self._answers) >= _MAX_ANSWERS:
            self._answers.clear()
        self._answers[(reason, detail)] = kept
        return kept


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
