"""Streaming: the events a streaming binding yields, whatever its wire format.

A binding's `stream(model, inputs)` is an async iterator of these events. It yields
`StreamEnd` exactly once, when the provider's completion signal arrived (`[DONE]`, a
`finish_reason`, `message_stop`), and then stops. Every failure raises `ProviderError`, the same
type as a non-streaming call, whether it happens before the body or while it is read: an error
status, an in-band `error` object after HTTP 200, a body that ends before the completion signal
(`note="stream truncated"`), or no event within the idle timeout (`note="stream stalled"`).
A binding that resumes cut streams (Cloudflare AI Gateway) hides the cuts it repairs, and
fails with `note="stream interrupted"` (reconnects spent) or `status=404,
note="stream resume expired"` when it cannot.

Parts that are *output* (text, reasoning, tool-call arguments) commit a guarded stream to its
model; everything before the first of them (a role-only chunk, metadata, a tool name alone) is
preamble, which a fallback silently replaces.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ._binding import Usage

__all__ = [
    "ReasoningDelta",
    "StreamEnd",
    "StreamEvent",
    "StreamingBinding",
    "TextDelta",
    "ToolCallDelta",
    "is_output",
]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the answer's text."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of the model's visible reasoning (models that stream it apart from the text)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call: its `index` in the answer, and any of its id, its name and a
    fragment of its JSON `arguments` (concatenate fragments of one index in order)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The completion signal: the stream is complete. `finish_reason` as the provider sent it
    (`stop`, `length`, `tool_calls`, `content_filter`...; None when it sends none, as Workers
    AI's native events), `usage` when it sent one, `model` the model that served when it said
    so (the bindings of `guards.providers` fill in the model requested otherwise, as `run`
    does)."""

    finish_reason: str | None = None
    usage: Usage | None = None
    model: str | None = None


StreamEvent = TextDelta | ReasoningDelta | ToolCallDelta | StreamEnd


def is_output(event: StreamEvent) -> bool:
    """True for a part the client would see as the answer: non-empty text or reasoning, or
    tool-call arguments. A tool name alone, or an empty delta, is preamble."""
    if isinstance(event, TextDelta | ReasoningDelta):
        return bool(event.text)
    if isinstance(event, ToolCallDelta):
        return bool(event.arguments)
    return False


@runtime_checkable
class StreamingBinding(Protocol):
    """A binding that can also stream (see the module docstring for the contract).

    `inputs` are Workers-AI-shaped, as for `run`. Cancelling the iteration (or `aclose` on the
    iterator) must close the provider connection at once.
    """

    def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncIterator[StreamEvent]: ...
