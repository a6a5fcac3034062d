"""The Workers AI REST adapter (`guards.providers.WorkersAI`) against the fake HTTP server.

Every failure shape of PROTOCOLS.md must end as a `ProviderError` carrying the provider's code
and the HTTP status, and never the provider's own text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from fixtures import Drop, Fail, FakeWorkersAI, Raw, Reply
from fixtures.script import Outcome
from guards import AIResult, ConfigurationError, ProviderError, Usage
from guards.providers import WorkersAI

from ..conftest import run_binding_once

MODEL = "@cf/meta/llama-3.3-70b-instruct-fp8-fast"
INPUTS: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}]}
CANARY = "CANARY-PROVIDER-TEXT"


def binding_for(server: FakeWorkersAI, **overrides: Any) -> WorkersAI:
    options: dict[str, Any] = {
        "account_id": server.account_id,
        "api_token": server.api_token,
        "base_url": server.base_url,
    }
    options.update(overrides)
    return WorkersAI(**options)


def run_once(
    server: FakeWorkersAI,
    outcome: Outcome | None = None,
    *,
    inputs: dict[str, Any] = INPUTS,
    **overrides: Any,
) -> AIResult:
    """One call through a fresh binding (closed afterwards), with `outcome` scripted first."""
    if outcome is not None:
        server.script(MODEL, outcome)
    return run_binding_once(lambda: binding_for(server, **overrides), MODEL, inputs)


def failure_of(server: FakeWorkersAI, outcome: Outcome | None = None, **overrides: Any) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        run_once(server, outcome, **overrides)
    return info.value


# --- success ------------------------------------------------------------------------------------


def test_success_returns_text_usage_and_model(fake_workers_ai: FakeWorkersAI) -> None:
    result = run_once(fake_workers_ai, Reply("Hello there."))
    assert result == AIResult(
        response="Hello there.",
        model=MODEL,
        usage=Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15),
    )


def test_json_mode_object_response_comes_back_as_a_dict(fake_workers_ai: FakeWorkersAI) -> None:
    inputs = {
        **INPUTS,
        "response_format": {"type": "json_schema", "json_schema": {"type": "object"}},
    }
    result = run_once(fake_workers_ai, Reply(response={"label": "x"}), inputs=inputs)
    assert result.response == {"label": "x"}


def test_request_carries_inputs_model_path_and_token(fake_workers_ai: FakeWorkersAI) -> None:
    """The model id keeps its slashes in the path and the token travels as a Bearer header."""
    run_once(fake_workers_ai)
    [call] = fake_workers_ai.calls
    assert call.model == MODEL
    assert call.inputs == INPUTS
    assert call.headers["authorization"] == "Bearer test-token"


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "code", "status"),
    [
        pytest.param(Fail(code=3040, status=429), 3040, 429, id="3040-with-429"),
        pytest.param(Fail(code=3040, status=200), 3040, 200, id="success-false-with-200"),
        pytest.param(Fail(code=3036, status=429, shape="aierror"), 3036, 429, id="aierror-shape"),
        pytest.param(Fail(code=5007, status=400), 5007, 400, id="5007-with-400"),
        pytest.param(Fail(status=429), None, 429, id="429-without-code"),
        pytest.param(Fail(status=200), None, 200, id="success-false-200-without-code"),
        pytest.param(Fail(status=503), None, 503, id="503-without-code"),
        pytest.param(Raw(502, b"<html>bad gateway</html>"), None, 502, id="html-502"),
        pytest.param(Raw(200, b"not json"), None, 200, id="non-json-200"),
        pytest.param(Raw(200, b"[1, 2, 3]", "application/json"), None, 200, id="json-not-an-object"),
        pytest.param(
            Raw(200, b'{"result": null, "success": true, "errors": []}', "application/json"),
            None,
            200,
            id="success-without-result",
        ),
        pytest.param(
            Raw(200, b'{"result": {"response": "hi"}, "success": false, "errors": []}', "application/json"),
            None,
            200,
            id="success-false-with-a-result-and-no-errors",
        ),
    ],
)
def test_failure_shapes_raise_provider_error(
    fake_workers_ai: FakeWorkersAI, outcome: Outcome, code: int | None, status: int
) -> None:
    error = failure_of(fake_workers_ai, outcome)
    assert (error.code, error.status) == (code, status)
    assert not error.transport
    assert error.retry_after_s is None
    assert not error.json_mode_failed


def test_retry_after_header_is_read_as_seconds(fake_workers_ai: FakeWorkersAI) -> None:
    error = failure_of(fake_workers_ai, Fail(code=3040, status=429, retry_after="7"))
    assert error.retry_after_s == 7


@pytest.mark.parametrize(
    "outcome",
    [
        pytest.param(
            Fail(status=400, message="AiError: AiError: JSON Mode couldn't be met (1234)"), id="rest-shape"
        ),
        pytest.param(
            Fail(code=5006, status=200, message="AiError: JSON Mode couldn't be met (1234)"),
            id="with-http-200",
        ),
        pytest.param(
            Fail(status=400, message="JSON Mode couldn't be met", shape="aierror"), id="aierror-shape"
        ),
        pytest.param(Fail(status=400, message="json mode couldn\u2019t be met"), id="typographic-quote"),
    ],
)
def test_json_mode_failure_is_marked(fake_workers_ai: FakeWorkersAI, outcome: Fail) -> None:
    assert failure_of(fake_workers_ai, outcome).json_mode_failed


def test_oversized_body_is_refused(fake_workers_ai: FakeWorkersAI) -> None:
    """Default cap is 1 MiB: a 2 MiB body is a failure, not a 2 MiB string in memory."""
    error = failure_of(fake_workers_ai, Raw(200, b"x" * (2 << 20)))
    assert error.status == 200


def test_small_body_cap(fake_workers_ai: FakeWorkersAI) -> None:
    with pytest.raises(ProviderError):
        run_once(fake_workers_ai, Reply("y" * 500), max_body_bytes=100)
    assert run_once(fake_workers_ai, Reply("y" * 500), max_body_bytes=1_000).response == "y" * 500


def test_dropped_connection_is_a_transport_failure(fake_workers_ai: FakeWorkersAI) -> None:
    error = failure_of(fake_workers_ai, Drop())
    assert error.status is None
    assert error.code is None
    assert error.transport


def test_connection_refused_is_a_transport_failure() -> None:
    with FakeWorkersAI() as server:
        base_url = server.base_url
    error = failure_of(server, base_url=base_url)
    assert error.transport


def test_wrong_token_is_401_code_10000(fake_workers_ai: FakeWorkersAI) -> None:
    error = failure_of(fake_workers_ai, api_token="wrong-token")
    assert (error.code, error.status) == (10000, 401)


@pytest.mark.parametrize(
    "outcome",
    [
        pytest.param(Fail(code=3040, status=429, message=f"AiError: {CANARY} (1234)"), id="rest-shape"),
        pytest.param(Fail(code=3036, status=429, message=CANARY, shape="aierror"), id="aierror-shape"),
        pytest.param(Fail(status=400, message=f"JSON Mode couldn't be met: {CANARY}"), id="json-mode"),
        pytest.param(Raw(502, f"<html>{CANARY}</html>".encode()), id="html"),
    ],
)
def test_provider_text_never_reaches_the_error(fake_workers_ai: FakeWorkersAI, outcome: Outcome) -> None:
    """Provider messages may echo the prompt: they are never kept on the error."""
    error = failure_of(fake_workers_ai, outcome)
    for text in (str(error), repr(error), error.describe(), error.note, *map(str, error.args)):
        assert CANARY not in text


# --- configuration and lifecycle ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("account_id", "api_token", "named", "not_named"),
    [
        pytest.param("", "tok-SECRET", ["account_id"], ["api_token"], id="no-account"),
        pytest.param("acct", "", ["api_token"], ["account_id"], id="no-token"),
        pytest.param("", "", ["account_id", "api_token"], [], id="neither"),
    ],
)
def test_missing_credentials_are_a_configuration_error(
    account_id: str, api_token: str, named: list[str], not_named: list[str]
) -> None:
    with pytest.raises(ConfigurationError) as info:
        WorkersAI(account_id=account_id, api_token=api_token)
    message = str(info.value)
    assert all(name in message for name in named)
    assert not any(name in message for name in not_named)
    assert "tok-SECRET" not in message


def test_repr_hides_the_token() -> None:
    async def scenario() -> None:
        binding = WorkersAI(account_id="acct", api_token="tok-SECRET-123")
        try:
            assert "tok-SECRET-123" not in repr(binding)
            assert "tok-SECRET-123" not in str(binding)
        finally:
            await binding.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("code", "expected"),
    [(3040, 3040), (-1, -1), (10**12, None), (10**4000, None), (True, None), ("3040", None)],
    ids=["code", "negative", "past-32-bits", "4000-digits", "boolean", "text"],
)
def test_error_codes_are_bounded_numbers(
    fake_workers_ai: FakeWorkersAI, code: Any, expected: int | None
) -> None:
    """A provider's numeric code reaches `detail` and the logs: only a plausible code is kept."""
    body = b'{"success": false, "errors": [{"code": %s, "message": "x"}]}' % json.dumps(code).encode()
    error = failure_of(fake_workers_ai, Raw(429, body, "application/json"))
    assert error.code == expected
    assert len(error.describe()) < 100


@pytest.mark.parametrize(
    "tokens",
    [-1, 2**53 + 1, 10**4000, 1.5, "7", None],
    ids=["negative", "past-2**53", "4000-digits", "float", "text", "null"],
)
def test_implausible_token_counts_are_zero(fake_workers_ai: FakeWorkersAI, tokens: Any) -> None:
    """Token counts feed spend caps (costs in floats) and the ledger: only integers from 0 to
    2**53 are counted."""
    usage = {"prompt_tokens": tokens, "completion_tokens": 5, "total_tokens": 5}
    body = json.dumps({"success": True, "errors": [], "result": {"response": "hi", "usage": usage}}).encode()
    result = run_once(fake_workers_ai, Raw(200, body, "application/json"))
    assert result.usage == Usage(prompt_tokens=0, completion_tokens=5, total_tokens=5)
