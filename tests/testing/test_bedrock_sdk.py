"""`FakeBedrock` as the official AWS SDK sees it: boto3's `bedrock-runtime` client (a test-only
dependency; sync, so it simply calls the fake's server thread) signs its requests, which the
fake verifies, parses every answer with the service's own model, reads the binary event stream
with botocore's parser (both CRCs checked), and raises the SDK's exception for each documented
error. If the fake drifts from Bedrock's wire, these fail."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, EventStreamError

from fixtures import Fail, FakeBedrock, Reply, Stream, Text, ToolCall

MODEL = "anthropic.claude-3-5-haiku-20241022-v1:0"
MESSAGES: list[Any] = [{"role": "user", "content": [{"text": "Say hello."}]}]


def sdk(server: FakeBedrock, **options: Any) -> Any:
    """boto3's client of `server` (no retries: each failure is seen as sent); `options` override."""
    settings = {
        "endpoint_url": server.base_url,
        "region_name": server.region,
        "aws_access_key_id": server.access_key_id,
        "aws_secret_access_key": server.secret_access_key,
        "config": Config(
            retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=5
        ),
    }
    return boto3.client("bedrock-runtime", **{**settings, **options})


@pytest.fixture
def client(fake_bedrock: FakeBedrock) -> Iterator[Any]:
    made = sdk(fake_bedrock)
    yield made
    made.close()


def test_a_reply(client: Any, fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Reply("Hello there.", usage={"prompt_tokens": 7, "completion_tokens": 3}))
    answer = client.converse(modelId=MODEL, messages=MESSAGES, system=[{"text": "Be brief."}])
    assert answer["output"]["message"] == {"role": "assistant", "content": [{"text": "Hello there."}]}
    assert (answer["stopReason"], answer["usage"]["totalTokens"]) == ("end_turn", 10)
    [call] = fake_bedrock.calls
    assert (call.model, call.inputs["system"]) == (MODEL, [{"text": "Be brief."}])


def test_a_tool_call(client: Any, fake_bedrock: FakeBedrock) -> None:
    call = {"id": "tooluse_1", "name": "lookup", "arguments": {"id": 7}}
    fake_bedrock.script(MODEL, Reply(None, tool_calls=(call,), finish_reason="tool_use"))
    answer = client.converse(modelId=MODEL, messages=MESSAGES)
    assert answer["output"]["message"]["content"] == [
        {"toolUse": {"toolUseId": "tooluse_1", "name": "lookup", "input": {"id": 7}}}
    ]
    assert answer["stopReason"] == "tool_use"


def test_a_stream(client: Any, fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Stream([Text("Hel"), Text("lo."), ToolCall("lookup", {"id": 7}, id="t1")]))
    stream = client.converse_stream(modelId=MODEL, messages=MESSAGES)["stream"]
    events = list(stream)
    stream.close()
    assert [next(iter(e)) for e in events] == [
        "messageStart",
        "contentBlockDelta",
        "contentBlockDelta",
        "contentBlockStart",
        "contentBlockDelta",
        "messageStop",
        "metadata",
    ]
    text = "".join(
        e["contentBlockDelta"]["delta"].get("text", "") for e in events if "contentBlockDelta" in e
    )
    assert text == "Hello."
    assert events[3]["contentBlockStart"]["start"]["toolUse"] == {"toolUseId": "t1", "name": "lookup"}
    assert events[-2]["messageStop"]["stopReason"] == "end_turn"
    assert events[-1]["metadata"]["usage"]["totalTokens"] == 15
    assert fake_bedrock.calls[0].inputs["stream"] is True


def test_an_exception_event_mid_stream(client: Any, fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Stream([Text("Hel"), Text("lo.")], error_after=2))
    events = client.converse_stream(modelId=MODEL, messages=MESSAGES)["stream"]
    seen = []
    with pytest.raises(EventStreamError) as info:
        seen.extend(events)
    events.close()
    assert [next(iter(e)) for e in seen] == ["messageStart", "contentBlockDelta"]
    assert info.value.response["Error"]["Code"] == "modelStreamErrorException"


@pytest.mark.parametrize(
    ("failure", "code", "status"),
    [
        pytest.param(Fail(status=429), "ThrottlingException", 429, id="throttling"),
        pytest.param(
            Fail(status=429, error_type="ModelNotReadyException"),
            "ModelNotReadyException",
            429,
            id="not-ready",
        ),
        pytest.param(Fail(status=503), "ServiceUnavailableException", 503, id="unavailable"),
        pytest.param(Fail(status=500), "InternalServerException", 500, id="internal"),
        pytest.param(Fail(status=408), "ModelTimeoutException", 408, id="timeout"),
        pytest.param(
            Fail(status=400, message="Input is too long for requested model."),
            "ValidationException",
            400,
            id="too-long",
        ),
        pytest.param(
            Fail(status=400, error_type="ServiceQuotaExceededException"),
            "ServiceQuotaExceededException",
            400,
            id="quota",
        ),
        pytest.param(Fail(status=403), "AccessDeniedException", 403, id="access-denied"),
        pytest.param(Fail(status=404), "ResourceNotFoundException", 404, id="not-found"),
    ],
)
@pytest.mark.parametrize("operation", ["converse", "converse_stream"])
def test_documented_failures(
    client: Any, fake_bedrock: FakeBedrock, failure: Fail, code: str, status: int, operation: str
) -> None:
    fake_bedrock.script(MODEL, failure)
    with pytest.raises(getattr(client.exceptions, code)) as info:
        getattr(client, operation)(modelId=MODEL, messages=MESSAGES)
    error = info.value.response
    assert (error["Error"]["Code"], error["ResponseMetadata"]["HTTPStatusCode"]) == (code, status)
    if failure.message:
        assert error["Error"]["Message"] == failure.message


@pytest.mark.parametrize(
    ("options", "code"),
    [
        pytest.param({"aws_secret_access_key": "wrong"}, "InvalidSignatureException", id="wrong-secret"),
        pytest.param({"aws_access_key_id": "AKIDWRONG"}, "UnrecognizedClientException", id="unknown-key"),
        pytest.param({"region_name": "eu-west-1"}, "InvalidSignatureException", id="wrong-region"),
    ],
)
def test_the_fake_checks_the_signature(fake_bedrock: FakeBedrock, options: dict[str, Any], code: str) -> None:
    """The signature is recomputed: boto3's own, made with the wrong secret, key or region,
    is refused as AWS refuses it (and the right one is accepted by every test above)."""
    client = sdk(fake_bedrock, **options)
    with pytest.raises(ClientError) as info:
        client.converse(modelId=MODEL, messages=MESSAGES)
    client.close()
    assert info.value.response["Error"]["Code"] == code
    assert fake_bedrock.calls == []


def test_a_session_token(fake_bedrock: FakeBedrock) -> None:
    fake_bedrock.script(MODEL, Reply("Hi."))
    client = sdk(fake_bedrock, aws_session_token="session")
    answer = client.converse(modelId=MODEL, messages=MESSAGES)
    client.close()
    assert answer["output"]["message"]["content"] == [{"text": "Hi."}]
