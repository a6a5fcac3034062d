"""A request's deadline runs from its arrival at the app, over real HTTP (uvicorn): the time to
take the request in (its body read, validation, routing) counts against its first walk's
`timeout_s`, so the deadline bounds what the client waits for; each later walk of the request
has its own `timeout_s` from its start.

The client sends the request's head, then its body `PAUSE_S` later (a client-side pause: the
server cannot start the walk before the body is in), so the intake's length is known.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import FakeBinding, Hang, Reply
from guards import AI, Budget, Guards

from ..conftest import Serve, assert_error

MODEL = "@cf/test/model"
#: How long after the request's head its body is sent.
PAUSE_S = 0.6
#: What an answer may take past the bound the test sets (a loaded 2-core machine).
SLACK_S = 0.3


class Ask(BaseModel):
    text: str


def make_app(fake: FakeBinding, timeout_s: float) -> FastAPI:
    guards = Guards(fake)
    app = FastAPI()
    guards.install(app)

    @app.post("/reply")
    @guards.route(model=MODEL, timeout_s=timeout_s, budget=Budget(per_day=1))
    async def reply(body: Ask, ai: AI[str]) -> str:
        return await ai.run({"prompt": body.text})

    @app.post("/two")
    @guards.route(model=MODEL, timeout_s=timeout_s)
    async def two(body: Ask, ai: AI[str]) -> str:
        first = await ai.run({"prompt": body.text})
        return first + await ai.run({"prompt": first})

    return app


def late_body(pause_s: float) -> Iterator[bytes]:
    """The request's body, sent `pause_s` after its head."""
    time.sleep(pause_s)  # the client's own pause: the intake the test needs
    yield Ask(text="Where is my parcel?").model_dump_json().encode()


def post_late(client: httpx.Client, path: str, pause_s: float = PAUSE_S) -> tuple[httpx.Response, float]:
    """`POST path` with its body sent `pause_s` after its head: the answer, and its seconds
    from before the head was sent."""
    body = Ask(text="Where is my parcel?").model_dump_json().encode()
    headers = {"content-type": "application/json", "content-length": str(len(body))}
    started = time.monotonic()
    response = client.post(path, content=late_body(pause_s), headers=headers)
    return response, time.monotonic() - started


def test_the_first_walk_s_deadline_counts_from_the_request_s_arrival(serve: Serve) -> None:
    fake = FakeBinding(Hang())
    timeout_s = 1.0
    response, seconds = post_late(serve(make_app(fake, timeout_s)), "/reply")
    assert_error(response, 503, "model_temporarily_unavailable", True)
    assert len(fake.calls) == 1  # time was left: the model was called
    # The deadline started when the head arrived, not once the body was in (PAUSE_S later).
    assert seconds <= timeout_s + SLACK_S, f"answered {seconds:.2f}s after arrival"


def test_a_request_past_its_deadline_before_its_first_call_is_not_sent_nor_charged(serve: Serve) -> None:
    fake = FakeBinding(Reply("On its way."))
    client = serve(make_app(fake, timeout_s=0.4))
    response, seconds = post_late(client, "/reply")
    assert_error(response, 503, "model_temporarily_unavailable", True)
    assert seconds <= PAUSE_S + SLACK_S  # answered once the body was in
    assert fake.calls == []
    # Nothing was charged: the budget's one request a day is still there.
    served = client.post("/reply", json={"text": "Where is my parcel?"})
    assert served.status_code == 200, served.text
    assert len(fake.calls) == 1


def test_each_later_walk_has_its_own_deadline_from_its_start(serve: Serve) -> None:
    fake = FakeBinding()
    # First walk: from arrival, PAUSE_S + 0.1 s of the 1 s. The second's 0.6 s would pass the
    # first walk's deadline, but not its own.
    fake.script(MODEL, Reply("On its way.", delay_s=0.1), Reply(" Soon.", delay_s=0.6))
    response, _ = post_late(serve(make_app(fake, timeout_s=1.0)), "/two")
    assert response.status_code == 200, response.text
    assert response.json() == "On its way. Soon."
