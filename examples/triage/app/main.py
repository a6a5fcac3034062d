"""The service: a degrading route (triage, with a fallback computed by rules), a strict route
(a drafted reply: no fallback, a stable public error when the model fails), and a budget keyed
on the `x-user-id` header.

Serve it with `uvicorn app.main:app` (WORKERS_AI_ACCOUNT_ID and WORKERS_AI_API_TOKEN set)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from guards import AI, Breaker, Budget, Guards, GuardTripped, header_key
from guards.providers import WorkersAI

MODEL = "@cf/meta/llama-3.3-70b-instruct-fp8-fast"


class Ticket(BaseModel):
    text: str


class Triage(BaseModel):
    label: str
    urgent: bool


class Draft(BaseModel):
    message: str


def triage_by_rules(arguments: Mapping[str, Any], tripped: GuardTripped) -> Triage:
    """The fallback of the degrading route: computed from the ticket when a guard trips."""
    text = arguments["ticket"].text.lower()
    return Triage(label="outage" if "down" in text else "other", urgent="down" in text)


guards = Guards(
    WorkersAI(
        account_id=os.environ.get("WORKERS_AI_ACCOUNT_ID", "unset"),
        api_token=os.environ.get("WORKERS_AI_API_TOKEN", "unset"),
    )
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with guards:  # closes the provider's connections and the store on shutdown
        yield


app = FastAPI(title="triage", lifespan=lifespan)
guards.install(app)


@app.post("/triage")
@guards.route(
    model=MODEL,
    timeout_s=8,
    budget=Budget(per_minute=3, key=header_key("x-user-id")),
    breaker=Breaker(failure_threshold=5, reset_timeout_s=30),
    fallback=triage_by_rules,
)
async def triage(ticket: Ticket, ai: AI[Triage]) -> Triage:
    """Degrading: always the same shape, the model's answer or the rules'."""
    return await ai.run({"messages": [{"role": "user", "content": f"Triage this ticket: {ticket.text}"}]})


@app.post("/draft")
@guards.route(model=MODEL, timeout_s=8, budget=Budget(per_minute=3, key=header_key("x-user-id")))
async def draft(ticket: Ticket, ai: AI[str]) -> Draft:
    """Strict: the model's draft, or a public error (no made-up answer)."""
    return Draft(message=await ai.run({"prompt": f"Draft a reply to: {ticket.text}"}))
