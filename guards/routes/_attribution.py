"""Which model answered, in a guarded route's response headers (`Guards(attribution=...)`):
`x-ai-model`, `x-ai-deployment` and `x-ai-fallback`, `x-ai-rejected` on a route that moves rejected answers on,
and, whatever the mode, `x-ai-budget` and `x-ai-downgraded` near a budget's cap.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..walk import AI

__all__ = ["add_attribution"]

_UNSAFE_HEADER = re.compile(r"[^\x21-\x7e]")


def add_attribution(headers: list[tuple[bytes, bytes]], ai: AI[Any], mode: str) -> None:
    """Add which model answered to response `headers`: `x-ai-model` (the model the provider
    says served), `x-ai-deployment` (the deployment that served, `group/name`, when it was one
    of a `Deployments` group) and `x-ai-fallback` (the chain entry that served, when not the
    first) in `detailed` mode; only `x-ai-fallback: true` in `redacted` mode; nothing when `off`, or
    when no model answered. A model whose answer the output guard rejected answered too. On a
    route that moves rejected answers on, `x-ai-rejected` names the chain entries whose answers
    were rejected, one per answer, in order (`detailed`), or says how many were (`redacted`).
    Whatever the mode, a request admitted past a budget's soft limit carries `x-ai-budget`, and
    one that ran the route's downgrade chain `x-ai-downgraded` (the scopes that sent it)."""
    route = ai._route
    if route.soft_limited:
        if (near := getattr(ai, "_near", None)) is not None:
            headers.append((b"x-ai-budget", near))
        if route.downgrade is not None and (downgraded := getattr(ai, "_downgraded", None)) is not None:
            headers.append((b"x-ai-downgraded", _header_value(downgraded)))
    model = ai.model
    if mode == "off" or model is None:
        return
    answers = route.answers
    if answers is not None and (rejected := answers.rejected_header(ai, mode)) is not None:
        headers.append((b"x-ai-rejected", _header_value(rejected)))
    if mode == "redacted":
        if ai.fallback_model is not None:
            headers.append((b"x-ai-fallback", b"true"))
        return
    headers.append((b"x-ai-model", _header_values.get(model) or _header_value(model)))
    served = ai._served_leg
    if served is not None and served.ref.deployment is not None:
        headers.append((b"x-ai-deployment", _header_value(served.ref.key)))
    if ai.fallback_model is not None:
        headers.append((b"x-ai-fallback", _header_value(ai.fallback_model)))


def _header_value(text: str) -> bytes:
    # A served-model name comes from the provider: keep it a short, printable ASCII token.
    # The same few names come back on every request: each is cleaned once (bounded cache).
    text = text[:200]  # all that is sent: the cache keys on it alone, whatever the name's size
    value = _header_values.get(text)
    if value is None:
        clean = text
        if not (clean.isascii() and clean.isprintable() and " " not in clean):
            clean = _UNSAFE_HEADER.sub("?", clean)
        if len(_header_values) >= 256:
            _header_values.clear()
        value = _header_values[text] = clean.encode("ascii")
    return value


_header_values: dict[str, bytes] = {}
