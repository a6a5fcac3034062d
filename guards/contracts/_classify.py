"""The classifier (DESIGN.md, contract 3): one pure function from a provider failure to
`(kind, status, retryable)`. Codes decide first, then the HTTP status.

Workers AI sends 3040 (capacity, transient) and 3036 (daily quota) with the same HTTP 429, so a
status-first rule would retry quota exhaustion; hence codes first.

    an answer refused unread for its Content-Encoding                      -> model_unavailable
    code 2016 2017, or a content-filter flag                               -> moderation_blocked
    code 3006, or a context-length flag                                    -> context_length_exceeded
    code 5004 5005 5007 5016 5018 5035 3042                                -> model_incompatible
    code 3036 (or a quota flag)                                            -> model_quota_exhausted
    code 3040 or 3007, a transient flag, status 408, status >= 500,
      transport failure                                                    -> model_temporarily_unavailable
    status 413                                                             -> context_length_exceeded
    status 400 403 404 405                                                 -> model_incompatible
    status 429                                                             -> model_rate_limited
    anything else                                                          -> model_unavailable

An answer refused for its `Content-Encoding` (the adapters ask for `identity` and never inflate
a body) was not read: its status alone says nothing we trust, so it is `model_unavailable`,
never retried, never a cooldown.

A content filter and a context window are limits of the request, not failures of the model: a
provider's content-policy refusal (AI Gateway's guardrails send 2016 for a prompt, 2017 for an
answer; OpenAI-compatible servers the string codes the adapters flag) is `moderation_blocked`,
and an input too long for the model (Workers AI's 3006 and any 413, "request too large";
OpenAI's `context_length_exceeded`, flagged by the adapters) is `context_length_exceeded`.
Neither is retried: the same input gets the same answer. The flags come before the numeric
codes, being the more specific (a Workers AI 5006 "bad input" whose message names the context
length is a context-length failure).

HTTP 408 is a timeout: Workers AI sends it with 3007, and gateways (LiteLLM, proxies) answer it
when their upstream timed out; like any transient failure it is retried.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ._errors import ProviderError
from ._vocabulary import Kind

__all__ = ["Classification", "classify"]


@dataclass(frozen=True, slots=True)
class Classification:
    kind: Kind
    #: The HTTP status a strict route answers for this kind (None for cancellation).
    status: int | None
    retryable: bool


INCOMPATIBLE_CODES = frozenset({5004, 5005, 5007, 5016, 5018, 5035, 3042})
INCOMPATIBLE_STATUSES = frozenset({400, 403, 404, 405})
MODERATION_CODES = frozenset({2016, 2017})
CONTEXT_CODES = frozenset({3006})
CONTEXT_STATUSES = frozenset({413})
QUOTA_CODES = frozenset({3036})
TRANSIENT_CODES = frozenset({3040, 3007})
TRANSIENT_STATUSES = frozenset({408})

_INCOMPATIBLE = Classification(Kind.model_incompatible, 502, retryable=False)
_QUOTA = Classification(Kind.model_quota_exhausted, 503, retryable=False)
_TRANSIENT = Classification(Kind.model_temporarily_unavailable, 503, retryable=True)
_RATE_LIMITED = Classification(Kind.model_rate_limited, 503, retryable=False)
_UNAVAILABLE = Classification(Kind.model_unavailable, 503, retryable=False)
_MODERATION = Classification(Kind.moderation_blocked, 502, retryable=False)
_CONTEXT = Classification(Kind.context_length_exceeded, 400, retryable=False)
_CANCELLED = Classification(Kind.cancelled, None, retryable=False)


def classify(failure: BaseException) -> Classification:
    """Classify a failed provider call.

    `ProviderError` is classified by its flags and code, then status; a transport failure (no
    status) is transient; an answer refused for its encoding is `model_unavailable`.
    Cancellation is never retryable. Anything else is `model_unavailable`.
    """
    if isinstance(failure, asyncio.CancelledError):
        return _CANCELLED
    if not isinstance(failure, ProviderError):
        return _UNAVAILABLE
    if failure.encoding_refused:
        return _UNAVAILABLE
    code, status = failure.code, failure.status
    if failure.content_filtered or code in MODERATION_CODES:
        return _MODERATION
    if failure.context_exceeded or code in CONTEXT_CODES:
        return _CONTEXT
    if code in INCOMPATIBLE_CODES:
        return _INCOMPATIBLE
    if code in QUOTA_CODES or failure.quota_exhausted:
        return _QUOTA
    if code in TRANSIENT_CODES or failure.transient:
        return _TRANSIENT
    if status is None or status >= 500 or status in TRANSIENT_STATUSES:
        return _TRANSIENT
    if status in CONTEXT_STATUSES:
        return _CONTEXT
    if status in INCOMPATIBLE_STATUSES:
        return _INCOMPATIBLE
    if status == 429:
        return _RATE_LIMITED
    return _UNAVAILABLE
