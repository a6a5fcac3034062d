"""`Bedrock` over real HTTP against `FakeBedrock`, every request SigV4-signed and its signature
recomputed by the fake: guarded routes' outcomes (strict and degrading answers, a stream ending
with `done`, an unavailable model moving to the next, a throttle's bounded `Retry-After`, a
context window, a guardrail, an exception event after the first output, credentials and unknown
models as the operator's fault, never a credential or provider text in an answer or a log
line), the request Converse is sent, and the binding's own stream."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from fixtures import Fail, FakeBedrock, Reasoning, Reply, Stream, Text, ToolArgs, ToolCall, ToolName
from guards import (
    AI,
    ConfigurationError,
    EventStream,
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
from guards.providers import Bedrock
from guards.testing import UseFakeAI, UseFakeServers

from ..conftest import AppClient, LogLines, assert_error, assert_fallback, no_sleep

#: Model ids with a colon: the path is encoded, and signed encoded once more.
MODEL = "anthropic.claude-3-5-haiku-20241022-v1:0"
SECOND = "amazon.nova-lite-v1:0"
CANARY = "CANARY-BEDROCK-TEXT"
FALLBACK = "Sorry, try again later."
INPUTS: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}]}


def binding(server: FakeBedrock, **options: Any) -> Bedrock:
    keys = {"aws_access_key_id": server.access_key_id, "aws_secret_access_key": server.secret_access_key}
    return Bedrock(region=server.region, endpoint_url=server.base_url, **{**keys, **options})


def create_app(bedrock: Bedrock) -> FastAPI:
    guards = Guards(bedrock, sleep=no_sleep)
    app = FastAPI()
    guards.install(app)
    # A Bedrock model id has a colon: `default:` says it is the main binding's, not a provider's.
    chain = {"model": f"default:{MODEL}", "fallbacks": [f"default:{SECOND}"], "timeout_s": 5}

    @app.post("/strict")
    @guards.route(**chain)
    async def strict(body: dict[str, str], ai: AI[str]) -> dict[str, Any]:
        return {"reply": await ai.run({"prompt": body["text"]}), "model": ai.model}

    @app.post("/degrading")
    @guards.route(**chain, fallback=FALLBACK)
    async def degrading(body: dict[str, str], ai: AI[str]) -> str:
        return await ai.run({"prompt": body["text"]})

    @app.post("/stream")
    @guards.route(**chain)
    async def stream(body: dict[str, str], ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": body["text"]})

    return app


Client = Callable[..., httpx.Client]


@pytest.fixture
def client(fake_bedrock: FakeBedrock, app_client: AppClient) -> Client:
    def make(**options: Any) -> httpx.Client:
        return app_client(create_app(binding(fake_bedrock, **options)))

    return make


def ask(client: httpx.Client, path: str = "/strict") -> httpx.Response:
    return client.post(path, json={"text": "Where is my parcel?"})


def no_canary(response: httpx.Response, log: LogLines, *secrets: str) -> None:
    for secret in (CANARY, *secrets):
        assert secret not in response.text
        assert not any(secret in line for line in log.lines)


# --- routes -------------------------------------------------------------------------------------


def test_a_signed_request_answers_a_strict_route(client: Client, fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Reply("On its way."))
    assert ask(client()).json() == {"reply": "On its way.", "model": MODEL}
    [call] = fake_bedrock.calls
    assert call.headers["authorization"].startswith(
        f"AWS4-HMAC-SHA256 Credential={fake_bedrock.access_key_id}/"
    )
    assert call.inputs == {"messages": [{"role": "user", "content": [{"text": "Where is my parcel?"}]}]}


def test_a_session_token_is_sent_and_signed(client: Client, fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Reply("On its way."))
    assert ask(client(aws_session_token="session-token")).status_code == 200
    [call] = fake_bedrock.calls
    assert call.headers["x-amz-security-token"] == "session-token"
    assert "x-amz-security-token" in call.headers["authorization"]


def test_a_bedrock_api_key_is_a_bearer_token(client: Client, fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Reply("On its way."))
    response = ask(client(api_key=fake_bedrock.api_key, aws_access_key_id=None, aws_secret_access_key=None))
    assert response.json() == {"reply": "On its way.", "model": MODEL}
    assert fake_bedrock.calls[0].headers["authorization"] == f"Bearer {fake_bedrock.api_key}"


def test_a_degrading_route_answers(client: Client, fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Reply("On its way."))
    assert ask(client(), "/degrading").json() == {"ok": True, "data": "On its way.", "fallback": None}


def test_a_stream_relays_text_and_ends_with_done(client: Client, fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Stream([Text("On"), Text(" its"), Text(" way.")]))
    streamed = ask(client(), "/stream")
    assert streamed.status_code == 200
    assert streamed.text.count("event: delta") == 3
    lines = streamed.text.rstrip().splitlines()
    assert lines[-2] == "event: done"
    assert '"finish_reason":"stop"' in lines[-1]
    assert fake_bedrock.calls[0].inputs["stream"] is True  # converse-stream was called


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(Fail(status=503), id="ServiceUnavailableException"),
        pytest.param(Fail(status=500), id="InternalServerException"),
        pytest.param(Fail(status=408), id="ModelTimeoutException"),
        pytest.param(Fail(status=429, error_type="ModelNotReadyException"), id="ModelNotReadyException"),
    ],
)
def test_an_unavailable_model_is_retried_then_moves_to_the_next(
    client: Client, fake_bedrock: FakeBedrock, failure: Fail
) -> None:
    fake_bedrock.script(MODEL, failure, failure)
    fake_bedrock.script(SECOND, Reply("On its way."))
    assert ask(client()).json() == {"reply": "On its way.", "model": SECOND}
    assert [c.model for c in fake_bedrock.calls] == [MODEL, MODEL, SECOND]


def test_an_exception_event_before_output_moves_to_the_next_model(
    client: Client, fake_bedrock: FakeBedrock
) -> None:
    cut = Stream([Text("On")], error_after=1)  # messageStart, then modelStreamErrorException
    fake_bedrock.script(MODEL, cut, cut)
    fake_bedrock.script(SECOND, Stream([Text("On its way.")]))
    streamed = ask(client(), "/stream")
    assert "event: done" in streamed.text
    assert [c.model for c in fake_bedrock.calls] == [MODEL, MODEL, SECOND]


def test_a_throttle_sends_a_bounded_retry_after(
    client: Client, fake_bedrock: FakeBedrock, guards_log: LogLines
) -> None:
    """Bedrock sends no wait with `ThrottlingException`: the cooldown's default is told."""
    throttled = Fail(status=429, message=CANARY)
    fake_bedrock.script("*", throttled, throttled)
    response = ask(client())
    assert_error(response, 503, "model_rate_limited", False)
    assert response.headers["retry-after"] == "30"
    assert [c.model for c in fake_bedrock.calls] == [MODEL, SECOND]  # not retried on the same model
    no_canary(response, guards_log)


def test_a_spent_quota_is_model_quota_exhausted(client: Client, fake_bedrock: FakeBedrock) -> None:
    spent = Fail(status=400, error_type="ServiceQuotaExceededException")
    fake_bedrock.script("*", spent, spent)
    assert_error(ask(client()), 503, "model_quota_exhausted", False)


def test_an_input_too_long_is_400_on_a_strict_route(client: Client, fake_bedrock: FakeBedrock) -> None:
    too_long = Fail(status=400, message="Input is too long for requested model.")
    fake_bedrock.script("*", too_long, too_long)
    assert_error(ask(client()), 400, "context_length_exceeded", False)


@pytest.mark.parametrize("stop", ["guardrail_intervened", "content_filtered"])
def test_a_guardrail_is_moderation(
    client: Client, fake_bedrock: FakeBedrock, guards_log: LogLines, stop: str
) -> None:
    fake_bedrock.script(MODEL, Reply(CANARY, finish_reason=stop))
    response = ask(client(), "/degrading")
    assert_fallback(response, "output", "moderation_blocked", FALLBACK)
    assert [c.model for c in fake_bedrock.calls] == [MODEL]
    no_canary(response, guards_log)


def test_an_exception_event_after_output_ends_the_stream_with_error(
    client: Client, fake_bedrock: FakeBedrock, guards_log: LogLines
) -> None:
    fake_bedrock.script(MODEL, Stream([Text("On"), Text(" its")], error_after=3, error_message=CANARY))
    streamed = ask(client(), "/stream")
    assert streamed.status_code == 200
    assert streamed.text.count("event: delta") == 2
    assert "event: error" in streamed.text
    assert "event: done" not in streamed.text
    assert [c.model for c in fake_bedrock.calls] == [MODEL]
    no_canary(streamed, guards_log)


@pytest.mark.parametrize(
    ("options", "outcome", "status", "error"),
    [
        pytest.param(
            {"aws_secret_access_key": "wrong-secret"}, None, 502, "model_incompatible", id="bad-signature"
        ),
        pytest.param({"aws_access_key_id": "AKIDWRONG"}, None, 502, "model_incompatible", id="unknown-key"),
        pytest.param({}, Fail(status=404), 502, "model_incompatible", id="unknown-model"),
        pytest.param({}, Fail(status=403), 502, "model_incompatible", id="no-model-access"),
        pytest.param(
            {}, Fail(status=400, error_type="ValidationException"), 502, "model_incompatible", id="invalid"
        ),
    ],
)
def test_credentials_and_models_are_the_operators_fault(
    client: Client,
    fake_bedrock: FakeBedrock,
    guards_log: LogLines,
    options: dict[str, Any],
    outcome: Fail | None,
    status: int,
    error: str,
) -> None:
    """Never a 4xx: the client can fix none of them."""
    if outcome is not None:
        fake_bedrock.script("*", outcome, outcome)
    response = ask(client(**options))
    assert_error(response, status, error, False)
    no_canary(response, guards_log, "wrong-secret", "security token", "signature we calculated")


# --- the request and the binding's own stream ---------------------------------------------------------


def run(bedrock: Bedrock, inputs: dict[str, Any]) -> Any:
    async def go() -> Any:
        try:
            return await bedrock.run(MODEL, inputs)
        finally:
            await bedrock.aclose()

    return anyio.run(go)


def collect(bedrock: Bedrock, inputs: dict[str, Any] = INPUTS) -> list[StreamEvent]:
    async def go() -> list[StreamEvent]:
        try:
            return [event async for event in bedrock.stream(MODEL, inputs)]
        finally:
            await bedrock.aclose()

    return anyio.run(go)


def test_the_converse_request(fake_bedrock: FakeBedrock) -> None:
    schema = {"title": "Label", "type": "object", "properties": {"label": {"type": "string"}}}
    tools = [
        {
            "type": "function",
            "function": {"name": "lookup", "description": "Find", "parameters": {"type": "object"}},
        }
    ]
    fake_bedrock.script(
        MODEL, Reply({"label": "billing"}, usage={"prompt_tokens": 7, "completion_tokens": 3})
    )
    result = run(
        binding(fake_bedrock),
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Label this."},
                {"role": "user", "content": ""},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "t1", "function": {"name": "lookup", "arguments": '{"q": 1}'}}],
                },
                {"role": "tool", "tool_call_id": "t1", "content": "found"},
            ],
            "max_tokens": 64,
            "temperature": 0.2,
            "response_format": {"type": "json_schema", "json_schema": schema},
            "tools": tools,
            "tool_choice": "auto",
            "seed": 1,
        },
    )
    sent = fake_bedrock.calls[0].inputs
    assert sent["system"] == [{"text": "Be brief."}]
    assert sent["messages"] == [
        {"role": "user", "content": [{"text": "Label this."}]},
        {
            "role": "assistant",
            "content": [{"toolUse": {"toolUseId": "t1", "name": "lookup", "input": {"q": 1}}}],
        },
        {"role": "user", "content": [{"toolResult": {"toolUseId": "t1", "content": [{"text": "found"}]}}]},
    ]
    assert sent["inferenceConfig"] == {"maxTokens": 64, "temperature": 0.2}
    assert sent["toolConfig"] == {
        "tools": [
            {
                "toolSpec": {
                    "name": "lookup",
                    "description": "Find",
                    "inputSchema": {"json": {"type": "object"}},
                }
            }
        ],
        "toolChoice": {"auto": {}},
    }
    structure = sent["outputConfig"]["textFormat"]["structure"]["jsonSchema"]
    assert (structure["name"], structure["schema"]) == ("Label", __import__("json").dumps(schema))
    assert "seed" not in sent
    assert (result.response, result.model, result.finish_reason) == (
        '{"label": "billing"}',
        MODEL,
        "end_turn",
    )
    assert result.usage == Usage(7, 3, 10)


def test_tool_use_and_cached_tokens_in_an_answer(fake_bedrock: FakeBedrock) -> None:
    usage = {
        "inputTokens": 5,
        "outputTokens": 4,
        "totalTokens": 109,
        "cacheReadInputTokens": 80,
        "cacheWriteInputTokens": 20,
    }
    call = {"id": "tooluse_1", "name": "lookup", "arguments": {"id": 7}}
    fake_bedrock.script(MODEL, Reply(None, tool_calls=(call,), finish_reason="tool_use", usage=usage))
    result = run(binding(fake_bedrock), INPUTS)
    assert result.tool_calls == (
        {"id": "tooluse_1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 7}'}},
    )
    assert result.usage == Usage(105, 4, 109, cached_input_tokens=80, cache_write_tokens=20)
    assert not result.truncated


def test_a_stream_of_reasoning_and_tool_calls(fake_bedrock: FakeBedrock) -> None:
    parts = [
        Reasoning("Thinking."),
        Text("Looking."),
        ToolName(0, "tooluse_a", "lookup"),
        ToolArgs(0, '{"id":'),
        ToolArgs(0, " 7}"),
        ToolCall("other", {"x": 1}, index=1, id="tooluse_b"),
    ]
    fake_bedrock.script(
        MODEL, Stream(parts, finish_reason="tool_calls", usage={"prompt_tokens": 4, "completion_tokens": 2})
    )
    events = collect(binding(fake_bedrock))
    assert events == [
        ReasoningDelta("Thinking."),
        TextDelta("Looking."),
        ToolCallDelta(0, id="tooluse_a", name="lookup"),
        ToolCallDelta(0, arguments='{"id":'),
        ToolCallDelta(0, arguments=" 7}"),
        ToolCallDelta(1, id="tooluse_b", name="other"),
        ToolCallDelta(1, arguments='{"x": 1}'),
        StreamEnd(finish_reason="tool_calls", usage=Usage(4, 2, 6), model=MODEL),
    ]


@pytest.mark.parametrize(
    ("stream", "kind"),
    [
        pytest.param(
            Stream([Text("Hi")], done=False), Kind.model_temporarily_unavailable, id="no-messageStop"
        ),
        pytest.param(
            Stream([Text("Hi")], cut_after=1, partial_tail=True),
            Kind.model_temporarily_unavailable,
            id="cut-mid-frame",
        ),
        pytest.param(
            Stream([Text("Hi")], error_after=1), Kind.model_temporarily_unavailable, id="exception-event"
        ),
    ],
)
def test_a_stream_that_does_not_complete_fails(fake_bedrock: FakeBedrock, stream: Stream, kind: Kind) -> None:
    fake_bedrock.script(MODEL, stream)
    with pytest.raises(ProviderError) as info:
        collect(binding(fake_bedrock))
    assert classify(info.value).kind is kind


def test_a_stream_ending_after_message_stop_is_complete(fake_bedrock: FakeBedrock) -> None:
    """`metadata` (the usage) missing: the answer is whole all the same."""
    fake_bedrock.script(MODEL, Stream([Text("Hi")], cut_after=3))  # messageStart, text, messageStop
    events = collect(binding(fake_bedrock))
    assert events[-1] == StreamEnd(finish_reason="stop", usage=None, model=MODEL)


def test_an_event_over_the_cap_fails_before_it_is_read(fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Stream([Text("x" * 5000)]))
    with pytest.raises(ProviderError, match="event over 2048 bytes"):
        collect(binding(fake_bedrock, max_body_bytes=2048))


def test_closing_the_stream_closes_the_connection(fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Stream([Text("Hi")], stall_after=2))

    async def go() -> None:
        bedrock = binding(fake_bedrock)
        events = bedrock.stream(MODEL, INPUTS)
        assert await anext(events) == TextDelta("Hi")
        await events.aclose()
        await bedrock.aclose()

    anyio.run(go)
    assert fake_bedrock.wait_for(lambda calls: calls and calls[0].disconnected)


# --- configuration ------------------------------------------------------------------------------


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """No AWS setting from the machine: no variables, no files, no instance metadata."""
    for name in (
        "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN", "AWS_BEARER_TOKEN_BEDROCK", "AWS_ENDPOINT_URL_BEDROCK_RUNTIME",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.usefixtures("no_aws")
def test_the_standard_variables_are_read(monkeypatch: pytest.MonkeyPatch, fake_bedrock: FakeBedrock) -> None:
    monkeypatch.setenv("AWS_REGION", fake_bedrock.region)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", fake_bedrock.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", fake_bedrock.secret_access_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL_BEDROCK_RUNTIME", fake_bedrock.base_url)
    fake_bedrock.script(MODEL, Reply("Hi."))
    assert run(Bedrock(), INPUTS).response == "Hi."
    assert (
        repr(Bedrock(region="eu-west-1"))
        == f"Bedrock(provider='bedrock', endpoint='http://127.0.0.1:{fake_bedrock.port}')"
    )


@pytest.mark.usefixtures("no_aws")
@pytest.mark.parametrize(
    ("options", "match"),
    [
        pytest.param({"aws_access_key_id": "AKID", "aws_secret_access_key": "s"}, "region", id="no-region"),
        pytest.param({"region": "us-east-1"}, "no AWS credentials", id="no-credentials"),
        pytest.param({"region": "us-east-1", "aws_access_key_id": "AKID"}, "both", id="half-a-key"),
        pytest.param({"region": "us-east-1", "api_key": ""}, "empty api_key", id="empty-api-key"),
    ],
)
def test_a_missing_setting_is_named_at_start_up(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Bedrock(**options)


def test_without_botocore_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "botocore", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'route-guards\[bedrock\]'"):
        Bedrock(region="us-east-1", aws_access_key_id="AKID", aws_secret_access_key="secret")
    assert Bedrock(region="us-east-1", api_key="key").region == "us-east-1"  # no signing: no botocore


def _app() -> FastAPI:
    return create_app(Bedrock(region="us-east-1", endpoint_url="http://127.0.0.1:9", api_key="unused"))


def test_use_fake_ai_and_use_fake_servers_speak_bedrocks_wire(
    use_fake_ai: UseFakeAI, use_fake_servers: UseFakeServers, fake_bedrock: FakeBedrock, app_client: AppClient
) -> None:
    faked, served = _app(), _app()
    fake = use_fake_ai(faked)
    use_fake_servers(served)
    too_long = Fail(status=400, message="Input is too long for requested model.")
    for script in (fake.script, fake_bedrock.script):
        script("*", too_long, too_long)
    for app in (faked, served):
        assert_error(ask(app_client(app)), 400, "context_length_exceeded", False)
    assert (fake.wire, fake.provider) == ("bedrock", "bedrock")
    assert len(fake.calls) == len(fake_bedrock.calls) == 2
    with pytest.raises(ValueError, match="bedrock wire"):
        fake.script(MODEL, Fail(status=429, error_code="insufficient_quota"))


def test_importing_the_providers_does_not_import_botocore() -> None:
    """botocore is loaded when a signing `Bedrock` is made, never by `import guards.providers`."""
    code = "import sys, guards.providers; print('botocore' in sys.modules)"
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert found.stdout.strip() == "False"
