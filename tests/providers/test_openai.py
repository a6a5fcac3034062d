"""The OpenAI-compatible adapter (`guards.providers.OpenAICompatible`) against the fake HTTP server.

Workers-AI-shaped inputs become a chat completion request; every failure shape of PROTOCOLS.md
ends as a `ProviderError` carrying the HTTP status (and quota or retry hints), never the
provider's own text.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from typing import Any

import pytest

from fixtures import Drop, Fail, FakeOpenAI, Raw, Reply
from fixtures.script import Outcome
from guards import AIResult, ConfigurationError, Kind, ProviderError, Usage, classify
from guards.providers import OpenAICompatible

from ..conftest import run_binding_once

MODEL = "gpt-4o-mini"
INPUTS: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}]}
CANARY = "CANARY-PROVIDER-TEXT"
SCHEMA: dict[str, Any] = {
    "title": "Summary",
    "type": "object",
    "properties": {"label": {"type": "string", "maxLength": 80}, "confidence": {"type": "number"}},
    "required": ["label", "confidence"],
}
JSON_MODE = {"type": "json_schema", "json_schema": SCHEMA}


def binding_for(server: FakeOpenAI, **overrides: Any) -> OpenAICompatible:
    options: dict[str, Any] = {"api_key": server.api_key, "base_url": server.base_url}
    options.update(overrides)
    return OpenAICompatible(**options)


def run_once(
    server: FakeOpenAI,
    outcome: Outcome | None = None,
    *,
    inputs: dict[str, Any] = INPUTS,
    **overrides: Any,
) -> AIResult:
    """One call through a fresh binding (closed afterwards), with `outcome` scripted first."""
    if outcome is not None:
        server.script(MODEL, outcome)
    return run_binding_once(lambda: binding_for(server, **overrides), MODEL, inputs)


def failure_of(
    server: FakeOpenAI, outcome: Outcome | None = None, *, inputs: dict[str, Any] = INPUTS, **overrides: Any
) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        run_once(server, outcome, inputs=inputs, **overrides)
    return info.value


def sent(server: FakeOpenAI, inputs: dict[str, Any]) -> dict[str, Any]:
    """The request body the binding sends for `inputs`."""
    run_once(server, inputs=inputs)
    body: dict[str, Any] = server.calls[-1].inputs
    return body


# --- success ------------------------------------------------------------------------------------


def test_success_returns_text_usage_and_model(fake_openai: FakeOpenAI) -> None:
    result = run_once(fake_openai, Reply("Hello there."))
    assert result == AIResult(
        response="Hello there.",
        model=MODEL,
        usage=Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15),
        finish_reason="stop",
    )


def test_model_is_the_one_that_served(fake_openai: FakeOpenAI) -> None:
    """OpenAI answers with a dated snapshot of the alias asked for: that is what served."""
    result = run_once(fake_openai, Reply("hi", model="gpt-4o-mini-2024-07-18"))
    assert result.model == "gpt-4o-mini-2024-07-18"
    assert fake_openai.calls[-1].model == MODEL


def test_model_falls_back_to_the_requested_id(fake_openai: FakeOpenAI) -> None:
    body = b'{"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}'
    result = run_once(fake_openai, Raw(200, body, "application/json"))
    assert result == AIResult(response="hi", model=MODEL, finish_reason="stop")


def test_request_carries_path_model_and_bearer_key(fake_openai: FakeOpenAI) -> None:
    run_once(fake_openai)
    [call] = fake_openai.calls
    assert call.model == MODEL
    assert call.inputs == {"model": MODEL, **INPUTS}
    assert call.headers["authorization"] == "Bearer test-key"


def test_no_authorization_header_without_a_key() -> None:
    """Local servers (Ollama, llama.cpp) take no key: the header is left out, not sent empty."""
    with FakeOpenAI(api_key=None) as server:
        assert run_once(server, api_key=None).response == Reply().response
        assert "authorization" not in server.calls[-1].headers


def test_extra_headers_are_sent(fake_openai: FakeOpenAI) -> None:
    """E.g. Cloudflare AI Gateway's token, next to the provider's own key."""
    run_once(fake_openai, headers={"cf-aig-authorization": "Bearer gw-token", "x-extra": "1"})
    headers = fake_openai.calls[-1].headers
    assert headers["cf-aig-authorization"] == "Bearer gw-token"
    assert headers["x-extra"] == "1"
    assert headers["authorization"] == "Bearer test-key"


def test_wrong_key_is_401(fake_openai: FakeOpenAI) -> None:
    error = failure_of(fake_openai, api_key="wrong-key")
    assert (error.status, error.code, error.note) == (401, None, "invalid_api_key")
    assert classify(error).kind is Kind.model_unavailable


# --- request translation ------------------------------------------------------------------------


def test_prompt_becomes_one_user_message(fake_openai: FakeOpenAI) -> None:
    body = sent(fake_openai, {"prompt": "Say hello."})
    assert body == {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}]}


def test_messages_win_over_a_prompt(fake_openai: FakeOpenAI) -> None:
    body = sent(fake_openai, {**INPUTS, "prompt": "ignored"})
    assert body["messages"] == INPUTS["messages"]


def test_json_mode_schema_is_wrapped_with_a_name_and_strict_false(fake_openai: FakeOpenAI) -> None:
    body = sent(fake_openai, {**INPUTS, "response_format": JSON_MODE, "max_tokens": 64})
    assert body == {
        "model": MODEL,
        "messages": INPUTS["messages"],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "Summary", "schema": SCHEMA, "strict": False},
        },
        "max_tokens": 64,
    }


@pytest.mark.parametrize(
    ("title", "name"),
    [
        pytest.param("Ticket Triage (v2)", "Ticket_Triage_v2", id="unsafe-characters"),
        pytest.param("a" * 100, "a" * 64, id="too-long"),
        pytest.param("Summary-1_ok", "Summary-1_ok", id="already-safe"),
        pytest.param("(((", "output", id="nothing-left"),
        pytest.param(None, "output", id="no-title"),
        pytest.param(42, "output", id="not-a-string"),
    ],
)
def test_schema_name_fits_openai_rules(fake_openai: FakeOpenAI, title: Any, name: str) -> None:
    schema = {"type": "object"} if title is None else {"type": "object", "title": title}
    body = sent(fake_openai, {**INPUTS, "response_format": {"type": "json_schema", "json_schema": schema}})
    assert body["response_format"]["json_schema"]["name"] == name
    assert body["response_format"]["json_schema"]["schema"] == schema


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        pytest.param(
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
            },
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
            },
            id="openai-wrapper-passes",
        ),
        pytest.param({"type": "json_object"}, {"type": "json_object"}, id="json-object"),
        pytest.param({"type": "text"}, {"type": "text"}, id="text"),
        pytest.param({"type": "grammar", "grammar": "x"}, None, id="unknown-type-dropped"),
        pytest.param("json", None, id="not-an-object-dropped"),
    ],
)
def test_other_response_formats(fake_openai: FakeOpenAI, given: Any, expected: Any) -> None:
    body = sent(fake_openai, {**INPUTS, "response_format": given})
    assert body.get("response_format") == expected


def test_sampling_keys_pass_and_unknown_keys_are_dropped(fake_openai: FakeOpenAI) -> None:
    sampling = {
        "temperature": 0.2,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["\n\n"],
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
        "max_tokens": 100,
    }
    workers_only = {"top_k": 5, "repetition_penalty": 1.1, "raw": True, "lora": "x", "n": 3, "stream": True}
    body = sent(fake_openai, {**INPUTS, **sampling, **workers_only})
    assert body == {"model": MODEL, **INPUTS, **sampling}


# --- answers ------------------------------------------------------------------------------------


def test_json_mode_answer_is_the_json_string(fake_openai: FakeOpenAI) -> None:
    """OpenAI sends JSON mode answers as text: the output guard parses strings, the binding
    leaves them alone."""
    result = run_once(
        fake_openai,
        Reply({"label": "billing", "confidence": 0.9}),
        inputs={**INPUTS, "response_format": JSON_MODE},
    )
    assert result.response == '{"label": "billing", "confidence": 0.9}'


def test_tool_calls_are_returned(fake_openai: FakeOpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 7}'}}
    result = run_once(fake_openai, Reply(None, tool_calls=(call,), finish_reason="tool_calls"))
    assert result.response is None
    assert result.tool_calls == (call,)
    assert not result.moderated
    assert not result.truncated


@pytest.mark.parametrize(
    ("finish_reason", "moderated", "truncated"),
    [("stop", False, False), ("content_filter", True, False), ("length", False, True)],
)
def test_finish_reason(fake_openai: FakeOpenAI, finish_reason: str, moderated: bool, truncated: bool) -> None:
    result = run_once(fake_openai, Reply("partial", finish_reason=finish_reason))
    assert (result.response, result.moderated, result.truncated) == ("partial", moderated, truncated)


def test_refusal_is_moderated(fake_openai: FakeOpenAI) -> None:
    body = (
        b'{"model": "m", "choices": [{"finish_reason": "stop", "message": {"role": "assistant",'
        b' "content": null, "refusal": "I cannot help with that."}}]}'
    )
    assert run_once(fake_openai, Raw(200, body, "application/json")).moderated


def test_content_parts_are_joined(fake_openai: FakeOpenAI) -> None:
    body = (
        b'{"model": "m", "choices": [{"finish_reason": "stop", "message": {"role": "assistant",'
        b' "content": [{"type": "text", "text": "Hel"}, {"type": "image_url"}, {"type": "text", "text": "lo"}]}}]}'
    )
    assert run_once(fake_openai, Raw(200, body, "application/json")).response == "Hello"


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "status", "kind"),
    [
        pytest.param(Fail(status=400), 400, Kind.model_incompatible, id="400"),
        pytest.param(Fail(status=401, error_code="invalid_api_key"), 401, Kind.model_unavailable, id="401"),
        pytest.param(Fail(status=404, error_code="model_not_found"), 404, Kind.model_incompatible, id="404"),
        pytest.param(
            Fail(status=429, error_code="rate_limit_exceeded"), 429, Kind.model_rate_limited, id="429-rate"
        ),
        pytest.param(
            Fail(status=429, error_type="insufficient_quota", error_code="insufficient_quota"),
            429,
            Kind.model_quota_exhausted,
            id="429-insufficient-quota",
        ),
        pytest.param(
            Fail(status=429, error_type="insufficient_quota"),
            429,
            Kind.model_quota_exhausted,
            id="quota-by-type",
        ),
        pytest.param(Fail(status=500), 500, Kind.model_temporarily_unavailable, id="500"),
        pytest.param(Fail(status=503), 503, Kind.model_temporarily_unavailable, id="503"),
        pytest.param(
            Fail(status=200, error_code="server_error"), 200, Kind.model_unavailable, id="error-in-200"
        ),
        pytest.param(
            Raw(502, b"<html><body>502 Bad Gateway</body></html>"),
            502,
            Kind.model_temporarily_unavailable,
            id="html-502",
        ),
        pytest.param(Raw(200, b"not json"), 200, Kind.model_unavailable, id="non-json-200"),
        pytest.param(
            Raw(200, b"[1, 2]", "application/json"), 200, Kind.model_unavailable, id="json-not-an-object"
        ),
        pytest.param(
            Raw(200, b'{"model": "m", "choices": []}', "application/json"),
            200,
            Kind.model_unavailable,
            id="empty-choices",
        ),
        pytest.param(
            Raw(200, b'{"model": "m"}', "application/json"), 200, Kind.model_unavailable, id="no-choices"
        ),
        pytest.param(
            Raw(200, b'{"choices": [{"finish_reason": "stop"}]}', "application/json"),
            200,
            Kind.model_unavailable,
            id="choice-without-message",
        ),
    ],
)
def test_failure_shapes_raise_provider_error(
    fake_openai: FakeOpenAI, outcome: Outcome, status: int, kind: Kind
) -> None:
    error = failure_of(fake_openai, outcome)
    assert error.status == status
    assert error.code is None  # OpenAI's codes are strings: never the numeric `code`
    assert error.provider == "openai"
    assert not error.transport
    assert classify(error).kind is kind


def test_insufficient_quota_is_flagged_not_rate_limited(fake_openai: FakeOpenAI) -> None:
    error = failure_of(
        fake_openai, Fail(status=429, error_type="insufficient_quota", error_code="insufficient_quota")
    )
    assert error.quota_exhausted
    assert "insufficient_quota" in error.describe()
    assert not failure_of(fake_openai, Fail(status=429, error_code="rate_limit_exceeded")).quota_exhausted


@pytest.mark.parametrize(
    ("outcome", "note"),
    [
        pytest.param(Fail(status=429, error_code="rate_limit_exceeded"), "rate_limit_exceeded", id="code"),
        pytest.param(Fail(status=500, error_type="server_error"), "server_error", id="type"),
        pytest.param(Fail(status=400, error_code="Not-A-Token", error_type="x" * 41), "", id="unsafe"),
        pytest.param(
            Fail(status=400, error_code="bad code", error_type="invalid_request_error"),
            "invalid_request_error",
            id="type-when-code-unsafe",
        ),
    ],
)
def test_note_is_a_safe_token_only(fake_openai: FakeOpenAI, outcome: Fail, note: str) -> None:
    assert failure_of(fake_openai, outcome).note == note


@pytest.mark.parametrize(
    ("outcome", "code", "kind"),
    [
        pytest.param(
            Fail(code=2005, status=500, shape="gateway"),
            2005,
            Kind.model_temporarily_unavailable,
            id="gateway-5xx",
        ),
        pytest.param(
            Fail(code=3036, status=429, shape="gateway"), 3036, Kind.model_quota_exhausted, id="gateway-3036"
        ),
        pytest.param(
            Fail(code=3040, status=200, shape="gateway"),
            3040,
            Kind.model_temporarily_unavailable,
            id="gateway-200",
        ),
        pytest.param(
            Fail(code=None, status=400, shape="gateway"), None, Kind.model_incompatible, id="gateway-no-code"
        ),
        pytest.param(
            Raw(429, b'{"error": {"code": 3040, "message": "x"}}', "application/json"),
            3040,
            Kind.model_temporarily_unavailable,
            id="numeric-code-in-an-error-object",
        ),
        pytest.param(
            Raw(429, b'{"success": false, "errors": [{"code": 3036, "message": "x"}]}', "application/json"),
            3036,
            Kind.model_quota_exhausted,
            id="cloudflare-errors-list",
        ),
    ],
)
def test_cloudflare_error_envelopes_carry_numeric_codes(
    fake_openai: FakeOpenAI, outcome: Outcome, code: int | None, kind: Kind
) -> None:
    """AI Gateway's `{"success": false, "error": [{"code", "message"}]}` (and Cloudflare's
    `errors` list): their numeric codes are Cloudflare's, which the classifier knows."""
    error = failure_of(fake_openai, outcome)
    assert error.code == code
    assert classify(error).kind is kind


def test_json_mode_not_met_behind_a_compatible_endpoint(fake_openai: FakeOpenAI) -> None:
    """Workers AI models behind AI Gateway's compat endpoint still say "JSON Mode couldn't be met"."""
    error = failure_of(
        fake_openai, Fail(code=5024, status=400, shape="gateway", message="JSON Mode couldn't be met")
    )
    assert error.json_mode_failed


# --- retry hints --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("retry_after", "retry_after_ms", "seconds"),
    [
        pytest.param("7", None, 7.0, id="seconds"),
        pytest.param(None, "1500", 1.5, id="milliseconds"),
        pytest.param("20", "250.5", 0.2505, id="milliseconds-win"),
        pytest.param("20", "soon", 20.0, id="unreadable-milliseconds-ignored"),
        pytest.param("20", "nan", 20.0, id="nan-milliseconds-ignored"),
        pytest.param("inf", None, None, id="infinite-seconds-ignored"),
        pytest.param("1e300", None, 86_400.0, id="seconds-capped-at-a-day"),
        pytest.param(None, "9" * 300, 86_400.0, id="milliseconds-capped-at-a-day"),
        pytest.param("-5", None, 0.0, id="negative-is-now"),
        pytest.param(None, None, None, id="none"),
    ],
)
def test_retry_hint(
    fake_openai: FakeOpenAI, retry_after: str | None, retry_after_ms: str | None, seconds: float | None
) -> None:
    error = failure_of(fake_openai, Fail(status=429, retry_after=retry_after, retry_after_ms=retry_after_ms))
    assert error.retry_after_s == (pytest.approx(seconds) if seconds is not None else None)


def test_retry_after_http_date(fake_openai: FakeOpenAI) -> None:
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    error = failure_of(fake_openai, Fail(status=503, retry_after=when))
    assert error.retry_after_s is not None
    assert 25 <= error.retry_after_s <= 31


@pytest.mark.parametrize(("status", "should_retry"), [(400, "true"), (503, "false")])
def test_should_retry_header_is_ignored(fake_openai: FakeOpenAI, status: int, should_retry: str) -> None:
    """`x-should-retry` is the OpenAI SDK's retry policy; ours is the classifier's alone."""
    body = b'{"error": {"message": "x", "type": "server_error", "code": null, "param": null}}'
    plain = failure_of(fake_openai, Raw(status, body, "application/json"))
    hinted = failure_of(
        fake_openai, Raw(status, body, "application/json", headers={"x-should-retry": should_retry})
    )
    assert hinted.describe() == plain.describe()
    assert classify(hinted) == classify(plain)
    assert classify(hinted).retryable is (status >= 500)


# --- body size and transport --------------------------------------------------------------------


def test_oversized_body_is_refused(fake_openai: FakeOpenAI) -> None:
    """Default cap is 1 MiB: a 2 MiB body is a failure, not a 2 MiB string in memory."""
    error = failure_of(fake_openai, Raw(200, b"x" * (2 << 20)))
    assert error.status == 200


def test_small_body_cap(fake_openai: FakeOpenAI) -> None:
    with pytest.raises(ProviderError):
        run_once(fake_openai, Reply("y" * 500), max_body_bytes=100)
    assert run_once(fake_openai, Reply("y" * 500), max_body_bytes=2_000).response == "y" * 500


def test_dropped_connection_is_a_transport_failure(fake_openai: FakeOpenAI) -> None:
    error = failure_of(fake_openai, Drop())
    assert error.transport
    assert (error.status, error.code) == (None, None)
    assert classify(error).kind is Kind.model_temporarily_unavailable


def test_connection_refused_is_a_transport_failure() -> None:
    with FakeOpenAI() as server:
        base_url = server.base_url
    assert failure_of(server, base_url=base_url).transport


# --- no provider text ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "outcome",
    [
        pytest.param(Fail(status=429, message=f"Rate limit reached: {CANARY}"), id="openai-shape"),
        pytest.param(
            Fail(
                status=429, message=CANARY, error_type="insufficient_quota", error_code="insufficient_quota"
            ),
            id="quota",
        ),
        pytest.param(Fail(status=200, message=CANARY), id="error-in-200"),
        pytest.param(Fail(code=3036, status=429, message=CANARY, shape="gateway"), id="gateway"),
        pytest.param(Raw(502, f"<html>{CANARY}</html>".encode()), id="html"),
        pytest.param(
            Raw(200, f'{{"choices": [], "detail": "{CANARY}"}}'.encode(), "application/json"), id="no-choices"
        ),
    ],
)
def test_provider_text_never_reaches_the_error(fake_openai: FakeOpenAI, outcome: Outcome) -> None:
    """Provider messages may echo the prompt: they are never kept on the error."""
    error = failure_of(fake_openai, outcome)
    for text in (str(error), repr(error), error.describe(), error.note, *map(str, error.args)):
        assert CANARY not in text


# --- configuration and lifecycle ----------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"api_key": ""}, id="empty-key"),
        pytest.param({"api_key": "k", "base_url": "api.openai.com/v1"}, id="no-scheme"),
        pytest.param({"api_key": "k", "provider": ""}, id="no-provider-name"),
    ],
)
def test_bad_configuration_is_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        OpenAICompatible(**options)


def test_provider_name_is_used_in_errors(fake_openai: FakeOpenAI) -> None:
    error = failure_of(fake_openai, Fail(status=503), provider="ai-gateway")
    assert error.provider == "ai-gateway"
    assert error.describe().startswith("ai-gateway ")


def test_repr_hides_the_key_and_headers() -> None:
    async def scenario() -> None:
        binding = OpenAICompatible(
            api_key="sk-SECRET-123", headers={"cf-aig-authorization": "Bearer gw-SECRET"}
        )
        try:
            for text in (repr(binding), str(binding)):
                assert "SECRET" not in text
        finally:
            await binding.aclose()

    asyncio.run(scenario())
