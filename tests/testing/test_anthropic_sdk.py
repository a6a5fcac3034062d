"""`FakeAnthropic` as Anthropic's own Python SDK sees it: the official `anthropic` client (a
test-only dependency) with strict response validation on, so every answer the fake sends must
parse into the SDK's own types, every stream must accumulate into its message, and every
failure must raise the SDK's exception for it, with Anthropic's status and error type. If the
fake drifts from Anthropic's wire, these fail."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from fixtures import Fail, FakeAnthropic, Reasoning, Reply, Stream, Text, ToolArgs, ToolName

MODEL = "claude-sonnet-4-5"
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client(fake_anthropic: FakeAnthropic) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        api_key=fake_anthropic.api_key,
        base_url=fake_anthropic.base_url,
        max_retries=0,
        timeout=5,
        _strict_response_validation=True,
    ) as sdk:
        yield sdk


async def test_a_message(client: anthropic.AsyncAnthropic, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(MODEL, Reply("Hello there.", model="claude-sonnet-4-5-20250929"))
    raw = await client.messages.with_raw_response.create(model=MODEL, max_tokens=64, messages=MESSAGES)
    message = await raw.parse()
    assert raw.headers["request-id"].startswith("req_")
    assert message.model == "claude-sonnet-4-5-20250929"
    assert message.stop_reason == "end_turn"
    [block] = message.content
    assert block.type == "text"
    assert block.text == "Hello there."
    assert (message.usage.input_tokens, message.usage.output_tokens) == (10, 5)
    assert message.usage.cache_read_input_tokens == 0


async def test_a_stream(client: anthropic.AsyncAnthropic, fake_anthropic: FakeAnthropic) -> None:
    parts = (Reasoning("Let me think."), Text("Hel"), Text("lo."))
    fake_anthropic.script(MODEL, Stream(parts=parts))
    async with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES) as stream:
        texts = [text async for text in stream.text_stream]
        message = await stream.get_final_message()
    assert texts == ["Hel", "lo."]
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking == "Let me think."
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 5


async def test_a_tool_call(client: anthropic.AsyncAnthropic, fake_anthropic: FakeAnthropic) -> None:
    tool = {"name": "lookup", "input_schema": {"type": "object", "properties": {"id": {"type": "integer"}}}}
    fake_anthropic.script(MODEL, Reply(None, tool_calls=({"name": "lookup", "arguments": {"id": 7}},)))
    message = await client.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES, tools=[tool])  # type: ignore[list-item]
    [block] = message.content
    assert block.type == "tool_use"
    assert (block.name, block.input) == ("lookup", {"id": 7})
    assert message.stop_reason == "tool_use"


async def test_a_tool_call_stream(client: anthropic.AsyncAnthropic, fake_anthropic: FakeAnthropic) -> None:
    parts = (ToolName(0, "toolu_1", "lookup"), ToolArgs(0, '{"id":'), ToolArgs(0, " 7}"))
    fake_anthropic.script(MODEL, Stream(parts=parts, finish_reason="tool_calls"))
    async with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES) as stream:
        message = await stream.get_final_message()
    [block] = message.content
    assert block.type == "tool_use"
    assert (block.id, block.name, block.input) == ("toolu_1", "lookup", {"id": 7})
    assert message.stop_reason == "tool_use"


async def test_a_refusal(client: anthropic.AsyncAnthropic, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(MODEL, Reply(refusal="I can't help with that."))
    message = await client.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES)
    assert message.stop_reason == "refusal"


async def test_a_json_answer_is_the_forced_tool_input(
    client: anthropic.AsyncAnthropic, fake_anthropic: FakeAnthropic
) -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"label": {"type": "string"}}}
    fake_anthropic.script(MODEL, Reply({"label": "billing"}))
    message = await client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=MESSAGES,
        tools=[{"name": "json_answer", "input_schema": schema}],
        tool_choice={"type": "tool", "name": "json_answer"},
    )
    [block] = message.content
    assert block.type == "tool_use"
    assert block.input == {"label": "billing"}


async def test_an_error_event_in_a_stream(
    client: anthropic.AsyncAnthropic, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.script(MODEL, Stream(parts=(Text("Hel"), Text("lo.")), error_after=1))
    texts: list[str] = []

    async def read() -> None:
        async with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES) as stream:
            async for text in stream.text_stream:
                texts.append(text)

    with pytest.raises(anthropic.APIStatusError) as info:
        await read()
    assert texts == ["Hel"]
    assert info.value.type == "overloaded_error"


@pytest.mark.parametrize(
    ("outcome", "exception", "status", "type_"),
    [
        pytest.param(
            Fail(status=400, message="prompt is too long: 210000 tokens > 200000 maximum"),
            anthropic.BadRequestError,
            400,
            "invalid_request_error",
            id="400-prompt-too-long",
        ),
        pytest.param(Fail(status=401), anthropic.AuthenticationError, 401, "authentication_error", id="401"),
        pytest.param(Fail(status=402), anthropic.PaymentRequiredError, 402, "billing_error", id="402"),
        pytest.param(Fail(status=403), anthropic.PermissionDeniedError, 403, "permission_error", id="403"),
        pytest.param(Fail(status=404), anthropic.NotFoundError, 404, "not_found_error", id="404"),
        pytest.param(Fail(status=413), anthropic.ContentTooLargeError, 413, "request_too_large", id="413"),
        pytest.param(
            Fail(status=429, retry_after="7"), anthropic.RateLimitError, 429, "rate_limit_error", id="429"
        ),
        pytest.param(Fail(status=500), anthropic.InternalServerError, 500, "api_error", id="500"),
        pytest.param(Fail(status=529), anthropic.OverloadedError, 529, "overloaded_error", id="529"),
    ],
)
async def test_documented_failures(
    client: anthropic.AsyncAnthropic,
    fake_anthropic: FakeAnthropic,
    outcome: Fail,
    exception: type[anthropic.APIStatusError],
    status: int,
    type_: str,
) -> None:
    fake_anthropic.script(MODEL, outcome)
    with pytest.raises(exception) as info:
        await client.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES)
    error = info.value
    assert (error.status_code, error.type) == (status, type_)
    assert error.request_id is not None
    assert error.request_id.startswith("req_")


async def test_a_rate_limit_says_when(
    client: anthropic.AsyncAnthropic, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.script(MODEL, Fail(status=429, retry_after="7"))
    with pytest.raises(anthropic.RateLimitError) as info:
        await client.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES)
    headers = info.value.response.headers
    assert headers["retry-after"] == "7"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert headers["anthropic-ratelimit-requests-reset"].endswith("Z")


async def test_a_wrong_key(fake_anthropic: FakeAnthropic) -> None:
    async with anthropic.AsyncAnthropic(
        api_key="wrong", base_url=fake_anthropic.base_url, max_retries=0
    ) as sdk:
        with pytest.raises(anthropic.AuthenticationError) as info:
            await sdk.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES)
    assert info.value.type == "authentication_error"
    assert fake_anthropic.calls == []


async def test_a_system_turn_is_refused_as_the_api_does(client: anthropic.AsyncAnthropic) -> None:
    """The fake is as strict as the API where an adapter could go wrong."""
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=[{"role": "system", "content": "Be brief."}, *MESSAGES],
        )
    assert "top-level `system`" in json.dumps(info.value.body)
