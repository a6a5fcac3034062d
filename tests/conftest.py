"""Shared test helpers: a real uvicorn server in a thread, and captured `guards` log lines."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from app.settings import Settings
from fixtures import FakeWorkersAI


class LiveServer:
    """`app` served by uvicorn on a free loopback port, in a background thread."""

    def __init__(self, app: FastAPI) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> LiveServer:
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                return self
            self._thread.join(0.01)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[FastAPI], httpx.Client]]:
    """`client = serve(app)`: serve `app` for real and get an httpx client bound to it."""
    stack: list[tuple[LiveServer, httpx.Client]] = []

    def start(app: FastAPI) -> httpx.Client:
        server = LiveServer(app).__enter__()
        client = httpx.Client(base_url=server.url, timeout=10)
        stack.append((server, client))
        return client

    yield start
    for server, client in reversed(stack):
        client.close()
        server.__exit__()


class LogLines(logging.Handler):
    """Every record of the `guards` logger, as text and parsed JSON."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def events(self, event: str | None = None) -> list[dict[str, Any]]:
        parsed = [json.loads(line) for line in self.lines]
        return [p for p in parsed if event is None or p["event"] == event]


@pytest.fixture
def guards_log() -> Iterator[LogLines]:
    logger = logging.getLogger("guards")
    handler = LogLines()
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(previous)


def workers_ai_settings(server: FakeWorkersAI, **overrides: Any) -> Settings:
    """Settings for the example app pointed at the fake Workers AI server."""
    values: dict[str, Any] = {
        "ai_provider": "workers-ai",
        "cloudflare_account_id": server.account_id,
        "cloudflare_api_token": server.api_token,
        "cloudflare_api_base": server.base_url,
        "ai_model": "@cf/test/model",
        "ai_timeout_s": 2.0,
    }
    values.update(overrides)
    return Settings(**values)


async def no_sleep(seconds: float) -> None:
    """Retry delays in tests: recorded by nobody, waited by nobody."""
