"""Exceptions raised by guards.

    GuardsError                  base of everything guards raises on purpose
    ├── ProviderError            a provider call failed (adapter boundary); classified by `classify`
    ├── GuardTripped             a guard refused or replaced a model answer; carries a `Reason`
    └── ConfigurationError       a route or binding is declared wrong (raised at start-up)

Messages never include a prompt, a generated text, a provider's own error text or a credential:
they are safe to log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._vocabulary import GuardName, Reason

if TYPE_CHECKING:
    from ._vocabulary import Kind

__all__ = ["ConfigurationError", "GuardTripped", "GuardsError", "ProviderError"]


class GuardsError(Exception):
    """Base class of the errors guards raises."""


class ConfigurationError(GuardsError, ValueError):
    """A route, binding or setting is declared wrong: its message names the setting, the value
    and the fix. Raised at start-up, never per request. A `ValueError`, as Python's own checks
    of a value are."""


class ProviderError(GuardsError):
    """A provider call failed: an error status, an error body, or a transport failure.

    `code` is the provider's numeric error code when it sent one, `status` the HTTP status
    (`None` when no response arrived: a transport failure). The provider's own message is not
    kept: it may echo the prompt. `json_mode_failed` marks a "JSON Mode couldn't be met" answer,
    which the output guard reports as `schema_invalid`. `quota_exhausted` marks an account
    quota failure a provider signals without a numeric code (OpenAI's `insufficient_quota`).
    `encoding_refused` marks an answer refused unread for its `Content-Encoding` (adapters ask
    for the body as sent): `model_unavailable` whatever its status. `context_exceeded` marks an
    input too long for the model's context window, signalled without a numeric code (OpenAI's
    `context_length_exceeded`, a compatible server's message); `content_filtered` a refusal by
    the provider's content policy (OpenAI's and Azure's `content_filter`,
    `content_policy_violation`; Bedrock's `guardrail_intervened`); `transient` a failure the
    provider documents as passing whatever its status (Bedrock's `ModelNotReadyException`,
    sent with 429, and `modelStreamErrorException`). `retry_after_s` is the
    provider's wait in seconds as this process read it; `retry_at`, when the wait came as an
    HTTP date, is that date (seconds since the epoch), so a cooldown can end by it on the
    store's clock rather than this process's.
    """

    def __init__(
        self,
        provider: str,
        *,
        code: int | None = None,
        status: int | None = None,
        retry_after_s: float | None = None,
        json_mode_failed: bool = False,
        quota_exhausted: bool = False,
        encoding_refused: bool = False,
        retry_at: float | None = None,
        context_exceeded: bool = False,
        content_filtered: bool = False,
        note: str = "",
        transient: bool = False,
    ) -> None:
        self.provider = provider
        self.code = code
        self.status = status
        self.retry_after_s = retry_after_s
        self.json_mode_failed = json_mode_failed
        self.quota_exhausted = quota_exhausted
        self.encoding_refused = encoding_refused
        self.retry_at = retry_at
        self.context_exceeded = context_exceeded
        self.content_filtered = content_filtered
        self.transient = transient
        self.note = note
        super().__init__(self.describe())

    @property
    def transport(self) -> bool:
        """True when no HTTP response arrived (refused, reset, dropped mid-body)."""
        return self.status is None

    def describe(self) -> str:
        """A short, safe summary: provider, code, status and our own note. No provider text."""
        parts = [self.provider]
        if self.code is not None:
            parts.append(f"code={self.code}")
        parts.append(f"status={self.status}" if self.status is not None else "transport failure")
        if self.json_mode_failed:
            parts.append("json mode not met")
        if self.quota_exhausted:
            parts.append("quota exhausted")
        if self.context_exceeded:
            parts.append("context length exceeded")
        if self.content_filtered:
            parts.append("content filtered")
        if self.transient:
            parts.append("transient")
        if self.note:
            parts.append(self.note)
        return " ".join(parts)


class GuardTripped(GuardsError):
    """A guard refused the call or rejected its answer.

    Raised by `AI.run`; the route decorator turns it into the envelope (degrading route) or the
    public error (strict route). Fallback functions receive it to compute their value.

    Attributes: `reason` (closed set), `guard` (derived from it), `kind` (the classifier's kind
    for call failures), `detail` (safe free text), `attempts` (provider calls made),
    `retry_after_s` (when the wait is known), `model` (the model concerned, if any),
    `problems` (an answer the output guard rejected: what was wrong with it, as field paths and
    problem tokens such as `answer.score: missing` or `tool[get_weather].city: missing`, at
    most 10; never the answer's text; empty for every other verdict), `scope` (the scope of the
    budget that refused, for `rate_limited` and `budget_exceeded`).
    """

    def __init__(
        self,
        reason: Reason,
        detail: str,
        *,
        kind: Kind | None = None,
        attempts: int = 0,
        retry_after_s: float | None = None,
        model: str | None = None,
        problems: tuple[str, ...] = (),
        scope: str | None = None,
    ) -> None:
        self.reason = reason
        self.detail = detail
        self.kind = kind
        self.attempts = attempts
        self.retry_after_s = retry_after_s
        self.model = model
        self.problems = problems
        self.scope = scope
        super().__init__(detail)

    def __str__(self) -> str:
        # Made when read (a log, a traceback), not on every refused request.
        return f"{self.reason.guard.value}/{self.reason.value}: {self.detail}"

    @property
    def guard(self) -> GuardName:
        return self.reason.guard
