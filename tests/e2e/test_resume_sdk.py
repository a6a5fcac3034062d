"""A resumable chat resumed by the Vercel AI SDK itself, under Node (`js/resume.mjs`): the SDK's
chat (what `useChat` wraps) stops after its first text deltas (the browser leaving), then a new
chat of the same id calls `resumeStream()`, as `useChat({ resume: true })` does on mount, and
gets the whole answer, the provider called once; a chat with no stream gets 204 (the SDK stays
ready, no message). Skipped where Node or the pinned `ai` package is absent (see
`test_ui_stream_sdk`)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from fixtures import FakeOpenAI, FakeWorkersAI, Stream

from ..conftest import LiveServer
from ..streams.test_resume import MODEL, PARTS, app_of
from .test_ui_stream_sdk import JS, node, text

__all__ = ["node"]


@pytest.fixture
def base_url(fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI) -> Iterator[str]:
    with LiveServer(app_of(fake_workers_ai, fake_openai)) as server:
        yield server.url


def resume(node: str, base_url: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [node, str(JS / "resume.mjs"), base_url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_the_sdk_resumes_a_chat_it_stopped(node: str, base_url: str, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=PARTS, interval_s=0.01))
    result = resume(node, base_url, "chat-sdk", "stop")
    whole = "".join(part.text for part in PARTS)
    assert result["stopped"]
    assert len(result["stopped"]) < len(whole)
    assert result["error"] is None
    assert result["status"] == "ready"
    user, answer = result["messages"]
    assert user["role"] == "user"
    assert answer["role"] == "assistant"
    assert text(answer) == whole
    assert answer["metadata"]["guards"]["attempts"] == 1
    assert len(fake_workers_ai.calls) == 1


def test_the_sdk_finds_no_stream_for_a_chat_without_one(node: str, base_url: str) -> None:
    result = resume(node, base_url, "chat-none")
    assert result == {"stopped": None, "messages": [], "status": "ready", "error": None}
