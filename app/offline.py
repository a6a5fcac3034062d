"""The offline default provider: deterministic answers, no account, no network."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from guards import AIResult, Usage

from .labels import keyword_label

DRAFT = (
    "Thank you for getting in touch. We have received your message and a member of our team "
    "will follow up shortly."
)


class OfflineModel:
    """A `guards.Binding` that answers like a well-behaved model: a fixed draft for text
    requests, a keyword label for JSON-mode summary requests."""

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        messages = inputs.get("messages") or []
        text = " ".join(str(m.get("content", "")) for m in messages if m.get("role") == "user")
        usage = Usage(
            prompt_tokens=len(text.split()), completion_tokens=24, total_tokens=len(text.split()) + 24
        )
        if "response_format" in inputs:
            label, hits = keyword_label(text)
            return AIResult({"label": label, "confidence": 0.9 if hits else 0.5}, model=model, usage=usage)
        return AIResult(DRAFT, model=model, usage=usage)

    async def aclose(self) -> None:
        return None
