"""`guards.classify` against DESIGN.md contract 3 and the Workers AI table in PROTOCOLS.md.

Expected values are written from the contract, row by row:

    code 2016 2017, or a content-filter flag                                -> moderation_blocked
    code 3006, or a context-length flag                                     -> context_length_exceeded
    code 5004 5005 5007 5016 5018 5035 3042, or status 400 403 404 405      -> model_incompatible
    status 413                                                              -> context_length_exceeded
    code 3036                                                               -> model_quota_exhausted
    code 3040 or 3007, a transient flag, status 408, any status >= 500,
      transport failure                                                     -> model_temporarily_unavailable
    status 429                                                              -> model_rate_limited
    anything else                                                           -> model_unavailable

Flags and codes decide first, then the HTTP status. Public statuses (contract 2): 502 for
model_incompatible and moderation_blocked, 400 for context_length_exceeded (the client must
shorten the input), 503 for every other provider kind; cancellation has none.
"""

from __future__ import annotations

import asyncio

import pytest

from guards import Classification, Kind, ProviderError, classify

INCOMPATIBLE = (Kind.model_incompatible, 502, False)
QUOTA = (Kind.model_quota_exhausted, 503, False)
TRANSIENT = (Kind.model_temporarily_unavailable, 503, True)
RATE_LIMITED = (Kind.model_rate_limited, 503, False)
UNAVAILABLE = (Kind.model_unavailable, 503, False)
CANCELLED = (Kind.cancelled, None, False)
CONTEXT = (Kind.context_length_exceeded, 400, False)
MODERATION = (Kind.moderation_blocked, 502, False)


def wai(code: int | None, status: int | None) -> ProviderError:
    return ProviderError("workers-ai", code=code, status=status)


# Every code of the PROTOCOLS.md table, with its documented HTTP status.
DOCUMENTED_CODES = [
    pytest.param(wai(3003, 400), INCOMPATIBLE, id="3003/400-incomplete-request-by-status"),
    pytest.param(wai(3006, 413), CONTEXT, id="3006/413-too-large"),
    pytest.param(wai(3007, 408), TRANSIENT, id="3007/408-timeout"),
    pytest.param(wai(3008, 408), TRANSIENT, id="3008/408-aborted-by-status"),
    pytest.param(wai(3023, 403), INCOMPATIBLE, id="3023/403-account-blocked-by-status"),
    pytest.param(wai(3036, 429), QUOTA, id="3036/429-daily-quota-not-rate-limit"),
    pytest.param(wai(3039, 400), INCOMPATIBLE, id="3039/400-finetune-missing-by-status"),
    pytest.param(wai(3040, 429), TRANSIENT, id="3040/429-capacity-not-rate-limit"),
    pytest.param(wai(3041, 403), INCOMPATIBLE, id="3041/403-private-model-by-status"),
    pytest.param(wai(3042, 404), INCOMPATIBLE, id="3042/404-invalid-model"),
    pytest.param(wai(5004, 400), INCOMPATIBLE, id="5004/400-invalid-data"),
    pytest.param(wai(5005, 405), INCOMPATIBLE, id="5005/405-lora-unsupported"),
    pytest.param(wai(5006, 400), INCOMPATIBLE, id="5006/400-bad-input-by-status"),
    pytest.param(wai(5006, 200), UNAVAILABLE, id="5006/200-bad-input-unlisted-code"),
    pytest.param(wai(5007, 400), INCOMPATIBLE, id="5007/400-no-such-model"),
    pytest.param(wai(5016, 403), INCOMPATIBLE, id="5016/403-agreement-not-accepted"),
    pytest.param(wai(5018, 403), INCOMPATIBLE, id="5018/403-private-model"),
    pytest.param(wai(5019, 405), INCOMPATIBLE, id="5019/405-deprecated-sdk-by-status"),
    pytest.param(wai(5035, 403), INCOMPATIBLE, id="5035/403-requires-paid"),
    pytest.param(wai(10000, 401), UNAVAILABLE, id="10000/401-bad-token"),
]

# A failure can arrive with HTTP 200 (success: false), or with an unexpected status: the code decides.
CODES_WIN_OVER_STATUS = [
    pytest.param(wai(3040, 200), TRANSIENT, id="3040/200-still-transient"),
    pytest.param(wai(3036, 200), QUOTA, id="3036/200-still-quota"),
    pytest.param(wai(3007, 200), TRANSIENT, id="3007/200-still-transient"),
    pytest.param(wai(3042, 200), INCOMPATIBLE, id="3042/200-still-incompatible"),
    pytest.param(wai(5007, 503), INCOMPATIBLE, id="5007/503-code-before-5xx"),
    pytest.param(wai(3036, 503), QUOTA, id="3036/503-code-before-5xx"),
    pytest.param(wai(3040, 403), TRANSIENT, id="3040/403-code-before-incompatible-status"),
    pytest.param(wai(3036, None), QUOTA, id="3036/no-status-code-before-transport"),
    pytest.param(
        ProviderError("openai", status=429, quota_exhausted=True),
        QUOTA,
        id="429-flagged-quota-not-rate-limit",
    ),
]

BARE_STATUSES = [
    pytest.param(wai(None, 400), INCOMPATIBLE, id="400"),
    pytest.param(wai(None, 403), INCOMPATIBLE, id="403"),
    pytest.param(wai(None, 404), INCOMPATIBLE, id="404"),
    pytest.param(wai(None, 405), INCOMPATIBLE, id="405"),
    pytest.param(wai(None, 413), CONTEXT, id="413-request-too-large"),
    pytest.param(wai(None, 429), RATE_LIMITED, id="429"),
    pytest.param(wai(None, 500), TRANSIENT, id="500"),
    pytest.param(wai(None, 502), TRANSIENT, id="502"),
    pytest.param(wai(None, 503), TRANSIENT, id="503"),
    pytest.param(wai(None, 504), TRANSIENT, id="504"),
    pytest.param(wai(None, 529), TRANSIENT, id="529-any-5xx"),
    pytest.param(wai(None, 401), UNAVAILABLE, id="401"),
    pytest.param(wai(None, 408), TRANSIENT, id="408-a-gateway-timeout"),
    pytest.param(wai(None, 409), UNAVAILABLE, id="409"),
    pytest.param(wai(None, 422), UNAVAILABLE, id="422"),
    pytest.param(wai(None, 200), UNAVAILABLE, id="200-success-false-without-code"),
]

# The request's limits: a context window, a content filter (flagged by the adapters from string
# codes and messages, or AI Gateway's numeric guardrail codes); flags before codes.
LIMITS = [
    pytest.param(wai(3006, 400), CONTEXT, id="3006/400-code-before-incompatible-status"),
    pytest.param(wai(3006, 200), CONTEXT, id="3006/200-still-too-large"),
    pytest.param(
        ProviderError("openai", status=400, context_exceeded=True), CONTEXT, id="400-flagged-context-length"
    ),
    pytest.param(
        ProviderError("workers-ai", code=5006, status=400, context_exceeded=True),
        CONTEXT,
        id="5006/400-flagged-context-length-flag-before-code",
    ),
    pytest.param(wai(2016, 400), MODERATION, id="2016-gateway-guardrail-prompt-blocked"),
    pytest.param(wai(2017, 200), MODERATION, id="2017-gateway-guardrail-response-blocked"),
    pytest.param(
        ProviderError("openai", status=400, content_filtered=True),
        MODERATION,
        id="400-flagged-content-filter",
    ),
    pytest.param(
        ProviderError("openai", status=400, content_filtered=True, context_exceeded=True),
        MODERATION,
        id="content-filter-before-context-length",
    ),
    pytest.param(
        ProviderError("openai", status=413, encoding_refused=True, context_exceeded=True),
        UNAVAILABLE,
        id="413-encoding-refused-unread",
    ),
]

# Bedrock's error types, as its adapter reads them (docs/providers/bedrock.md): the status, and a
# transient flag where the type says more than its status.
BEDROCK = [
    pytest.param(ProviderError("bedrock", status=429), RATE_LIMITED, id="ThrottlingException/429"),
    pytest.param(
        ProviderError("bedrock", status=429, transient=True), TRANSIENT, id="ModelNotReady/429-transient"
    ),
    pytest.param(
        ProviderError("bedrock", status=424, transient=True), TRANSIENT, id="modelStreamError/424-transient"
    ),
    pytest.param(
        ProviderError("bedrock", status=400, quota_exhausted=True), QUOTA, id="ServiceQuotaExceeded/400"
    ),
    pytest.param(
        ProviderError("bedrock", status=429, quota_exhausted=True, transient=True),
        QUOTA,
        id="quota-before-transient",
    ),
    pytest.param(
        ProviderError("bedrock", status=400, context_exceeded=True),
        CONTEXT,
        id="Validation/400-input-too-long",
    ),
    pytest.param(ProviderError("bedrock", status=424), UNAVAILABLE, id="ModelErrorException/424"),
    pytest.param(ProviderError("bedrock", status=403), INCOMPATIBLE, id="UnrecognizedClient/403"),
]

NOT_PROVIDER_ERRORS = [
    pytest.param(ProviderError("workers-ai", note="ConnectError"), TRANSIENT, id="transport-no-status"),
    pytest.param(wai(7003, None), TRANSIENT, id="unlisted-code-no-status-is-transport"),
    pytest.param(asyncio.CancelledError(), CANCELLED, id="cancelled"),
    pytest.param(ValueError("boom"), UNAVAILABLE, id="unrelated-exception"),
]


@pytest.mark.parametrize(
    ("failure", "expected"),
    [*DOCUMENTED_CODES, *CODES_WIN_OVER_STATUS, *BARE_STATUSES, *LIMITS, *BEDROCK, *NOT_PROVIDER_ERRORS],
)
def test_classify(failure: BaseException, expected: tuple[Kind, int | None, bool]) -> None:
    kind, status, retryable = expected
    assert classify(failure) == Classification(kind, status, retryable)


def test_only_transient_failures_are_retryable() -> None:
    """Contract 2: `retryable` is true only for transient failures."""
    rows = [
        *DOCUMENTED_CODES,
        *CODES_WIN_OVER_STATUS,
        *BARE_STATUSES,
        *LIMITS,
        *BEDROCK,
        *NOT_PROVIDER_ERRORS,
    ]
    for row in rows:
        failure = row.values[0]
        assert isinstance(failure, BaseException)
        verdict = classify(failure)
        assert verdict.retryable == (verdict.kind is Kind.model_temporarily_unavailable), row.id
