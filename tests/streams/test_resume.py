"""Resumable streams over real HTTP (`route(resumable=Resumable(...))`): every event carries an
id; a client cut after 10 events resumes with `Last-Event-ID` at `GET <path>/<id>/stream` and
gets events 11 onward exactly once, the provider called once; a chat's stream is resumed by its
chat id (the AI SDK's request), replayed from its start; a client leaving does not cancel the
stream; and the bounds: the largest kept stream (its caps end a resume with `error`), the time
it lives (past its TTL: 204), the store writes per event.

Both wires stream here: Workers AI (`fake_workers_ai`) and OpenAI-compatible (`fake_openai`),
each counting the calls it received."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Response
from pydantic import BaseModel

from fixtures import FakeBinding, FakeOpenAI, FakeWorkersAI, ManualClock, Stream, Text
from guards import (
    AI,
    UI_MESSAGE_STREAM,
    Breaker,
    Budget,
    ConfigurationError,
    EventStream,
    Guards,
    Resumable,
    UIChatRequest,
    header_key,
    render_metrics,
)
from guards.providers import OpenAICompatible, WorkersAI
from guards.stores import MemoryStore, SQLiteStore, Store

from ..conftest import STORE_TIMEOUT_S, AppClient, LiveServer, guards_samples, no_sleep

MODEL = "@cf/test/model"
OPENAI = "gpt-4o-mini"
#: 30 pieces of text, a little apart: a client can leave in the middle.
DEFAULT = Resumable()
PARTS = tuple(Text(f"word{i} ") for i in range(30))


class Ask(BaseModel):
    message: str


@dataclass
class Event:
    id: str
    name: str  # "message" for the UI message stream's unnamed events
    data: str


def parse(block: str) -> Event:
    fields: dict[str, str] = {}
    for line in block.split("\n"):
        name, _, value = line.partition(": ")
        fields[name] = value
    return Event(fields.get("id", ""), fields.get("event", "message"), fields["data"])


def events_of(body: str) -> list[Event]:
    return [parse(block) for block in body.split("\n\n") if block.strip()]


def read_some(response: httpx.Response, count: int) -> list[Event]:
    """The first `count` events of a streamed response (then the caller leaves)."""
    got: list[Event] = []
    buffer = ""
    for text in response.iter_text():
        buffer += text
        while "\n\n" in buffer and len(got) < count:
            block, buffer = buffer.split("\n\n", 1)
            got.append(parse(block))
        if len(got) >= count:
            return got
    return got


def text_of(events: list[Event]) -> str:
    return "".join(json.loads(e.data)["text"] for e in events if e.name == "delta")


def app_of(
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    *,
    store: Store | None = None,
    resumable: Resumable = DEFAULT,
    stream_max_s: float = 300.0,
) -> FastAPI:
    guards = Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        ),
        providers={"openai": OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)},
        store=store,
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)
    budget = Budget(per_minute=1000, key=header_key("x-user-id"))
    options: dict[str, Any] = {
        "timeout_s": 5,
        "breaker": Breaker(failure_threshold=100),
        "budget": budget,
        "resumable": resumable,
        "stream_max_s": stream_max_s,
    }

    @app.post("/stream")
    @guards.route(model=MODEL, **options)
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream({"messages": [{"role": "user", "content": body.message}]})

    @app.post("/openai/stream")
    @guards.route(model=f"openai:{OPENAI}", **options)
    async def openai_stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream({"messages": [{"role": "user", "content": body.message}]})

    @app.post("/chat")
    @guards.route(model=MODEL, stream_format=UI_MESSAGE_STREAM, **options)
    async def chat(body: UIChatRequest, ai: AI[str]) -> EventStream:
        return await ai.stream(body.inputs())

    @app.get("/metrics")
    def metrics() -> Response:
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    return app


@pytest.fixture
def make_client(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, app_client: AppClient
) -> Callable[..., httpx.Client]:
    def make(**options: Any) -> httpx.Client:
        client = app_client(app_of(fake_workers_ai, fake_openai, **options), socket=True)
        client.headers["x-user-id"] = "ann"
        return client

    return make


@pytest.fixture
def client(make_client: Callable[..., httpx.Client]) -> httpx.Client:
    return make_client()


ASK = {"message": "Where is my parcel?"}
CHAT = {"id": "chat-7", "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "Hi"}]}]}


def cut_after_ten(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, list[Event]]:
    """POST `path`, read 10 events and leave: the stream id and the events read."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-stream-id"]
        return stream_id, read_some(response, 10)


@pytest.mark.parametrize(
    ("path", "server"), [("/stream", "fake_workers_ai"), ("/openai/stream", "fake_openai")]
)
def test_a_client_cut_after_ten_events_resumes_at_the_eleventh_exactly_once(
    client: httpx.Client, path: str, server: str, request: pytest.FixtureRequest
) -> None:
    fake: FakeWorkersAI | FakeOpenAI = request.getfixturevalue(server)
    model = MODEL if server == "fake_workers_ai" else OPENAI
    fake.script(model, Stream(parts=PARTS, interval_s=0.01))
    stream_id, first = cut_after_ten(client, path, ASK)
    assert [e.id for e in first] == [f"{stream_id}:{n}" for n in range(1, 11)]

    resumed = client.get(f"{path}/{stream_id}/stream", headers={"last-event-id": first[-1].id})
    assert resumed.status_code == 200
    assert resumed.headers["content-type"].startswith("text/event-stream")
    rest = events_of(resumed.text)
    assert [e.id for e in rest] == [f"{stream_id}:{n}" for n in range(11, len(rest) + 11)]
    assert rest[-1].name == "done"
    assert text_of(first + rest) == "".join(p.text for p in PARTS)
    assert len(fake.calls) == 1  # the upstream was called once for the stream

    # Without Last-Event-ID: the whole stream again, the same events.
    whole = events_of(client.get(f"{path}/{stream_id}/stream").text)
    assert [e.id for e in whole] == [e.id for e in first + rest]
    # With the last event's id: nothing left, 204 (an EventSource stops reconnecting).
    done = client.get(f"{path}/{stream_id}/stream", headers={"last-event-id": rest[-1].id})
    assert done.status_code == 204
    assert len(fake.calls) == 1


def test_a_chats_stream_is_resumed_by_its_chat_id_from_its_start(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=PARTS, interval_s=0.01))
    stream_id, first = cut_after_ten(client, "/chat", CHAT)
    assert json.loads(first[0].data) == {"type": "start"}
    assert all(e.id.startswith(f"{stream_id}:") for e in first)

    resumed = client.get("/chat/chat-7/stream")  # what DefaultChatTransport sends
    assert resumed.status_code == 200
    assert resumed.headers["x-vercel-ai-ui-message-stream"] == "v1"
    replay = events_of(resumed.text)
    assert [e.id for e in replay[:10]] == [e.id for e in first]
    assert replay[-1].data == "[DONE]"
    assert json.loads(replay[-2].data)["type"] == "finish"
    assert len(fake_workers_ai.calls) == 1

    # Another caller (another budget key) finds nothing under the same chat id.
    other = client.get("/chat/chat-7/stream", headers={"x-user-id": "bob"})
    assert other.status_code == 204
    # A chat with no stream: 204, as the AI SDK expects.
    assert client.get("/chat/chat-8/stream").status_code == 204


def test_a_client_leaving_does_not_cancel_a_resumable_stream(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=PARTS, interval_s=0.01))
    stream_id, first = cut_after_ten(client, "/stream", ASK)
    # The resume follows the live stream to its end: the provider's call ran to completion.
    rest = events_of(client.get(f"/stream/{stream_id}/stream", headers={"last-event-id": first[-1].id}).text)
    assert rest[-1].name == "done"
    assert not fake_workers_ai.calls[0].disconnected


def test_a_bad_last_event_id_is_a_400_that_names_the_header(client: httpx.Client) -> None:
    answer = client.get("/stream/abc/stream", headers={"last-event-id": "not an id"})
    assert answer.status_code == 400
    assert answer.json()["problems"] == [{"field": "header.last-event-id", "problem": "value_error"}]


#: The bytes of the first 12 events of `PARTS`, as kept (a stream id has 22 characters).
TWELVE_BYTES = sum(
    len(f'id: {"x" * 22}:{n}\nevent: delta\ndata: {{"text":"word{n - 1} "}}\n\n') for n in range(1, 13)
)


@pytest.mark.parametrize(
    ("caps", "detail"),
    [
        (Resumable(max_events=12), "12 events"),
        (Resumable(max_bytes=TWELVE_BYTES), f"{TWELVE_BYTES} bytes"),
    ],
    ids=["events", "bytes"],
)
def test_past_its_caps_a_resume_ends_with_the_documented_error(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI, caps: Resumable, detail: str
) -> None:
    client = make_client(resumable=caps)
    # At once: the stream is over, its caps passed, before the client has read 10 events.
    fake_workers_ai.script(MODEL, Stream(parts=PARTS))
    stream_id, first = cut_after_ten(client, "/stream", ASK)
    resumed = client.get(f"/stream/{stream_id}/stream", headers={"last-event-id": first[-1].id})
    rest = events_of(resumed.text)
    assert [e.id for e in rest] == [f"{stream_id}:{n}" for n in (11, 12, 13)]
    assert [e.name for e in rest] == ["delta", "delta", "error"]
    error = json.loads(rest[-1].data)
    assert (error["guard"], error["reason"]) == ("call", "provider_error")
    assert detail in error["detail"]
    assert error["trace_id"] == resumed.headers["x-trace-id"]
    assert len(fake_workers_ai.calls) == 1


def test_past_its_ttl_a_resume_is_204_and_never_a_second_call(
    make_client: Callable[..., httpx.Client], fake_workers_ai: FakeWorkersAI
) -> None:
    clock = ManualClock()
    client = make_client(store=MemoryStore(clock=clock), resumable=Resumable(ttl_s=60))
    fake_workers_ai.script(MODEL, Stream(parts=PARTS[:3]))
    whole = client.post("/stream", json=ASK)
    stream_id = whole.headers["x-stream-id"]
    first = events_of(whole.text)
    assert first[-1].name == "done"
    clock.advance(59)
    kept = client.get(f"/stream/{stream_id}/stream", headers={"last-event-id": first[0].id})
    assert [e.id for e in events_of(kept.text)] == [e.id for e in first[1:]]
    clock.advance(2)  # 61 s after its end
    gone = client.get(f"/stream/{stream_id}/stream", headers={"last-event-id": first[0].id})
    assert gone.status_code == 204
    assert len(fake_workers_ai.calls) == 1


def test_events_that_come_together_are_kept_in_one_store_write(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    # 200 parts at once (no interval): far fewer writes than events, never more.
    fake_workers_ai.script(MODEL, Stream(parts=tuple(Text("x") for _ in range(200))))
    before = guards_samples(client)
    body = client.post("/stream", json=ASK).text
    events = len(events_of(body))
    after = guards_samples(client)

    def grown(what: str) -> float:
        key = ("guards_stream_kept_total", (("route", "stream"), ("what", what)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grown("events") == events
    assert 1 <= grown("writes") <= events / 4


def test_a_stream_still_produced_when_the_app_stops_ends_with_its_error_kept(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, tmp_path: Path
) -> None:
    """The app's shutdown (`Guards.aclose`, in its lifespan) ends a resumable stream whose client
    left with its `error` event, kept: another worker's resume gets it."""

    def worker() -> FastAPI:
        store = SQLiteStore(tmp_path / "guards.db", timeout_s=STORE_TIMEOUT_S)
        app = app_of(fake_workers_ai, fake_openai, store=store)
        guards = Guards.of(app)

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            yield
            await guards.aclose()

        app.router.lifespan_context = lifespan
        return app

    fake_workers_ai.script(MODEL, Stream(parts=PARTS[:3], endless=True, interval_s=0.01))
    with LiveServer(worker()) as one, httpx.Client(base_url=one.url, headers={"x-user-id": "ann"}) as first:
        stream_id, seen = cut_after_ten(first, "/stream", ASK)
    # The first worker has stopped, its stream ended by its shutdown.
    with LiveServer(worker()) as two, httpx.Client(base_url=two.url, headers={"x-user-id": "ann"}) as second:
        rest = events_of(
            second.get(f"/stream/{stream_id}/stream", headers={"last-event-id": seen[-1].id}).text
        )
    assert rest[-1].name == "error"
    assert json.loads(rest[-1].data)["detail"] == (
        "the server is stopping: the stream was cut at the end of its graceful shutdown"
    )
    assert [e.id for e in seen + rest] == [f"{stream_id}:{n}" for n in range(1, len(rest) + 11)]
    assert len(fake_workers_ai.calls) == 1


def test_a_resumable_route_is_declared_right() -> None:
    guards = Guards(FakeBinding())
    with pytest.raises(ConfigurationError, match="max_events"):
        Resumable(max_events=0)
    with pytest.raises(ConfigurationError, match="only a streaming route"):

        @guards.route(model=MODEL, resumable=Resumable())
        async def whole(body: Ask, ai: AI[str]) -> str:
            return await ai.run({"prompt": body.message})


def test_the_openapi_document_has_the_resume_route(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    document = app_of(fake_workers_ai, fake_openai).openapi()
    resume = document["paths"]["/chat/{id}/stream"]["get"]
    assert set(resume["responses"]) == {"200", "204", "400"}
    assert "text/event-stream" in resume["responses"]["200"]["content"]
    assert [p["name"] for p in resume["parameters"]] == ["id", "last-event-id"]
    assert "x-stream-id" in document["paths"]["/chat"]["post"]["responses"]["200"]["headers"]
