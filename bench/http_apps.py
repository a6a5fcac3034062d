"""The apps `make bench-http` serves, each in a uvicorn worker of its own. Every route is the
same: `POST /label` with a pydantic body (`Ticket`), a model call, a pydantic answer (`Label`).

- `bare`: a FastAPI route that awaits a zero-latency binding and validates its answer;
- `guarded`: the same route behind `Guards.route` (rate limit and daily cap that never bind,
  keyed by `x-user-id`; the default breaker; cooldown read; deadline; output validation;
  metrics; trace id) on an app that called `guards.install(app)`, its state in the store
  `BENCH_STORE` names (`memory://` by default). Its log lines are as an app that configured no
  logging has them (the console fallback, one request line per request: the default), unless
  `BENCH_LOGS=off`: then the `guards` logger is at WARNING, as an app that does not want them
  sets it;
- `outage`: the guarded route made degrading (`fallback=`), its model always failing
  (`ProviderError`, status 500) and its breaker opening after 5 failures for an hour: once
  warmed up, every request is refused by the open breaker and answered with the fallback in
  the 200 envelope;
- `bare_fallback`: what `outage` answers, from a bare FastAPI route: the same envelope
  (`{ok, data, fallback}`), a pydantic answer of constant values;
- `outage_peer`: the stack teams build by hand around the same failing model, serving what
  `outage` serves: a FastAPI route whose call goes through tenacity (two attempts, a short
  jittered wait, retrying provider errors only), aiolimiter (a rate limit that never binds) and
  pybreaker (opened by 5 failures for an hour; checked before the call with its `calling()`
  context manager, as its `call_async` needs tornado), the fallback in the same envelope when
  the call fails or the breaker is open (`circuit_open`, the same detail as guards'). tenacity
  and pybreaker are in the `dev` extra only;
- `bare_slow`, `guarded_slow`: `bare` and `guarded` with a model that takes `SLOW_S` per call
  (the bare handler awaits it too; the guarded route's deadline is above it).

Built on first access, so importing this module starts nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from bench.bench import INPUTS, MODEL, ConstantBinding, Label
from guards import AI, AIResult, Breaker, Budget, Guards, GuardTripped, ProviderError, header_key
from guards.stores import open_store

#: Seconds each call of the slow model takes (the capacity scenario; `make bench-http` says).
SLOW_S = float(os.environ.get("BENCH_SLOW_S", "2"))
BUDGET = Budget(per_minute=10**9, per_day=10**9, key=header_key("x-user-id"))


class Ticket(BaseModel):
    text: str


class Fallback(BaseModel):
    guard: str
    reason: str
    detail: str


class Envelope(BaseModel):
    ok: bool
    data: Label
    fallback: Fallback | None


class SlowBinding(ConstantBinding):
    """Answers after `SLOW_S`, as a provider would."""

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        await asyncio.sleep(SLOW_S)
        return self.result


class FailingBinding(ConstantBinding):
    """Every call fails as a provider's 500 does."""

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        raise ProviderError("bench", status=500)


def by_rules(arguments: Mapping[str, Any], tripped: GuardTripped) -> Label:
    return Label(label="other", confidence=0.0)


def bare_app(binding: ConstantBinding) -> FastAPI:
    app = FastAPI()

    @app.post("/label")
    async def label(ticket: Ticket) -> Label:
        result = await binding.run(MODEL, INPUTS)
        return Label.model_validate(result.response)

    return app


def bare_fallback_app() -> FastAPI:
    app = FastAPI()
    detail = f"every model was skipped: {MODEL}: skipped (circuit_open)"

    @app.post("/label")
    async def label(ticket: Ticket) -> Envelope:
        fallback = Fallback(guard="budget", reason="circuit_open", detail=detail)
        return Envelope(ok=True, data=by_rules({"ticket": ticket}, None), fallback=fallback)  # type: ignore[arg-type]

    return app


def outage_peer_app() -> FastAPI:
    """The hand-built peer of `outage` (see the module's docstring)."""
    import pybreaker
    from aiolimiter import AsyncLimiter
    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

    binding = FailingBinding()
    breaker = pybreaker.CircuitBreaker(fail_max=5, reset_timeout=3600)
    limiter = AsyncLimiter(10**9, 60)  # never binds
    app = FastAPI()
    skipped = f"every model was skipped: {MODEL}: skipped (circuit_open)"

    async def call_model() -> AIResult:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(2),
            wait=wait_exponential_jitter(initial=0.05, max=0.5),
            retry=retry_if_exception_type(ProviderError),
            reraise=True,
        ):
            with attempt:
                async with limiter:
                    with breaker.calling():  # raises CircuitBreakerError while open
                        return await binding.run(MODEL, INPUTS)
        raise AssertionError("tenacity reraises the last failure")

    @app.post("/label")
    async def label(ticket: Ticket) -> Envelope:
        try:
            result = await call_model()
        except pybreaker.CircuitBreakerError:
            fallback = Fallback(guard="budget", reason="circuit_open", detail=skipped)
        except ProviderError:
            fallback = Fallback(guard="call", reason="provider_error", detail="the model failed")
        else:
            return Envelope(ok=True, data=Label.model_validate(result.response), fallback=None)
        return Envelope(ok=True, data=by_rules({"ticket": ticket}, None), fallback=fallback)  # type: ignore[arg-type]

    return app


def guarded_app(binding: ConstantBinding, store_url: str, **route: Any) -> FastAPI:
    if os.environ.get("BENCH_LOGS") == "off":
        logging.getLogger("guards").setLevel(logging.WARNING)
    guards = Guards(binding, store=open_store(store_url))
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, budget=BUDGET, **route)
    async def label(ticket: Ticket, ai: AI[Label]) -> Label:
        return await ai.run(INPUTS)

    return app


def __getattr__(name: str) -> Any:
    store = os.environ.get("BENCH_STORE", "memory://")
    if name == "bare":
        return bare_app(ConstantBinding())
    if name == "guarded":
        return guarded_app(ConstantBinding(), store)
    if name == "bare_fallback":
        return bare_fallback_app()
    if name == "outage":
        breaker = Breaker(failure_threshold=5, reset_timeout_s=3600)
        return guarded_app(FailingBinding(), store, breaker=breaker, fallback=by_rules)
    if name == "outage_peer":
        return outage_peer_app()
    if name == "bare_slow":
        return bare_app(SlowBinding())
    if name == "guarded_slow":
        return guarded_app(SlowBinding(), store, timeout_s=SLOW_S + 8)
    raise AttributeError(name)
