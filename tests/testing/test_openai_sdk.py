"""`FakeOpenAI` as OpenAI's own Python SDK sees it: the official `openai` client (a test-only
dependency) with strict response validation on, so every answer the fake sends must parse into
the SDK's own types, and every failure must raise the SDK's exception for it, with OpenAI's
status, type and code. If the fake drifts from OpenAI's wire, these fail."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from fixtures import Fail, FakeOpenAI, Hang, Refusal, Reply, Stream, Text, ToolArgs, ToolCall, ToolName

MODEL = "gpt-4o-mini"
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def client(fake_openai: FakeOpenAI) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        api_key=fake_openai.api_key,
        base_url=fake_openai.base_url,
        max_retries=0,
        timeout=5,
        _strict_response_validation=True,
    ) as sdk:
        yield sdk


def test_a_reply(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply("Hello there.", model="gpt-4o-mini-2024-07-18"))
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES)
    completion = raw.parse()
    assert raw.headers["x-request-id"].startswith("req_")
    assert completion.model == "gpt-4o-mini-2024-07-18"
    assert completion.system_fingerprint
    [choice] = completion.choices
    assert (choice.message.content, choice.message.refusal, choice.logprobs) == ("Hello there.", None, None)
    assert choice.finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.total_tokens == 15


def test_json_mode(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply({"label": "billing", "confidence": 0.9}))
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    completion = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "Label", "schema": schema}},
    )
    content = completion.choices[0].message.content
    assert content is not None
    assert json.loads(content) == {"label": "billing", "confidence": 0.9}


def test_a_refusal(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Reply(refusal="I can't help with that."))
    message = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
    assert (message.content, message.refusal) == (None, "I can't help with that.")


def test_tool_calls(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    """Scripted in Workers AI's flat shape, they arrive in OpenAI's."""
    fake_openai.script(MODEL, Reply(None, tool_calls=({"name": "lookup", "arguments": {"id": 7}},)))
    [call] = (
        client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message.tool_calls or []
    )
    assert call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"id": 7})


def stream(client: openai.OpenAI, **options: Any) -> list[ChatCompletionChunk]:
    with client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **options) as chunks:
        return list(chunks)


def text_of(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_stream_without_usage(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    """Without `stream_options`, no usage chunk: every chunk has a choice (`chunk.choices[0]`
    is safe, as on OpenAI)."""
    fake_openai.script(MODEL, Stream(parts=(Text("Hel"), Text("lo."))))
    chunks = stream(client)
    assert all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)
    assert text_of(chunks) == "Hello."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stream_with_usage(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Stream(parts=(Text("Hel"), Text("lo."))))
    chunks = stream(client, stream_options={"include_usage": True})
    *answer, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.total_tokens == 15
    assert all(chunk.usage is None and chunk.choices for chunk in answer)
    assert text_of(chunks) == "Hello."


def test_a_tool_call_stream(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    parts = (
        ToolName(0, "call_1", "lookup"),
        ToolArgs(0, '{"id":'),
        ToolArgs(0, " 7}"),
        ToolCall("f", {"a": 1}, 1),
    )
    fake_openai.script(MODEL, Stream(parts=parts, finish_reason="tool_calls"))
    calls: dict[int, dict[str, str]] = {}
    chunks = stream(client)
    for chunk in chunks:
        for piece in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    assert calls == {
        0: {"name": "lookup", "arguments": '{"id": 7}'},
        1: {"name": "f", "arguments": '{"a": 1}'},
    }
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_refusal_stream(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Stream(parts=(Refusal("I can't"), Refusal(" help."))))
    chunks = stream(client)
    assert "".join(c.choices[0].delta.refusal or "" for c in chunks) == "I can't help."


def test_an_error_in_a_stream(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Stream(parts=(Text("Hel"), Text("lo.")), error_after=1))
    with pytest.raises(openai.APIError) as info:
        stream(client)
    assert info.value.type == "server_error"


@pytest.mark.parametrize(
    ("outcome", "exception", "status", "type_", "code"),
    [
        pytest.param(Fail(status=400), openai.BadRequestError, 400, "invalid_request_error", None, id="400"),
        pytest.param(
            Fail(status=404, error_code="model_not_found"),
            openai.NotFoundError,
            404,
            "invalid_request_error",
            "model_not_found",
            id="404",
        ),
        pytest.param(
            Fail(status=429), openai.RateLimitError, 429, "requests", "rate_limit_exceeded", id="429"
        ),
        pytest.param(
            Fail(status=429, error_type="insufficient_quota", error_code="insufficient_quota"),
            openai.RateLimitError,
            429,
            "insufficient_quota",
            "insufficient_quota",
            id="429-quota",
        ),
        pytest.param(Fail(status=500), openai.InternalServerError, 500, "server_error", None, id="500"),
        pytest.param(Fail(status=503), openai.InternalServerError, 503, "server_error", None, id="503"),
    ],
)
def test_documented_failures(
    client: openai.OpenAI,
    fake_openai: FakeOpenAI,
    outcome: Fail,
    exception: type[openai.APIStatusError],
    status: int,
    type_: str,
    code: str | None,
) -> None:
    fake_openai.script(MODEL, outcome)
    with pytest.raises(exception) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    error = info.value
    assert (error.status_code, error.type, error.code) == (status, type_, code)
    assert error.request_id is not None
    assert error.request_id.startswith("req_")


def test_a_rate_limit_reads_like_openai(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Fail(status=429))
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.message.startswith(f"Error code: 429 - Rate limit reached for {MODEL} in organization")


def test_a_wrong_key(fake_openai: FakeOpenAI) -> None:
    with (
        openai.OpenAI(api_key="wrong", base_url=fake_openai.base_url, max_retries=0) as sdk,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        sdk.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert (info.value.status_code, info.value.code) == (401, "invalid_api_key")


def test_a_hang_is_a_timeout(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(MODEL, Hang())
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.3).chat.completions.create(model=MODEL, messages=MESSAGES)
