"""`POST /chat` of the example app: the Vercel AI SDK's UI message stream over real HTTP, every
chunk checked against the protocol's rules (`check_ui_stream`), and `UIChatRequest`'s checks.
The same route driven by the SDK itself under Node is `tests/e2e/test_ui_stream_sdk.py`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from app.service import create_app
from app.settings import Settings
from fixtures import Fail, FakeBinding, FakeWorkersAI, Reasoning, Stream, Text, ToolArgs, ToolName
from guards import Reason

from ..conftest import ExampleClient, Serve, assert_error, no_sleep, problems, workers_ai_settings

#: A stream with reasoning, text and a tool call in two pieces (the SDK tests play it too).
REASONING_AND_TOOL = Stream(
    parts=(
        Reasoning("Looking it up."),
        Text("Let me check."),
        ToolName(0, "call_1", "track"),
        ToolArgs(0, '{"parcel": '),
        ToolArgs(0, "7}"),
    ),
    finish_reason="tool_calls",
)

MODEL = "@cf/test/model"
BACKUP = "@cf/test/backup"


def chat_body(text: str = "Where is my parcel?") -> dict[str, Any]:
    return {
        "id": "chat-1",
        "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": text}]}],
        "trigger": "submit-message",
    }


def check_ui_stream(response: httpx.Response) -> list[dict[str, Any]]:
    """The chunks of a UI message stream, after checking the protocol's rules: the header,
    every event one `data:` line of a JSON chunk, `start` first, each delta inside its part's
    start and end, tool input started before its deltas, exactly one of `finish` and `error`
    with no part left open, then `[DONE]` and nothing after. Returns the chunks."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        assert "\n" not in event, event
        chunk = json.loads(event[len("data: ") :])
        assert isinstance(chunk, dict), chunk
        assert isinstance(chunk.get("type"), str), chunk
        chunks.append(chunk)
    assert chunks[0] == {"type": "start"}
    open_parts: dict[str, str] = {}  # id: text or reasoning
    tools: dict[str, str] = {}  # toolCallId: streaming / done
    for chunk in chunks[1:-1]:
        kind = chunk["type"]
        if kind in ("text-start", "reasoning-start"):
            assert not open_parts, chunk  # one part open at a time
            open_parts[chunk["id"]] = kind.split("-")[0]
        elif kind in ("text-delta", "reasoning-delta"):
            assert open_parts.get(chunk["id"]) == kind.split("-")[0], chunk
            assert isinstance(chunk["delta"], str)
            assert chunk["delta"]
        elif kind in ("text-end", "reasoning-end"):
            assert open_parts.pop(chunk["id"]) == kind.split("-")[0], chunk
        elif kind == "tool-input-start":
            assert chunk["toolCallId"] not in tools, chunk
            assert isinstance(chunk["toolName"], str), chunk
            tools[chunk["toolCallId"]] = "streaming"
        elif kind == "tool-input-delta":
            assert tools[chunk["toolCallId"]] == "streaming"
            assert isinstance(chunk["inputTextDelta"], str)
        elif kind in ("tool-input-available", "tool-input-error"):
            assert tools[chunk["toolCallId"]] == "streaming", chunk
            tools[chunk["toolCallId"]] = "done"
        elif kind == "data-object":  # a structured stream's validated object, just before `finish`
            assert chunks[-1]["type"] == "finish", chunk
            assert chunk is chunks[-2], chunk
        elif kind == "message-metadata":
            assert chunks[-1]["type"] == "error"
            assert set(chunk["messageMetadata"]["guards"]) == {"guard", "reason", "detail", "trace_id"}
        else:
            raise AssertionError(f"a chunk of a type the stream never sends in between: {chunk}")
    assert not open_parts, "a part left open at the end"
    assert all(state == "done" for state in tools.values()), tools
    last = chunks[-1]
    assert last["type"] in ("finish", "error"), last
    assert sum(c["type"] in ("finish", "error") for c in chunks) == 1
    if last["type"] == "error":
        assert last["errorText"] in {r.value for r in Reason}, last
    else:
        assert set(last) <= {"type", "finishReason", "messageMetadata"}
        assert last.get("finishReason", "stop") in ("stop", "length", "tool-calls", "other")
        assert set(last["messageMetadata"]["guards"]) == {
            "finish_reason",
            "usage",
            "model",
            "fallback_model",
            "attempts",
            "trace_id",
        }
    return chunks


def text_of(chunks: list[dict[str, Any]], kind: str = "text") -> str:
    return "".join(c["delta"] for c in chunks if c["type"] == f"{kind}-delta")


@pytest.fixture
def client(example_client: ExampleClient) -> httpx.Client:
    """Served for real: a client here leaves a stream in the middle."""
    return example_client(
        ai_timeout_s=0.5, breaker_failure_threshold=1000, ai_fallback_models=BACKUP, socket=True
    )


def test_a_full_answer_is_a_ui_message_stream(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=(Text("Your parcel"), Text(" ships today."))))
    response = client.post("/chat", json=chat_body(), headers={"x-user-id": "ann"})
    chunks = check_ui_stream(response)
    assert text_of(chunks) == "Your parcel ships today."
    assert [c["type"] for c in chunks] == [
        "start",
        "text-start",
        "text-delta",
        "text-delta",
        "text-end",
        "finish",
    ]
    guards = chunks[-1]["messageMetadata"]["guards"]
    # Workers AI's native events carry no finish reason: `finishReason` is left out then.
    assert "finishReason" not in chunks[-1]
    assert guards["finish_reason"] is None
    assert guards["attempts"] == 1
    assert guards["fallback_model"] is None
    assert guards["trace_id"] == response.headers["x-trace-id"]
    assert guards["usage"]["total_tokens"] > 0
    # The model got the conversation after the service's own instructions.
    messages = fake_workers_ai.calls[-1].inputs["messages"]
    assert messages[0]["role"] == "system"
    assert messages[1:] == [{"role": "user", "content": "Where is my parcel?"}]


def test_a_fallback_before_output_answers_from_the_next_model(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Fail(status=503), Fail(status=503))
    fake_workers_ai.script(BACKUP, Stream(parts=(Text("From the backup."),)))
    chunks = check_ui_stream(client.post("/chat", json=chat_body()))
    assert text_of(chunks) == "From the backup."
    assert chunks[-1]["messageMetadata"]["guards"]["fallback_model"] == BACKUP


def test_a_failure_before_output_is_a_public_error(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    for model in (MODEL, BACKUP):
        fake_workers_ai.script(model, Fail(status=503), Fail(status=503))
    response = client.post("/chat", json=chat_body())
    assert response.headers["content-type"] == "application/json"
    assert_error(response, 503, "model_temporarily_unavailable", True)


@pytest.mark.parametrize("cut", ["cut_after", "error_after"])
def test_a_stream_cut_after_output_ends_with_an_error_chunk_and_keeps_the_text(
    cut: str, client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=(Text("Your parcel"), Text(" ships.")), **{cut: 1}))
    response = client.post("/chat", json=chat_body())
    chunks = check_ui_stream(response)
    assert text_of(chunks) == "Your parcel"
    assert chunks[-1] == {"type": "error", "errorText": "provider_error"}
    assert chunks[-2]["messageMetadata"]["guards"]["detail"] == "stream interrupted after output"
    assert "AiError" not in response.text  # never the provider's text
    assert len(fake_workers_ai.calls) == 1  # no second model after output


def test_reasoning_and_tool_calls_map_to_their_chunks(serve: Serve) -> None:
    fake = FakeBinding()
    client = serve(create_app(Settings(), binding=fake, sleep=no_sleep))
    fake.script("*", REASONING_AND_TOOL)
    chunks = check_ui_stream(client.post("/chat", json=chat_body()))
    assert text_of(chunks, "reasoning") == "Looking it up."
    assert text_of(chunks) == "Let me check."
    tool = [c for c in chunks if c["type"].startswith("tool-")]
    assert tool[0] == {"type": "tool-input-start", "toolCallId": "call_1", "toolName": "track"}
    assert "".join(c["inputTextDelta"] for c in tool if c["type"] == "tool-input-delta") == '{"parcel": 7}'
    assert tool[-1] == {
        "type": "tool-input-available",
        "toolCallId": "call_1",
        "toolName": "track",
        "input": {"parcel": 7},
    }
    assert chunks[-1]["finishReason"] == "tool-calls"


def test_tool_arguments_whose_json_holds_a_lone_surrogate_are_a_tool_input_error(serve: Serve) -> None:
    """`{"parcel": "\\ud800"}` is valid JSON whose value no UTF-8 can carry: the tool's input
    is an error (`invalid_tool_arguments`, its text as sent), never a stream cut."""
    fake = FakeBinding()
    client = serve(create_app(Settings(), binding=fake, sleep=no_sleep))
    arguments = '{"parcel": "\\ud800"}'
    fake.script(
        "*",
        Stream(parts=(ToolName(0, "call_1", "track"), ToolArgs(0, arguments)), finish_reason="tool_calls"),
    )
    chunks = check_ui_stream(client.post("/chat", json=chat_body()))
    tool = [c for c in chunks if c["type"].startswith("tool-")]
    assert tool[-1] == {
        "type": "tool-input-error",
        "toolCallId": "call_1",
        "toolName": "track",
        "input": arguments,
        "errorText": "invalid_tool_arguments",
    }
    assert chunks[-1]["type"] == "finish"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "body.messages"),
        ({"messages": []}, "body.messages"),
        ({"messages": [{"role": "robot", "parts": []}]}, "body.messages.0.role"),
        (
            {
                "messages": [
                    {"role": "user", "parts": [{"type": "file", "mediaType": "image/png", "url": "data:,"}]}
                ]
            },
            "body.messages.0.parts.0",
        ),
        ({"messages": [{"role": "user", "parts": [{"type": "text"}]}]}, "body.messages.0.parts.0"),
    ],
    ids=["no-messages", "empty", "bad-role", "file-part", "text-part-without-text"],
)
def test_a_body_that_is_not_a_chat_request_is_a_400_without_a_call(
    body: dict[str, Any], field: str, client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    response = client.post("/chat", json=body)
    assert_error(response, 400, "invalid_request", False)
    assert field in [f for f, _ in problems(response)], response.json()
    assert fake_workers_ai.calls == []


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "parts": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


ANSWERED = {"role": "assistant", "parts": [{"type": "step-start"}, text("It ships today.")]}


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([user()], "body.messages.0.parts"),
        ([user({"type": "step-start"}, {"type": "data-note", "data": {"n": 1}})], "body.messages.0.parts"),
        ([user(text(""))], "body.messages.0.parts"),
        ([user(text(" \n\t\u3000"), text(""))], "body.messages.0.parts"),
        ([user(text("Where is it?")), ANSWERED, user()], "body.messages.2.parts"),
        ([user(), ANSWERED, user(text("And now?"))], "body.messages.0.parts"),
    ],
    ids=["no-parts", "no-text-part", "empty-text", "blank-text", "last-of-three", "an-earlier-one"],
)
def test_a_user_message_without_text_is_a_400_without_a_call(
    messages: list[dict[str, Any]], field: str, client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    """Every user message must carry text: a text part that is not blank. One without (no
    parts, only parts that are not text, empty or blank text), the last or an earlier one, is
    `too_short` at its `parts`."""
    response = client.post("/chat", json={"id": "chat-1", "messages": messages})
    assert_error(response, 400, "invalid_request", False)
    assert problems(response) == [(field, "too_short")]
    assert fake_workers_ai.calls == []


def test_assistant_and_system_messages_without_text_are_left_out(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    """An assistant (or system) message with no text (a tool call only, no parts, blank text)
    is not refused: it is left out of what the model is given."""
    fake_workers_ai.script(MODEL, Stream(parts=(Text("Tomorrow."),)))
    tool_only = {
        "role": "assistant",
        "parts": [{"type": "tool-track", "toolCallId": "c1", "state": "input-available"}],
    }
    messages = [
        {"role": "system", "parts": [text(" ")]},
        user(text("Where is it?")),
        tool_only,
        {"role": "assistant", "parts": []},
        {"role": "assistant", "parts": [text(" \n")]},
        user(text("And "), {"type": "step-start"}, text("now?")),
    ]
    check_ui_stream(client.post("/chat", json={"id": "chat-1", "messages": messages}))
    (call,) = fake_workers_ai.calls
    assert call.inputs["messages"][1:] == [
        {"role": "user", "content": "Where is it?"},
        {"role": "user", "content": "And now?"},
    ]


def test_the_budget_is_per_user(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    settings = workers_ai_settings(fake_workers_ai, rate_limit_per_minute=1)
    client = serve(create_app(settings, sleep=no_sleep))
    fake_workers_ai.default = Stream(parts=(Text("Hi."),))
    check_ui_stream(client.post("/chat", json=chat_body(), headers={"x-user-id": "ann"}))
    assert_error(
        client.post("/chat", json=chat_body(), headers={"x-user-id": "ann"}), 429, "rate_limited", False
    )
    check_ui_stream(client.post("/chat", json=chat_body(), headers={"x-user-id": "bob"}))


def test_a_client_that_leaves_cancels_the_upstream(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Stream(parts=(Text("again "),), endless=True, interval_s=0.01))
    with client.stream("POST", "/chat", json=chat_body()) as response:
        assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
        lines = response.iter_lines()
        assert next(lines) == 'data: {"type":"start"}'
    assert fake_workers_ai.wait_for(lambda calls: calls[0].disconnected, timeout=5)
