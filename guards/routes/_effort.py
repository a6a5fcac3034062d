"""Effort routing: easy turns to a cheap model, hard ones to a capable model, decided without a
model call.

A route declared with `effort=Effort(simple=..., standard=..., complex=...)` names a routing
hint per tier instead of a model. At the request's first `ai.run` / `ai.stream`, before any
provider call, `estimate_effort` reads the inputs and says `simple`, `standard` or `complex`;
the chosen hint's chain (the hint's models, then the route's `fallbacks`) then runs with every
usual guard. Each chain is flattened once, at start-up; a request only picks one.

The estimator is a pure function of the latest user turn (the system prompt is the operator's,
and earlier turns were answered already), linear in its length, with no regular expression
that can backtrack (a hostile client writes the text). Its rules, first match wins:

    no user text (no `prompt`, no user message with text)        standard
    a code fence (three backticks or three tildes) anywhere       complex
    COMPLEX_QUESTIONS or more questions (runs of ? count once)    complex
    COMPLEX_CHARS characters or more                              complex
    under SIMPLE_CHARS characters, one line, one sentence         simple
    anything else                                                 standard

(the text is trimmed first; a fullwidth question mark counts as `?`; "one sentence": before
its final punctuation, no `.`, `!` or `…` followed by a space, and no `?`, ideographic full
stop or fullwidth `!` at all).

A `complex` turn goes to the complex hint only when `escalate="auto"`; with `"never"` it stays
on the standard hint. A trusted per-request override (`override_effort(request, tier)`, called
by a dependency the app writes, never read from a client header) sets the tier and skips the
estimator for that request. Each decision is logged (`{"event": "effort", ...}`, never the
text) and counted (`guards_effort_decisions_total{route, tier, hint}`).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from ..contracts._errors import ConfigurationError
from ..observe._log import emit
from ..observe._metrics import EFFORT_DECISIONS, Tally, counter
from ._balance import on_chain

if typing.TYPE_CHECKING:
    from starlette.requests import Request

    from ..spec._route_spec import GuardedRoute, Leg

__all__ = [
    "COMPLEX_CHARS",
    "COMPLEX_QUESTIONS",
    "SIMPLE_CHARS",
    "TIERS",
    "Effort",
    "EffortRoutes",
    "Tier",
    "estimate_effort",
    "override_effort",
]

#: How demanding a turn is.
Tier = Literal["simple", "standard", "complex"]
TIERS: Final[tuple[Tier, ...]] = ("simple", "standard", "complex")
#: A turn with this many questions or more is `complex`.
COMPLEX_QUESTIONS: Final = 3
#: A turn of this many characters or more is `complex`.
COMPLEX_CHARS: Final = 2_000
#: A one-sentence turn shorter than this is `simple`.
SIMPLE_CHARS: Final = 80

#: A run of question marks, matched where one starts: nothing after it to backtrack into.
_QUESTION_RUN = re.compile(r"\?+")
#: What ends a sentence inside a turn.
_BREAKS = (". ", "! ", "\u2026 ", "?", "\u3002", "\uff01")
#: What a one-sentence turn may end with (stripped before looking for breaks).
_END = " \t.!?\u2026\u3002\uff01\"'\u00bb)]"
#: Where `override_effort` puts the tier, in the request's ASGI scope.
_OVERRIDE = "guards.effort"


@dataclass(frozen=True, slots=True, kw_only=True)
class Effort:
    """Route by effort: the routing hint (a name from `Guards(hints=...)`) each tier goes to.

    `escalate="auto"` sends `complex` turns to the `complex` hint; `"never"` keeps them on the
    `standard` hint (the complex hint is then never called). Raises `ConfigurationError` for an
    empty hint name or another `escalate`.
    """

    simple: str
    standard: str
    complex: str
    escalate: Literal["auto", "never"] = "auto"

    def __post_init__(self) -> None:
        if self.escalate not in ("auto", "never"):
            raise ConfigurationError('Effort.escalate must be "auto" or "never"')
        for tier in TIERS:
            hint = getattr(self, tier)
            if not isinstance(hint, str) or not hint.strip():
                raise ConfigurationError(f"Effort.{tier} must name a routing hint")

    def hint_for(self, tier: Tier) -> tuple[str, bool]:
        """The hint a `tier` goes to, and whether that is an escalation to the complex hint."""
        if tier == "complex":
            return (self.complex, True) if self.escalate == "auto" else (self.standard, False)
        return (self.simple if tier == "simple" else self.standard), False


def estimate_effort(inputs: Mapping[str, Any]) -> Tier:
    """The effort tier of Workers-AI-shaped `inputs` (`prompt`, or `messages` whose latest
    `user` message is read: its text, or its text parts). Pure and deterministic; linear in the
    inputs' size. See the module's docstring for the rules."""
    text = _turn_text(inputs)
    if text is None:
        return "standard"
    text = text.strip()
    if not text:
        return "standard"
    if not text.isascii():
        text = text.replace("\uff1f", "?")  # a fullwidth question mark is a question too
    # Each test looks for one character first (memchr: a fraction of a microsecond for 4,000
    # characters), and only then for the longer pattern.
    if ("`" in text and "```" in text) or ("~" in text and "~~~" in text):
        return "complex"
    if _questions(text) >= COMPLEX_QUESTIONS:
        return "complex"
    if len(text) >= COMPLEX_CHARS:
        return "complex"
    if len(text) < SIMPLE_CHARS and "\n" not in text:
        core = text.rstrip(_END)
        if not any(mark in core for mark in _BREAKS):
            return "simple"
    return "standard"


def override_effort(request: Request, tier: Tier) -> None:
    """Set the effort tier of this request, skipping the estimator: call it from a dependency
    of the route (code the app trusts: an authenticated plan, an operator's switch), never
    with a value a client sent. Raises `ValueError` for an unknown tier."""
    if tier not in TIERS:
        raise ValueError(f"unknown effort tier {tier!r}: one of {', '.join(TIERS)}")
    request.scope[_OVERRIDE] = tier


@dataclass(frozen=True, slots=True, eq=False)
class EffortRoutes:
    """A route's chain per tier, flattened at start-up, and the decision's log and count."""

    route: str
    #: tier: (the route with that tier's chain, its hint, whether it escalated, its count).
    tiers: Mapping[Tier, tuple[GuardedRoute, str, bool, Tally]]

    @classmethod
    def attach(
        cls, route: GuardedRoute, effort: Effort, chain_of: Callable[[str], tuple[tuple[Leg, ...], int]]
    ) -> GuardedRoute:
        """`route`, which runs the standard hint's chain, with a chain per tier attached:
        `chain_of(hint)` flattens a hint's chain (its legs and its attempt budget)."""
        chains: dict[str, GuardedRoute] = {}
        for hint in dict.fromkeys((effort.simple, effort.standard, effort.complex)):
            legs, budget = (route.legs, route.attempt_budget) if hint == effort.standard else chain_of(hint)
            chains[hint] = on_chain(route, legs, budget)
        tiers: dict[Tier, tuple[GuardedRoute, str, bool, Tally]] = {}
        for tier in TIERS:
            hint, escalated = effort.hint_for(tier)
            tiers[tier] = (chains[hint], hint, escalated, counter(EFFORT_DECISIONS, route.name, tier, hint))
        return dataclasses.replace(chains[effort.standard], effort=cls(route.name, tiers))

    def choose(self, inputs: Mapping[str, Any], request: Request | None, trace_id: str) -> GuardedRoute:
        """The route whose chain this request runs: the override's tier, else the estimate's."""
        override: Tier | None = request.scope.get(_OVERRIDE) if request is not None else None
        overridden = override in TIERS
        tier = override if override is not None and overridden else estimate_effort(inputs)
        route, hint, escalated, decisions = self.tiers[tier]
        decisions.add()
        emit(
            "effort",
            route=self.route,
            trace_id=trace_id,
            tier=tier,
            hint=hint,
            escalated=escalated,
            override=overridden,
        )
        return route


def _turn_text(inputs: Mapping[str, Any]) -> str | None:
    prompt = inputs.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = inputs.get("messages")
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return None
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return _content_text(message.get("content"))
    return None


def _content_text(content: Any) -> str | None:
    """A message's text: a string, or the text of its parts (`[{"type": "text", "text": ...}]`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        ]
        return "\n".join(texts) if texts else None
    return None


def _questions(text: str) -> int:
    """Questions in `text`, up to COMPLEX_QUESTIONS: runs of `?`, each run once (`??` is one
    question). Each run is found by `find` and skipped by an anchored match: one pass."""
    count, at = 0, text.find("?")
    while at >= 0 and count < COMPLEX_QUESTIONS:
        count += 1
        run = _QUESTION_RUN.match(text, at)
        assert run is not None
        at = text.find("?", run.end())
    return count
