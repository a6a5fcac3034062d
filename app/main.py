"""The example service: `uvicorn app.main:app`.

`POST /draft-reply` is a strict route (public errors), and `POST /draft-reply/stream` the same
streamed, shed first when a model is down; `POST /summary` a degrading one (always the
envelope); `POST /report` a strict three-step task that resumes under an `Idempotency-Key`;
`GET /health` the service level; `GET /metrics` the Prometheus exposition. Configured from the
environment (see `app.settings.Settings` and the README).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import anyio
from fastapi import FastAPI, Header, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from guards import (
    AI,
    Binding,
    Breaker,
    Budget,
    Clock,
    EventStream,
    Guards,
    GuardTripped,
    Task,
    header_key,
    render_metrics,
)
from guards.providers import OpenAICompatible, WorkersAI
from guards.stores import Store, open_store

from .labels import keyword_label, mentions_personal_data
from .offline import OfflineModel
from .settings import Settings, load_settings

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


class DraftRequest(BaseModel):
    model_config = ConfigDict(regex_engine="python-re")

    #: 1 to 500 characters once trimmed. The pattern says so of the raw input (so clients read
    #: exactly what is accepted); the value is then trimmed.
    message: Annotated[
        str,
        Field(
            pattern=f"^[{_WS}]*[^{_WS}](?:[\\s\\S]{{0,498}}[^{_WS}])?[{_WS}]*$",
            description="1 to 500 characters after trimming.",
        ),
        AfterValidator(_trim),
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


def create_app(
    settings: Settings | None = None,
    *,
    binding: Binding | None = None,
    store: Store | None = None,
    clock: Clock | None = None,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
) -> FastAPI:
    """Build the service. Tests pass `binding`, `store`, `clock` and `sleep` to control the world."""
    settings = settings or load_settings()
    configure_logging()
    # The main binding, and every provider the fallback chain names (by name).
    providers = {
        name: binding
        if binding is not None and name == settings.ai_provider
        else make_binding(settings, name)
        for name in sorted(settings.providers_used())
    }
    main = providers[settings.ai_provider]
    guards = Guards(
        main,
        providers=providers,
        store=store if store is not None else open_store(settings.guards_store, clock=clock),
        sleep=sleep,
        retry_after_s=settings.retry_after_s,
        attribution=settings.ai_attribution,
        max_in_flight=settings.max_in_flight,
    )
    fallbacks = settings.fallback_models
    # GUARDS_STORE_FAILURE, when set, decides for both guards; else each keeps its default
    # (budget fails closed, breaker fails open: see guards.Budget and guards.Breaker).
    failure = settings.guards_store_failure

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with guards:
            yield

    app = FastAPI(
        title="guards example service",
        version="0.1.0",
        description="AI routes that stay standing: a strict route and a degrading one.",
        lifespan=lifespan,
    )
    guards.install(app)
    breaker = Breaker(
        failure_threshold=settings.breaker_failure_threshold,
        reset_timeout_s=settings.breaker_reset_s,
        on_store_failure=failure or "open",
    )

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

    @app.post("/draft-reply")
    @guards.route(
        model=settings.ai_model, fallbacks=fallbacks, timeout_s=settings.ai_timeout_s, breaker=breaker
    )
    async def draft_reply(body: DraftRequest, ai: AI[ReplyText]) -> DraftReply:
        """Draft a reply to a customer message. Strict: fails with a public error."""
        reply = await ai.run(draft_inputs(body))
        return DraftReply(
            model=ai.model or settings.ai_model, reply=reply, attempts=ai.attempts, trace_id=ai.trace_id
        )

    @app.post("/draft-reply/stream")
    @guards.route(
        model=settings.ai_model,
        fallbacks=fallbacks,
        timeout_s=settings.ai_timeout_s,
        breaker=breaker,
        name="draft_reply_stream",
        stream_max_s=settings.ai_stream_max_s,
        stream_max_chars=settings.ai_stream_max_chars,
        shed_at="degraded",  # streaming is the first thing to go
    )
    async def draft_reply_stream(body: DraftRequest, ai: AI[str]) -> EventStream:
        """Stream a reply to a customer message as Server-Sent Events. Strict: a failure before
        the first word is a public error; after it, an `error` event ends the stream."""
        return await ai.stream(draft_inputs(body))

    # One budget for /summary and /report: their counters are shared (scope "summary").
    budget = Budget(
        per_minute=settings.rate_limit_per_minute,
        per_day=settings.daily_call_limit,
        key=header_key("x-user-id"),
        scope="summary",
        on_store_failure=failure or "closed",
    )

    @app.post("/summary")
    @guards.route(
        model=settings.ai_model,
        fallbacks=fallbacks,
        timeout_s=settings.ai_timeout_s,
        breaker=breaker,
        budget=budget,
        fallback=keyword_summary,
        moderation=mentions_personal_data,
    )
    async def summary(body: SummaryRequest, ai: AI[Summary], x_user_id: UserId = None) -> Summary:
        """Label a customer message. Degrading: always the envelope; a keyword label on failure."""
        return await ai.run(summary_inputs(body.text))

    @app.post("/report")
    @guards.route(
        model=settings.ai_model,
        fallbacks=fallbacks,
        # Three calls, each with the chain's attempts (every model, one retry).
        attempts=3 * (len(fallbacks) + 2),
        timeout_s=settings.ai_timeout_s,
        breaker=breaker,
        budget=budget,
        task=Task(),
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


def make_binding(settings: Settings, provider: str) -> Binding:
    """The binding of one provider the settings name (`fake`, `workers-ai`, `openai`)."""
    if provider == "workers-ai":
        return WorkersAI(
            account_id=settings.cloudflare_account_id,
            api_token=settings.cloudflare_api_token.get_secret_value(),
            base_url=settings.cloudflare_api_base,
            idle_timeout_s=settings.ai_stream_idle_timeout_s,
        )
    if provider == "openai":
        return OpenAICompatible(
            api_key=settings.openai_api_key.get_secret_value() or None,
            base_url=settings.openai_base_url,
            idle_timeout_s=settings.ai_stream_idle_timeout_s,
        )
    return OfflineModel()


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


def __getattr__(name: str) -> Any:
    # `uvicorn app.main:app` builds the app on first access, so importing this module (tests,
    # tooling) does not read the environment.
    if name == "app":
        application = create_app()
        globals()["app"] = application
        return application
    raise AttributeError(name)
