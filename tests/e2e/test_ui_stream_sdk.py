"""`POST /chat` driven by the Vercel AI SDK itself, under Node: `js/chat.mjs` posts through
`DefaultChatTransport` (which parses every chunk against the SDK's own schema) and builds the
message with `readUIMessageStream`, as `useChat` does. The SDK is the `ai` version pinned in
`js/package.json` (`npm ci --prefix js`, which `.ci/run` runs). Without Node or the installed
package the tests skip, except under `CI=true`, where they fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.service import create_app
from app.settings import Settings
from fixtures import Fail, FakeBinding, FakeWorkersAI, Stream, Text

from ..app.test_ui_stream import REASONING_AND_TOOL
from ..conftest import LiveServer, no_sleep, workers_ai_settings

JS = Path(__file__).resolve().parents[2] / "js"
MODEL = "@cf/test/model"
BACKUP = "@cf/test/backup"


@pytest.fixture(scope="module")
def node() -> str:
    found = shutil.which("node")
    missing = (
        "node is not installed"
        if found is None
        else None
        if (JS / "node_modules" / "ai" / "package.json").exists()
        else "the ai package is not installed: npm ci --prefix js"
    )
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing} (CI runs these tests)")
        pytest.skip(missing)
    assert found is not None
    return found


@pytest.fixture
def base_url(fake_workers_ai: FakeWorkersAI) -> Iterator[str]:
    settings = workers_ai_settings(
        fake_workers_ai, ai_timeout_s=2.0, breaker_failure_threshold=1000, ai_fallback_models=BACKUP
    )
    with LiveServer(create_app(settings, sleep=no_sleep)) as server:
        yield server.url


def sdk(node: str, base_url: str, *args: str) -> dict[str, Any]:
    """What the SDK made of one `/chat` request (see `js/chat.mjs`)."""
    done = subprocess.run(
        [node, str(JS / "chat.mjs"), base_url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def text(message: dict[str, Any]) -> str:
    return "".join(p["text"] for p in message["parts"] if p["type"] == "text")


def test_the_sdk_reads_a_full_answer(node: str, base_url: str, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=(Text("Your parcel"), Text(" ships today."))))
    result = sdk(node, base_url)
    assert result["errors"] == []
    assert result["thrown"] is None
    assert result["chunks"][0] == "start"
    assert result["chunks"][-1] == "finish"
    message = result["message"]
    assert message["role"] == "assistant"
    assert text(message) == "Your parcel ships today."
    assert message["metadata"]["guards"]["attempts"] == 1
    assert message["metadata"]["guards"]["trace_id"]


def test_the_sdk_reads_the_fallbacks_answer(node: str, base_url: str, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Fail(status=503), Fail(status=503))
    fake_workers_ai.script(BACKUP, Stream(parts=(Text("From the backup."),)))
    result = sdk(node, base_url)
    assert result["errors"] == []
    assert text(result["message"]) == "From the backup."
    assert result["message"]["metadata"]["guards"]["fallback_model"] == BACKUP


def test_a_failure_before_output_is_the_transports_error(
    node: str, base_url: str, fake_workers_ai: FakeWorkersAI
) -> None:
    for model in (MODEL, BACKUP):
        fake_workers_ai.script(model, Fail(status=503), Fail(status=503))
    result = sdk(node, base_url)
    assert result["chunks"] == []
    assert "model_temporarily_unavailable" in result["thrown"]


def test_a_cut_after_output_is_an_error_and_the_partial_text_is_kept(
    node: str, base_url: str, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=(Text("Your parcel"), Text(" ships.")), cut_after=1))
    result = sdk(node, base_url)
    assert result["errors"] == ["provider_error"]  # the error chunk, nothing failed the schema
    assert result["chunks"][-1] == "error"
    assert "finish" not in result["chunks"]
    assert text(result["message"]) == "Your parcel"
    assert result["message"]["metadata"]["guards"]["reason"] == "provider_error"


def test_the_browser_leaving_cancels_the_upstream(
    node: str, base_url: str, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=(Text("again "),), endless=True, interval_s=0.01))
    result = sdk(node, base_url, "leave")
    assert "text-delta" in result["chunks"]
    assert fake_workers_ai.wait_for(lambda calls: calls[0].disconnected, timeout=5)


def test_the_sdk_reads_reasoning_and_tool_calls(node: str) -> None:
    fake = FakeBinding()
    fake.script("*", REASONING_AND_TOOL)
    with LiveServer(create_app(Settings(), binding=fake, sleep=no_sleep)) as server:
        result = sdk(node, server.url)
    assert result["errors"] == []
    parts = result["message"]["parts"]
    assert [p["type"] for p in parts] == ["reasoning", "text", "tool-track"]
    assert parts[0]["text"] == "Looking it up."
    assert parts[2]["toolCallId"] == "call_1"
    assert parts[2]["state"] == "input-available"
    assert parts[2]["input"] == {"parcel": 7}
