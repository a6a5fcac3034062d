"""A structured stream in the UI message stream, read by the Vercel AI SDK itself under Node
(`js/chat.mjs`, as in `test_ui_stream_sdk.py`): the JSON text is the message's text part, the
validated object its `data-object` part, and a rejected answer the SDK's error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import FakeBinding, Stream, Text
from guards import AI, UI_MESSAGE_STREAM, EventStream, Guards, UIChatRequest

from ..conftest import LiveServer, no_sleep
from .test_ui_stream_sdk import node, sdk, text

__all__ = ["node"]  # the fixture, imported for pytest to find


class Triage(BaseModel):
    label: str
    urgent: bool


@pytest.fixture
def served() -> Iterator[tuple[str, FakeBinding]]:
    """An app whose `POST /chat` streams a `Triage` in the UI message stream; its URL and fake."""
    fake = FakeBinding()
    guards = Guards(fake, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/chat")
    @guards.route(model="m", stream_format=UI_MESSAGE_STREAM)
    async def chat(body: UIChatRequest, ai: AI[Triage]) -> EventStream:
        return await ai.stream(body.inputs())

    with LiveServer(app) as server:
        yield server.url, fake


def test_the_sdk_reads_the_json_text_and_the_validated_object(
    node: str, served: tuple[str, FakeBinding]
) -> None:
    url, fake = served
    fake.script("*", Stream(parts=(Text('{"label": "billing", '), Text('"urgent": true}'))))
    result = sdk(node, url)
    assert result["errors"] == []
    assert result["chunks"][-2:] == ["data-object", "finish"]
    message = result["message"]
    assert text(message) == '{"label": "billing", "urgent": true}'
    [part] = [p for p in message["parts"] if p["type"] == "data-object"]
    assert part["data"] == {"label": "billing", "urgent": True}
    assert set(message["metadata"]["guards"]) >= {"attempts", "trace_id"}


def test_the_sdk_reads_a_rejected_answer_as_its_error(node: str, served: tuple[str, FakeBinding]) -> None:
    url, fake = served
    fake.script("*", Stream(parts=(Text('{"label": "billing"}'),)))
    result = sdk(node, url)
    assert result["errors"] == ["schema_invalid"]
    assert "data-object" not in result["chunks"]
    assert result["message"]["metadata"]["guards"]["guard"] == "output"
