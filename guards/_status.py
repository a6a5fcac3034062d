"""The status page: what an operator looks at to see, at a glance, how the app's models and
routes are doing.

`Guards.status_router()` gives a router with `GET /status`, answering JSON for machines and one
self-contained HTML page for people, chosen by the request's `Accept` (`negotiate`). Where each
number comes from, and whose it is:

- **the level, and each model's breaker and cooldown**: one `Store.health` read per view of the
  page (the page's own read, never a guarded request's), so every worker and machine sharing
  the store shows the same. When the store does not answer, the worker's last reading of the
  level (`Guards.service_level`) instead, and no breaker or cooldown;
- **each model's last failure**: the kind (a classifier token) and time of the newest failed
  call this worker made to it, kept by the failure tallies themselves (`StampedTally`);
- **recent rates**: the counts `/metrics` exports: every worker's in prometheus-client's
  multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`: the sums of the workers' files, read in a
  thread), else the answering worker's tallies; copied every `window_s / 30` seconds by a task
  of the event loop (`History`, started with the app's lifespan, or by the first view); a rate
  is the difference between the counts now and the oldest copy at most `window_s` old, over
  the time between them;
- **spend today**: the same counts of `guards_cost_usd_total` since the UTC day began (to
  within one copy's interval), or since the worker started when that was later; the spend caps
  are the routes' `Budget(spend_per_day=...)`, each applying to each budget key on its own.
  A key's own spend lives in the store under that key: the page never reads or shows one.

Nothing the page shows comes from a request or a provider's answer: route names and model
names come from configuration (models named as `Guards(attribution=...)` allows), guards,
reasons and kinds from closed sets. It is still escaped everywhere, as text.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import html
import math
import os
import time
import typing
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import anyio.to_thread
from fastapi import APIRouter, HTTPException, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import Counter
from pydantic import BaseModel, Field
from starlette.requests import HTTPConnection, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from ._classify import Kind
from ._errors import ConfigurationError
from ._levels import Level, down_for, level_of
from ._log import emit_warning
from ._metrics import (
    ATTEMPTS,
    COST,
    FALLBACKS,
    REQUESTS,
    SERVED,
    StampedTally,
    counts,
    multiprocess,
    peek,
    totals,
)
from .stores import StoreUnavailable, utc_day

if typing.TYPE_CHECKING:
    from ._guards import Guards
    from ._route import GuardedRoute

__all__ = [
    "History",
    "OperatorToken",
    "StatusReport",
    "bearer_token",
    "negotiate",
    "render_html",
    "render_sign_in",
    "status_router",
]

#: Copies of the tallies a window holds: a rate's window is `window_s` less at most one interval.
COPIES = 30
_DAY_S = 86_400.0
#: An `Accept` header is read up to this many characters and media ranges (a bound, not a limit
#: any browser or client comes near).
_ACCEPT_CHARS = 4096
_ACCEPT_RANGES = 64
_FAILURES = tuple(kind for kind in Kind if kind is not Kind.cancelled)
_OUTCOMES = ("ok", "fallback", "error", "cancelled", "invalid")

Key = tuple[Counter, tuple[str, ...]]
Counts = dict[Key, float]


# --- the JSON answer (its schema is the OpenAPI one, and the README's) -------------------------


class LastFailure(BaseModel):
    kind: Kind = Field(description="The classifier's kind of the newest failed call (this worker's).")
    at: float = Field(description="When it failed: seconds since the epoch (this worker's clock).")


class Price(BaseModel):
    input_usd_per_mtok: float = Field(description="US dollars per million input tokens.")
    output_usd_per_mtok: float = Field(description="US dollars per million output tokens.")
    call_usd: float = Field(description="US dollars per call.")


class ModelStatus(BaseModel):
    model: str = Field(description="The model, named as Guards(attribution=...) allows.")
    down: bool = Field(description="True while the walk would skip it (open breaker or cooldown).")
    down_for_s: float = Field(description="Seconds until it may be called again (0: it is up).")
    breaker: Literal["closed", "open", "half_open"] | None = Field(
        description="Its breaker's state as the store holds it; null when no route calls it with a "
        "breaker, or when the store did not answer."
    )
    breaker_wait_s: float | None = Field(
        description="Seconds until its breaker lets a call through (0: it does now); null as `breaker`."
    )
    cooldown_s: float | None = Field(
        description="Seconds left on its cooldown (0: none); null when the store did not answer."
    )
    last_failure: LastFailure | None = Field(description="Its newest failed call on this worker.")
    calls: int = Field(description="Provider calls in the recent window (this worker), retries included.")
    failures: int = Field(description="Those that failed (any classifier kind but cancelled).")
    cost_usd_today: float | None = Field(
        description="What its calls cost today (this worker), US dollars; null without a price."
    )
    price: Price | None = Field(description="Its price (Guards(prices=...)), when it has one.")


class Outcomes(BaseModel):
    ok: int
    fallback: int
    error: int
    cancelled: int
    invalid: int


class Trip(BaseModel):
    guard: str
    reason: str
    count: int


class SpendCap(BaseModel):
    usd_per_key_per_day: float = Field(description="Budget(spend_per_day=...), in US dollars.")
    scope: str = Field(description="The budget's scope: routes of one scope share each key's spend.")


class RouteStatus(BaseModel):
    route: str
    requests: int = Field(description="Requests in the recent window (this worker), every outcome.")
    per_minute: float
    outcomes: Outcomes
    error_rate: float | None = Field(description="error / (requests - invalid); null without such requests.")
    fallback_rate: float | None = Field(
        description="fallback (the envelope's) / (requests - invalid); null without such requests."
    )
    fallback_model_rate: float | None = Field(
        description="Answers served by a fallback model / answers served by a model; null without any."
    )
    trips: list[Trip] = Field(
        description="Guards that tripped in the window, by guard and reason, most first."
    )
    cost_usd_today: float
    spend_cap: SpendCap | None


#: Whose counts the rates and the spend are: every worker's (prometheus-client's multiprocess
#: mode, `PROMETHEUS_MULTIPROC_DIR`), or only the answering worker's.
CountsOf = Literal["all_workers", "this_worker"]


class Recent(BaseModel):
    seconds: float = Field(description="The window the rates cover, in seconds.")
    counts: CountsOf = Field(
        description="all_workers (PROMETHEUS_MULTIPROC_DIR set: the workers' summed counts) or "
        "this_worker (the answering worker's own)."
    )
    worker: int = Field(description="The process id of the worker that answered.")


class Today(BaseModel):
    day: str = Field(description="The UTC day, YYYY-MM-DD.")
    since: float = Field(
        description="Counted since: the day's start, or the answering worker's start when later."
    )
    cost_usd: float = Field(description="What the priced provider calls cost since then, US dollars.")
    counts: CountsOf = Field(description="As recent.counts.")
    worker: int = Field(description="The process id of the worker that answered.")


class StatusProblem(BaseModel):
    """What `GET /status` answers as JSON when it cannot show the page (401, 406)."""

    detail: str


class StatusReport(BaseModel):
    """What `GET /status` answers as JSON."""

    level: Level
    time: float = Field(description="The store's time of the reading, seconds since the epoch.")
    store: Literal["ok", "unavailable"]
    refresh_s: float = Field(description="How often the HTML page reloads itself.")
    models: list[ModelStatus]
    routes: list[RouteStatus]
    recent: Recent
    today: Today


# --- this worker's counts over time ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Copy:
    mono: float
    wall: float
    counts: Counts


#: The counters the page reads.
_COUNTED = (REQUESTS, SERVED, FALLBACKS, ATTEMPTS, COST)


async def _copy() -> _Copy:
    """The counts now: every worker's in multiprocess mode (files: read in a thread), else
    this worker's."""
    if multiprocess():
        found = await anyio.to_thread.run_sync(totals, *_COUNTED)
    else:
        found = counts(*_COUNTED)
    return _Copy(time.monotonic(), time.time(), found)


@dataclass(frozen=True, slots=True)
class Reading:
    """The counts now, and the two baselines to subtract: the window's and the day's."""

    now: Counts
    recent: Counts
    recent_s: float
    today: Counts
    day: str
    since: float


class History:
    """Copies of the counts, one every `window_s / COPIES` seconds, kept for `window_s`; and
    the copy the UTC day started from. Bounded: at most `COPIES + 1` copies. The first copy is
    taken when copying starts (the app's lifespan, else the first view)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.every_s = window_s / COPIES
        self._copies: deque[_Copy] = deque()
        self._day, self._day_counts, self._since = "", Counts(), 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Take the first copy, and copy every `every_s` on this event loop (already copying:
        nothing)."""
        if self._task is not None and not self._task.done():
            return
        if not self._copies:
            self._add(await _copy())
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self._add(await _copy())

    def _add(self, copy: _Copy) -> None:
        self._roll(copy)
        copies = self._copies
        copies.append(copy)
        while len(copies) > COPIES + 1 or (len(copies) > 1 and copies[0].mono < copy.mono - self.window_s):
            copies.popleft()

    def _roll(self, copy: _Copy) -> None:
        """A new UTC day starts from the newest copy (taken before midnight, at most one interval
        before it: what was spent in between counts for the new day); the first copy starts
        the first day (the page counts from then)."""
        day = utc_day(copy.wall)
        if not self._copies:
            self._day, self._day_counts, self._since = day, copy.counts, copy.wall
        elif day != self._day:
            self._day, self._day_counts = day, self._copies[-1].counts
            self._since = copy.wall // _DAY_S * _DAY_S

    async def read(self) -> Reading:
        await self.start()
        now = await _copy()
        self._roll(now)
        oldest = now.mono - self.window_s
        # The oldest copy within the window; when the timer did not run (no copy that recent),
        # the newest one, and the window says how long it really is.
        base = next((c for c in self._copies if c.mono >= oldest), self._copies[-1])
        return Reading(
            now.counts, base.counts, now.mono - base.mono, self._day_counts, self._day, self._since
        )


def _grown(reading: Reading, base: Counts, metric: Counter) -> dict[tuple[str, ...], float]:
    """How much each series of `metric` grew since `base`."""
    return {
        labels: count - base.get((m, labels), 0.0)
        for (m, labels), count in reading.now.items()
        if m is metric and count != base.get((m, labels), 0.0)
    }


# --- the page --------------------------------------------------------------------------------------


class StatusPage:
    """One app's status page: its `Guards`, its counts' history, and its settings."""

    def __init__(self, guards: Guards, *, refresh_s: float, window_s: float) -> None:
        self.guards = guards
        self.refresh_s = refresh_s
        self.history = History(window_s)

    async def report(self) -> StatusReport:
        """Read the store once and this worker's counts, and put them together."""
        guards = self.guards
        reading = await self.history.read()
        watched = guards.levels.models
        store = "ok"
        health = None
        if watched:
            try:
                health = await guards.store.health(
                    [(m.cooldown_key, m.breaker_key) for m in watched.values()]
                )
            except StoreUnavailable:
                store = "unavailable"
                emit_warning("store_unavailable", guard="status", op="health")
        recent = {m: _grown(reading, reading.recent, m) for m in (REQUESTS, SERVED, FALLBACKS, ATTEMPTS)}
        spent = _grown(reading, reading.today, COST)
        unit = guards.cost_unit_usd

        models = []
        wall = time.time()
        # When the store did not answer: the level as this worker last read it.
        seen = guards.service_level() if health is None else None
        seen_down = {model.model: model.until for model in seen.down} if seen is not None else {}
        for index, (key, model) in enumerate(watched.items()):
            calls = {kind: n for (k, kind), n in recent[ATTEMPTS].items() if k == key}
            price = guards.prices.get(key)
            entry: dict[str, Any] = {
                "model": model.name,
                "last_failure": _last_failure(key),
                "calls": round(sum(calls.values())),
                "failures": round(sum(calls.get(kind.value, 0.0) for kind in _FAILURES)),
                "cost_usd_today": None
                if price is None
                else _usd(sum(n for (_, k), n in spent.items() if k == key)),
                "price": None
                if price is None
                else Price(
                    input_usd_per_mtok=price.input_token * unit * 1e6,
                    output_usd_per_mtok=price.output_token * unit * 1e6,
                    call_usd=price.call * unit,
                ),
            }
            if health is not None:
                breaker, cooldown_s = health.breakers[index], health.cooldowns[index]
                wait = down_for(breaker, cooldown_s, model.policies, health.now)
                guarded = bool(model.policies)
                entry.update(
                    down=wait > 0,
                    down_for_s=_seconds(wait),
                    breaker=breaker.state.value if guarded else None,
                    breaker_wait_s=_seconds(down_for(breaker, 0.0, model.policies, health.now))
                    if guarded
                    else None,
                    cooldown_s=_seconds(cooldown_s),
                )
            else:
                until = seen_down.get(model.name)
                entry.update(
                    down=until is not None,
                    down_for_s=_seconds(max(0.0, (until or 0.0) - wall)),
                    breaker=None,
                    breaker_wait_s=None,
                    cooldown_s=None,
                )
            models.append(ModelStatus(**entry))

        if seen is None:
            level, now = level_of(sum(m.down for m in models), len(models)), health.now if health else wall
        else:
            level, now = seen.level, wall
        seconds = reading.recent_s
        whose: CountsOf = "all_workers" if multiprocess() else "this_worker"
        return StatusReport(
            level=level,
            time=now,
            store=store,  # type: ignore[arg-type]
            refresh_s=self.refresh_s,
            models=models,
            routes=[self._route(route, recent, spent, seconds) for route in _routes(guards)],
            recent=Recent(seconds=round(seconds, 1), counts=whose, worker=os.getpid()),
            today=Today(
                day=reading.day,
                since=reading.since,
                cost_usd=_usd(sum(spent.values())),
                counts=whose,
                worker=os.getpid(),
            ),
        )

    def _route(
        self,
        route: GuardedRoute,
        recent: dict[Counter, dict[tuple[str, ...], float]],
        spent: dict[tuple[str, ...], float],
        seconds: float,
    ) -> RouteStatus:
        name = route.name
        outcomes = {o: round(n) for (r, o), n in recent[REQUESTS].items() if r == name}
        counted = Outcomes(**{o: outcomes.get(o, 0) for o in _OUTCOMES})
        requests = sum(outcomes.values())
        judged = requests - counted.invalid
        served = {position: 0.0 for position in ("first", "fallback")}
        for (r, _, position), n in recent[SERVED].items():
            if r == name:
                served[position] += n
        trips = sorted(
            (
                Trip(guard=g, reason=why, count=round(n))
                for (r, g, why), n in recent[FALLBACKS].items()
                if r == name
            ),
            key=lambda trip: (-trip.count, trip.guard, trip.reason),
        )
        budget = route.budget
        cap = None
        if budget is not None and budget.spend_per_day is not None:
            cap = SpendCap(
                usd_per_key_per_day=budget.spend_per_day * self.guards.cost_unit_usd, scope=route.scope
            )
        return RouteStatus(
            route=name,
            requests=requests,
            # Over at least a minute: a few requests in a young window are not a rate.
            per_minute=round(requests * 60 / max(seconds, 60.0), 2),
            outcomes=counted,
            error_rate=_share(counted.error, judged),
            fallback_rate=_share(counted.fallback, judged),
            fallback_model_rate=_share(served["fallback"], sum(served.values())),
            trips=trips,
            cost_usd_today=_usd(sum(n for (r, _), n in spent.items() if r == name)),
            spend_cap=cap,
        )


def _routes(guards: Guards) -> list[GuardedRoute]:
    """The guarded routes, once per name, in declaration order."""
    return list({route.name: route for route in reversed(guards.routes)}.values())[::-1]


def _last_failure(model_key: str) -> LastFailure | None:
    newest: tuple[float, Kind] | None = None
    for kind in _FAILURES:
        tally = peek(ATTEMPTS, model_key, kind.value)
        if (
            isinstance(tally, StampedTally)
            and tally.last_at
            and (newest is None or tally.last_at > newest[0])
        ):
            newest = (tally.last_at, kind)
    return None if newest is None else LastFailure(kind=newest[1], at=round(newest[0], 3))


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def _seconds(value: float) -> float:
    return round(max(0.0, value), 1)


def _usd(value: float) -> float:
    return round(value, 6)


# --- content negotiation ---------------------------------------------------------------------------

#: How specific a media range is for each answer: the most specific range that matches decides
#: its quality (RFC 9110, 12.5.1).
_HTML_RANGES = {"text/html": 2, "application/xhtml+xml": 2, "text/*": 1, "*/*": 0}
_JSON_RANGES = {"application/json": 2, "application/*": 1, "*/*": 0}


def negotiate(accept: str | None) -> Literal["json", "html"] | None:
    """Which answer `accept` prefers: "html" when it rates HTML above JSON (a browser), "json"
    otherwise (no header, `*/*`, `application/json`, a tie), None when it accepts neither (406).
    Linear in the header, read up to 4,096 characters and 64 ranges."""
    if not accept:
        return "json"
    best = {"html": (-1, 0.0), "json": (-1, 0.0)}
    for part in accept[:_ACCEPT_CHARS].split(",")[:_ACCEPT_RANGES]:
        media, *params = part.split(";")
        media = media.strip().lower()
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value.strip())
                except ValueError:
                    quality = math.nan
        if not 0.0 <= quality <= 1.0:  # malformed (nan, inf, out of range): the range is ignored
            continue
        for answer, ranges in (("html", _HTML_RANGES), ("json", _JSON_RANGES)):
            rank = ranges.get(media)
            if rank is not None and rank > best[answer][0]:
                best[answer] = (rank, quality)
    html_q, json_q = best["html"][1], best["json"][1]
    if html_q > json_q:
        return "html"
    return "json" if json_q > 0 else ("html" if html_q > 0 else None)


# --- keeping it private ----------------------------------------------------------------------------


class OperatorToken:
    """An operator token, kept as its SHA-256 digest: `matches` takes the same time whatever
    was sent (digests of equal length, compared with `hmac.compare_digest`)."""

    __slots__ = ("_digest",)

    def __init__(self, token: str) -> None:
        if not token:
            raise ConfigurationError("an operator token must not be empty: it would admit nobody")
        self._digest = hashlib.sha256(token.encode()).digest()

    def matches(self, credentials: HTTPAuthorizationCredentials | None) -> bool:
        sent = credentials.credentials if credentials is not None else ""
        matched = hmac.compare_digest(hashlib.sha256(sent.encode()).digest(), self._digest)
        return credentials is not None and matched


#: The 401's answer: the scheme to use, and nothing a cache may keep.
_UNAUTHORIZED_HEADERS = {"www-authenticate": "Bearer", "cache-control": "no-store"}
_UNAUTHORIZED = "a valid operator token is required"


def bearer_token(token: str) -> HTTPBearer:
    """A FastAPI dependency that answers 401 (with `WWW-Authenticate: Bearer`) unless the
    request carries `Authorization: Bearer <token>`: `Depends(bearer_token(token))`, for any
    operator route (say, `/metrics`). The comparison takes the same time whatever token was
    sent. In an OpenAPI document it is an HTTP bearer security scheme. Raises
    `ConfigurationError` for an empty token."""
    return _BearerToken(OperatorToken(token))


class _BearerToken(HTTPBearer):
    def __init__(self, token: OperatorToken) -> None:
        super().__init__(auto_error=False, description="The operator token.")
        self._token = token

    async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
        credentials = await super().__call__(request)  # None: no header, or not `Bearer ...`
        if not self._token.matches(credentials):
            raise HTTPException(401, _UNAUTHORIZED, headers=_UNAUTHORIZED_HEADERS)
        return credentials


# --- the router ------------------------------------------------------------------------------------

#: Every answer of the page: it changes with each view and may be private.
_HEADERS = {"cache-control": "no-store", "vary": "Accept, Authorization"}


def status_router(
    guards: Guards,
    *,
    path: str,
    token: str | None,
    dependencies: Sequence[Any],
    refresh_s: float,
    window_s: float,
    include_in_schema: bool,
) -> APIRouter:
    """See `Guards.status_router`."""
    if not path.startswith("/"):
        raise ConfigurationError("the status page's path must start with '/'")
    if not refresh_s >= 1:
        raise ConfigurationError("refresh_s must be at least 1 (seconds between reloads of the page)")
    if not window_s >= 1:
        raise ConfigurationError("window_s must be at least 1 (seconds of recent counts)")
    page = StatusPage(guards, refresh_s=refresh_s, window_s=window_s)
    required = OperatorToken(token) if token is not None else None
    # Parses `Authorization: Bearer ...` (None for anything else) and, with a token, documents
    # the bearer scheme in OpenAPI; the page checks it itself, to answer a browser's 401 with
    # the page that asks for the token.
    scheme = HTTPBearer(auto_error=False, description="The operator token (STATUS_TOKEN).")

    async def no_credentials() -> None:
        return None

    credentials_of: Any = scheme if required is not None else no_credentials

    @asynccontextmanager
    async def copying(app: Any) -> AsyncIterator[None]:
        # The recent window fills from the app's start, not from the first view.
        await page.history.start()
        try:
            yield
        finally:
            page.history.stop()

    router = APIRouter(dependencies=list(dependencies), lifespan=copying)
    responses: dict[int | str, dict[str, Any]] = {
        200: {"content": {"text/html": {"schema": {"type": "string"}}}},
        406: {
            "description": "The request accepts neither application/json nor text/html.",
            "model": StatusProblem,
        },
    }
    if required is not None:
        responses[401] = {
            "description": "No operator token, or a wrong one (`WWW-Authenticate: Bearer`); a "
            "browser gets the page that asks for it.",
            "model": StatusProblem,
            "content": {"text/html": {"schema": {"type": "string"}}},
            "headers": {"WWW-Authenticate": {"schema": {"type": "string", "const": "Bearer"}}},
        }

    @router.get(
        path,
        include_in_schema=include_in_schema,
        response_model=StatusReport,
        summary="Status page",
        description="The service level, every model's breaker, cooldown and last failure, recent "
        "rates per route and today's spend: JSON (`application/json`, and the default), or one "
        "HTML page for a browser (`text/html` preferred in `Accept`).",
        responses=responses,
    )
    async def status(
        request: Request,
        credentials: HTTPAuthorizationCredentials | None = Security(credentials_of),  # noqa: B008
    ) -> Response:
        answer = negotiate(request.headers.get("accept"))
        if required is not None and not required.matches(credentials):
            if answer == "html":
                refused = credentials is not None
                return HTMLResponse(
                    render_sign_in(refused), status_code=401, headers=_UNAUTHORIZED_HTML_HEADERS
                )
            return JSONResponse({"detail": _UNAUTHORIZED}, status_code=401, headers=_UNAUTHORIZED_HEADERS)
        if answer is None:
            return JSONResponse(
                {"detail": "ask for application/json or text/html"}, status_code=406, headers=_HEADERS
            )
        report = await page.report()
        if answer == "html":
            return HTMLResponse(render_html(report, window_s), headers=_HTML_HEADERS)
        return JSONResponse(report.model_dump(mode="json"), headers=_HEADERS)

    return router


# --- the HTML --------------------------------------------------------------------------------------

_CSS = """
:root{color-scheme:light dark;--bg:#f4f5f7;--card:#fff;--text:#1c2230;--muted:#5f6877;--line:#e2e5ea;
--ok:#17663a;--ok-bg:#dcf2e3;--warn:#7a4d00;--warn-bg:#fdeccb;--bad:#9b1c15;--bad-bg:#fbe0dd}
@media (prefers-color-scheme:dark){:root{--bg:#101318;--card:#191e25;--text:#e5e8ed;--muted:#98a1b0;
--line:#2a313b;--ok:#7ad69a;--ok-bg:#143022;--warn:#f2c66d;--warn-bg:#392b0c;--bad:#ff8f86;--bad-bg:#3b1714}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--text);
font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif}
main{max-width:1040px;margin:0 auto;padding:20px 16px 32px}
header{display:flex;flex-wrap:wrap;align-items:center;gap:6px 14px;margin-bottom:18px}
h1{font-size:21px;margin:0}
header p{margin:0;flex-basis:100%;color:var(--muted);font-size:13px}
section{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:14px 18px;margin-bottom:16px}
h2{font-size:15px;margin:0 0 10px}
h2 small{font-weight:400;color:var(--muted)}
table{width:100%;border-collapse:collapse}
th,td{text-align:left;padding:7px 12px 7px 0;border-top:1px solid var(--line);vertical-align:middle}
th:last-child,td:last-child{padding-right:0}
th{font-size:12px;font-weight:600;color:var(--muted);border-top:0;white-space:nowrap}
.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.name{font:600 13px/1.4 ui-monospace,"DejaVu Sans Mono",monospace;overflow-wrap:anywhere}
.pill{display:inline-block;padding:2px 10px;border-radius:999px;font-size:12px;font-weight:700;
letter-spacing:.03em;white-space:nowrap}
.level{font-size:13px;padding:4px 14px;text-transform:uppercase}
.good{color:var(--ok);background:var(--ok-bg)}.warn{color:var(--warn);background:var(--warn-bg)}
.bad{color:var(--bad);background:var(--bad-bg)}
.muted{color:var(--muted)}
.note{margin:10px 0 0;color:var(--muted);font-size:13px}
footer{color:var(--muted);font-size:12px;line-height:1.5}
form{display:flex;flex-wrap:wrap;gap:8px;align-items:center}
label{font-weight:600;flex-basis:100%}
input{flex:1 1 220px;font:inherit;padding:8px 10px;border:1px solid var(--line);border-radius:8px;
background:var(--bg);color:var(--text)}
button{font:inherit;font-weight:600;padding:8px 14px;border:0;border-radius:8px;background:var(--text);
color:var(--bg);cursor:pointer}
@media (max-width:700px){
main{padding:14px 10px 24px}
section{padding:10px 12px}
thead{display:none}
table,tbody,tr,td{display:block;width:100%}
tr{border-top:1px solid var(--line);padding:8px 0}
tbody tr:first-child{border-top:0}
td{border:0;padding:2px 0;display:flex;justify-content:space-between;align-items:baseline;gap:16px;
text-align:right;font-size:14px}
td::before{content:attr(data-label);color:var(--muted);font-size:13px;text-align:left;flex:none}
td.name{display:block;text-align:left;font-size:14px;padding-bottom:4px}
td.name::before{content:none}
}
"""

#: The page's one script: every `data-refresh` seconds it asks for the page again (with the
#: operator token this tab was given, if any: a meta refresh could not send one) and swaps in its
#: `<main>`; on the sign-in page it keeps the token in `sessionStorage` and loads the page. The
#: page is the server's own, escaped HTML: the script never builds markup from data.
_SCRIPT = """
"use strict";
(() => {
  const KEY = "guards-status-token";
  let timer = 0;
  const schedule = () => {
    clearTimeout(timer);
    // The period of the page now shown (the sign-in page has none: it waits for the form).
    const every = Number(document.querySelector("main").dataset.refresh) * 1000;
    if (every > 0) timer = setTimeout(reload, every);
  };
  const bind = () => {
    const form = document.getElementById("sign-in");
    if (!form) return;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, form.elements.token.value.trim());
      reload();
    });
  };
  async function reload() {
    if (document.hidden) return schedule();
    const token = sessionStorage.getItem(KEY);
    const headers = {Accept: "text/html"};
    if (token) headers.Authorization = "Bearer " + token;
    try {
      const answer = await fetch(location.pathname, {headers, cache: "no-store"});
      if (answer.status === 401 && token) sessionStorage.removeItem(KEY);
      const page = new DOMParser().parseFromString(await answer.text(), "text/html");
      const main = page.querySelector("main");
      if (!main) throw new Error("HTTP " + answer.status);
      document.querySelector("main").replaceWith(document.adoptNode(main));
      document.title = page.title;
      document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
      bind();
    } catch (error) {
      const summary = document.getElementById("summary");
      if (summary && !summary.dataset.stale) {
        summary.dataset.stale = "1";
        summary.append(" · not refreshed: the app did not answer (trying again)");
      }
    }
    schedule();
  }
  bind();
  if (document.getElementById("sign-in") && sessionStorage.getItem(KEY)) reload();
  else schedule();
})();
"""
_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
#: The HTML page loads nothing from anywhere and runs only its own script (by its hash), which
#: may fetch only this app: even a value that escaped escaping could not run or call out.
_CSP = (
    f"default-src 'none'; script-src 'sha256-{_SCRIPT_HASH}'; connect-src 'self'; "
    "style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HTML_HEADERS = {
    **_HEADERS,
    "content-security-policy": _CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
_UNAUTHORIZED_HTML_HEADERS = {**_HTML_HEADERS, **_UNAUTHORIZED_HEADERS}

_LEVEL_CLASS = {Level.full: "good", Level.degraded: "warn", Level.minimal: "bad"}


def _e(value: object) -> str:
    """Every value the page shows goes through here: text, never markup."""
    return html.escape(str(value), quote=True)


def _duration(seconds: float) -> str:
    seconds = math.ceil(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        minutes, rest = divmod(seconds, 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, rest = divmod(seconds, 3600)
    return f"{hours} h {rest // 60} min" if rest // 60 else f"{hours} h"


def _percent(share: float | None) -> str:
    return "—" if share is None else f"{share * 100:.0f} %"


def _dollars(usd: float) -> str:
    if usd == 0:
        return "$0"
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.4f}"


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(epoch))


def _cell(label: str, content: str, kind: str = "") -> str:
    """One table cell; `content` is already escaped markup, `label` names it on a phone."""
    css = f' class="{kind}"' if kind else ""
    return f'<td data-label="{_e(label)}"{css}><span>{content}</span></td>'


def _table(headers: Sequence[tuple[str, str]], rows: list[str]) -> str:
    head = "".join(
        f'<th class="{kind}">{_e(name)}</th>' if kind else f"<th>{_e(name)}</th>" for name, kind in headers
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _model_row(model: ModelStatus, now: float) -> str:
    if model.down:
        state = (
            f'<span class="pill bad">down</span> <span class="muted">{_e(_duration(model.down_for_s))}</span>'
        )
    else:
        state = '<span class="pill good">up</span>'
    if model.breaker is None:
        breaker = '<span class="muted">—</span>'
    elif model.breaker == "closed":
        breaker = "closed"
    else:
        wait = model.breaker_wait_s or 0.0
        when = f"probe in {_duration(wait)}" if wait > 0 else "probe due"
        breaker = f'<span class="pill warn">{_e(model.breaker.replace("_", "-"))}</span> <span class="muted">{_e(when)}</span>'
    cooldown = _e(_duration(model.cooldown_s)) if model.cooldown_s else '<span class="muted">—</span>'
    failure = model.last_failure
    if failure is None:
        last = '<span class="muted">none</span>'
    else:
        last = f'{_e(failure.kind.value)} <span class="muted">{_e(_duration(max(0.0, now - failure.at)))} ago</span>'
    calls = _e(model.calls) + (
        f' <span class="muted">({_e(model.failures)} failed)</span>' if model.failures else ""
    )
    spent = model.cost_usd_today
    cost = _e(_dollars(spent)) if spent is not None else '<span class="muted">no price</span>'
    return (
        f'<tr data-model="{_e(model.model)}">'
        + _cell("Model", _e(model.model), "name")
        + _cell("State", state)
        + _cell("Breaker", breaker)
        + _cell("Cooldown", cooldown)
        + _cell("Last failure", last)
        + _cell("Calls", calls, "num")
        + _cell("Spent today", cost, "num")
        + "</tr>"
    )


def _route_row(route: RouteStatus) -> str:
    def share(rate: float | None, count: int, high: float) -> str:
        """A rate, with its count when there is one, marked from `high` on (the alerts' levels)."""
        text = _e(_percent(rate))
        if rate is not None and rate >= high:
            text = f'<span class="pill warn">{text}</span>'
        return text + (f' <span class="muted">({_e(count)})</span>' if count else "")

    outcomes = route.outcomes
    trips = ", ".join(f"{_e(t.guard)}/{_e(t.reason)} {_e(t.count)}" for t in route.trips[:3])
    return (
        f'<tr data-route="{_e(route.route)}">'
        + _cell("Route", _e(route.route), "name")
        + _cell("Requests", _e(route.requests), "num")
        + _cell("Per minute", _e(f"{route.per_minute:g}"), "num")
        + _cell("Errors", share(route.error_rate, outcomes.error, 0.1), "num")
        + _cell("Fallbacks", share(route.fallback_rate, outcomes.fallback, 0.2), "num")
        + _cell("Fallback model", share(route.fallback_model_rate, 0, 0.2), "num")
        + _cell("Invalid", _e(outcomes.invalid), "num")
        + _cell("Guards tripped", trips or '<span class="muted">none</span>')
        + "</tr>"
    )


def render_html(report: StatusReport, window_s: float) -> str:
    """The page: one document, inline CSS, no script, reloading itself every `refresh_s`."""
    now = time.time()
    down = sum(model.down for model in report.models)
    level = report.level
    summary = f"{down} of {len(report.models)} models down" if report.models else "no models configured"
    store = "" if report.store == "ok" else " · store unavailable: level as last read, no breakers shown"
    window = _duration(window_s)
    whose = (
        "every worker's counts"
        if report.recent.counts == "all_workers"
        else f"the counts of the worker that answered (pid {report.recent.worker})"
    )
    models = [_model_row(model, now) for model in report.models]
    routes = [_route_row(route) for route in report.routes]
    caps: dict[tuple[str, float], list[str]] = {}
    for route in report.routes:
        if route.spend_cap is not None:
            caps.setdefault((route.spend_cap.scope, route.spend_cap.usd_per_key_per_day), []).append(
                route.route
            )
    cap_rows = [
        "<tr>"
        + _cell("Budget scope", _e(scope), "name")
        + _cell("Routes", _e(", ".join(names)))
        + _cell("Cap per key per day", _e(_dollars(usd)), "num")
        + "</tr>"
        for (scope, usd), names in caps.items()
    ]
    today = report.today
    since = (
        "the start of the day"
        if today.since % _DAY_S == 0
        else f"{_clock(today.since)} (the answering worker's start)"
    )
    spend = (
        f"<p><strong>{_e(_dollars(today.cost_usd))}</strong> spent on {_e(today.day)} (UTC) since "
        f"{_e(since)}, by priced calls.</p>"
    )
    if cap_rows:
        spend += _table((("Budget scope", ""), ("Routes", ""), ("Cap per key per day", "num")), cap_rows)
        spend += '<p class="note">Each cap applies to each budget key on its own; what one key spent is not shown here.</p>'
    else:
        spend += '<p class="note">No route has a spend cap.</p>'
    main = f"""<main data-refresh="{_e(f"{report.refresh_s:g}")}">
<header>
<h1>Status</h1>
<span id="level" class="pill level {_LEVEL_CLASS[level]}">{_e(level.value)}</span>
<p id="summary">{_e(summary)}{_e(store)} · as of <time id="as-of">{_e(_clock(report.time))}</time> · refreshes every {_e(_duration(report.refresh_s))}</p>
</header>
<section id="models">
<h2>Models <small>· calls in the last {_e(window)}</small></h2>
{_table((("Model", ""), ("State", ""), ("Breaker", ""), ("Cooldown", ""), ("Last failure", ""), ("Calls", "num"), ("Spent today", "num")), models) if models else '<p class="muted">No guarded route names a model.</p>'}
</section>
<section id="routes">
<h2>Routes <small>· the last {_e(window)}</small></h2>
{_table((("Route", ""), ("Requests", "num"), ("Per minute", "num"), ("Errors", "num"), ("Fallbacks", "num"), ("Fallback model", "num"), ("Invalid", "num"), ("Guards tripped", "")), routes) if routes else '<p class="muted">No guarded routes.</p>'}
<p class="note">Errors: public errors and application failures; fallbacks: answers from a degrading
route's fallback (both among the requests that were not invalid). Fallback model: the answers a
later model of the chain served, among those a model served.</p>
</section>
<section id="spend">
<h2>Spend today</h2>
{spend}
</section>
<footer>
Level, breakers and cooldowns: read from the store, shared by every worker.
Calls, rates and spend: {_e(whose)}, over the last {_e(_duration(report.recent.seconds))}.
Last failures: the answering worker's (pid {_e(report.recent.worker)}).
</footer>
</main>"""
    return _document(f"{level.value} · status", main, report.refresh_s)


def render_sign_in(refused: bool) -> str:
    """The 401 page a browser gets without the operator token (or with a wrong one): a form
    that keeps the token in the tab's `sessionStorage` and loads the page with it."""
    why = (
        "That token was refused."
        if refused
        else "This page needs the operator token (the app's STATUS_TOKEN)."
    )
    main = f"""<main>
<header><h1>Status</h1><p id="summary">{_e(why)}</p></header>
<section>
<form id="sign-in" autocomplete="off">
<label for="token">Operator token</label>
<input id="token" name="token" type="password" required autocomplete="off" spellcheck="false">
<button type="submit">Show the status</button>
</form>
<p class="note">Kept in this tab only (sessionStorage) and sent as
<code>Authorization: Bearer</code>; never in the address.</p>
</section>
</main>"""
    return _document("sign in · status", main, None)


def _document(title: str, main: str, refresh_s: float | None) -> str:
    """One self-contained page: inline CSS and the one inline script CSP allows (by its hash).
    The script reloads `<main>` every `refresh_s` seconds (None: the sign-in page, which waits
    for the form); without scripts, a meta refresh reloads the whole page instead."""
    refresh = "" if refresh_s is None else f"{refresh_s:g}"
    fallback = (
        f'<noscript><meta http-equiv="refresh" content="{_e(refresh)}"></noscript>\n' if refresh else ""
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{fallback}<meta name="robots" content="noindex">
<meta name="referrer" content="no-referrer">
<title>{_e(title)}</title>
<style>{_CSS}</style>
</head>
<body>
{main}
<script>{_SCRIPT}</script>
</body>
</html>
"""
