"""The Vercel AI SDK's UI message stream (what `useChat` reads), as a guarded stream's format.

`guards.route(..., stream_format=UI_MESSAGE_STREAM)` answers the route's stream as Server-Sent
Events of JSON chunks, with the header `x-vercel-ai-ui-message-stream: v1`:

    {"type":"start"}
    {"type":"text-start","id":"text-1"}  {"type":"text-delta","id":"text-1","delta":"..."}
    {"type":"text-end","id":"text-1"}                   reasoning-start/-delta/-end likewise
    {"type":"tool-input-start","toolCallId","toolName"} {"type":"tool-input-delta",
    "toolCallId","inputTextDelta"}  then, at the end, {"type":"tool-input-available",
    "toolCallId","toolName","input"} (`tool-input-error` when the arguments are not JSON)
    {"type":"data-object","data":{...}}   a structured stream's validated object (`done`'s `object`)
    {"type":"finish","finishReason","messageMetadata":{"guards":{...the `done` data...}}}
  or {"type":"message-metadata","messageMetadata":{"guards":{...the `error` data...}}}
    {"type":"error","errorText":"<reason>"}   (a public token of the closed taxonomy)
    [DONE]

Exactly one of `finish` and `error` ends every stream, then `[DONE]`. The open part is ended
(`text-end`...) before it, so the text delivered before an `error` stays in the message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..contracts._stream import ReasoningDelta, StreamEvent, TextDelta, ToolCallDelta
from ..contracts._unicode import has_lone_surrogate
from ._event_stream import StreamWriter, _dumps, _string

__all__ = ["UI_MESSAGE_STREAM", "UIChatRequest", "UIMessage", "UIPart"]

_DONE = b"data: [DONE]\n\n"
#: guards' `finish_reason` (the provider's) as the SDK's `finishReason`.
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool-calls", "content_filter": "content-filter"}


def _chunk(data: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(data).encode() + b"\n\n"


@dataclass(slots=True)
class _Tool:
    id: str
    name: str | None = None
    started: bool = False
    arguments: list[str] = field(default_factory=list)


class _UIWriter:
    """One stream's writer: it remembers the part that is open and the tool calls."""

    __slots__ = ("_open", "_parts", "_text_prefix", "_tools")

    def __init__(self) -> None:
        self._open: str | None = None  # "text" or "reasoning"
        self._parts = 0
        self._text_prefix = b""  # `data: {"type":"text-delta","id":"text-N","delta":` when open
        self._tools: dict[int, _Tool] = {}

    def start(self) -> bytes:
        return _chunk({"type": "start"})

    def _switch(self, kind: str | None) -> bytes:
        """End the open part, and start one of `kind` (None: none)."""
        out = b""
        if self._open is not None:
            out = _chunk({"type": f"{self._open}-end", "id": f"{self._open}-{self._parts}"})
        self._open = kind
        if kind is not None:
            self._parts += 1
            part = f"{kind}-{self._parts}"
            out += _chunk({"type": f"{kind}-start", "id": part})
            self._text_prefix = f'data: {{"type":"{kind}-delta","id":"{part}","delta":'.encode()
        return out

    def text(self, text: str) -> bytes:
        if not text:  # an empty delta (preamble) is no part
            return b""
        head = b"" if self._open == "text" else self._switch("text")
        return head + self._text_prefix + _string(text).encode() + b"}\n\n"

    def event(self, event: StreamEvent) -> bytes:
        if isinstance(event, TextDelta):
            return self.text(event.text)
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return b""
            head = b"" if self._open == "reasoning" else self._switch("reasoning")
            return head + self._text_prefix + _string(event.text).encode() + b"}\n\n"
        if isinstance(event, ToolCallDelta):
            return self._tool(event)
        raise TypeError(f"not a client event: {type(event).__name__}")  # pragma: no cover

    def _tool(self, event: ToolCallDelta) -> bytes:
        out = self._switch(None)
        tool = self._tools.get(event.index)
        if tool is None:
            tool = self._tools[event.index] = _Tool(event.id or f"call-{event.index}")
        if tool.name is None and event.name:
            tool.name = event.name
        if event.arguments:
            tool.arguments.append(event.arguments)
        if tool.name is None:  # the SDK needs the name first: the arguments wait for it
            return out
        if not tool.started:
            tool.started = True
            out += _chunk({"type": "tool-input-start", "toolCallId": tool.id, "toolName": tool.name})
            pending = "".join(tool.arguments)
        else:
            pending = event.arguments
        if pending:
            out += _chunk({"type": "tool-input-delta", "toolCallId": tool.id, "inputTextDelta": pending})
        return out

    def _end_tools(self, failed: str | None) -> bytes:
        out = b""
        for tool in self._tools.values():
            name = tool.name or ""
            if not tool.started:
                out += _chunk({"type": "tool-input-start", "toolCallId": tool.id, "toolName": name})
            raw = "".join(tool.arguments)
            try:
                value = json.loads(raw) if failed is None else None
            except ValueError:
                failed_here: str | None = "invalid_tool_arguments"
            else:
                # A lone surrogate (a `\ud800` escape in the arguments) cannot be sent as UTF-8.
                failed_here = "invalid_tool_arguments" if has_lone_surrogate(value) else failed
            if failed_here is None:
                out += _chunk(
                    {"type": "tool-input-available", "toolCallId": tool.id, "toolName": name, "input": value}
                )
            else:
                out += _chunk(
                    {
                        "type": "tool-input-error",
                        "toolCallId": tool.id,
                        "toolName": name,
                        "input": raw,
                        "errorText": failed_here,
                    }
                )
        self._tools.clear()
        return out

    def done(self, data: dict[str, Any]) -> bytes:
        finish: dict[str, Any] = {"type": "finish"}
        reason = data.get("finish_reason")
        if reason is not None:
            finish["finishReason"] = _FINISH.get(reason, "other")
        ended = self._switch(None) + self._end_tools(None)
        if "object" in data:  # a structured stream: its validated object, as a data part
            data = dict(data)
            ended += _chunk({"type": "data-object", "data": data.pop("object")})
        finish["messageMetadata"] = {"guards": data}
        return ended + _chunk(finish) + _DONE

    def error(self, data: dict[str, Any]) -> bytes:
        reason = str(data["reason"])
        return (
            self._switch(None)
            + self._end_tools(reason)
            + _chunk({"type": "message-metadata", "messageMetadata": {"guards": data}})
            + _chunk({"type": "error", "errorText": reason})
            + _DONE
        )


class _UIMessageStream:
    name = "ui-message-stream"
    headers: Mapping[str, str] = {"x-vercel-ai-ui-message-stream": "v1"}

    def writer(self) -> StreamWriter:
        return _UIWriter()


#: The Vercel AI SDK's UI message stream protocol (v1), for `useChat` (see the module docstring).
UI_MESSAGE_STREAM = _UIMessageStream()


#: Whitespace as JSON Schema patterns know it (ECMA-262 `\s`), so that the OpenAPI document's
#: pattern and the check agree to the character (Python's `\s` and a bare `str.strip()` differ
#: from it on a few control and format characters): text made only of these is blank.
_BLANK_CODES = (0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029)
_BLANK_CODES += (0x202F, 0x205F, 0x3000, 0xFEFF)
_BLANK = "".join(map(chr, _BLANK_CODES))
#: A text that is not blank, as a JSON Schema pattern.
_NOT_BLANK = "[^" + "".join(f"\\u{code:04x}" for code in _BLANK_CODES) + "]"


def _text(parts: list[UIPart]) -> str | None:
    """A message's text: its text parts joined, or None when that is empty or blank."""
    text = "".join(p.text for p in parts if p.type == "text")
    return text if text.strip(_BLANK) else None


def _part_schema(schema: dict[str, Any]) -> None:
    """The checks of `UIPart._check` in its JSON Schema (the OpenAPI document)."""
    schema["properties"]["type"]["not"] = {"const": "file"}
    schema["if"] = {"properties": {"type": {"const": "text"}}, "required": ["type"]}
    schema["then"] = {"required": ["text"]}


class UIPart(BaseModel):
    """One part of a UI message: `text` parts are the message; `file` parts are refused; the
    other kinds an assistant message carries back (`reasoning`, `step-start`, tool and
    `data-*` parts) are not sent to the model."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_part_schema)

    type: str = Field(max_length=200)
    text: str = ""

    @model_validator(mode="after")
    def _check(self) -> UIPart:
        if self.type == "file":
            raise ValueError("file parts are not supported: send the message as text parts")
        if self.type == "text" and "text" not in self.model_fields_set:
            raise ValueError("a text part needs its text")
        return self


def _message_schema(schema: dict[str, Any]) -> None:
    """The check of `UIMessage._user_text` in its JSON Schema (the OpenAPI document)."""
    schema["if"] = {"properties": {"role": {"const": "user"}}, "required": ["role"]}
    text = {"type": "string", "pattern": _NOT_BLANK}
    part = {"properties": {"type": {"const": "text"}, "text": text}, "required": ["type", "text"]}
    schema["then"] = {"properties": {"parts": {"contains": part}}}


class UIMessage(BaseModel):
    """One message of the conversation. A user message must carry text: at least one text
    part whose text is not blank. An assistant or system message without text (a tool call
    alone) is not sent to the model."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_message_schema)

    id: str = Field(default="", max_length=200)
    role: Literal["system", "user", "assistant"]
    parts: list[UIPart] = Field(max_length=1000)

    @field_validator("parts")
    @classmethod
    def _user_text(cls, parts: list[UIPart], info: ValidationInfo) -> list[UIPart]:
        if info.data.get("role") == "user" and _text(parts) is None:
            raise PydanticCustomError(
                "too_short",
                "A user message should have text: a text part that is not blank",
                {"min_length": 1},
            )
        return parts


class UIChatRequest(BaseModel):
    """The body `useChat` posts (`DefaultChatTransport`): `{id, messages, trigger}`. Declare
    it as the route's body; a body that is not one is answered `400 invalid_request` with its
    `problems`, like any body. `inputs()` is what the model is given."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(default="", max_length=200)
    messages: list[UIMessage] = Field(min_length=1, max_length=1000)
    trigger: Literal["submit-message", "regenerate-message"] = "submit-message"

    def inputs(self) -> dict[str, Any]:
        """`{"messages": [{"role", "content"}]}`: each message's text parts, joined; a message
        whose text is empty or blank (an assistant's tool call alone) is left out."""
        messages = []
        for message in self.messages:
            text = _text(message.parts)
            if text is not None:
                messages.append({"role": message.role, "content": text})
        return {"messages": messages}
