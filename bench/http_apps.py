"""The apps `make bench-http` serves, each in a uvicorn worker of its own.

- `bare`: a FastAPI route that awaits a zero-latency binding and validates its answer;
- `guarded`: the same route behind `Guards.route` (rate limit and daily cap that never bind,
  keyed by `x-user-id`; the default breaker; cooldown read; deadline; output validation;
  metrics; trace id), its state in the store `BENCH_STORE` names (`memory://` by default).
  Its request and attempt log lines are off (the `guards` logger at WARNING, as an app that
  does not want them sets it), unless `BENCH_LOGS=1`: then they go to the console fallback,
  as in an app that configured no logging.

Built on first access, so importing this module starts nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI

from bench.bench import INPUTS, MODEL, ConstantBinding, Label
from guards import AI, Budget, Guards, header_key
from guards.stores import open_store


def bare_app() -> FastAPI:
    binding = ConstantBinding()
    app = FastAPI()

    @app.get("/label")
    async def label() -> Label:
        result = await binding.run(MODEL, INPUTS)
        return Label.model_validate(result.response)

    return app


def guarded_app(store_url: str, *, logs: bool = False) -> FastAPI:
    if not logs:
        logging.getLogger("guards").setLevel(logging.WARNING)
    guards = Guards(ConstantBinding(), store=open_store(store_url))
    app = FastAPI()
    guards.install(app)

    @app.get("/label")
    @guards.route(model=MODEL, budget=Budget(per_minute=10**9, per_day=10**9, key=header_key("x-user-id")))
    async def label(ai: AI[Label]) -> Label:
        return await ai.run(INPUTS)

    return app


def __getattr__(name: str) -> Any:
    if name == "bare":
        return bare_app()
    if name == "guarded":
        return guarded_app(
            os.environ.get("BENCH_STORE", "memory://"), logs=os.environ.get("BENCH_LOGS") == "1"
        )
    raise AttributeError(name)
