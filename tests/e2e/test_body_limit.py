"""Request bodies: a guarded route stops reading past its `max_body_bytes` (default 1 MiB).

Over real HTTP through uvicorn, with a raw client that sends a body piece by piece and stops as
soon as the answer arrives: a declared length over the limit is answered `400
invalid_request` before the body is sent, a chunked body once it passes the limit, and the
worker's memory stays where it was for a 100 MB body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from app.service import create_app
from fixtures import FakeBinding, FakeWorkersAI, Reply
from guards import AI, ConfigurationError, Guards
from guards.providers import WorkersAI

from ..conftest import LogLines, Serve, assert_error, no_sleep, workers_ai_settings
from .test_shared_state import AppProcess, app_process_env

MiB = 1 << 20
#: How long a client waits for an answer before the test gives up on it.
ANSWER_LIMIT_S = 30.0
PREFIX, SUFFIX = b'{"message": "', b'"}'


def json_body(size: int, piece: int = 64 * 1024) -> Iterator[bytes]:
    """A JSON object `{"message": "aaa..."}` of exactly `size` bytes, in pieces."""
    yield PREFIX
    left = size - len(PREFIX) - len(SUFFIX)
    block = b"a" * piece
    while left > 0:
        yield block[:left]
        left -= piece
    yield SUFFIX


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, Any]:
    """One HTTP/1.1 answer: its status and JSON body (declared length or chunked)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
    status = int(head.split(" ", 2)[1])
    if "transfer-encoding: chunked" in head:
        size = int((await reader.readline()).strip(), 16)
        payload = await reader.readexactly(size)
    else:
        size = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
        payload = await reader.readexactly(size)
    return status, json.loads(payload)


async def post_body(url: str, size: int, *, chunked: bool) -> tuple[int, Any, int]:
    """POST a `size`-byte JSON body to `url` (`http://host:port/path`) with a declared length
    or chunked, sending until the answer arrives. Returns (status, JSON body, bytes sent)."""
    parsed = httpx.URL(url)
    reader, writer = await asyncio.open_connection(parsed.host, parsed.port)
    head = f"POST {parsed.path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
    head += "transfer-encoding: chunked\r\n" if chunked else f"content-length: {size}\r\n"
    writer.write(f"{head}\r\n".encode())
    answer = asyncio.ensure_future(read_answer(reader))
    sent = 0
    try:
        async with asyncio.timeout(ANSWER_LIMIT_S):
            for piece in json_body(size):
                if answer.done():
                    break
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
                drained = asyncio.ensure_future(writer.drain())
                await asyncio.wait({drained, answer}, return_when=asyncio.FIRST_COMPLETED)
                drained.cancel()
            else:
                if chunked:
                    writer.write(b"0\r\n\r\n")
            status, body = await answer
    except ConnectionError:
        status, body = await answer  # the server closed while we were sending: it answered first
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return status, body, sent


class Message(BaseModel):
    message: str


def limited_app(fake: FakeWorkersAI) -> FastAPI:
    """A guarded route with a 100-byte limit, one with the default, one without any, and a
    route that is not guarded."""
    guards = Guards(
        WorkersAI(account_id=fake.account_id, api_token=fake.api_token, base_url=fake.base_url),
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/small")
    @guards.route(model="@cf/test/model", max_body_bytes=100)
    async def small(body: Message, ai: AI[str]) -> str:
        return await ai.run({"prompt": body.message[:20]})

    @app.post("/default")
    @guards.route(model="@cf/test/model")
    async def default(body: Message, ai: AI[str]) -> str:
        return await ai.run({"prompt": body.message[:20]})

    @app.post("/unlimited")
    @guards.route(model="@cf/test/model", max_body_bytes=None)
    async def unlimited(body: Message, ai: AI[str]) -> int:
        return len(body.message)

    @app.post("/plain")
    async def plain(request: Request) -> int:
        return len(await request.body())

    return app


@pytest.fixture
def served(fake_workers_ai: FakeWorkersAI, serve: Serve) -> str:
    fake_workers_ai.default = Reply("Hello!")
    return str(serve(limited_app(fake_workers_ai)).base_url)


def body_of(size: int) -> bytes:
    return b"".join(json_body(size))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_at_the_limit_is_read_and_one_byte_more_is_400(
    served: str, chunked: bool, fake_workers_ai: FakeWorkersAI, guards_log: LogLines
) -> None:
    status, body, _ = asyncio.run(post_body(f"{served}/small", 100, chunked=chunked))
    assert (status, body) == (200, "Hello!")
    status, body, _ = asyncio.run(post_body(f"{served}/small", 101, chunked=chunked))
    assert status == 400
    assert body == {
        "error": "invalid_request",
        "retryable": False,
        "trace_id": body["trace_id"],
        "problems": [{"field": "body", "problem": "too_long"}],
    }
    assert len(fake_workers_ai.calls) == 1
    lines = [line for line in guards_log.events("request") if line["status"] == 400]
    assert [(line["route"], line["trace_id"], line["attempts"]) for line in lines] == [
        ("small", body["trace_id"], 0)
    ]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_default_limit_is_answered_before_it_is_sent(served: str, chunked: bool) -> None:
    """1 MiB by default. A declared length over it is refused before the body is read, a chunked
    body once it passes it: the client, sending 100 MB, stops long before the end. (What it
    counts as sent includes what the two sockets' buffers hold: a few MB on loopback.)"""
    status, body, _ = asyncio.run(post_body(f"{served}/default", MiB, chunked=chunked))
    assert (status, body) == (200, "Hello!")
    status, body, sent = asyncio.run(post_body(f"{served}/default", 100 * MiB, chunked=chunked))
    assert_error(_response(status, body), 400, "invalid_request", False)
    assert sent < 20 * MiB


def _response(status: int, body: Any) -> httpx.Response:
    return httpx.Response(status, json=body, headers={"x-trace-id": body["trace_id"]})


def test_routes_without_a_limit_read_whole_bodies(served: str) -> None:
    """`max_body_bytes=None`, and routes that are not guarded: not ours to limit."""
    body, headers = body_of(2 * MiB), {"content-type": "application/json"}
    message = 2 * MiB - len(PREFIX) - len(SUFFIX)
    assert httpx.post(f"{served}/unlimited", content=body, headers=headers, timeout=30).json() == message
    assert httpx.post(f"{served}/plain", content=body, headers=headers, timeout=30).json() == 2 * MiB


def test_the_limit_is_documented_in_each_route_s_400(fake_workers_ai: FakeWorkersAI) -> None:
    paths = limited_app(fake_workers_ai).openapi()["paths"]
    guarded = ("/small", "/default", "/unlimited")
    described = {path: paths[path]["post"]["responses"]["400"]["description"] for path in guarded}
    assert "over 100 bytes is refused" in described["/small"]
    assert f"over {MiB} bytes is refused" in described["/default"]
    assert "refused" not in described["/unlimited"]


def test_max_body_bytes_must_be_positive() -> None:
    guards = Guards(FakeBinding())
    with pytest.raises(ConfigurationError, match="max_body_bytes"):

        @guards.route(model="m", max_body_bytes=0)
        async def route(ai: AI[str]) -> str:
            return await ai.run({"prompt": "x"})


# --- memory, in a uvicorn worker of its own -------------------------------------------------


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set size so far (`VmHWM`), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def test_a_100_mb_body_leaves_the_worker_s_memory_where_it_was(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path
) -> None:
    """The example app under uvicorn, one worker: after warming up (answers, a 400, a refused
    body), two 100 MB bodies, declared and chunked, move the worker's peak RSS by at most 5 MB."""
    fake_workers_ai.default = Reply("Thanks, it is on its way.")
    app = AppProcess(app_process_env(fake_workers_ai, "memory://"))
    try:
        app.wait_ready()
        url = f"{app.url}/draft-reply"
        for _ in range(3):
            assert httpx.post(url, json={"message": "Where is my parcel?"}, timeout=10).status_code == 200
            assert httpx.post(url, json={"message": ""}, timeout=10).status_code == 400
            assert asyncio.run(post_body(url, MiB + 1, chunked=False))[0] == 400
            assert asyncio.run(post_body(url, MiB + 1, chunked=True))[0] == 400
        idle = peak_rss_kib(app.process.pid)
        for chunked in (False, True):
            status, body, _ = asyncio.run(post_body(url, 100 * MiB, chunked=chunked))
            assert (status, body["error"]) == (400, "invalid_request")
        grown = peak_rss_kib(app.process.pid) - idle
    finally:
        app.stop()
    assert grown <= 5 * 1024, f"peak RSS grew by {grown} KiB"


def test_the_example_app_limits_its_guarded_routes(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    client = serve(create_app(workers_ai_settings(fake_workers_ai)))
    for path in ("/draft-reply", "/draft-reply/stream", "/summary"):
        status, body, _ = asyncio.run(post_body(f"{client.base_url}{path}", MiB + 1, chunked=False))
        assert (status, body["error"]) == (400, "invalid_request")
    assert fake_workers_ai.calls == []
