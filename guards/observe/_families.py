"""guards' metrics, each declared once: its name, help and labels (`Metric`; made in
prometheus-client when first needed).

Labels come from closed sets only: route names, configured model keys, guard names, reasons,
kinds, outcomes. Never a user id, a route's input, a served-model string from a provider, or a
free-text detail.
"""

from __future__ import annotations

from ..contracts._vocabulary import CircuitState
from ._prometheus import Metric

__all__ = [
    "ATTEMPTS",
    "ANSWER_SECONDS",
    "ATTEMPT_SECONDS",
    "BREAKER_STATE",
    "BREAKER_TRANSITIONS",
    "BUDGET_HELD",
    "BUDGET_NEAR",
    "BUDGET_SETTLED",
    "COST",
    "EFFORT_DECISIONS",
    "FALLBACKS",
    "FIRST_OUTPUT_SECONDS",
    "HEDGES",
    "LATENCY_BUCKETS",
    "HOLD_REJECTIONS",
    "LOG_LINES_DROPPED",
    "REQUESTS",
    "REQUEST_SECONDS",
    "RETRY_BUDGET_EXHAUSTED",
    "SERVED",
    "SERVICE_LEVEL",
    "SKIPS",
    "SLOW_STREAMS",
    "STATE_VALUE",
    "STORE_RESETS",
    "STORE_UNAVAILABLE",
    "STREAM_KEPT",
    "STREAM_RESUMES",
    "TASK_STEPS",
    "TOKENS",
]

STORE_UNAVAILABLE = Metric(
    "Counter",
    "guards_store_unavailable",
    "Store operations that failed (store down or slower than its timeout), by guard and what the "
    "guard did: open (admitted), closed (refused), or the op that was lost after the call.",
    ["guard", "action"],
)
STORE_RESETS = Metric(
    "Counter",
    "guards_store_reset",
    "Times this worker found its store had forgotten its state (the store's epoch marker missing "
    "or changed: a flush, a restart without persistence, an empty replica promoted, a SQLite "
    "file replaced; or Redis keys evicted under memory pressure), by store: redis or sqlite. "
    "Each worker counts each reset once.",
    ["store"],
)
REQUESTS = Metric(
    "Counter",
    "guards_requests",
    "Requests to guarded routes by outcome: ok (the model answered), fallback (200 with a "
    "fallback envelope), error (a public error or an application failure), cancelled (the "
    "client left before the answer), invalid (400 invalid_request: no handler ran, no call).",
    ["route", "outcome"],
)
FALLBACKS = Metric(
    "Counter",
    "guards_fallbacks",
    "Degraded or refused requests, by the guard that tripped and its reason.",
    ["route", "guard", "reason"],
)
ATTEMPTS = Metric(
    "Counter",
    "guards_provider_attempts",
    "Provider calls by model (as configured in the chain) and outcome kind (ok or a failure kind).",
    ["model", "kind"],
)
SERVED = Metric(
    "Counter",
    "guards_served",
    "Requests answered (outcome ok) by a model, by route, the chain entry whose answer served "
    "(as configured) and its position in the chain: first (the route's model) or fallback.",
    ["route", "model", "position"],
)
TOKENS = Metric(
    "Counter",
    "guards_tokens",
    "Tokens the providers reported using, by model (as configured in the chain) and type: "
    "input or output. Calls that report no usage add nothing.",
    ["model", "type"],
)
COST = Metric(
    "Counter",
    "guards_cost_usd",
    "What provider calls cost in US dollars, by route and model: the reported usage priced by "
    "Guards(prices=...) (times Guards(cost_unit_usd=...)). Models without a price, and calls "
    "that report no usage, add nothing.",
    ["route", "model"],
)
BUDGET_HELD = Metric(
    "Counter",
    "guards_budget_held",
    "What requests held against their budgets before their first call, by budget scope and "
    "unit: tokens (the estimated input tokens plus max_tokens), or spend (the worst-case cost, "
    "in the cost units of Guards(prices=...)). Only budgets with token limits or spend caps hold.",
    ["scope", "unit"],
)
BUDGET_SETTLED = Metric(
    "Counter",
    "guards_budget_settled",
    "What the holds of guards_budget_held settled to when their request ended, by budget "
    "scope and unit: the tokens the providers reported (a billed call that reported none: its "
    "hold), or the cost of the calls.",
    ["scope", "unit"],
)
BUDGET_NEAR = Metric(
    "Counter",
    "guards_budget_near",
    "Requests admitted past a budget's soft limit (Budget(soft_limit=...)), by budget scope: "
    "some limit of the scope was past that fraction of itself once the request was charged.",
    ["scope"],
)
BREAKER_TRANSITIONS = Metric(
    "Counter",
    "guards_breaker_transitions",
    "Breaker state changes by model and the state entered: open, half_open, closed. Each change "
    "is counted once, by the worker whose store operation made it.",
    ["model", "to"],
)
SKIPS = Metric(
    "Counter",
    "guards_model_skips",
    "Chain models skipped without a call, by reason: cooldown, circuit_open, context_window, content_filter "
    "or rate_limited (a deployment at its rpm or tpm).",
    ["model", "reason"],
)
HOLD_REJECTIONS = Metric(
    "Counter",
    "guards_stream_hold_rejections",
    "Streamed answers the output guard rejected inside their hold (route(stream_hold=...)), by "
    "route and reason: empty_response, moderation_blocked. The client saw none of them.",
    ["route", "reason"],
)
SLOW_STREAMS = Metric(
    "Counter",
    "guards_stream_slow_models",
    "Streams cancelled before their commit point for streaming below their model's "
    "min_chars_per_s, by route and model (as configured in the chain).",
    ["route", "model"],
)
EFFORT_DECISIONS = Metric(
    "Counter",
    "guards_effort_decisions",
    "Effort routing decisions, by route, the tier the request was given (simple, standard, "
    "complex) and the routing hint it was sent to.",
    ["route", "tier", "hint"],
)
HEDGES = Metric(
    "Counter",
    "guards_hedges",
    "Hedged calls (route(hedge=...)), by route, the model hedged (as configured in the chain) "
    "and outcome: started (a second attempt began on the next model), won (its answer came "
    "first), lost (the first attempt's answer came first; the hedge was cancelled or failed), "
    "skipped (the model's retry budget was spent: no hedge).",
    ["route", "model", "outcome"],
)
RETRY_BUDGET_EXHAUSTED = Metric(
    "Counter",
    "guards_retry_budget_exhausted",
    "Retryable failures not retried because the model's retry budget (in this worker) was spent.",
    ["model"],
)
REQUEST_SECONDS = Metric(
    "Histogram",
    "guards_request_duration_seconds",
    "Time spent in guarded routes, from the handler's start to its answer.",
    ["route"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
ATTEMPT_SECONDS = Metric(
    "Histogram",
    "guards_provider_attempt_duration_seconds",
    "Latency of single provider calls, by model.",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
#: The latency histograms' bounds, in seconds: each bound at most twice the one below it, so a
#: percentile read from them (interpolated within its bucket) is off by less than its bucket's
#: width (`guards.observe._latency`).
LATENCY_BUCKETS = (
    0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
FIRST_OUTPUT_SECONDS = Metric(
    "Histogram",
    "guards_model_first_output_seconds",
    "Time from a provider call's start to its first output, by model (as configured in the "
    "chain): a stream's first output part, a whole answer's arrival. Calls that produced one.",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
ANSWER_SECONDS = Metric(
    "Histogram",
    "guards_model_answer_seconds",
    "Time from a provider call's start to its whole answer, by model (as configured in the "
    "chain): a stream's end. Answered calls only (kind ok).",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
BREAKER_STATE = Metric(
    "Gauge",
    "guards_breaker_state",
    "The breaker state a worker last saw per model: 0 closed, 1 half-open, 2 open.",
    ["model"],
    multiprocess_mode="mostrecent",
)
STATE_VALUE = {CircuitState.closed: 0, CircuitState.half_open: 1, CircuitState.open: 2}
#: Every worker reads the same store, so the value a worker set last is the freshest reading
#: (`mostrecent`): a worker that has been idle keeps an older one, and `max` or `min` would
#: hold on to it.
SERVICE_LEVEL = Metric(
    "Gauge",
    "guards_service_level",
    "The service level a worker last read: 0 full, 1 degraded (some model down), 2 minimal "
    "(every model down).",
    multiprocess_mode="mostrecent",
)
TASK_STEPS = Metric(
    "Counter",
    "guards_task_steps",
    "Multi-step tasks by outcome: saved and resumed (steps), replayed (requests answered with a "
    "completed task's response), conflict (requests refused 409 task_in_progress, 422 "
    "idempotency_key_reused, or 429 rate_limited for too many live tasks).",
    ["route", "outcome"],
)
LOG_LINES_DROPPED = Metric(
    "Counter",
    "guards_log_lines_dropped",
    "Log lines dropped because the writer of guards' lines (and, under guards.serve, of "
    "uvicorn's and asyncio's) was behind (a stderr, stdout or log handler that does not keep "
    "up): never waited for (see docs/operating/logs.md).",
)
STREAM_RESUMES = Metric(
    "Counter",
    "guards_stream_resumes",
    "Resumes of resumable streams, by outcome: resumed (the kept events and the live rest sent), "
    "none (204: no stream kept under that id for this caller, past its TTL, or nothing left to "
    "send), invalid (400: a Last-Event-ID that names no event of the stream).",
    ["route", "outcome"],
)
STREAM_KEPT = Metric(
    "Counter",
    "guards_stream_kept",
    "Resumable streams' events kept in the store, and the store writes that kept them "
    "(events written together in one write when they came together), by what: events, writes, "
    "dropped (streams that stopped being kept: past their caps, or the store failed).",
    ["route", "what"],
)
