"""Identifiers a provider sends, made safe to pass on.

The name a provider gives the model that served, and a stream's finish reason, travel far: into
`ai.model` and the route's answer, the `x-ai-model` header, the `done` event, the request log
and the usage ledger. They are provider text like any other (a 900 KB name made 1.8 MB of log
per request), so the adapters clean them here, once, as they read them: at most
`MAX_IDENTIFIER_CHARS` characters (as `x-ai-model`), printable characters only.

Tool-call ids and names are not identifiers in this sense: they are part of the model's output
(handed to the route, relayed as `tool_call` events) and counted against a stream's size limit.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_IDENTIFIER_CHARS", "identifier"]

MAX_IDENTIFIER_CHARS = 200


def identifier(value: Any) -> str | None:
    """`value` as a bounded, printable identifier: None unless it is a non-empty string; cut to
    `MAX_IDENTIFIER_CHARS` characters, each character that is not printable (controls, line
    breaks, separators) replaced with `?`. Costs a slice and one check for a normal name."""
    if not isinstance(value, str) or not value:
        return None
    text = value[:MAX_IDENTIFIER_CHARS]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else "?" for c in text)
    return text
