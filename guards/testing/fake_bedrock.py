"""A fake Bedrock runtime on a loopback port: the Converse API (`/model/{id}/converse` and
`/converse-stream`, its binary event stream), checking each request's SigV4 signature as AWS
does, and playing the same scripted outcomes as the other fakes on Bedrock's wire
(`bedrock_wire`, `bedrock_stream_wire`, which `FakeBinding(wire="bedrock")` plays too)."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

from guards.providers._eventstream import encode_message

from ._server import FakeServer, Wire
from .script import (
    Call,
    Chooser,
    Fail,
    Meta,
    Outcome,
    Raw,
    Reasoning,
    Refusal,
    Reply,
    Stream,
    Text,
    ToolArgs,
    ToolCall,
    ToolName,
    flat_tool_call,
)

__all__ = ["BEDROCK_ERROR_TYPES", "FakeBedrock", "bedrock_stream_wire", "bedrock_wire"]

_PATH = re.compile(r"^/model/(?P<model>[^/?]+)/(?P<operation>converse|converse-stream)$")
_AUTHORIZATION = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/(?P<service>[^/]+)"
    r"/aws4_request, ?SignedHeaders=(?P<signed>[a-z0-9;-]+), ?Signature=(?P<signature>[0-9a-f]{64})"
)
_REQUEST_ID = {"x-amzn-requestid": "00000000-0000-0000-0000-000000000000"}
#: The error type Bedrock sends with each status (`Fail(error_type=...)` names another).
BEDROCK_ERROR_TYPES = {
    400: "ValidationException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    408: "ModelTimeoutException",
    424: "ModelErrorException",
    429: "ThrottlingException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
}
#: What Bedrock says with each error type (its wording).
_MESSAGES = {
    "ThrottlingException": "Too many requests, please wait before trying again.",
    "ValidationException": "The provided request is not valid",
    "AccessDeniedException": "You don't have access to the model with the specified model ID.",
    "ResourceNotFoundException": "Could not resolve the foundation model from the provided model identifier.",
    "ServiceUnavailableException": "Bedrock is unable to process your request.",
    "ModelNotReadyException": "Model is not ready for inference. Wait and try your request again.",
    "UnrecognizedClientException": "The security token included in the request is invalid.",
    "InvalidSignatureException": "The request signature we calculated does not match the signature you provided.",
    "MissingAuthenticationTokenException": "Missing Authentication Token",
}
#: OpenAI's finish reasons (what a script says) as Bedrock's stop reasons.
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "content_filtered",
}


class FakeBedrock(FakeServer):
    """`with FakeBedrock() as server:` serves Bedrock's runtime at `server.base_url` (the
    adapter's `endpoint_url`, and boto3's).

    Each request must be SigV4-signed for `region` and service `bedrock` with the key pair
    `access_key_id` / `secret_access_key` (the signature is recomputed over the request as
    received, body included), or carry `Authorization: Bearer <api_key>`; else AWS's 403
    (`UnrecognizedClientException` for an unknown key, `InvalidSignatureException` for a wrong
    signature, `MissingAuthenticationTokenException` for none). The model is the path's
    (URL-decoded); a call to `converse-stream` is recorded with `"stream": True` in its inputs
    and plays a `Reply` as its stream. A `Fail` is sent with its `error_type` (default: the
    one Bedrock sends with its status, `BEDROCK_ERROR_TYPES`) in `x-amzn-ErrorType` and a
    `{"message"}` body; a context window is `Fail(status=400,
    message="Input is too long for requested model.")`, a guardrail `Reply(...,
    finish_reason="guardrail_intervened")`.
    """

    thread_name = "fake-bedrock"

    def __init__(
        self,
        default: Outcome | Chooser | None = None,
        *,
        region: str = "us-east-1",
        access_key_id: str = "AKIDFAKEBEDROCK",
        secret_access_key: str = "fake-bedrock-secret",
        api_key: str | None = "test-bedrock-api-key",
    ) -> None:
        super().__init__(default)
        self.region = region
        self.access_key_id = access_key_id
        self.secret_access_key = secret_access_key
        self.api_key = api_key

    def check_request(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Wire | None:
        authorization = headers.get("authorization", "")
        if self.api_key is not None and authorization == f"Bearer {self.api_key}":
            return None
        refused = self.refusal(method, path, headers, body)
        return None if refused is None else _error(403, refused)

    def refusal(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> str | None:
        """The AWS error type refusing a request's signature, or None when it holds."""
        found = _AUTHORIZATION.fullmatch(headers.get("authorization", ""))
        if found is None:
            return "MissingAuthenticationTokenException"
        if found["key"] != self.access_key_id:
            return "UnrecognizedClientException"
        signed = found["signed"].split(";")
        amz_date = headers.get("x-amz-date", "")
        if (
            "host" not in signed
            or any(name not in headers for name in signed)
            or amz_date[:8] != found["date"]
        ):
            return "InvalidSignatureException"
        raw_path, _, query = path.partition("?")
        canonical = "\n".join(
            [
                method,
                quote(raw_path, safe="/~"),  # AWS encodes the (already encoded) path once more
                "&".join(
                    f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(parse_qsl(query))
                ),
                "".join(f"{name}:{' '.join(headers[name].split())}\n" for name in signed),
                found["signed"],
                headers.get("x-amz-content-sha256") or hashlib.sha256(body).hexdigest(),
            ]
        )
        scope = f"{found['date']}/{found['region']}/{found['service']}/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        key = f"AWS4{self.secret_access_key}".encode()
        for part in (found["date"], found["region"], found["service"], "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        expected = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        right_scope = (found["region"], found["service"]) == (self.region, "bedrock")
        return (
            None
            if right_scope and hmac.compare_digest(expected, found["signature"])
            else "InvalidSignatureException"
        )

    def route(self, method: str, path: str, headers: Mapping[str, str], inputs: Any) -> str | Wire:
        found = _PATH.match(path)
        if method != "POST" or found is None:
            return _error(404, "UnknownOperationException")
        if not isinstance(inputs, dict):
            return _error(400, "SerializationException")
        if found["operation"] == "converse-stream":
            inputs["stream"] = True  # recorded as the other fakes record a stream
        return unquote(found["model"])

    def wire(self, outcome: Reply | Fail | Raw, call: Call) -> Wire:
        return bedrock_wire(outcome)

    def stream_wire(self, outcome: Stream, call: Call) -> list[bytes]:
        return bedrock_stream_wire(outcome)

    def stream_headers(self, call: Call) -> dict[str, str]:
        return {"content-type": "application/vnd.amazon.eventstream", **_REQUEST_ID}


def _error(
    status: int, error_type: str, message: str | None = None, headers: Mapping[str, str] | None = None
) -> Wire:
    body = json.dumps({"message": message or _MESSAGES.get(error_type, "An error occurred.")}).encode()
    kind = f"{error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/"
    return (
        status,
        {"content-type": "application/json", "x-amzn-errortype": kind, **_REQUEST_ID, **(headers or {})},
        body,
    )


def bedrock_wire(outcome: Reply | Fail | Raw) -> Wire:
    """How Bedrock's `converse` puts `outcome` on the wire: status, headers, body. A `Reply`'s
    text (an object as its JSON text: structured output) and tool calls are content blocks,
    its `finish_reason` the stop reason (OpenAI's words translated: `stop` is `end_turn`,
    `length` `max_tokens`; Bedrock's own pass), its usage Converse's (OpenAI's counts
    translated)."""
    if isinstance(outcome, Raw):
        return outcome.status, {"content-type": outcome.content_type, **outcome.headers}, outcome.body
    if isinstance(outcome, Fail):
        error_type = outcome.error_type or BEDROCK_ERROR_TYPES.get(outcome.status, "InternalServerException")
        waits = {"retry-after": outcome.retry_after} if outcome.retry_after is not None else {}
        return _error(outcome.status, error_type, outcome.message, waits)
    answer = outcome.response
    text = answer if isinstance(answer, str) else "" if answer is None else json.dumps(answer)
    content: list[dict[str, Any]] = [{"text": text}] if text else []
    for index, call in enumerate(outcome.tool_calls):
        flat = flat_tool_call(call)
        call_id = str(call.get("id") or f"tooluse_{index}")
        content.append({"toolUse": {"toolUseId": call_id, "name": flat["name"], "input": flat["arguments"]}})
    stop = "content_filtered" if outcome.refusal is not None else _stop_reason(outcome.finish_reason)
    body = {
        "output": {"message": {"role": "assistant", "content": content}},
        "stopReason": stop,
        "usage": _usage(outcome.usage),
        "metrics": {"latencyMs": 100},
    }
    return 200, {"content-type": "application/json", **_REQUEST_ID}, json.dumps(body).encode()


def _stop_reason(finish_reason: str) -> str:
    return _STOP_REASONS.get(finish_reason, finish_reason)


def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """Converse's usage: given as it is, or translated from OpenAI's counts."""
    if "inputTokens" in usage:
        return dict(usage)
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"inputTokens": prompt, "outputTokens": completion, "totalTokens": prompt + completion}


def _event(event_type: str, payload: Mapping[str, Any]) -> bytes:
    headers = {":event-type": event_type, ":content-type": "application/json", ":message-type": "event"}
    return encode_message(headers, json.dumps(payload).encode())


def bedrock_stream_wire(outcome: Stream) -> list[bytes]:
    """Every frame of `outcome` as `converse-stream` sends it: `messageStart`, one per part
    (a `ToolCall` is two: its block's start and its whole input; a `Refusal` and a `Meta` none,
    a refused stream stopping as `content_filtered`), then, when `done`, `messageStop` and `metadata` (usage).
    With `error_after=N`, the first N frames then a `modelStreamErrorException`: N counts
    `messageStart` (frame 0) as the wire sends it, where `FakeBinding`'s in-process stream
    counts the parts alone (its `error_after=N` is this wire's N+1)."""
    frames = [_event("messageStart", {"role": "assistant"})]
    refused = False
    for block, part in enumerate(outcome.parts):
        if isinstance(part, Text):
            frames.append(_event("contentBlockDelta", {"delta": {"text": part.text}, "contentBlockIndex": 0}))
        elif isinstance(part, Reasoning):
            delta = {"reasoningContent": {"text": part.text}}
            frames.append(_event("contentBlockDelta", {"delta": delta, "contentBlockIndex": 0}))
        elif isinstance(part, ToolName | ToolCall):
            start = {"toolUse": {"toolUseId": part.id or f"tooluse_{part.index}", "name": part.name}}
            frames.append(_event("contentBlockStart", {"start": start, "contentBlockIndex": part.index + 1}))
            if isinstance(part, ToolCall):
                arguments = part.arguments if isinstance(part.arguments, str) else json.dumps(part.arguments)
                delta = {"toolUse": {"input": arguments}}
                frames.append(
                    _event("contentBlockDelta", {"delta": delta, "contentBlockIndex": part.index + 1})
                )
        elif isinstance(part, ToolArgs):
            delta = {"toolUse": {"input": part.arguments}}
            frames.append(_event("contentBlockDelta", {"delta": delta, "contentBlockIndex": part.index + 1}))
        elif isinstance(part, Refusal):
            refused = True
        else:  # a `Meta`: the stream's own `messageStart` is the preamble
            assert isinstance(part, Meta), block
    if outcome.done:
        stop = "content_filtered" if refused else _stop_reason(outcome.finish_reason)
        frames.append(_event("messageStop", {"stopReason": stop}))
        metadata = {"usage": _usage(outcome.usage), "metrics": {"latencyMs": 100}}
        frames.append(_event("metadata", metadata))
    if outcome.error_after is not None:
        headers = {
            ":exception-type": "modelStreamErrorException",
            ":content-type": "application/json",
            ":message-type": "exception",
        }
        error = encode_message(headers, json.dumps({"message": outcome.error_message}).encode())
        frames = [*frames[: outcome.error_after], error]
    return frames
