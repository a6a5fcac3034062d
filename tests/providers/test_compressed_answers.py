"""Compressed provider answers: every provider request asks for `Accept-Encoding: identity`,
bodies are read as sent (never inflated), and an answer with any other `Content-Encoding` is
refused before its body is read (`model_unavailable`, a strict route's 503).

Over real HTTP: the example app under uvicorn, its adapter (Workers AI or OpenAI-compatible)
talking to a fake provider that answers with a gzip bomb: `Content-Encoding: gzip` (half a MB
that inflates to 512 MiB) and `gzip, gzip` (2.5 KB that inflates to 1 GiB), on `run` and on
`stream`. The guarded route answers at once, the worker's memory does not grow with the bomb,
and `/health` keeps being served meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from app.service import create_app
from app.settings import Settings
from fixtures import FakeOpenAI, FakeWorkersAI, Raw, Reply, Stream, Text
from guards import ProviderError, classify
from guards.providers import OpenAICompatible, WorkersAI, http_library

from ..conftest import Serve, assert_error, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
MIB = 1 << 20
#: What the worker may allocate while refusing a bomb (the bomb itself is at most 1 MiB).
MEMORY_BOUND = 16 * MIB
#: How long the refusal may take on a loaded machine (it reads no body at all).
ANSWER_BOUND_S = 2.0


@functools.cache
def gzip_bomb(inflated_mib: int, layers: int) -> bytes:
    """`layers` nested gzip streams of `inflated_mib` MiB of zeros. A MiB of zeros is deflated
    once, then repeated: a full flush after it leaves the compressor as it was before it, so
    each further MiB would deflate to the same bytes (0.2 s of CPU for a GiB, not 6)."""
    zeros = bytes(MIB)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    one_mib = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(inflated_mib):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"  # gzip, deflate, no name, no time
    trailer = struct.pack("<II", crc, (inflated_mib * MIB) & 0xFFFFFFFF)
    body = header + one_mib * inflated_mib + deflate.flush() + trailer
    if layers == 2:
        outer = zlib.compressobj(9, zlib.DEFLATED, 31)
        body = outer.compress(body) + outer.flush()
    return body


#: Content-Encoding -> (the bomb, what it inflates to).
BOMBS = {"gzip": (512, 1), "gzip, gzip": (1024, 2)}


def bomb(encoding: str, content_type: str) -> Raw:
    body = gzip_bomb(*BOMBS[encoding])
    assert len(body) < MIB
    return Raw(200, body, content_type, headers={"content-encoding": encoding})


Provider = FakeWorkersAI | FakeOpenAI


@pytest.fixture(params=["workers-ai", "openai"])
def provider(request: pytest.FixtureRequest) -> Provider:
    fake: Provider = request.getfixturevalue(
        "fake_workers_ai" if request.param == "workers-ai" else "fake_openai"
    )
    return fake


def settings_for(provider: Provider) -> Settings:
    if isinstance(provider, FakeWorkersAI):
        return workers_ai_settings(provider, ai_timeout_s=30, breaker_failure_threshold=1000)
    return Settings(
        ai_provider="openai",
        ai_model=MODEL,
        openai_base_url=provider.base_url,
        openai_api_key=provider.api_key,
        ai_timeout_s=30,
        breaker_failure_threshold=1000,
    )


def while_health_is_served(url: str, request: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    """`request()` in a thread while `/health` is polled with a 1 s timeout (a timeout fails
    the test): its answer and its wall time."""
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=url, timeout=1.0) as health:
        started = time.monotonic()
        answer = pool.submit(lambda: (request(), time.monotonic() - started))
        polls = 0
        while not answer.done() or polls < 3:
            assert health.get("/health").json()["ok"] is True
            polls += 1
            time.sleep(0.02)
        return answer.result()


@pytest.mark.parametrize("encoding", BOMBS)
@pytest.mark.parametrize("path", ["/draft-reply", "/draft-reply/stream"])
def test_a_compressed_answer_is_refused_unread(
    provider: Provider, serve: Serve, encoding: str, path: str
) -> None:
    """A bomb on `run` (JSON) and on `stream` (an event stream): 503 `model_unavailable` at
    once, one call, the worker's memory bounded, `/health` served throughout."""
    gzip_bomb(*BOMBS[encoding])  # built before the clock starts
    content_type = "text/event-stream" if path.endswith("/stream") else "application/json"
    provider.default = bomb(encoding, content_type)
    client = serve(create_app(settings_for(provider), sleep=no_sleep))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        response, elapsed = while_health_is_served(
            str(client.base_url),
            lambda: httpx.post(f"{client.base_url}{path}", json={"message": "Hello"}, timeout=30),
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_error(response, 503, "model_unavailable", False)
    assert elapsed < ANSWER_BOUND_S
    assert peak - before < MEMORY_BOUND, f"{(peak - before) / MIB:.0f} MiB allocated"
    assert len(provider.calls) == 1  # model_unavailable is not retried


def test_a_degrading_route_answers_its_fallback(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    fake_workers_ai.default = bomb("gzip, gzip", "application/json")
    client = serve(create_app(settings_for(fake_workers_ai), sleep=no_sleep))
    response, elapsed = while_health_is_served(
        str(client.base_url),
        lambda: httpx.post(f"{client.base_url}/summary", json={"text": "refund please"}, timeout=30),
    )
    assert response.status_code == 200
    assert response.json()["fallback"]["reason"] == "provider_error"
    assert elapsed < ANSWER_BOUND_S


# --- the adapters: identity asked, anything else refused ------------------------------------


def adapter(provider: Provider, client: httpx.AsyncClient | None) -> WorkersAI | OpenAICompatible:
    if isinstance(provider, FakeWorkersAI):
        return WorkersAI(
            account_id=provider.account_id,
            api_token=provider.api_token,
            base_url=provider.base_url,
            client=client,
        )
    return OpenAICompatible(api_key=provider.api_key, base_url=provider.base_url, client=client)


def outcome(provider: Provider, stream: bool, *, own_client: bool = False) -> Any:
    """The text of one call through the provider's adapter (`run`, or every text delta of
    `stream`), or its `ProviderError`."""

    async def call() -> Any:
        client = http_library.AsyncClient() if own_client else None
        binding = adapter(provider, client)
        try:
            if not stream:
                return (await binding.run(MODEL, {"prompt": "Hi"})).response
            return "".join([getattr(e, "text", "") async for e in binding.stream(MODEL, {"prompt": "Hi"})])
        except ProviderError as error:
            return error
        finally:
            await binding.aclose()
            if client is not None:
                await client.aclose()

    return asyncio.run(call())


@pytest.mark.parametrize("stream", [False, True], ids=["run", "stream"])
@pytest.mark.parametrize("own_client", [False, True], ids=["default-client", "given-client"])
def test_every_request_asks_for_the_body_as_sent(provider: Provider, stream: bool, own_client: bool) -> None:
    """`Accept-Encoding: identity`, also through a client of the caller's own making (httpx's
    own default is `gzip, deflate`)."""
    provider.default = Reply("Hello there.")
    assert outcome(provider, stream, own_client=own_client) == "Hello there."
    assert provider.calls[-1].headers["accept-encoding"] == "identity"


@pytest.mark.parametrize("stream", [False, True], ids=["run", "stream"])
@pytest.mark.parametrize("status", [200, 429, 503])
@pytest.mark.parametrize("encoding", ["gzip", "br"])
def test_any_other_encoding_is_model_unavailable(
    provider: Provider, stream: bool, status: int, encoding: str
) -> None:
    """Whatever the status (a 429 or a 503 too: its code and its wait are in the body and
    headers we do not trust), refused as `model_unavailable`, not retried, no provider text."""
    body = zlib.compress(b'{"result": {"response": "secret"}, "success": true}')
    provider.default = Raw(status, body, "application/json", headers={"content-encoding": encoding})
    error = outcome(provider, stream)
    assert isinstance(error, ProviderError)
    assert error.note == "content-encoding refused"
    assert classify(error).kind.value == "model_unavailable"
    assert "secret" not in str(error)


@pytest.mark.parametrize("stream", [False, True], ids=["run", "stream"])
def test_identity_is_read_as_usual(provider: Provider, stream: bool) -> None:
    body = (
        b'{"result": {"response": "plain"}, "success": true}'
        if isinstance(provider, FakeWorkersAI)
        else (b'{"choices": [{"message": {"content": "plain"}, "finish_reason": "stop"}], "model": "m"}')
    )
    provider.default = Raw(200, body, "application/json", headers={"content-encoding": "identity"})
    assert outcome(provider, stream) == "plain"


@pytest.mark.parametrize("wire", ["workers-ai", "gateway"])
def test_a_compressed_resume_is_refused_unread(request: pytest.FixtureRequest, wire: str) -> None:
    """AI Gateway's resume (`GET .../run/{id}/resume`) asks for identity too, and its answer is
    refused like any other when compressed: the events before the cut, then the failure."""
    server: Provider
    if wire == "workers-ai":
        server = request.getfixturevalue("fake_workers_ai")
    else:
        server = request.getfixturevalue("fake_gateway")
    server.default = Stream(
        (Text("Hello"), Text(" there")),
        resumable=True,
        cut_after=1,
        resume_headers={"content-encoding": "gzip"},
    )
    texts: list[str] = []

    async def call() -> ProviderError | None:
        if isinstance(server, FakeWorkersAI):
            binding: WorkersAI | OpenAICompatible = WorkersAI(
                account_id=server.account_id,
                api_token=server.api_token,
                base_url=server.base_url,
                resume_base=server.base_url,
            )
        else:
            binding = OpenAICompatible(api_key=server.api_key, base_url=server.base_url)
        try:
            async for event in binding.stream(MODEL, {"prompt": "Hi"}):
                texts.append(getattr(event, "text", ""))
        except ProviderError as error:
            return error
        finally:
            await binding.aclose()
        return None

    error = asyncio.run(call())
    assert texts == ["Hello"]
    assert error is not None
    assert error.note == "content-encoding refused"
    assert classify(error).kind.value == "model_unavailable"
    [resume] = server.resume_request_headers
    assert resume["accept-encoding"] == "identity"
