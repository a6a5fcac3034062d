"""The fakes are as strict as the providers they stand in for (what OpenAI's SDK checks is in
test_openai_sdk.py): shapes only a real provider would send, and the paths of the adapters that
only those shapes reach (refusals as moderation, Workers AI's own tool-call shape)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from app.service import create_app
from app.settings import Settings
from fixtures import Fail, FakeOpenAI, FakeWorkersAI, Refusal, Reply, Stream, Text, ToolCall
from guards import StreamEnd, TextDelta, ToolCallDelta
from guards.providers import OpenAICompatible, WorkersAI

from ..conftest import AppClient, assert_error, assert_fallback, run_binding_once

OPENAI_MODEL = "gpt-4o-mini"
WORKERS_MODEL = "@cf/meta/llama-3.3-70b-instruct-fp8-fast"
INPUTS: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}]}
FLAT_CALL = {"name": "lookup", "arguments": {"id": 7}}
OPENAI_CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 7}'}}


def post_openai(server: FakeOpenAI, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/chat/completions",
        json={"model": OPENAI_MODEL, "messages": INPUTS["messages"], **body},
        headers={"authorization": f"Bearer {server.api_key}"},
    )


def events_of(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream, `[DONE]` as the string."""
    payloads = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


# --- OpenAI: usage only when asked --------------------------------------------------------------


def test_openai_sends_no_usage_chunk_unless_asked(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(OPENAI_MODEL, Stream(parts=(Text("Hel"), Text("lo."))))
    *chunks, done = events_of(post_openai(fake_openai, {"stream": True}))
    assert done == "[DONE]"
    assert all(chunk["choices"] and "usage" not in chunk for chunk in chunks)


def test_openai_sends_the_usage_chunk_when_asked(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(OPENAI_MODEL, Stream(parts=(Text("Hel"), Text("lo."))))
    body = {"stream": True, "stream_options": {"include_usage": True}}
    *chunks, usage, done = events_of(post_openai(fake_openai, body))
    assert (usage["choices"], usage["usage"]["total_tokens"], done) == ([], 15, "[DONE]")
    assert all(chunk["choices"] and chunk["usage"] is None for chunk in chunks)


def test_the_adapter_asks_for_usage_and_gets_it(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(OPENAI_MODEL, Stream(parts=(Text("Hel"), Text("lo."))))

    async def stream() -> list[Any]:
        binding = OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)
        try:
            return [event async for event in binding.stream(OPENAI_MODEL, INPUTS)]
        finally:
            await binding.aclose()

    events = asyncio.run(stream())
    assert fake_openai.calls[-1].inputs["stream_options"] == {"include_usage": True}
    assert isinstance(events[-1], StreamEnd)
    assert events[-1].usage is not None
    assert events[-1].usage.total_tokens == 15


# --- OpenAI: what every answer carries ------------------------------------------------------------


def test_openai_answers_carry_what_openai_always_sends(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(OPENAI_MODEL, Reply("Hi."))
    response = post_openai(fake_openai, {})
    body = response.json()
    assert response.headers["x-request-id"].startswith("req_")
    assert body["system_fingerprint"]
    [choice] = body["choices"]
    assert (choice["logprobs"], choice["message"]["refusal"], choice["message"]["content"]) == (
        None,
        None,
        "Hi.",
    )


def test_openai_default_rate_limit_is_openais(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(OPENAI_MODEL, Fail(status=429))
    response = post_openai(fake_openai, {})
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["code"], error["param"]) == (
        429,
        "requests",
        "rate_limit_exceeded",
        None,
    )
    assert error["message"].startswith(f"Rate limit reached for {OPENAI_MODEL}")
    assert response.headers["x-request-id"].startswith("req_")


# --- refusals reach the adapter's moderation path ------------------------------------------------


def test_a_refusal_is_moderated(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(OPENAI_MODEL, Reply(refusal="I can't help with that."))
    result = run_binding_once(
        lambda: OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url),
        OPENAI_MODEL,
        INPUTS,
    )
    assert result.moderated
    assert result.response is None


def test_a_streamed_refusal_ends_as_filtered(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(OPENAI_MODEL, Stream(parts=(Refusal("I can't"), Refusal(" help."))))

    async def stream() -> list[Any]:
        binding = OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)
        try:
            return [event async for event in binding.stream(OPENAI_MODEL, INPUTS)]
        finally:
            await binding.aclose()

    [end] = asyncio.run(stream())
    assert isinstance(end, StreamEnd)
    assert end.finish_reason == "content_filter"


@pytest.fixture
def openai_app(fake_openai: FakeOpenAI, app_client: AppClient) -> httpx.Client:
    settings = Settings(
        ai_provider="openai",
        openai_base_url=fake_openai.base_url,
        openai_api_key=fake_openai.api_key or "",
        ai_model=OPENAI_MODEL,
        breaker_failure_threshold=1000,
    )
    return app_client(create_app(settings))


def test_a_refusal_over_http_is_moderation_blocked(openai_app: httpx.Client, fake_openai: FakeOpenAI) -> None:
    """The example app on the OpenAI wire: a refused draft is 502, a refused summary the
    keyword fallback with `moderation_blocked`, a refused stream 502 before any event."""
    fake_openai.script(OPENAI_MODEL, Reply(refusal="No."))
    assert_error(
        openai_app.post("/draft-reply", json={"message": "Hi"}), 502, "incompatible_model_response", False
    )
    fake_openai.script(OPENAI_MODEL, Reply(refusal="No."))
    body = assert_fallback(
        openai_app.post("/summary", json={"text": "refund"}),
        "output",
        "moderation_blocked",
        {"label": "billing", "confidence": 0.3},
    )
    assert body["fallback"]["detail"] == "the provider flagged the completion"
    fake_openai.script(OPENAI_MODEL, Stream(parts=(Refusal("No."),)))
    streamed = openai_app.post("/draft-reply/stream", json={"message": "Hi"})
    assert_error(streamed, 502, "incompatible_model_response", False)
    assert len(fake_openai.calls) == 3


# --- Workers AI: tool calls in its own flat shape ---------------------------------------------


def workers_ai(server: FakeWorkersAI) -> WorkersAI:
    return WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url)


@pytest.mark.parametrize("call", [FLAT_CALL, OPENAI_CALL], ids=["scripted-flat", "scripted-openai"])
def test_workers_ai_tool_calls_are_flat(fake_workers_ai: FakeWorkersAI, call: dict[str, Any]) -> None:
    """Whichever shape they are scripted in, a Workers AI answer carries `{"name", "arguments":
    {...}}`, and the adapter returns them as sent."""
    fake_workers_ai.script(WORKERS_MODEL, Reply(None, tool_calls=(call,)))
    result = run_binding_once(lambda: workers_ai(fake_workers_ai), WORKERS_MODEL, INPUTS)
    assert result.tool_calls == (FLAT_CALL,)
    assert result.response is None


@pytest.mark.parametrize("call", [FLAT_CALL, OPENAI_CALL], ids=["scripted-flat", "scripted-openai"])
def test_openai_tool_calls_are_nested(fake_openai: FakeOpenAI, call: dict[str, Any]) -> None:
    fake_openai.script(OPENAI_MODEL, Reply(None, tool_calls=(call,), finish_reason="tool_calls"))
    result = run_binding_once(
        lambda: OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url),
        OPENAI_MODEL,
        INPUTS,
    )
    [sent] = result.tool_calls
    assert sent == {**OPENAI_CALL, "id": sent["id"]}


def test_workers_ai_streams_a_whole_tool_call_flat(fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(WORKERS_MODEL, Stream(parts=(Text("Looking."), ToolCall("lookup", {"id": 7}))))
    response = httpx.post(
        f"{fake_workers_ai.base_url}/accounts/{fake_workers_ai.account_id}/ai/run/{WORKERS_MODEL}",
        json={**INPUTS, "stream": True},
        headers={"authorization": f"Bearer {fake_workers_ai.api_token}"},
    )
    assert events_of(response)[1] == {"response": "", "tool_calls": [FLAT_CALL]}

    async def stream() -> list[Any]:
        binding = workers_ai(fake_workers_ai)
        try:
            return [event async for event in binding.stream(WORKERS_MODEL, INPUTS)]
        finally:
            await binding.aclose()

    fake_workers_ai.script(WORKERS_MODEL, Reply("Looking.", tool_calls=(FLAT_CALL,)))  # as a stream
    events = asyncio.run(stream())
    assert events[:2] == [TextDelta("Looking."), ToolCallDelta(0, name="lookup", arguments='{"id": 7}')]
    assert isinstance(events[2], StreamEnd)


# --- a default chosen per call (the soak's hook) ------------------------------------------------


def post_workers_ai(server: FakeWorkersAI, content: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/accounts/{server.account_id}/ai/run/{WORKERS_MODEL}",
        json={"messages": [{"role": "user", "content": content}]},
        headers={"authorization": f"Bearer {server.api_token}"},
    )


def test_a_chooser_picks_each_calls_outcome_from_its_inputs(fake_workers_ai: FakeWorkersAI) -> None:
    """A function as `default` is asked once per call that has no queued outcome, with the
    model and the request's JSON body; queued outcomes still go first."""
    asked: list[tuple[str, str]] = []

    def choose(model: str, inputs: Any) -> Fail | Reply:
        content = inputs["messages"][0]["content"]
        asked.append((model, content))
        return Fail(code=3040, status=429) if content == "busy" else Reply(f"echo {content}")

    fake_workers_ai.default = choose
    fake_workers_ai.script(WORKERS_MODEL, Reply("queued"))
    answers = [post_workers_ai(fake_workers_ai, content) for content in ("first", "second", "busy")]
    assert [a.json()["result"]["response"] if a.status_code == 200 else a.status_code for a in answers] == [
        "queued",
        "echo second",
        429,
    ]
    assert answers[2].json()["errors"][0]["code"] == 3040
    assert asked == [(WORKERS_MODEL, "second"), (WORKERS_MODEL, "busy")]
    assert len(fake_workers_ai.calls) == 3


def test_a_script_that_does_not_record_keeps_no_calls(fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.record = False
    assert post_workers_ai(fake_workers_ai, "hello").status_code == 200
    assert fake_workers_ai.calls == []
    fake_workers_ai.record = True
    assert post_workers_ai(fake_workers_ai, "hello").status_code == 200
    assert len(fake_workers_ai.calls) == 1
