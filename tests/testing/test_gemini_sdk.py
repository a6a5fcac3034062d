"""`FakeGemini` as Google's own Python SDK sees it: the official `google-genai` client (a
test-only dependency), async, pointed at the fake. Every answer the fake sends must parse into
the SDK's own types, and every failure must raise the SDK's `APIError` subclass with Gemini's
code and status. If the fake drifts from Gemini's wire, these fail."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from google import genai
from google.genai import errors, types
from google.genai.client import AsyncClient

from fixtures import Fail, FakeGemini, Reasoning, Reply, Stream, Text, ToolCall

MODEL = "gemini-2.5-flash"


def client(server: FakeGemini, api_key: str | None = None) -> AsyncClient:
    """The SDK's async client for `server` (closed by `async with`), its own retries off."""
    options = types.HttpOptions(
        base_url=server.base_url, timeout=5_000, retry_options=types.HttpRetryOptions(attempts=1)
    )
    return genai.Client(api_key=api_key or server.api_key, http_options=options).aio


def generate(server: FakeGemini, api_key: str | None = None, **options: Any) -> types.GenerateContentResponse:
    async def call() -> types.GenerateContentResponse:
        async with client(server, api_key) as sdk:
            return await sdk.models.generate_content(model=MODEL, contents="Say hello.", **options)

    return anyio.run(call)


def stream(server: FakeGemini) -> list[types.GenerateContentResponse]:
    async def call() -> list[types.GenerateContentResponse]:
        async with client(server) as sdk:
            chunks = await sdk.models.generate_content_stream(model=MODEL, contents="Say hello.")
            return [chunk async for chunk in chunks]

    return anyio.run(call)


def test_an_answer(fake_gemini: FakeGemini) -> None:
    fake_gemini.script(MODEL, Reply("Hello there.", model="gemini-2.5-flash-001"))
    answer = generate(fake_gemini, config=types.GenerateContentConfig(system_instruction="Be brief."))
    assert answer.text == "Hello there."
    assert answer.model_version == "gemini-2.5-flash-001"
    assert answer.candidates is not None
    assert answer.candidates[0].finish_reason == types.FinishReason.STOP
    assert answer.usage_metadata is not None
    assert answer.usage_metadata.total_token_count == 15
    [call] = fake_gemini.calls
    assert call.headers["x-goog-api-key"] == fake_gemini.api_key
    assert call.inputs["systemInstruction"]["parts"] == [{"text": "Be brief."}]


def test_json_mode(fake_gemini: FakeGemini) -> None:
    fake_gemini.script(MODEL, Reply({"label": "billing"}))
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    config = types.GenerateContentConfig(response_mime_type="application/json", response_json_schema=schema)
    assert generate(fake_gemini, config=config).parsed == {"label": "billing"}
    sent = fake_gemini.calls[0].inputs["generationConfig"]
    assert (sent["responseMimeType"], sent["responseJsonSchema"]) == ("application/json", schema)


def test_a_function_call(fake_gemini: FakeGemini) -> None:
    fake_gemini.script(MODEL, Reply(None, tool_calls=({"name": "lookup", "arguments": {"id": 7}},)))
    [call] = generate(fake_gemini).function_calls or []
    assert (call.name, call.args) == ("lookup", {"id": 7})


def test_a_filtered_answer_and_a_blocked_prompt(fake_gemini: FakeGemini) -> None:
    fake_gemini.script(MODEL, Reply(finish_reason="content_filter"), Reply(refusal="no"))
    filtered = generate(fake_gemini)
    assert filtered.candidates is not None
    assert filtered.candidates[0].finish_reason == types.FinishReason.SAFETY
    assert filtered.candidates[0].content is None
    blocked = generate(fake_gemini)
    assert blocked.candidates is None
    assert blocked.prompt_feedback is not None
    assert blocked.prompt_feedback.block_reason == types.BlockedReason.SAFETY


def test_a_stream(fake_gemini: FakeGemini) -> None:
    parts = (Reasoning("Thinking."), Text("Hel"), Text("lo."), ToolCall("lookup", {"id": 7}))
    fake_gemini.script(MODEL, Stream(parts=parts))
    chunks = stream(fake_gemini)
    texts = [p for c in chunks for p in (c.candidates or [])[0].content.parts or [] if p.text]  # type: ignore[union-attr]
    assert [(p.text, bool(p.thought)) for p in texts] == [("Thinking.", True), ("Hel", False), ("lo.", False)]
    assert [(c.name, c.args) for chunk in chunks for c in chunk.function_calls or []] == [
        ("lookup", {"id": 7})
    ]
    last = chunks[-1]
    assert last.candidates is not None
    assert last.candidates[0].finish_reason == types.FinishReason.STOP
    assert last.usage_metadata is not None
    assert last.usage_metadata.total_token_count == 15


def test_an_error_in_a_stream(fake_gemini: FakeGemini) -> None:
    fake_gemini.script(MODEL, Stream(parts=(Text("Hel"), Text("lo.")), error_after=1, error_code=503))
    with pytest.raises(errors.ServerError) as info:
        stream(fake_gemini)
    assert (info.value.code, info.value.status) == (503, "UNAVAILABLE")


@pytest.mark.parametrize(
    ("outcome", "exception", "code", "status"),
    [
        pytest.param(
            Fail(status=429, retry_after="30"), errors.ClientError, 429, "RESOURCE_EXHAUSTED", id="429"
        ),
        pytest.param(
            Fail(status=429, error_code="insufficient_quota"),
            errors.ClientError,
            429,
            "RESOURCE_EXHAUSTED",
            id="429-per-day",
        ),
        pytest.param(
            Fail(status=400, error_code="context_length_exceeded"),
            errors.ClientError,
            400,
            "INVALID_ARGUMENT",
            id="400-context",
        ),
        pytest.param(
            Fail(status=400, error_type="FAILED_PRECONDITION"),
            errors.ClientError,
            400,
            "FAILED_PRECONDITION",
            id="400-precondition",
        ),
        pytest.param(Fail(status=403), errors.ClientError, 403, "PERMISSION_DENIED", id="403"),
        pytest.param(Fail(status=404), errors.ClientError, 404, "NOT_FOUND", id="404"),
        pytest.param(Fail(status=500), errors.ServerError, 500, "INTERNAL", id="500"),
        pytest.param(Fail(status=503), errors.ServerError, 503, "UNAVAILABLE", id="503"),
        pytest.param(Fail(status=504), errors.ServerError, 504, "DEADLINE_EXCEEDED", id="504"),
    ],
)
def test_documented_failures(
    fake_gemini: FakeGemini, outcome: Fail, exception: type[errors.APIError], code: int, status: str
) -> None:
    fake_gemini.script(MODEL, outcome)
    with pytest.raises(exception) as info:
        generate(fake_gemini)
    assert (info.value.code, info.value.status) == (code, status)
    assert isinstance(info.value.message, str)
    assert info.value.message


def test_a_rate_limit_carries_its_retry_info_and_quota(fake_gemini: FakeGemini) -> None:
    fake_gemini.script(
        MODEL, Fail(status=429, retry_after="30"), Fail(status=429, error_code="insufficient_quota")
    )
    quotas = []
    for _ in range(2):
        with pytest.raises(errors.ClientError) as info:
            generate(fake_gemini)
        details = {d["@type"].rsplit(".", 1)[1]: d for d in info.value.details["error"]["details"]}
        quotas.append(details["QuotaFailure"]["violations"][0]["quotaId"])
        if "RetryInfo" in details:
            assert details["RetryInfo"]["retryDelay"] == "30s"
    assert quotas == [
        "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
        "GenerateRequestsPerDayPerProjectPerModel-FreeTier",
    ]


def test_a_wrong_key(fake_gemini: FakeGemini) -> None:
    with pytest.raises(errors.ClientError) as info:
        generate(fake_gemini, "wrong")
    assert (info.value.code, info.value.status) == (400, "INVALID_ARGUMENT")
    assert fake_gemini.calls == []
