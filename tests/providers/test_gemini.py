"""The Gemini adapter (`guards.providers.Gemini`) against the fake Gemini server, over HTTP.

Workers-AI-shaped inputs become a `generateContent` request; an answer's text, thoughts,
function calls, filters and usage are read as documented; every failure shape ends as a
`ProviderError` with the HTTP status and the flags the classifier reads (a wait, a per-day
quota, an input over the window), never the provider's own text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from fixtures import Drop, Fail, FakeBinding, FakeGemini, Raw, Reasoning, Reply, Stream, Text, ToolCall
from fixtures.script import Outcome
from guards import (
    AIResult,
    ConfigurationError,
    Kind,
    ProviderError,
    ReasoningDelta,
    StreamEnd,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    Usage,
    classify,
)
from guards.providers import Gemini

from ..conftest import run_binding_once

MODEL = "gemini-2.5-flash"
INPUTS: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}]}
CANARY = "CANARY-PROVIDER-TEXT"
SCHEMA: dict[str, Any] = {
    "title": "Summary",
    "type": "object",
    "properties": {"label": {"type": "string", "maxLength": 80}},
    "required": ["label"],
}


def binding_for(server: FakeGemini, **overrides: Any) -> Gemini:
    return Gemini(**{"api_key": server.api_key, "base_url": server.base_url, **overrides})


def run_once(
    server: FakeGemini, outcome: Outcome | None = None, *, inputs: dict[str, Any] = INPUTS
) -> AIResult:
    if outcome is not None:
        server.script(MODEL, outcome)
    return run_binding_once(lambda: binding_for(server), MODEL, inputs)


def failure_of(server: FakeGemini, outcome: Outcome | None = None, **overrides: Any) -> ProviderError:
    if outcome is not None:
        server.script(MODEL, outcome)
    with pytest.raises(ProviderError) as info:
        run_binding_once(lambda: binding_for(server, **overrides), MODEL, INPUTS)
    return info.value


def sent(server: FakeGemini, inputs: dict[str, Any]) -> dict[str, Any]:
    run_once(server, inputs=inputs)
    body: dict[str, Any] = server.calls[-1].inputs
    return body


def stream_events(server: FakeGemini, outcome: Outcome, inputs: dict[str, Any] = INPUTS) -> list[StreamEvent]:
    server.script(MODEL, outcome)

    async def read() -> list[StreamEvent]:
        binding = binding_for(server, idle_timeout_s=2)
        try:
            events: AsyncIterator[StreamEvent] = binding.stream(MODEL, inputs)
            return [event async for event in events]
        finally:
            await binding.aclose()

    return anyio.run(read)


def stream_failure(server: FakeGemini, outcome: Outcome) -> tuple[list[StreamEvent], ProviderError]:
    seen: list[StreamEvent] = []
    server.script(MODEL, outcome)

    async def read() -> None:
        binding = binding_for(server, idle_timeout_s=2)
        try:
            async for event in binding.stream(MODEL, INPUTS):
                seen.append(event)
        finally:
            await binding.aclose()

    with pytest.raises(ProviderError) as info:
        anyio.run(read)
    return seen, info.value


# --- requests -----------------------------------------------------------------------------------


def test_a_conversation_becomes_contents_and_a_system_instruction(fake_gemini: FakeGemini) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    "thought_signature": "sig-1",
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": '{"celsius": 21}'},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}],
        },
    ]
    body = sent(fake_gemini, {"messages": messages, "max_tokens": 64, "temperature": 0.2, "stop": "END"})
    assert body["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert body["contents"] == [
        {"role": "user", "parts": [{"text": "Weather in Paris?"}]},
        {
            "role": "model",
            "parts": [
                {"functionCall": {"name": "weather", "args": {"city": "Paris"}}, "thoughtSignature": "sig-1"}
            ],
        },
        # The tool result and the next question are one user turn (turns alternate).
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "weather", "response": {"celsius": 21}}},
                {"text": "And tomorrow?"},
            ],
        },
    ]
    assert body["generationConfig"] == {"maxOutputTokens": 64, "temperature": 0.2, "stopSequences": ["END"]}
    assert "stream" not in body


def test_json_mode_tools_and_tool_choice(fake_gemini: FakeGemini) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "description": "Find.", "parameters": SCHEMA}}
    body = sent(
        fake_gemini,
        {
            "prompt": "Label it.",
            "response_format": {"type": "json_schema", "json_schema": SCHEMA},
            "tools": [tool],
            "tool_choice": "required",
        },
    )
    assert body["contents"] == [{"role": "user", "parts": [{"text": "Label it."}]}]
    assert body["generationConfig"] == {"responseMimeType": "application/json", "responseJsonSchema": SCHEMA}
    assert body["tools"] == [
        {"functionDeclarations": [{"name": "lookup", "description": "Find.", "parametersJsonSchema": SCHEMA}]}
    ]
    assert body["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}


def test_the_key_travels_in_its_header_and_never_in_repr(fake_gemini: FakeGemini) -> None:
    run_once(fake_gemini, Reply())
    assert fake_gemini.calls[0].headers["x-goog-api-key"] == fake_gemini.api_key
    assert fake_gemini.calls[0].headers["accept-encoding"] == "identity"
    binding = binding_for(fake_gemini, api_key="AIza-SECRET")
    assert "SECRET" not in repr(binding)
    anyio.run(binding.aclose)


def test_configuration_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="api_key"):
        Gemini(api_key="")
    with pytest.raises(ConfigurationError, match="base_url"):
        Gemini(api_key="k", base_url="generativelanguage.googleapis.com")


# --- answers ------------------------------------------------------------------------------------


def test_an_answer_is_its_text_usage_and_model_version(fake_gemini: FakeGemini) -> None:
    usage = {
        "promptTokenCount": 120,
        "cachedContentTokenCount": 100,
        "candidatesTokenCount": 5,
        "thoughtsTokenCount": 30,
        "totalTokenCount": 155,
    }
    result = run_once(fake_gemini, Reply("Hello there.", usage=usage, model="gemini-2.5-flash-001"))
    assert result == AIResult(
        response="Hello there.",
        model="gemini-2.5-flash-001",
        usage=Usage(prompt_tokens=120, completion_tokens=35, total_tokens=155, cached_input_tokens=100),
        finish_reason="stop",
    )


def test_thought_parts_are_not_the_answer(fake_gemini: FakeGemini) -> None:
    parts = [{"text": "Let me think.", "thought": True}, {"text": "Hi."}]
    body = {"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP"}]}
    result = run_once(fake_gemini, Raw(200, json.dumps(body).encode(), "application/json"))
    assert result.response == "Hi."


def test_function_calls_are_tool_calls(fake_gemini: FakeGemini) -> None:
    result = run_once(fake_gemini, Reply(None, tool_calls=({"name": "lookup", "arguments": {"id": 7}},)))
    assert result.response is None
    assert result.finish_reason == "tool_calls"
    assert result.tool_calls == (
        {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 7}'}},
    )


@pytest.mark.parametrize(
    "finish", ["content_filter", "RECITATION", "PROHIBITED_CONTENT", "BLOCKLIST", "SPII"]
)
def test_a_filtered_candidate_is_moderated_never_an_answer(fake_gemini: FakeGemini, finish: str) -> None:
    result = run_once(fake_gemini, Reply("never shown", finish_reason=finish))
    assert (result.moderated, result.response, result.finish_reason) == (True, None, "content_filter")


def test_a_blocked_prompt_is_moderated(fake_gemini: FakeGemini) -> None:
    result = run_once(fake_gemini, Reply(refusal="blocked"))
    assert (result.moderated, result.response, result.finish_reason) == (True, None, "content_filter")


def test_max_tokens_is_truncated(fake_gemini: FakeGemini) -> None:
    result = run_once(fake_gemini, Reply("Hel", finish_reason="length"))
    assert (result.truncated, result.finish_reason) == (True, "length")


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "kind", "status", "flags"),
    [
        pytest.param(
            Fail(status=429, retry_after="30"),
            Kind.model_rate_limited,
            429,
            {"retry_after_s": 30.0},
            id="rate",
        ),
        pytest.param(
            Fail(status=429, error_code="insufficient_quota", retry_after="3600"),
            Kind.model_quota_exhausted,
            429,
            {"quota_exhausted": True, "retry_after_s": 3600.0},
            id="per-day-quota",
        ),
        pytest.param(Fail(status=503), Kind.model_temporarily_unavailable, 503, {}, id="unavailable"),
        pytest.param(Fail(status=500), Kind.model_temporarily_unavailable, 500, {}, id="internal"),
        pytest.param(Fail(status=504), Kind.model_temporarily_unavailable, 504, {}, id="deadline"),
        pytest.param(
            Fail(status=400, error_code="context_length_exceeded"),
            Kind.context_length_exceeded,
            400,
            {"context_exceeded": True},
            id="context",
        ),
        pytest.param(Fail(status=400), Kind.model_incompatible, 400, {}, id="invalid-argument"),
        pytest.param(
            Fail(status=400, error_type="FAILED_PRECONDITION"),
            Kind.model_incompatible,
            400,
            {},
            id="precondition",
        ),
        pytest.param(Fail(status=403), Kind.model_incompatible, 403, {}, id="permission"),
        pytest.param(Fail(status=404), Kind.model_incompatible, 404, {}, id="not-found"),
        pytest.param(
            Raw(502, b"<html>bad gateway</html>"), Kind.model_temporarily_unavailable, 502, {}, id="html"
        ),
        pytest.param(
            Raw(302, b"", headers={"location": "/elsewhere"}), Kind.model_unavailable, 302, {}, id="redirect"
        ),
        pytest.param(Drop(), Kind.model_temporarily_unavailable, None, {}, id="dropped"),
        pytest.param(
            Raw(200, b"\x1f\x8b", "application/json", headers={"content-encoding": "gzip"}),
            Kind.model_unavailable,
            200,
            {"encoding_refused": True},
            id="gzip-refused",
        ),
    ],
)
def test_documented_failures(
    fake_gemini: FakeGemini, outcome: Outcome, kind: Kind, status: int | None, flags: dict[str, Any]
) -> None:
    error = failure_of(fake_gemini, outcome)
    assert (classify(error).kind, error.status) == (kind, status)
    for name, value in flags.items():
        assert getattr(error, name) == value, name


def test_a_wrong_key_is_the_operators_fault(fake_gemini: FakeGemini) -> None:
    error = failure_of(fake_gemini, api_key="wrong")
    assert (classify(error).kind, classify(error).status, error.status) == (Kind.model_incompatible, 502, 400)


def test_an_unparsable_retry_delay_is_no_wait(fake_gemini: FakeGemini) -> None:
    body = {
        "error": {
            "code": 429,
            "status": "RESOURCE_EXHAUSTED",
            "message": CANARY,
            "details": [
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1" * 5000 + "s"}
            ],
        }
    }
    error = failure_of(fake_gemini, Raw(429, json.dumps(body).encode(), "application/json"))
    assert (error.retry_after_s, classify(error).kind) == (None, Kind.model_rate_limited)


@pytest.mark.parametrize(
    "outcome",
    [
        pytest.param(Fail(status=429, message=CANARY), id="429"),
        pytest.param(
            Fail(status=400, message=f"The input token count exceeds the maximum number of tokens {CANARY}"),
            id="400",
        ),
        pytest.param(Raw(503, f"<html>{CANARY}</html>".encode()), id="html"),
        pytest.param(
            Raw(200, f'{{"candidates": [], "x": "{CANARY}"}}'.encode(), "application/json"), id="no-candidate"
        ),
    ],
)
def test_no_provider_text_in_an_error(fake_gemini: FakeGemini, outcome: Outcome) -> None:
    error = failure_of(fake_gemini, outcome)
    assert CANARY not in str(error)
    assert CANARY not in repr(vars(error))


# --- streams ------------------------------------------------------------------------------------


def test_a_stream_relays_text_reasoning_and_tool_calls(fake_gemini: FakeGemini) -> None:
    parts = (Reasoning("Hmm."), Text("Hel"), Text("lo."), ToolCall("lookup", {"id": 7}))
    events = stream_events(fake_gemini, Stream(parts, model="gemini-2.5-flash-001"))
    assert events == [
        ReasoningDelta("Hmm."),
        TextDelta("Hel"),
        TextDelta("lo."),
        ToolCallDelta(0, "call_0", "lookup", '{"id": 7}'),
        StreamEnd(
            finish_reason="tool_calls",
            usage=Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15),
            model="gemini-2.5-flash-001",
        ),
    ]
    assert fake_gemini.calls[0].headers["accept"] == "text/event-stream"


def test_a_reply_streams_as_one_text(fake_gemini: FakeGemini) -> None:
    events = stream_events(fake_gemini, Reply("Hello."))
    assert [type(e) for e in events] == [TextDelta, StreamEnd]


def test_a_filtered_stream_ends_as_filtered(fake_gemini: FakeGemini) -> None:
    events = stream_events(fake_gemini, Stream((Text("Hel"),), finish_reason="SAFETY"))
    assert events[-1] == StreamEnd(finish_reason="content_filter", usage=events[-1].usage, model=MODEL)  # type: ignore[union-attr]


def test_a_stream_cut_before_its_finish_is_truncated(fake_gemini: FakeGemini) -> None:
    seen, error = stream_failure(fake_gemini, Stream((Text("Hel"), Text("lo.")), cut_after=1))
    assert seen == [TextDelta("Hel")]
    assert (error.note, classify(error).kind) == ("stream truncated", Kind.model_temporarily_unavailable)


def test_an_error_event_after_the_first_output(fake_gemini: FakeGemini) -> None:
    outcome = Stream((Text("Hel"), Text("lo.")), error_after=1, error_code=503, error_message=CANARY)
    seen, error = stream_failure(fake_gemini, outcome)
    assert seen == [TextDelta("Hel")]
    assert (error.status, classify(error).kind) == (503, Kind.model_temporarily_unavailable)
    assert "error event" in error.note
    assert CANARY not in str(error)


def test_an_error_status_before_the_stream(fake_gemini: FakeGemini) -> None:
    seen, error = stream_failure(fake_gemini, Fail(status=429, retry_after="7"))
    assert (seen, error.status, error.retry_after_s) == ([], 429, 7.0)


# --- the in-process fake on this wire -----------------------------------------------------------


@pytest.mark.parametrize(
    "scripted",
    [
        pytest.param(Stream((Text("Hel"), Text("lo.")), error_after=1, error_code=503), id="error-event"),
        pytest.param(Stream((Text("Hel"), Text("lo.")), error_after=1, error_code=429), id="error-event-429"),
        pytest.param(
            Fail(status=429, error_code="insufficient_quota", retry_after="9"), id="quota-before-the-body"
        ),
        pytest.param(Fail(status=400, error_code="context_length_exceeded"), id="context-before-the-body"),
    ],
)
def test_a_stream_fails_in_process_as_over_http(fake_gemini: FakeGemini, scripted: Stream | Fail) -> None:
    fake = FakeBinding(wire="gemini")
    fake.script(MODEL, scripted)

    faked_events: list[StreamEvent] = []

    async def read() -> None:
        async for event in fake.stream(MODEL, INPUTS):
            faked_events.append(event)

    with pytest.raises(ProviderError) as info:
        anyio.run(read)
    faked = info.value
    served_events, served = stream_failure(fake_gemini, scripted)
    facts = ("provider", "code", "status", "retry_after_s", "quota_exhausted", "context_exceeded", "note")
    assert [getattr(faked, f) for f in facts] == [getattr(served, f) for f in facts]
    assert faked_events == served_events


@pytest.mark.parametrize(
    ("failure", "field"),
    [
        (Fail(code=3036, status=429), "code"),
        (Fail(status=500, shape="gateway"), "shape"),
        (Fail(status=400, error_code="content_filter"), "error_code"),
    ],
)
def test_what_the_gemini_wire_cannot_carry_is_refused(failure: Fail, field: str) -> None:
    with pytest.raises(ValueError, match=rf"Fail\({field}=.* gemini wire"):
        FakeBinding(wire="gemini").script(MODEL, failure)
