"""A degrading route refused in an outage (its breaker open, known to the worker) answers its
fallback envelope prepared once: the same bytes and headers FastAPI serves for that envelope,
with the request's own trace id, but serialized once per route, reason and fallback rather than validated
and serialized again for every request. Served for real (uvicorn on a loopback port)."""

from __future__ import annotations

from typing import Any

from fastapi import BackgroundTasks, FastAPI
from pydantic import BaseModel, field_serializer

from fixtures import Fail, FakeBinding
from guards import AI, Breaker, Envelope, FallbackInfo, GuardName, Guards, Reason, Retry

from ..conftest import Serve, assert_fallback

MODEL = "@cf/test/model"
#: Breaks at once and stays open for the test: every request after the first is refused.
BREAKER = Breaker(failure_threshold=1, reset_timeout_s=3600.0)
SKIPPED = f"every model was skipped: {MODEL}: skipped (circuit_open)"


class Label(BaseModel):
    label: str
    confidence: float

    @field_serializer("label")
    def _counted(self, label: str) -> str:
        SERIALIZED.append(label)  # each serialization of a `Label`, counted
        return label


SERIALIZED: list[str] = []
FALLBACK = Label(label="unknown", confidence=0.0)


def outage_app(declared: dict[str, Any] | None = None, **route: Any) -> tuple[FastAPI, list[str]]:
    """A degrading route on a model that always fails (its breaker opens at the first failure),
    its fallback the static `FALLBACK`; the handler adds a background task (what it ran: the
    list returned) before its call. `declared`: the FastAPI route's own options.
    `/bare` serves the refused envelope from FastAPI alone."""
    guards = Guards(FakeBinding(Fail(status=500)), **route)
    app = FastAPI()
    guards.install(app)
    ran: list[str] = []

    @app.post("/label", **(declared or {}))
    @guards.route(model=MODEL, breaker=BREAKER, retry=Retry(attempts=1), fallback=FALLBACK)
    async def label(ai: AI[Label], tasks: BackgroundTasks) -> Label:
        tasks.add_task(ran.append, "task")
        return await ai.run({"prompt": "label this"})

    @app.post("/bare")
    async def bare() -> Envelope[Label]:
        info = FallbackInfo(guard=GuardName.budget, reason=Reason.circuit_open, detail=SKIPPED)
        return Envelope[Label](data=FALLBACK, fallback=info)

    return app, ran


def test_an_outage_serializes_the_fallback_envelope_once(serve: Serve) -> None:
    app, ran = outage_app()
    client = serve(app)
    data = {"label": "unknown", "confidence": 0.0}
    assert_fallback(client.post("/label"), "call", "provider_error", data)  # opens the breaker
    before = len(SERIALIZED)
    refused = [client.post("/label") for _ in range(3)]
    assert len(SERIALIZED) - before == 1  # prepared once, for the three
    bare = client.post("/bare")
    for answer in refused:
        assert_fallback(answer, "budget", "circuit_open", data)
        assert answer.content == bare.content  # FastAPI's own bytes for that envelope
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["content-length"] == str(len(bare.content))
    trace_ids = {answer.headers["x-trace-id"] for answer in refused}
    assert len(trace_ids) == 3  # each request's own
    assert ran == ["task"] * 4  # the handler's background tasks run, refused or not


def test_the_refused_answer_has_fastapis_headers_and_its_trace_id(serve: Serve) -> None:
    """FastAPI's headers for the envelope, in its order, then the request's trace id (a refused
    request names no model), then the service level (guards' middleware)."""
    app, _ = outage_app()
    client = serve(app)
    client.post("/label")
    answer = client.post("/label", headers={"x-trace-id": "trace-0123456789"})
    assert answer.headers.multi_items() == [
        ("date", answer.headers["date"]),
        ("server", "uvicorn"),
        ("content-length", str(len(answer.content))),
        ("content-type", "application/json"),
        ("x-trace-id", "trace-0123456789"),
        ("x-service-level", "minimal"),
    ]


def test_a_route_declared_with_its_own_status_is_rendered_by_fastapi(serve: Serve) -> None:
    """A route declared with a status code of its own (or its own response class, response
    model, field filters) gets the envelope rendered by FastAPI, as the declaration says."""
    app, _ = outage_app({"status_code": 202})
    client = serve(app)
    client.post("/label")
    before = len(SERIALIZED)
    refused = [client.post("/label") for _ in range(2)]
    assert len(SERIALIZED) - before == 2  # FastAPI's, for each
    for answer in refused:
        assert answer.status_code == 202
        assert answer.json()["fallback"]["reason"] == "circuit_open"


class Ticket(BaseModel):
    text: str


def by_ticket(arguments: dict[str, Any], tripped: Any) -> Label:
    """A fallback function: a new value each request, from the request's own ticket; `0.0` and
    `-0.0` are equal values with different JSON."""
    text = arguments["ticket"].text
    return Label(label=text.lstrip("-"), confidence=-0.0 if text.startswith("-") else 0.0)


def test_a_fallback_functions_value_is_each_requests_own(serve: Serve) -> None:
    """The prepared envelope answers a fallback function's new value only when it serializes
    the same: every refused request gets its own data, in FastAPI's own bytes."""
    guards = Guards(FakeBinding(Fail(status=500)))
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, breaker=BREAKER, retry=Retry(attempts=1), fallback=by_ticket)
    async def label(ticket: Ticket, ai: AI[Label]) -> Label:
        return await ai.run({"prompt": ticket.text})

    @app.post("/bare")
    async def bare(ticket: Ticket) -> Envelope[Label]:
        info = FallbackInfo(guard=GuardName.budget, reason=Reason.circuit_open, detail=SKIPPED)
        return Envelope[Label](data=by_ticket({"ticket": ticket}, None), fallback=info)

    client = serve(app)
    client.post("/label", json={"text": "opens the breaker"})
    for text in ["a", "a", "b", "a", "-x", "x", "-x", "x"]:
        answer = client.post("/label", json={"text": text})
        assert answer.content == client.post("/bare", json={"text": text}).content, text
        assert answer.headers["content-length"] == str(len(answer.content))
        assert_fallback(answer, "budget", "circuit_open", {"label": text.lstrip("-"), "confidence": 0.0})
