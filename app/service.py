"""The example service, built by `create_app` (`app.main` serves the one its environment
configures: `uvicorn app.main:app`).

`POST /draft-reply` is a strict route (public errors), and `POST /draft-reply/stream` the same
streamed, shed first when a model is down; `POST /chat` the same for the Vercel AI SDK's
`useChat` (its request body, its UI message stream), with a budget per `x-user-id`;
`POST /summary` a degrading one (always the envelope); `POST /report` a strict three-step task that resumes under an `Idempotency-Key`;
`GET /health` the service level; `GET /metrics` the Prometheus exposition; `GET /status` the
status page (only to requests that carry `STATUS_TOKEN` when it is set). Configured from the
environment (see `app.settings.Settings` and the README).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any, Literal

import anyio
from fastapi import FastAPI, Header, Response
from fastapi.middleware.cors import CORSMiddleware
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema
from pydantic_core import PydanticCustomError

from guards import (
    AI,
    UI_MESSAGE_STREAM,
    Binding,
    Breaker,
    Budget,
    Clock,
    Deployment,
    Deployments,
    Effort,
    EventStream,
    Guards,
    GuardTripped,
    Hedge,
    LastGood,
    SharedLimit,
    Task,
    UIChatRequest,
    header_key,
    render_metrics,
)
from guards.stores import Store, open_store

from .labels import keyword_label, mentions_personal_data
from .offline import OfflineModel
from .settings import CLOUD_HINT, LOCAL_HINT, Settings, load_settings
from .tracing import tracer_provider_from_env

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

DRAFT_PROMPT = (
    "You draft short, polite replies to customer messages. Answer with the reply text only, "
    "at most 150 words."
)
SUMMARY_PROMPT = "Label the customer message with a short topic label and your confidence between 0 and 1."
REPORT_SUMMARY_PROMPT = (
    "Summarize the customer message in one or two sentences. Answer with the summary only."
)


#: Whitespace as JSON Schema patterns know it (ECMA-262 `\s`), spelled out, so that what the
#: OpenAPI document says and what the app accepts agree to the character (Python's `\s` and
#: `str.strip` differ from it on a few control and format characters).
_WS = r"\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_WS_CHARS = "".join(
    chr(c)
    for c in [
        9,
        10,
        11,
        12,
        13,
        32,
        0xA0,
        0x1680,
        *range(0x2000, 0x200B),
        0x2028,
        0x2029,
        0x202F,
        0x205F,
        0x3000,
        0xFEFF,
    ]
)


def _trim(text: str) -> str:
    return text.strip(_WS_CHARS)


#: The most characters of a draft request's message, once trimmed.
MESSAGE_MAX = 500


def _message(text: str) -> str:
    """A draft request's message, trimmed: 1 to MESSAGE_MAX characters, else `string_too_short`
    or `string_too_long` (what to fix, not a pattern mismatch)."""
    trimmed = _trim(text)
    if not trimmed:
        raise PydanticCustomError(
            "string_too_short", "String should have at least 1 character after trimming", {"min_length": 1}
        )
    if len(trimmed) > MESSAGE_MAX:
        raise PydanticCustomError(
            "string_too_long",
            "String should have at most {max_length} characters after trimming",
            {"max_length": MESSAGE_MAX},
        )
    return trimmed


class DraftRequest(BaseModel):
    #: 1 to 500 characters once trimmed. The length is checked on its own (`_message`), so a
    #: client learns which limit it crossed; the document states the same rule of the raw input
    #: as a pattern, so clients read exactly what is accepted.
    message: Annotated[
        str,
        WithJsonSchema(
            {
                "type": "string",
                "pattern": f"^[{_WS}]*[^{_WS}](?:[\\s\\S]{{0,{MESSAGE_MAX - 2}}}[^{_WS}])?[{_WS}]*$",
                "description": f"1 to {MESSAGE_MAX} characters after trimming.",
            }
        ),
        AfterValidator(_message),
    ]


class DraftReply(BaseModel):
    model: str = Field(description="The model that wrote the reply.")
    reply: str
    attempts: int = Field(description="Provider calls made, retries included.")
    trace_id: str


#: What the model must produce for /draft-reply: non-empty text, at most 1200 characters.
ReplyText = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=1200)]


class SummaryRequest(BaseModel):
    model_config = ConfigDict(regex_engine="python-re")

    #: 1 to 4000 characters, not blank (the pattern: at least one non-whitespace character).
    text: str = Field(min_length=1, max_length=4000, pattern=f"[^{_WS}]")


class Summary(BaseModel):
    label: str = Field(min_length=1, max_length=80)
    confidence: float = Field(ge=0, le=1)


#: The budget key of /summary and /report.
UserId = Annotated[
    str | None,
    Header(
        max_length=128,
        pattern=r"^[^\x00-\x1f\x7f]*$",
        description="Budget key (default: client address): at most 128 characters, no control characters.",
    ),
]


#: The tenant's budget key of /summary (with TENANT_DAILY_CALL_LIMIT).
TenantId = Annotated[
    str | None,
    Header(
        max_length=128,
        pattern=r"^[^\x00-\x1f\x7f]*$",
        description="Tenant budget key (default: client address): at most 128 characters, no control characters.",
    ),
]

#: /summary's output tokens per call when a token limit is set (the label is a short JSON).
SUMMARY_MAX_TOKENS = 200


class ReportRequest(SummaryRequest):
    """`/report`'s body: the customer message, as `/summary` takes it."""


class Report(BaseModel):
    summary: str
    label: str = Field(description="The topic label, as `/summary` gives it.")
    reply: str = Field(description="A drafted reply.")
    resumed_steps: list[str] = Field(
        description="The steps (`summarize`, `classify`, `draft`) loaded from the task's "
        "checkpoints rather than called, in order."
    )
    trace_id: str


class Health(BaseModel):
    ok: bool = Field(description="Always true: the process is up.")
    level: Literal["full", "degraded", "minimal"] = Field(
        description="The service level: full (no model down), degraded (some model down: "
        "streaming is shed), minimal (every model down)."
    )
    down: list[str] = Field(description="The models down, as AI_ATTRIBUTION allows naming them.")


def keyword_summary(arguments: Mapping[str, Any], tripped: GuardTripped) -> Summary:
    """`/summary`'s fallback: a deterministic keyword label, with a confidence low enough that
    clients can tell it from a model's answer."""
    label, hits = keyword_label(arguments["body"].text)
    return Summary(label=label, confidence=0.3 if hits else 0.1)


def summary_key(arguments: Mapping[str, Any]) -> str:
    """Which `/summary` answers are shared: the same text, whitespace and case normalized."""
    return " ".join(arguments["body"].text.split()).casefold()


def create_app(
    settings: Settings | None = None,
    *,
    binding: Binding | None = None,
    store: Store | None = None,
    clock: Clock | None = None,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """Build the service. Tests pass `binding`, `store`, `clock` and `sleep` to control the world,
    and `tracer_provider` to trace (else `OTEL_TRACES_EXPORTER` decides: see `app.tracing`)."""
    settings = settings or load_settings()
    configure_logging()
    # Traces when OTEL_TRACES_EXPORTER names an exporter (the app then owns the provider and
    # flushes it at shutdown); none otherwise, and OpenTelemetry is never imported.
    owned = None
    if tracer_provider is None:
        tracer_provider = owned = tracer_provider_from_env()
        if owned is not None:
            use_as_global(owned)
    # The main binding, and every provider the fallback chain names (by name).
    providers = {
        name: binding
        if binding is not None and name == settings.ai_provider
        else make_binding(settings, name)
        for name in sorted(settings.providers_used())
    }
    main = providers[settings.ai_provider]
    # AI_DEPLOYMENTS: each deployment of AI_MODEL a binding of AI_PROVIDER of its own.
    deployments = settings.deployments if settings.ai_effort != "auto" else {}
    for name in deployments:
        providers[f"deployment-{name}"] = (
            binding if binding is not None else make_binding(settings, settings.ai_provider)
        )
    guards = Guards(
        main,
        providers=providers,
        # `is not None`: an empty MemoryStore is falsy (it has a length).
        store=store if store is not None else open_store(settings.guards_store, clock=clock),
        sleep=sleep,
        retry_after_s=settings.retry_after_s,
        attribution=settings.ai_attribution,
        tracing=tracer_provider if tracer_provider is not None else False,
        hints=settings.hints,
        max_in_flight=settings.max_in_flight,
        context_windows=settings.context_windows,
    )
    fallbacks = settings.fallback_models
    # AI_CONTENT_FILTER_FALLBACK=on: a provider's content filter moves every route on to the
    # chain's next model of another provider.
    content_filter_fallback = settings.ai_content_filter_fallback == "on"
    # AI_EFFORT=auto: the draft routes send simple and standard turns to the local model, complex
    # ones to the cloud model (then AI_FALLBACK_MODELS); else they call AI_MODEL.
    effort = (
        Effort(simple=LOCAL_HINT, standard=LOCAL_HINT, complex=CLOUD_HINT)
        if settings.ai_effort == "auto"
        else None
    )
    draft_model: str | Deployments | None = None if effort is not None else settings.ai_model
    if deployments:  # the draft routes balance AI_MODEL's deployments (docs/deployments.md)
        draft_model = Deployments(
            "draft",
            [
                Deployment(
                    name,
                    provider=f"deployment-{name}",
                    model=settings.ai_model,
                    weight=weight,
                    rpm=settings.ai_deployment_rpm,
                )
                for name, weight in deployments.items()
            ],
            strategy=settings.ai_deployment_strategy,
        )
    # GUARDS_STORE_FAILURE, when set, decides for both guards; else each keeps its default
    # (budget fails closed, breaker fails open: see guards.Budget and guards.Breaker).
    failure = settings.guards_store_failure

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with guards:
                yield
        finally:
            if owned is not None:
                owned.shutdown()  # exports the spans still batched

    app = FastAPI(
        title="guards example service",
        version="0.1.0",
        description="AI routes that stay standing: a strict route and a degrading one.",
        lifespan=lifespan,
    )
    guards.install(app)
    if settings.allowed_origins:
        # Pages on these origins may call the routes (the streaming one too: CORS headers go
        # out with the response head) and read the headers that tell what happened.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["content-type", "x-user-id", "x-trace-id"],
            expose_headers=["x-trace-id", "x-ai-model", "x-ai-fallback", "retry-after"],
            max_age=600,
        )
    breaker = Breaker(
        failure_threshold=settings.breaker_failure_threshold,
        reset_timeout_s=settings.breaker_reset_s,
        on_store_failure=failure or "open",
        window_s=settings.breaker_window_s,
        slow_call_s=settings.breaker_slow_call_s,
        minimum_calls=settings.breaker_minimum_calls,
    )
    # AI_FIRST_OUTPUT_S for every model; unset: the route's default (a share of the deadline for
    # each model but a chain's last).
    first_output: dict[str, Any] = (
        {} if settings.ai_first_output_s is None else {"first_output_s": settings.ai_first_output_s}
    )
    # AI_HEDGE_AFTER_S: a call with no answer after it asks the chain's next model too, on every
    # route but /report (a task's steps run once); unset: never.
    hedge = None if settings.ai_hedge_after_s is None else Hedge(after_s=settings.ai_hedge_after_s)
    if settings.breaker_probe_interval_s is not None:  # (unset: the default, 5 s at most BREAKER_RESET_S)
        breaker = dataclasses.replace(breaker, probe_interval_s=settings.breaker_probe_interval_s)

    @app.get("/health")
    async def health() -> Health:
        """The service level (always 200: the process is up)."""
        level = guards.service_level()
        return Health(ok=True, level=level.level.value, down=[model.model for model in level.down])

    # Out of the OpenAPI document: an operations endpoint, not part of the service's contract.
    # Under several workers, PROMETHEUS_MULTIPROC_DIR makes every worker answer the totals of all
    # (see guards.render_metrics; `make run` sets it). A plain `def`: reading the workers' files
    # runs in the thread pool, off the event loop.
    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    # The status page, for operators: with STATUS_TOKEN set, only for requests that carry it
    # (a browser without it is asked for it); without, open like /metrics.
    token = settings.status_token.get_secret_value()
    app.include_router(guards.status_router(token=token or None, refresh_s=settings.status_refresh_s))

    @app.post("/draft-reply")
    @guards.route(
        model=draft_model,
        effort=effort,
        fallbacks=fallbacks,
        timeout_s=settings.ai_timeout_s,
        **first_output,
        hedge=hedge,
        breaker=breaker,
        content_filter_fallback=content_filter_fallback,
        on_rejected=settings.ai_on_rejected,
    )
    async def draft_reply(body: DraftRequest, ai: AI[ReplyText]) -> DraftReply:
        """Draft a reply to a customer message. Strict: fails with a public error."""
        reply = await ai.run(draft_inputs(body))
        return DraftReply(
            model=ai.model or settings.ai_model, reply=reply, attempts=ai.attempts, trace_id=ai.trace_id
        )

    @app.post("/draft-reply/stream")
    @guards.route(
        model=draft_model,
        effort=effort,
        fallbacks=fallbacks,
        timeout_s=settings.ai_timeout_s,
        **first_output,
        hedge=hedge,
        breaker=breaker,
        content_filter_fallback=content_filter_fallback,
        name="draft_reply_stream",
        stream_max_s=settings.ai_stream_max_s,
        stream_max_chars=settings.ai_stream_max_chars,
        shed_at="degraded",  # streaming is the first thing to go
    )
    async def draft_reply_stream(body: DraftRequest, ai: AI[str]) -> EventStream:
        """Stream a reply to a customer message as Server-Sent Events. Strict: a failure before
        the first word is a public error; after it, an `error` event ends the stream."""
        return await ai.stream(draft_inputs(body))

    @app.post("/chat")
    @guards.route(
        model=draft_model,
        effort=effort,
        fallbacks=fallbacks,
        timeout_s=settings.ai_timeout_s,
        **first_output,
        hedge=hedge,
        breaker=breaker,
        content_filter_fallback=content_filter_fallback,
        budget=Budget(
            per_minute=settings.rate_limit_per_minute,
            per_day=settings.daily_call_limit,
            key=header_key("x-user-id"),
            scope="chat",
            on_store_failure=failure or "closed",
        ),
        name="chat",
        stream_max_s=settings.ai_stream_max_s,
        stream_max_chars=settings.ai_stream_max_chars,
        stream_format=UI_MESSAGE_STREAM,
        shed_at="degraded",
    )
    async def chat(body: UIChatRequest, ai: AI[str]) -> EventStream:
        """The conversation `useChat` (the Vercel AI SDK) posts, answered in its UI message
        stream. Strict: a failure before the first word is a public error; after it, an
        `error` chunk ends the stream."""
        return await ai.stream(chat_inputs(body))

    # One budget for /summary and /report: their counters are shared (scope "summary").
    budget = Budget(
        per_minute=settings.rate_limit_per_minute,
        per_day=settings.daily_call_limit,
        per_month=settings.monthly_call_limit,
        key=header_key("x-user-id"),
        scope="summary",
        on_store_failure=failure or "closed",
    )
    # /summary's own: the user's tokens (a request holds its estimated input tokens plus
    # SUMMARY_MAX_TOKENS), and the tenant's daily calls, admitted together with the user's.
    token_limited = settings.tokens_per_minute is not None or settings.tokens_per_day is not None
    summary_budgets = [
        dataclasses.replace(
            budget, tokens_per_minute=settings.tokens_per_minute, tokens_per_day=settings.tokens_per_day
        )
        if token_limited
        else budget
    ]
    if settings.tenant_daily_call_limit is not None:
        summary_budgets.append(
            Budget(
                per_day=settings.tenant_daily_call_limit,
                key=header_key("x-tenant-id"),
                scope="tenant",
                on_store_failure=failure or "closed",
            )
        )

    if settings.fair_share_per_minute is not None:
        # The model's upstream limit, shared by the tenants: each active one keeps its share.
        summary_budgets.append(
            Budget(
                key=header_key("x-tenant-id"),
                scope="upstream",
                shared=SharedLimit(per_minute=settings.fair_share_per_minute),
                on_store_failure=failure or "closed",
            )
        )

    @app.post("/summary")
    @guards.route(
        model=settings.ai_model,
        fallbacks=fallbacks,
        timeout_s=settings.ai_timeout_s,
        **first_output,
        hedge=hedge,
        breaker=breaker,
        content_filter_fallback=content_filter_fallback,
        budget=summary_budgets,
        max_tokens=SUMMARY_MAX_TOKENS if token_limited else None,
        # The last good summary of the same text, while fresh; then the keyword label.
        fallback=LastGood(key=summary_key, max_age_s=settings.last_good_max_age_s, otherwise=keyword_summary),
        moderation=mentions_personal_data,
        on_rejected=settings.ai_on_rejected,
    )
    async def summary(
        body: SummaryRequest, ai: AI[Summary], x_user_id: UserId = None, x_tenant_id: TenantId = None
    ) -> Summary:
        """Label a customer message. Degrading: always the envelope; on failure the last good
        label of the same text (while fresh), else a keyword label."""
        return await ai.run(summary_inputs(body.text))

    @app.post("/report")
    @guards.route(
        model=settings.ai_model,
        fallbacks=fallbacks,
        # Three calls, each with the chain's attempts (every model, one retry).
        attempts=3 * (len(fallbacks) + 2),
        timeout_s=settings.ai_timeout_s,
        **first_output,
        breaker=breaker,
        content_filter_fallback=content_filter_fallback,
        budget=budget,
        task=Task(),
        on_rejected=settings.ai_on_rejected,
    )
    async def report(body: ReportRequest, ai: AI[ReplyText], x_user_id: UserId = None) -> Report:
        """Summarize, label and answer a customer message in three model calls. Strict. With
        an `Idempotency-Key`, a retry resumes after the steps that completed, and a completed
        report is answered again without a call."""
        text = body.text
        summary = await ai.step(
            "summarize",
            {
                "messages": [
                    {"role": "system", "content": REPORT_SUMMARY_PROMPT},
                    {"role": "user", "content": text},
                ]
            },
        )
        label = await ai.step("classify", summary_inputs(text), output=Summary)
        context = f"The message is about: {label.label}. Summary: {summary}"
        reply = await ai.step(
            "draft",
            {
                "messages": [
                    {"role": "system", "content": f"{DRAFT_PROMPT} {context}"},
                    {"role": "user", "content": text},
                ]
            },
        )
        return Report(
            summary=summary,
            label=label.label,
            reply=reply,
            resumed_steps=list(ai.resumed_steps),
            trace_id=ai.trace_id,
        )

    return app


def summary_inputs(text: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": SUMMARY_PROMPT},
            {"role": "user", "content": text},
        ]
    }


def draft_inputs(body: DraftRequest) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": DRAFT_PROMPT},
            {"role": "user", "content": body.message},
        ]
    }


def chat_inputs(body: UIChatRequest) -> dict[str, Any]:
    """The conversation after the service's own instructions (a client's system messages are
    not the service's: they are left out)."""
    messages = [m for m in body.inputs()["messages"] if m["role"] != "system"]
    return {"messages": [{"role": "system", "content": DRAFT_PROMPT}, *messages]}


def make_binding(settings: Settings, provider: str) -> Binding:
    """The binding of one provider the settings name (`fake`, `workers-ai`, `openai`,
    `anthropic`, `gemini`, `bedrock`, `azure-openai`). The HTTP providers (and their HTTP
    client, and botocore for Bedrock) are imported only by an app that calls them."""
    idle = settings.ai_stream_idle_timeout_s
    if provider == "workers-ai":
        from guards.providers import WorkersAI

        return WorkersAI(
            account_id=settings.cloudflare_account_id,
            api_token=settings.cloudflare_api_token.get_secret_value(),
            base_url=settings.cloudflare_api_base,
            idle_timeout_s=idle,
        )
    if provider == "openai":
        from guards.providers import OpenAICompatible

        return OpenAICompatible(
            api_key=settings.openai_api_key.get_secret_value() or None,
            base_url=settings.openai_base_url,
            idle_timeout_s=idle,
        )
    if provider == "anthropic":
        from guards.providers import Anthropic

        return Anthropic(
            api_key=settings.anthropic_api_key.get_secret_value(),
            base_url=settings.anthropic_base_url,
            idle_timeout_s=idle,
        )
    if provider == "gemini":
        from guards.providers import Gemini

        return Gemini(
            api_key=settings.gemini_api_key.get_secret_value(),
            base_url=settings.gemini_base_url,
            idle_timeout_s=idle,
        )
    if provider == "bedrock":
        from guards.providers import Bedrock

        # Credentials: the standard AWS chain, which the adapter reads (checked at start-up).
        return Bedrock(
            region=settings.aws_region,
            endpoint_url=settings.aws_endpoint_url_bedrock_runtime or None,
            idle_timeout_s=idle,
        )
    if provider == "azure-openai":
        from guards.providers import AzureOpenAI

        return AzureOpenAI(
            endpoint=settings.azure_openai_endpoint,
            api_key=settings.azure_openai_api_key.get_secret_value(),
            api_version=settings.openai_api_version or None,
            idle_timeout_s=idle,
        )
    return OfflineModel()


def use_as_global(provider: TracerProvider) -> None:
    """Make `provider` OpenTelemetry's global one (the handlers' own spans, other
    instrumentations), unless the process already has one."""
    from opentelemetry import trace

    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)


def configure_logging() -> None:
    """Guards' events as JSON lines on stdout (once per process)."""
    logger = logging.getLogger("guards")
    if not any(getattr(h, "_guards_app", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._guards_app = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
