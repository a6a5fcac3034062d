"""OpenTelemetry traces of guarded requests, after the GenAI semantic conventions.

Off unless `Guards(tracing=...)` turns it on, and then only this module imports
`opentelemetry` (the API, from the optional extra `route-guards[otel]`): with tracing off the walk's
hooks are `is None` checks and nothing of OpenTelemetry is loaded.

With tracing on, a guarded request is one span, `guards.route`, child of the current span (an
ASGI instrumentation's server span) or else of the caller's W3C `traceparent`; its trace id is
the request's `x-trace-id`. It is the gateway span of the proposed GenAI gateway shape
(semantic-conventions #3342, semantic-conventions-genai #299, both still open): it carries the
requested model (`gen_ai.gateway.request.model`) and the effective one, and has one child per
attempt. Each provider call, retries included, is a CLIENT child named
`{gen_ai.operation.name} {gen_ai.request.model}` carrying the conventions' attributes
(`gen_ai.*`, `error.type`) and guards' own (`guards.*`, its outcome among them); a model passed
over without a call is an INTERNAL child `guards.skip {model}` saying why (not CLIENT: no call
was made, and a GenAI backend must not count it as one). An answered call's span ends when the
walk accounted for it (so that it carries the output guard's verdict); a streamed attempt's
when the stream ends.

Never the prompt, the answer, a budget key or a provider's message: the conventions' opt-in
content attributes (`gen_ai.input.messages`, `gen_ai.output.messages`,
`gen_ai.system_instructions`) are never set, and span statuses carry classifier kinds only.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..contracts._binding import AIResult
from ..contracts._classify import classify
from ..contracts._errors import ConfigurationError
from ..streams._relay import Opened
from ..waits._admission import never_admitted

if TYPE_CHECKING:
    from opentelemetry.trace import Span, TracerProvider
    from starlette.requests import Request

    from ..contracts._errors import GuardTripped
    from ..contracts._stream import StreamEnd
    from ..contracts._vocabulary import ErrorCode
    from ._route_spec import Leg

__all__ = ["RequestTrace", "Tracing", "provider_name"]

R = TypeVar("R")

#: `gen_ai.provider.name` of a binding that does not name itself (see `provider_name`).
_UNNAMED_PROVIDER = "guards.{}"
#: The instrumentation scope of guards' spans.
_SCOPE = "guards"
#: Each attempt's outcome: `ok`, a failure kind, `rejected`, a stream's ending, `skipped`.
_OUTCOME = "guards.attempt.outcome"
#: What a hedge's attempt span carries besides the rest (`route(hedge=...)`).
_HEDGE = {"guards.attempt.hedge": True}


def provider_name(binding: Any, chain_provider: str | None) -> str:
    """`gen_ai.provider.name` for a call through `binding`: the binding's own
    `gen_ai_provider_name` (a well-known value of the conventions where one applies: `openai`
    for `OpenAICompatible`; `cloudflare.workers_ai` for `WorkersAI`, which has none), else
    `guards.<name the chain gives the provider>` (`guards.default` for the main binding)."""
    name = getattr(binding, "gen_ai_provider_name", None)
    if isinstance(name, str) and name:
        return name
    return _UNNAMED_PROVIDER.format(chain_provider or "default")


class Tracing:
    """The tracer of one `Guards` with tracing on.

    `provider`: the `TracerProvider` to trace with; None: OpenTelemetry's global one (what an
    SDK set-up installs; with none installed, the API's no-op). Raises `ConfigurationError`
    when `opentelemetry-api` is not installed.
    """

    __slots__ = ("_context", "_fields", "_propagate", "_status", "_textmap", "_trace", "_tracer")

    def __init__(self, provider: TracerProvider | None = None) -> None:
        try:
            from opentelemetry import context, propagate, trace
            from opentelemetry.trace import Status, StatusCode
        except ImportError:
            raise ConfigurationError(
                "tracing needs the OpenTelemetry API: pip install 'route-guards[otel]'"
            ) from None
        self._trace = trace
        self._context = context
        self._propagate = propagate
        self._status = (Status, StatusCode)
        self._tracer = trace.get_tracer(_SCOPE, tracer_provider=provider)
        #: The global propagator last seen, and the headers it reads (`traceparent`...).
        self._textmap: object = None
        self._fields: frozenset[bytes] = frozenset()

    def start(self, route: str, request: Request, fallback_trace_id: Callable[[], str]) -> RequestTrace:
        """The span of one guarded request (not yet current: see `RequestTrace.enter`)."""
        trace = self._trace
        parent = None
        if not trace.get_current_span().get_span_context().is_valid and self._propagated(request):
            parent = self._propagate.extract(request.headers)  # the caller's traceparent
        span = self._tracer.start_span(
            "guards.route", context=parent, kind=trace.SpanKind.INTERNAL, attributes={"guards.route": route}
        )
        found = span.get_span_context()
        trace_id = trace.format_trace_id(found.trace_id) if found.is_valid else fallback_trace_id()
        return RequestTrace(self, span, trace_id, span.is_recording())

    def _propagated(self, request: Request) -> bool:
        """Whether the request carries a header the global propagator reads (scanning the raw
        headers costs less than an extraction that finds nothing)."""
        textmap = self._propagate.get_global_textmap()
        if textmap is not self._textmap:
            self._fields = frozenset(field.lower().encode("latin-1") for field in textmap.fields)
            self._textmap = textmap
        fields = self._fields
        return any(name in fields for name, _ in request.scope["headers"])


class RequestTrace:
    """One request's spans: the route span, and a span per provider attempt."""

    __slots__ = (
        "_pending",
        "_streams",
        "_token",
        "_tracing",
        "finished",
        "recording",
        "span",
        "streaming",
        "trace_id",
    )

    def __init__(self, tracing: Tracing, span: Span, trace_id: str, recording: bool) -> None:
        self._tracing = tracing
        self.span = span
        #: False for the API's no-op tracer (no SDK set up) or a request the sampler dropped:
        #: then nothing more is done (no attempt spans, no attributes), only the trace id kept.
        self.recording = recording
        #: The request's `x-trace-id`: the span's trace id (else the request's own id, when
        #: the no-op API gives no valid span).
        self.trace_id = trace_id
        self._token: object = None
        #: The span of each committed stream attempt, open until its stream ends.
        self._streams: dict[int, Span] = {}
        #: The span of the answered call the walk has not accounted for yet (`attempt_ended`).
        self._pending: Span | None = None
        #: Whether an answer still streams (the route span ends with it, in `finish`).
        self.streaming = False
        self.finished = False

    def enter(self) -> None:
        """Make the route span current (the handler's own spans and the attempts nest in it)."""
        if not self.recording:
            return
        trace = self._tracing._trace
        self._token = self._tracing._context.attach(trace.set_span_in_context(self.span))

    def leave(self) -> None:
        """Undo `enter`. A request that ended without an outcome (the handler's own
        HTTPException, a cancelled handler) ends its span here, unless its answer streams."""
        if self._token is not None:
            self._tracing._context.detach(self._token)
            self._token = None
        if not self.finished and not self.streaming:
            self.finished = True
            self._close_pending()
            self.span.end()

    def traced(
        self,
        call: Callable[[str, Mapping[str, Any]], Awaitable[R]],
        leg: Leg,
        binding: Any,
        *,
        fallback: bool,
        attempts: Callable[[], int],
        retry: bool = False,
        hedge: bool = False,
    ) -> Callable[[str, Mapping[str, Any]], Awaitable[R]]:
        """`call` (the attempts on one leg), each call a CLIENT span: the first is a retry
        when `retry`, every later one is. `fallback`: the leg is not the chain's first;
        `attempts()`: the request's calls so far; `hedge`: the call is a hedge
        (`guards.attempt.hedge`)."""
        if not self.recording:
            return call
        tracing = self._tracing
        trace = tracing._trace
        calls = [retry]
        provider = provider_name(binding, leg.ref.provider)
        deployment = {} if leg.ref.group is None else {"guards.deployment": leg.ref.key}

        async def attempt(model: str, inputs: Mapping[str, Any]) -> R:
            operation = "chat" if "messages" in inputs else "text_completion"
            span = tracing._tracer.start_span(
                f"{operation} {model}",
                kind=trace.SpanKind.CLIENT,
                attributes={
                    "gen_ai.operation.name": operation,
                    "gen_ai.provider.name": provider,
                    "gen_ai.request.model": model,
                    "guards.model": leg.ref.key,
                    "guards.attempt.number": attempts() + 1,
                    "guards.attempt.retry": calls[0],
                    "guards.attempt.fallback": fallback,
                    **(_HEDGE if hedge else {}),
                    **deployment,
                },
            )
            calls[0] = True
            started = time.perf_counter()
            token = tracing._context.attach(trace.set_span_in_context(span))
            try:
                result = await call(model, inputs)
            except BaseException as exc:
                if never_admitted(exc):  # cancelled while queued for a connection: never sent
                    span.set_attribute("guards.attempt.sent", False)
                self._failed(span, classify(exc).kind.value)
                span.end()
                raise
            finally:
                tracing._context.detach(token)
            if isinstance(result, Opened):
                span.set_attribute("gen_ai.response.time_to_first_chunk", time.perf_counter() - started)
                if result.committed:  # ends with its stream (`stream_ended`)
                    self._streams[id(result)] = span
                    return result
                self._answered(span, result.end, result.model)
            elif isinstance(result, AIResult):
                self._answered(span, result, result.model)
                self._close_pending()
                self._pending = span  # ends with its verdict (`attempt_ended`)
                return result
            span.set_attribute(_OUTCOME, "ok")
            span.end()
            return result

        return attempt

    def attempt_ended(self, outcome: str) -> None:
        """The walk accounted for the answered call whose span is still open: `outcome` is
        `ok`, `rejected` (the output guard's verdict, on a route that moves a rejected answer
        on) or the kind its answer was refused as (a content filter's finish)."""
        span = self._pending
        if span is None:
            return
        self._pending = None
        if outcome == "ok":
            span.set_attribute(_OUTCOME, outcome)
        else:
            self._failed(span, outcome)
        span.end()

    def _close_pending(self) -> None:
        """End an answered call's span that no verdict reached (the walk stopped between the
        answer and its accounting: a deadline, a cancellation): no outcome."""
        if self._pending is not None:
            self._pending.end()
            self._pending = None

    def stream_ended(self, opened: Opened, kind: str, end: StreamEnd | None, delivered: int) -> None:
        """End the span of a committed stream attempt: what it delivered, and how it ended
        (`kind`: `ok`, a failure kind, `cancelled`)."""
        span = self._streams.pop(id(opened), None)
        if span is None:
            return
        span.set_attribute("guards.stream.delivered_chars", delivered)
        self._answered(span, end, (end.model if end is not None else None) or opened.model)
        if kind != "ok":
            self._failed(span, kind)
        else:
            span.set_attribute(_OUTCOME, kind)
        span.end()

    def skipped(self, leg: Leg, reason: str, wait_s: float | None, *, fallback: bool) -> None:
        """A model of the chain passed over without a call (`reason`: `cooldown`,
        `circuit_open`, `context_window`, `content_filter`, or `retry_budget` for a retry the
        retry budget refused): a child span of its own, as long as nothing (no call)."""
        if not self.recording:
            return
        tracing = self._tracing
        key = leg.ref.key
        attributes: dict[str, Any] = {
            "gen_ai.request.model": leg.ref.model,
            "guards.model": key,
            "guards.attempt.skipped": True,
            "guards.attempt.fallback": fallback,
            "guards.skip.reason": reason,
            _OUTCOME: "skipped",
        }
        if wait_s is not None:
            attributes["guards.retry_after_s"] = round(wait_s, 3)
        parent = tracing._trace.set_span_in_context(self.span)
        tracing._tracer.start_span(
            f"guards.skip {key}", context=parent, kind=tracing._trace.SpanKind.INTERNAL, attributes=attributes
        ).end()

    def finish(
        self,
        outcome: str,
        status: int,
        tripped: GuardTripped | None,
        error: ErrorCode | None,
        attempts: int,
        *,
        service_level: str | None = None,
        requested: str | None = None,
        effective: Leg | None = None,
        served: str | None = None,
    ) -> None:
        """End the route span with the request's outcome (`guards_requests_total`'s), its HTTP
        status, the guard that tripped, the provider calls made and, when known, the service
        level; the requested model (the chain's first), and the effective one: the chain
        entry whose answer the request was given (`effective`) and the model the provider
        said served it (`served`). A server error (5xx) is the span's error status, its
        `error.type` the classifier's kind (else the public error)."""
        if self.finished:
            return
        self.finished = True
        self._close_pending()
        span = self.span
        if not self.recording:
            return
        attributes: dict[str, Any] = {
            "guards.outcome": outcome,
            "guards.attempts": attempts,
            "http.response.status_code": status,
        }
        if requested is not None:
            attributes["gen_ai.gateway.request.model"] = requested
        if effective is not None:
            attributes["guards.model"] = effective.ref.key
            attributes["gen_ai.response.model"] = served or effective.ref.model
        if tripped is not None:
            attributes["guards.fallback.guard"] = tripped.guard.value
            attributes["guards.fallback.reason"] = tripped.reason.value
        if service_level is not None:
            attributes["guards.service_level"] = service_level
        span.set_attributes(attributes)
        if outcome == "error" and status >= 500:
            kind = tripped.kind.value if tripped is not None and tripped.kind is not None else None
            self._failed(span, kind or (error.value if error is not None else "error"))
        span.end()

    def _answered(self, span: Span, answer: AIResult | StreamEnd | None, served: str | None) -> None:
        """The attributes of an answer: the model that served, usage, finish reason."""
        if served:
            span.set_attribute("gen_ai.response.model", served)
        if answer is None:
            return
        usage = answer.usage
        if usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        if answer.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", (answer.finish_reason,))

    def _failed(self, span: Span, kind: str) -> None:
        status, code = self._tracing._status
        span.set_attribute("error.type", kind)
        if span is not self.span:  # an attempt's
            span.set_attribute(_OUTCOME, kind)
        span.set_status(status(code.ERROR, kind))
