"""A resumable stream resumed on another worker: two apps served by uvicorn, each with its own
`RedisStore` on the session's Redis; a client cut after 10 events on the first resumes on the
second and gets events 11 onward exactly once, and the provider was called once. On both wires
(Workers AI and OpenAI-compatible fakes) and both stream formats (guards' events, the UI message
stream)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from fixtures import FakeOpenAI, FakeWorkersAI, Stream
from guards.stores import RedisStore

from ..conftest import STORE_TIMEOUT_S, LiveServer
from ..streams.test_resume import ASK, CHAT, MODEL, OPENAI, PARTS, app_of, cut_after_ten, events_of


@pytest.fixture
def workers(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, redis_url: str, prefix: str
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """Clients of two workers of one app, sharing one Redis (under this test's key prefix)."""

    def worker() -> FastAPI:
        store = RedisStore(redis_url, prefix=prefix, timeout_s=STORE_TIMEOUT_S)
        return app_of(fake_workers_ai, fake_openai, store=store)

    with LiveServer(worker()) as one, LiveServer(worker()) as two:
        headers = {"x-user-id": "ann"}
        with (
            httpx.Client(base_url=one.url, headers=headers, timeout=10) as first,
            httpx.Client(base_url=two.url, headers=headers, timeout=10) as second,
        ):
            yield first, second


@pytest.mark.parametrize(
    ("path", "server", "body"),
    [
        ("/stream", "fake_workers_ai", ASK),
        ("/openai/stream", "fake_openai", ASK),
        ("/chat", "fake_workers_ai", CHAT),
    ],
    ids=["workers-ai", "openai", "ui-message-stream"],
)
def test_a_stream_cut_on_one_worker_resumes_on_the_other(
    workers: tuple[httpx.Client, httpx.Client],
    path: str,
    server: str,
    body: dict[str, object],
    request: pytest.FixtureRequest,
) -> None:
    fake: FakeWorkersAI | FakeOpenAI = request.getfixturevalue(server)
    fake.script(MODEL if server == "fake_workers_ai" else OPENAI, Stream(parts=PARTS, interval_s=0.01))
    first, second = workers
    stream_id, seen = cut_after_ten(first, path, body)
    assert [e.id for e in seen] == [f"{stream_id}:{n}" for n in range(1, 11)]

    resumed = second.get(f"{path}/{stream_id}/stream", headers={"last-event-id": seen[-1].id})
    assert resumed.status_code == 200
    rest = events_of(resumed.text)
    ids = [e.id for e in seen + rest]
    assert ids == [f"{stream_id}:{n}" for n in range(1, len(ids) + 1)]  # 11 onward, exactly once
    if path == "/chat":
        assert rest[-1].data == "[DONE]"
        deltas = [json.loads(e.data) for e in seen + rest if e.data.startswith("{")]
        text = "".join(d["delta"] for d in deltas if d["type"] == "text-delta")
    else:
        assert rest[-1].name == "done"
        text = "".join(json.loads(e.data)["text"] for e in seen + rest if e.name == "delta")
    assert text == "".join(part.text for part in PARTS)
    assert len(fake.calls) == 1
