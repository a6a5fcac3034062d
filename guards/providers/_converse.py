"""Bedrock's Converse API on the wire (PROTOCOLS.md, "AWS Bedrock Converse"): the request made
from Workers-AI-shaped inputs, the answer, the errors and the stream's events. No I/O here:
`guards.providers._bedrock` sends and signs.

Errors are read by their type (`x-amzn-ErrorType`, or an exception event's `:exception-type`),
then their status, never their message but for one phrase: a `ValidationException` saying the
input is too long is a context window. The message itself is never kept (it may echo input).

    ThrottlingException (429)                 rate limited (no wait sent: the cooldown's default)
    ServiceQuotaExceededException (400, 429)  quota exhausted
    ModelNotReadyException (429),
    modelStreamErrorException (424)           transient (retried once, then the next model)
    ServiceUnavailableException (503),
    InternalServerException (500),
    ModelTimeoutException (408)               transient, by status
    ValidationException (400)                 context length when the input is too long, else
                                              the request does not suit the model (502)
    AccessDeniedException, UnrecognizedClient,
    ExpiredToken... (403), ResourceNotFound (404)  the operator's: 502, never a 4xx
    ModelErrorException (424)                 model_unavailable (503)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..contracts._binding import AIResult, Usage
from ..contracts._errors import ProviderError
from ..contracts._stream import ReasoningDelta, StreamEnd, StreamEvent, TextDelta, ToolCallDelta
from ._eventstream import Message
from ._http import parse_retry_after
from ._httpx import httpx
from ._identifiers import identifier

__all__ = ["ConverseDecoder", "converse_request", "failure", "parse_converse_answer"]

#: Workers AI's sampling keys and their names in `inferenceConfig`.
_INFERENCE = {
    "max_tokens": "maxTokens",
    "temperature": "temperature",
    "top_p": "topP",
    "stop": "stopSequences",
}
#: Stop reasons that are the provider's content filter or guardrail speaking.
FILTERED = frozenset({"guardrail_intervened", "content_filtered"})
#: Stop reasons of an answer cut short (its token limit; the context window filled while
#: generating).
TRUNCATED = frozenset({"max_tokens", "model_context_window_exceeded"})
#: Bedrock's stop reasons in the words a stream's end uses (OpenAI's finish reasons).
_FINISH = (
    {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls"}
    | {reason: "content_filter" for reason in FILTERED}
    | {reason: "length" for reason in TRUNCATED}
)
#: The HTTP status each error type is documented with: an exception event mid-stream carries
#: its type only. Lowercase, as types are compared.
_STATUSES = {
    "throttlingexception": 429,
    "servicequotaexceededexception": 429,
    "modelnotreadyexception": 429,
    "serviceunavailableexception": 503,
    "internalserverexception": 500,
    "modeltimeoutexception": 408,
    "modelerrorexception": 424,
    "modelstreamerrorexception": 424,
    "validationexception": 400,
    "accessdeniedexception": 403,
    "resourcenotfoundexception": 404,
    "unrecognizedclientexception": 403,
    "expiredtokenexception": 403,
    "invalidsignatureexception": 403,
    "incompletesignatureexception": 400,
    "missingauthenticationtokenexception": 403,
}
_TRANSIENT = frozenset({"modelnotreadyexception", "modelstreamerrorexception"})
_QUOTA = frozenset({"servicequotaexceededexception"})
#: What a `ValidationException` says of an input over the model's window (lowercase).
_TOO_LONG = ("input is too long", "prompt is too long", "too many input tokens", "context window")
_UNSAFE_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_-]+")
_MAX_TOKENS = 1 << 53


def converse_request(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The Converse request body for Workers-AI-shaped `inputs`: system turns as `system`,
    the others as `messages` (consecutive turns of one role merged, as Converse wants them
    alternating), sampling keys in `inferenceConfig`, tools in `toolConfig`, and JSON mode as
    `outputConfig.textFormat` (Bedrock's structured output). Other keys are dropped."""
    system: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    given = inputs.get("messages")
    if not isinstance(given, list):
        prompt = inputs.get("prompt")
        given = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else []
    for message in given:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role == "system":
            system += _text_blocks(message.get("content"))
            continue
        blocks, role = _blocks(message)
        if not blocks:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += blocks
        else:
            messages.append({"role": role, "content": blocks})
    body: dict[str, Any] = {"messages": messages}
    if system:
        body["system"] = system
    inference = {name: inputs[key] for key, name in _INFERENCE.items() if inputs.get(key) is not None}
    if isinstance(inference.get("stopSequences"), str):
        inference["stopSequences"] = [inference["stopSequences"]]
    if inference:
        body["inferenceConfig"] = inference
    tools = _tool_config(inputs.get("tools"), inputs.get("tool_choice"))
    if tools is not None:
        body["toolConfig"] = tools
    output = _output_config(inputs.get("response_format"))
    if output is not None:
        body["outputConfig"] = output
    return body


def _text_blocks(content: Any) -> list[dict[str, Any]]:
    """A message's content as text blocks: a string, or OpenAI's content parts (text only).
    Empty texts are left out (Converse refuses a blank text block)."""
    if isinstance(content, str):
        return [{"text": content}] if content else []
    if not isinstance(content, list):
        return []
    texts = (p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return [{"text": text} for text in texts if isinstance(text, str) and text]


def _blocks(message: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """One turn's content blocks and its Converse role: a tool's answer is a `toolResult` in a
    user turn, an assistant's tool calls `toolUse` blocks."""
    role = message.get("role")
    if role == "tool":
        result = {
            "toolUseId": str(message.get("tool_call_id") or ""),
            "content": _text_blocks(message.get("content")),
        }
        return [{"toolResult": result}], "user"
    blocks = _text_blocks(message.get("content"))
    if role != "assistant":
        return blocks, "user"
    for call in message.get("tool_calls") or ():
        if isinstance(call, Mapping):
            function: Mapping[str, Any] = call.get("function") or {}
            if not isinstance(function, Mapping):
                function = {}
            function = function or call
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except (ValueError, RecursionError):
                    arguments = {}
            use = {
                "toolUseId": str(call.get("id") or ""),
                "name": str(function.get("name") or ""),
                "input": arguments or {},
            }
            blocks.append({"toolUse": use})
    return blocks, "assistant"


def _tool_config(tools: Any, choice: Any) -> dict[str, Any] | None:
    """OpenAI's `{"type": "function", "function": {...}}` tools or Workers AI's flat ones as
    `toolSpec`s; `tool_choice` `auto`, `required` or one function as Converse's `toolChoice`
    (`none`: no tools sent, Converse having no such choice)."""
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    specs = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        function: Mapping[str, Any] = tool.get("function") or {}
        if not isinstance(function, Mapping):
            function = {}
        function = function or tool
        schema = function.get("parameters")
        spec: dict[str, Any] = {
            "name": str(function.get("name") or ""),
            "inputSchema": {"json": schema if isinstance(schema, Mapping) else {"type": "object"}},
        }
        if isinstance(function.get("description"), str) and function["description"]:
            spec["description"] = function["description"]
        specs.append({"toolSpec": spec})
    config: dict[str, Any] = {"tools": specs}
    if choice == "auto":
        config["toolChoice"] = {"auto": {}}
    elif choice in ("required", "any"):
        config["toolChoice"] = {"any": {}}
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        config["toolChoice"] = {"tool": {"name": str(choice["function"].get("name") or "")}}
    return config


def _output_config(given: Any) -> dict[str, Any] | None:
    """Workers AI's JSON mode (`{"type": "json_schema", "json_schema": <schema>}`, or OpenAI's
    wrapper with `name` and `schema`) as Converse's structured output: the schema as JSON text."""
    if not isinstance(given, Mapping) or given.get("type") != "json_schema":
        return None
    schema = given.get("json_schema")
    if not isinstance(schema, Mapping):
        return None
    name = schema.get("title")
    if isinstance(schema.get("schema"), Mapping):  # OpenAI's wrapper
        name, schema = schema.get("name"), schema["schema"]
    safe = _UNSAFE_NAME_CHARS.sub("_", name).strip("_")[:64] if isinstance(name, str) else ""
    definition = {"schema": json.dumps(schema), "name": safe or "output"}
    return {"textFormat": {"type": "json_schema", "structure": {"jsonSchema": definition}}}


def _count(value: Any) -> int:
    """`value` if it is an integer from 0 to 2**53, else 0."""
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKENS else 0
    )


def converse_usage(raw: Any) -> Usage | None:
    """Converse's `usage`: `inputTokens` leaves out the tokens read from the prompt cache and
    written to it (`cacheReadInputTokens`, `cacheWriteInputTokens`), which `Usage.prompt_tokens`
    counts (see `Usage`)."""
    if not isinstance(raw, Mapping):
        return None
    read, written = _count(raw.get("cacheReadInputTokens")), _count(raw.get("cacheWriteInputTokens"))
    prompt = _count(raw.get("inputTokens")) + read + written
    completion = _count(raw.get("outputTokens"))
    return Usage(prompt, completion, prompt + completion, read, written)


def parse_converse_answer(
    status: int, headers: httpx.Headers | Mapping[str, str], body: bytes, *, model: str, provider: str
) -> AIResult:
    """One Converse HTTP answer as a result, or raises `ProviderError`: its text blocks joined,
    its `toolUse` blocks as OpenAI-shaped tool calls, a content filter or guardrail as
    `moderated`, a token limit as `truncated`, its usage; the model is the one requested
    (Converse does not name it)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if not 200 <= status < 300:
        raise failure(provider, status, headers, data)
    output = data.get("output") if isinstance(data, dict) else None
    message = output.get("message") if isinstance(output, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        raise ProviderError(provider, status=status, note="no message in the answer")
    texts, calls = [], []
    for block in content:
        if not isinstance(block, dict):
            continue
        if isinstance(block.get("text"), str):
            texts.append(block["text"])
        use = block.get("toolUse")
        if isinstance(use, dict):
            arguments = json.dumps(use.get("input") if use.get("input") is not None else {})
            function = {"name": str(use.get("name") or ""), "arguments": arguments}
            calls.append({"id": str(use.get("toolUseId") or ""), "type": "function", "function": function})
    assert isinstance(data, dict)
    stop = data.get("stopReason")
    return AIResult(
        response="".join(texts),
        model=model,
        usage=converse_usage(data.get("usage")),
        tool_calls=tuple(calls),
        moderated=stop in FILTERED,
        truncated=stop in TRUNCATED,
        finish_reason=identifier(stop),
    )


def _error_type(raw: Any) -> str:
    """An error type as compared: `ThrottlingException:http://...` or `throttlingException`
    made `throttlingexception`."""
    return raw.split(":", 1)[0].strip().lower() if isinstance(raw, str) else ""


def failure(
    provider: str,
    status: int | None,
    headers: httpx.Headers | Mapping[str, str],
    data: Any,
    *,
    kind: Any = None,
) -> ProviderError:
    """The `ProviderError` of a failed Converse call: an error answer (`status`, the type in
    `x-amzn-ErrorType` or the body's `__type`), or an exception event of a stream (`kind`, its
    `:exception-type`; `status` None: the type's documented status is used)."""
    given = headers if isinstance(headers, httpx.Headers) else httpx.Headers(headers)
    error = _error_type(kind if kind is not None else given.get("x-amzn-errortype"))
    if not error and isinstance(data, dict):
        error = _error_type(data.get("__type"))
    if status is None:
        status = _STATUSES.get(error, 500)
    message = data.get("message") or data.get("Message") if isinstance(data, dict) else None
    too_long = (
        error == "validationexception"
        and isinstance(message, str)
        and any(phrase in message.lower() for phrase in _TOO_LONG)
    )
    return ProviderError(
        provider,
        status=status,
        retry_after_s=parse_retry_after(given.get("retry-after")),
        quota_exhausted=error in _QUOTA,
        context_exceeded=too_long,
        transient=error in _TRANSIENT,
        note=error if error in _STATUSES else "unexpected body" if data is None else "",
    )


class ConverseDecoder:
    """Turns the messages of one `converse-stream` into `StreamEvent`s (a `StreamDecoder`).

    `contentBlockDelta` gives text, reasoning (`reasoningContent.text`) and tool-call
    arguments (`toolUse.input`, JSON text in pieces); `contentBlockStart` a tool call's id and
    name (its index: the tool calls' order, not the block's); `messageStop` the stop reason;
    `metadata` the usage. The stream is complete at `metadata` after `messageStop`, or when
    the body ends after `messageStop`. An exception message raises its `ProviderError`
    (`failure`); events that are not JSON objects, or unknown, are skipped.
    """

    __slots__ = ("_stop", "_tools", "_usage", "complete", "model", "provider")

    def __init__(self, provider: str, model: str) -> None:
        self.provider = provider
        self.model = model
        self.complete = False
        self._stop: str | None = None
        self._usage: Usage | None = None
        self._tools: dict[int, int] = {}

    def decode(self, message: Message) -> list[StreamEvent]:
        headers = message.headers
        kind = headers.get(":message-type")
        try:
            data = json.loads(message.payload) if message.payload else {}
        except (ValueError, RecursionError):
            data = None
        if kind == "exception":
            raise failure(self.provider, None, {}, data, kind=headers.get(":exception-type"))
        if kind == "error":
            raise ProviderError(self.provider, status=200, note="error message")
        if not isinstance(data, dict):
            return []
        event = headers.get(":event-type")
        if event == "contentBlockDelta":
            return self._delta(data)
        if event == "contentBlockStart":
            start = data.get("start")
            use = start.get("toolUse") if isinstance(start, dict) else None
            if isinstance(use, dict):
                index = self._tool_index(data.get("contentBlockIndex"))
                name, call_id = use.get("name"), use.get("toolUseId")
                return [
                    ToolCallDelta(
                        index,
                        id=call_id if isinstance(call_id, str) and call_id else None,
                        name=name if isinstance(name, str) and name else None,
                    )
                ]
        elif event == "messageStop":
            self._stop = identifier(data.get("stopReason")) or "end_turn"
        elif event == "metadata":
            self._usage = converse_usage(data.get("usage"))
            if self._stop is not None:
                return [self._end()]
        return []

    def _delta(self, data: dict[str, Any]) -> list[StreamEvent]:
        delta = data.get("delta")
        if not isinstance(delta, dict):
            return []
        text = delta.get("text")
        if isinstance(text, str):
            return [TextDelta(text)] if text else []
        use = delta.get("toolUse")
        if isinstance(use, dict):
            arguments = use.get("input")
            if isinstance(arguments, str) and arguments:
                return [ToolCallDelta(self._tool_index(data.get("contentBlockIndex")), arguments=arguments)]
            return []
        reasoning = delta.get("reasoningContent")
        if isinstance(reasoning, dict) and isinstance(reasoning.get("text"), str) and reasoning["text"]:
            return [ReasoningDelta(reasoning["text"])]
        return []

    def _tool_index(self, block: Any) -> int:
        """The tool call's index for content block `block`: 0 for the first tool call, 1 for
        the next... (text blocks have block indexes too)."""
        key = block if isinstance(block, int) else -1
        return self._tools.setdefault(key, len(self._tools))

    def end_at_eof(self) -> StreamEnd | None:
        return self._end() if self._stop is not None and not self.complete else None

    def _end(self) -> StreamEnd:
        self.complete = True
        finish = _FINISH.get(self._stop or "", self._stop)
        return StreamEnd(finish_reason=finish, usage=self._usage, model=self.model)
