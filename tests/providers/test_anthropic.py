"""The `Anthropic` binding against the fake Anthropic server over real HTTP: the request it
sends for Workers-AI-shaped inputs, the answer and the stream it reads, each documented failure
as a `ProviderError` the classifier reads, and the in-process fake on Anthropic's wire giving
the same events and failures as the adapter over HTTP."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest
from fastapi import FastAPI

from fixtures import (
    Fail,
    FakeAnthropic,
    FakeBinding,
    Hang,
    Meta,
    Raw,
    Reasoning,
    Reply,
    Stream,
    Text,
    ToolArgs,
    ToolName,
)
from fixtures.script import Outcome
from guards import (
    AI,
    AIResult,
    ConfigurationError,
    Guards,
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
from guards.providers import Anthropic
from guards.testing import UseFakeAI, UseFakeServers
from guards.testing.fake_binding import wire_of

from ..conftest import AppClient, no_sleep

MODEL = "claude-sonnet-4-5"
SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}
JSON_MODE = {"type": "json_schema", "json_schema": SCHEMA}


def binding(server: FakeAnthropic, **options: Any) -> Anthropic:
    return Anthropic(api_key=server.api_key, base_url=server.base_url, **options)


def run(
    server: FakeAnthropic, inputs: dict[str, Any], outcome: Outcome | None = None, **options: Any
) -> AIResult:
    if outcome is not None:
        server.script(MODEL, outcome)

    async def go() -> AIResult:
        adapter = binding(server, **options)
        try:
            return await adapter.run(MODEL, inputs)
        finally:
            await adapter.aclose()

    return anyio.run(go)


def failure(server: FakeAnthropic, outcome: Outcome) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        run(server, {"prompt": "hi"}, outcome)
    return info.value


def streamed(adapter: Any, inputs: dict[str, Any]) -> tuple[list[StreamEvent], ProviderError | None]:
    async def go() -> tuple[list[StreamEvent], ProviderError | None]:
        events: list[StreamEvent] = []
        try:
            async for event in adapter.stream(MODEL, inputs):
                events.append(event)
        except ProviderError as error:
            return events, error
        finally:
            await adapter.aclose()
        return events, None

    return anyio.run(go)


# --- the request ----------------------------------------------------------------------------------


def test_the_request_in_anthropics_words(fake_anthropic: FakeAnthropic) -> None:
    inputs = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "weather", "description": "Now.", "parameters": SCHEMA}}
        ],
        "tool_choice": "required",
        "max_tokens": 300,
        "stop": "END",
        "temperature": 0.2,
        "seed": 7,  # not Anthropic's: dropped
        "raw": True,
    }
    run(fake_anthropic, inputs, Reply("Sunny."))
    [call] = fake_anthropic.calls
    assert call.inputs == {
        "model": MODEL,
        "max_tokens": 300,
        "temperature": 0.2,
        "stop_sequences": ["END"],
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}],
            },
        ],
        "tools": [{"name": "weather", "description": "Now.", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any"},
    }
    assert call.headers["x-api-key"] == fake_anthropic.api_key
    assert call.headers["anthropic-version"] == "2023-06-01"
    assert call.headers["accept-encoding"] == "identity"


def test_max_tokens_is_always_sent(fake_anthropic: FakeAnthropic) -> None:
    run(fake_anthropic, {"prompt": "hi"}, Reply("Hello."), default_max_tokens=1000)
    assert fake_anthropic.calls[0].inputs["max_tokens"] == 1000


def test_json_mode_is_a_forced_tool_whose_input_is_the_answer(fake_anthropic: FakeAnthropic) -> None:
    result = run(
        fake_anthropic, {"prompt": "Label it.", "response_format": JSON_MODE}, Reply({"label": "billing"})
    )
    assert (result.response, result.tool_calls, result.finish_reason) == ({"label": "billing"}, (), "stop")
    sent = fake_anthropic.calls[0].inputs
    assert sent["tools"] == [
        {"name": "json_answer", "description": "Give the answer.", "input_schema": SCHEMA}
    ]
    assert sent["tool_choice"] == {"type": "tool", "name": "json_answer"}


def test_json_mode_with_thinking_lets_the_model_choose(fake_anthropic: FakeAnthropic) -> None:
    """A forced tool is refused with extended thinking."""
    thinking = {"type": "enabled", "budget_tokens": 1024}
    run(fake_anthropic, {"prompt": "hi", "response_format": JSON_MODE, "thinking": thinking}, Reply("{}"))
    sent = fake_anthropic.calls[0].inputs
    assert (sent["thinking"], sent["tool_choice"]) == (thinking, {"type": "auto"})


def test_a_schema_that_is_no_object_is_asked_for_in_the_system_prompt(fake_anthropic: FakeAnthropic) -> None:
    schema = {"type": "array", "items": {"type": "integer"}}
    result = run(
        fake_anthropic,
        {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": schema}},
        Reply("[1, 2]"),
    )
    assert result.response == "[1, 2]"  # the output guard parses it
    sent = fake_anthropic.calls[0].inputs
    assert "tools" not in sent
    assert sent["system"].endswith(json.dumps(schema, separators=(",", ":")))


# --- the answer -----------------------------------------------------------------------------------


def test_usage_counts_every_input_token_once(fake_anthropic: FakeAnthropic) -> None:
    usage = {
        "input_tokens": 100,
        "output_tokens": 7,
        "cache_read_input_tokens": 900,
        "cache_creation_input_tokens": 50,
    }
    result = run(
        fake_anthropic, {"prompt": "hi"}, Reply("Hello.", usage=usage, model="claude-sonnet-4-5-20250929")
    )
    assert result.usage == Usage(1050, 7, 1057, cached_input_tokens=900, cache_write_tokens=50)
    assert result.model == "claude-sonnet-4-5-20250929"


def test_tool_use_blocks_are_tool_calls(fake_anthropic: FakeAnthropic) -> None:
    outcome = Reply(None, tool_calls=({"id": "toolu_9", "name": "lookup", "arguments": {"id": 7}},))
    result = run(fake_anthropic, {"prompt": "hi"}, outcome)
    assert result.tool_calls == (
        {"id": "toolu_9", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 7}'}},
    )
    assert (result.response, result.finish_reason) == ("", "tool_calls")


@pytest.mark.parametrize(
    ("outcome", "moderated", "truncated", "finish"),
    [
        pytest.param(Reply(refusal="I can't help with that."), True, False, "content_filter", id="refusal"),
        pytest.param(Reply("Hel", finish_reason="max_tokens"), False, True, "length", id="max-tokens"),
        pytest.param(Reply("Hi.", finish_reason="stop_sequence"), False, False, "stop", id="stop-sequence"),
    ],
)
def test_stop_reasons(
    fake_anthropic: FakeAnthropic, outcome: Reply, moderated: bool, truncated: bool, finish: str
) -> None:
    result = run(fake_anthropic, {"prompt": "hi"}, outcome)
    assert (result.moderated, result.truncated, result.finish_reason) == (moderated, truncated, finish)


# --- failures -------------------------------------------------------------------------------------

LONG = "prompt is too long: 210000 tokens > 200000 maximum"

FAILURES = [
    pytest.param(Fail(status=529), 529, "overloaded_error", Kind.model_temporarily_unavailable, id="529"),
    pytest.param(Fail(status=500), 500, "api_error", Kind.model_temporarily_unavailable, id="500"),
    pytest.param(Fail(status=504), 504, "timeout_error", Kind.model_temporarily_unavailable, id="504"),
    pytest.param(
        Fail(status=429, retry_after="7"), 429, "rate_limit_error", Kind.model_rate_limited, id="429"
    ),
    pytest.param(
        Fail(status=400, message=LONG),
        400,
        "invalid_request_error",
        Kind.context_length_exceeded,
        id="400-long",
    ),
    pytest.param(Fail(status=413), 413, "request_too_large", Kind.context_length_exceeded, id="413"),
    pytest.param(Fail(status=400), 400, "invalid_request_error", Kind.model_incompatible, id="400"),
    pytest.param(Fail(status=401), 401, "authentication_error", Kind.model_unavailable, id="401"),
    pytest.param(Fail(status=403), 403, "permission_error", Kind.model_incompatible, id="403"),
    pytest.param(Fail(status=404), 404, "not_found_error", Kind.model_incompatible, id="404"),
    pytest.param(Fail(status=402), 402, "billing_error", Kind.model_quota_exhausted, id="402"),
    pytest.param(
        Fail(status=400, message="Your credit balance is too low to access the Anthropic API."),
        400,
        "invalid_request_error",
        Kind.model_quota_exhausted,
        id="400-credit-balance",
    ),
    pytest.param(
        Raw(502, b"<html>502 Bad Gateway</html>"),
        502,
        "non-JSON body",
        Kind.model_temporarily_unavailable,
        id="html-502",
    ),
]


@pytest.mark.parametrize(("outcome", "status", "note", "kind"), FAILURES)
def test_documented_failures(
    fake_anthropic: FakeAnthropic, outcome: Outcome, status: int, note: str, kind: Kind
) -> None:
    error = failure(fake_anthropic, outcome)
    assert (error.provider, error.status, error.note, error.code) == ("anthropic", status, note, None)
    assert classify(error).kind == kind
    assert classify(error).status in (400, 502, 503)  # never the client's fault but a context window
    if status == 429:
        assert error.retry_after_s == 7.0


def test_a_rate_limit_reset_without_retry_after(fake_anthropic: FakeAnthropic) -> None:
    """No limit spent: the earliest reset; the time it names is kept for the store's clock."""
    soon, later = time.time() + 30, time.time() + 90
    stamp = time.strftime
    headers = {
        "anthropic-ratelimit-tokens-reset": stamp("%Y-%m-%dT%H:%M:%SZ", time.gmtime(later)),
        "anthropic-ratelimit-requests-reset": stamp("%Y-%m-%dT%H:%M:%SZ", time.gmtime(soon)),
    }
    body = b'{"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}'
    error = failure(fake_anthropic, Raw(429, body, content_type="application/json", headers=headers))
    assert error.retry_after_s is not None
    assert 20 <= error.retry_after_s <= 31
    assert error.retry_at == pytest.approx(int(soon), abs=1)


# --- the stream -----------------------------------------------------------------------------------


def test_a_stream_of_every_part(fake_anthropic: FakeAnthropic) -> None:
    parts = (
        Meta(),
        Reasoning("Hmm."),
        Text("Hel"),
        Text("lo."),
        ToolName(0, "toolu_1", "lookup"),
        ToolArgs(0, '{"id": 7}'),
    )
    usage = {"input_tokens": 20, "output_tokens": 9, "cache_read_input_tokens": 80}
    fake_anthropic.script(
        MODEL, Stream(parts=parts, usage=usage, finish_reason="tool_calls", model="claude-x")
    )
    events, error = streamed(binding(fake_anthropic), {"prompt": "hi"})
    assert error is None
    assert events == [
        ReasoningDelta("Hmm."),
        TextDelta("Hel"),
        TextDelta("lo."),
        ToolCallDelta(0, id="toolu_1", name="lookup"),
        ToolCallDelta(0, arguments='{"id": 7}'),
        StreamEnd("tool_calls", Usage(100, 9, 109, cached_input_tokens=80), "claude-x"),
    ]
    assert fake_anthropic.calls[0].headers["accept"] == "text/event-stream"


def test_a_json_stream_is_the_answer_tools_input_as_text(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(MODEL, Stream(parts=(Text('{"label":'), Text(' "billing"}'))))
    events, error = streamed(binding(fake_anthropic), {"prompt": "hi", "response_format": JSON_MODE})
    assert error is None
    assert events[:2] == [TextDelta('{"label":'), TextDelta(' "billing"}')]
    assert isinstance(events[-1], StreamEnd)
    assert events[-1].finish_reason == "stop"


STREAM_FAILURES = [
    pytest.param(
        Stream(parts=(Text("Hel"), Text("lo")), error_after=1),
        529,
        "overloaded_error event",
        id="overloaded-event",
    ),
    pytest.param(
        Stream(parts=(Text("Hel"),), error_after=0, error_code=500),
        500,
        "api_error event",
        id="api-error-event",
    ),
    pytest.param(
        Stream(parts=(Text("Hel"), Text("lo")), done=False), None, "stream truncated", id="no-message-stop"
    ),
    pytest.param(Stream(parts=(Text("Hel"), Text("lo")), cut_after=1), None, "stream truncated", id="cut"),
    pytest.param(Fail(status=529), 529, "overloaded_error", id="529-before-the-body"),
]


@pytest.mark.parametrize(("outcome", "status", "note"), STREAM_FAILURES)
def test_a_stream_fails_in_process_as_over_http(
    fake_anthropic: FakeAnthropic, outcome: Outcome, status: int | None, note: str
) -> None:
    """`FakeBinding(wire="anthropic")` plays the same events and the same failure as the
    adapter reading the fake server."""
    fake = FakeBinding(wire="anthropic")
    fake.script(MODEL, outcome)
    fake_anthropic.script(MODEL, outcome)
    served_events, served = streamed(binding(fake_anthropic), {"prompt": "hi"})
    faked_events, faked = streamed(fake, {"prompt": "hi"})
    assert served is not None
    assert faked is not None
    facts = ("provider", "status", "note", "retry_after_s", "quota_exhausted", "context_exceeded")
    assert [getattr(faked, f) for f in facts] == [getattr(served, f) for f in facts]
    assert (served.status, served.note) == (status, note)
    assert faked_events == served_events


def test_a_stream_that_stalls_fails_and_closes_the_connection(fake_anthropic: FakeAnthropic) -> None:
    """Pings count as events (the model is working); silence after them is a stall."""
    fake_anthropic.script(MODEL, Stream(parts=(Text("Hel"), Meta(), Text("lo")), stall_after=2))
    events, error = streamed(binding(fake_anthropic, idle_timeout_s=0.3), {"prompt": "hi"})
    assert events == [TextDelta("Hel")]
    assert error is not None
    assert (error.status, error.note) == (None, "stream stalled")
    assert fake_anthropic.wait_for(lambda calls: calls[0].disconnected)


def test_cancelling_a_call_closes_the_connection(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(MODEL, Hang())

    async def go() -> None:
        adapter = binding(fake_anthropic)
        with anyio.move_on_after(0.3):
            await adapter.run(MODEL, {"prompt": "hi"})
        await adapter.aclose()

    anyio.run(go)
    assert fake_anthropic.wait_for(lambda calls: len(calls) == 1 and calls[0].disconnected)


def test_a_stream_of_too_many_tool_calls_fails(fake_anthropic: FakeAnthropic) -> None:
    start = {
        "type": "content_block_start",
        "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
    }
    body = b"".join(
        b"event: content_block_start\ndata: " + json.dumps({**start, "index": i}).encode() + b"\n\n"
        for i in range(1100)
    )
    fake_anthropic.script(MODEL, Raw(200, body, content_type="text/event-stream"))
    events, error = streamed(binding(fake_anthropic), {"prompt": "hi"})
    assert error is not None
    assert error.note == "too many tool calls"
    assert len(events) == 1024


# --- the binding in an app ------------------------------------------------------------------------


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="api_key"):
        Anthropic(api_key="")
    with pytest.raises(ConfigurationError, match="default_max_tokens"):
        Anthropic(api_key="k", default_max_tokens=0)
    assert "sk-ant-secret" not in repr(Anthropic(api_key="sk-ant-secret"))


def anthropic_app() -> FastAPI:
    guards = Guards(Anthropic(api_key="sk-ant-unused", base_url="http://127.0.0.1:9"), sleep=no_sleep)
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, timeout_s=5)
    async def label(ai: AI[dict[str, str]]) -> dict[str, str]:
        return await ai.run({"prompt": "Label it."})

    return app


@pytest.mark.parametrize(
    ("outcome", "status", "body"),
    [
        pytest.param(Reply({"label": "billing"}), 200, {"label": "billing"}, id="answer"),
        pytest.param(
            Fail(status=529), 503, {"error": "model_temporarily_unavailable", "retryable": True}, id="529"
        ),
        pytest.param(
            Fail(status=400, message=LONG),
            400,
            {"error": "context_length_exceeded", "retryable": False},
            id="long",
        ),
    ],
)
def test_use_fake_servers_answers_as_use_fake_ai(
    use_fake_ai: UseFakeAI,
    use_fake_servers: UseFakeServers,
    fake_anthropic: FakeAnthropic,
    app_client: AppClient,
    outcome: Outcome,
    status: int,
    body: dict[str, Any],
) -> None:
    faked, served = anthropic_app(), anthropic_app()
    fake = use_fake_ai(faked)
    use_fake_servers(served)
    assert wire_of(Guards.of(faked).binding) == "anthropic"
    fake.script(MODEL, outcome, outcome)
    fake_anthropic.script(MODEL, outcome, outcome)
    answers = [app_client(app).post("/label") for app in (faked, served)]
    for answer in answers:
        assert answer.status_code == status
        assert {k: v for k, v in answer.json().items() if k not in ("trace_id", "problems")} == body
    assert len(fake.calls) == len(fake_anthropic.calls)


@pytest.mark.parametrize(
    ("failure_", "field"),
    [
        pytest.param(Fail(code=3040, status=429), "code", id="numeric-code"),
        pytest.param(Fail(status=400, error_code="context_length_exceeded"), "error_code", id="error-code"),
        pytest.param(Fail(status=400, shape="gateway"), "shape", id="gateway-shape"),
    ],
)
def test_a_field_the_wire_cannot_carry_is_refused(use_fake_ai: UseFakeAI, failure_: Fail, field: str) -> None:
    fake = use_fake_ai(anthropic_app())
    with pytest.raises(ValueError, match=rf"Fail\({field}=.* anthropic wire"):
        fake.script("*", failure_)
