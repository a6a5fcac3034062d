"""The offline default provider: deterministic answers, no account, no network."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from guards import AIResult, StreamEnd, StreamEvent, TextDelta, Usage

from .labels import keyword_label

DRAFT = (
    "Thank you for getting in touch. We have received your message and a member of our team "
    "will follow up shortly."
)


class OfflineModel:
    """A `guards.Binding` (and `StreamingBinding`) that answers like a well-behaved model: a
    fixed draft for text requests (streamed word by word), a keyword label for JSON-mode
    summary requests."""

    #: What traces call this provider (`gen_ai.provider.name`).
    gen_ai_provider_name = "guards.offline"

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        text = _user_text(inputs)
        usage = _usage(text)
        if "response_format" in inputs:
            label, hits = keyword_label(text)
            return AIResult({"label": label, "confidence": 0.9 if hits else 0.5}, model=model, usage=usage)
        return AIResult(DRAFT, model=model, usage=usage)

    async def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncIterator[StreamEvent]:
        for word in re.findall(r"\S+\s*", DRAFT):
            yield TextDelta(word)
        yield StreamEnd(finish_reason="stop", usage=_usage(_user_text(inputs)), model=model)

    async def aclose(self) -> None:
        return None


def _user_text(inputs: Mapping[str, Any]) -> str:
    messages = inputs.get("messages") or []
    return " ".join(str(m.get("content", "")) for m in messages if m.get("role") == "user")


def _usage(text: str) -> Usage:
    words = len(text.split())
    return Usage(prompt_tokens=words, completion_tokens=24, total_tokens=words + 24)
