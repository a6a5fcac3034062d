"""A test-only app for serving tests (`guards.serve`, plain uvicorn): two streaming routes,
`/stream` in guards' own events and `/chat` in the AI SDK's UI message stream, whose callers
(`x-user-id`) have a daily spend cap, its state in the SQLite file `$SPEND_DB`, its provider
the fake Workers AI at `$FAKE_BASE_URL` (`$FAKE_ACCOUNT_ID`, `$FAKE_API_TOKEN`).

Each call costs `CALL_PRICE` and a route may make two: a request holds 2 units until it
settles to what it cost (1 for an answered or cut stream). Both routes spend from one budget
(scope `stream`)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from pydantic import BaseModel

from guards import AI, UI_MESSAGE_STREAM, Budget, EventStream, Guards, Price, UIChatRequest, header_key
from guards.providers import WorkersAI
from guards.stores import open_store

MODEL = "@cf/meta/llama-3.1-8b-instruct"
CALL_PRICE = 1.0
#: The budget's spend key of the caller `ada` (`guards:{scope}:{caller}`).
ADA = "guards:stream:ada"

guards = Guards(
    WorkersAI(
        account_id=os.environ["FAKE_ACCOUNT_ID"],
        api_token=os.environ["FAKE_API_TOKEN"],
        base_url=os.environ["FAKE_BASE_URL"],
    ),
    # A loaded test machine can take longer than the default 0.1 s for a store operation.
    store=open_store(f"sqlite:///{os.environ['SPEND_DB']}", timeout_s=5.0),
    prices={MODEL: Price(call=CALL_PRICE)},
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with guards:
        yield


app = FastAPI(lifespan=lifespan)
guards.install(app)


class Ask(BaseModel):
    message: str


@app.post("/stream")
@guards.route(
    model=MODEL,
    max_tokens=100,
    budget=Budget(spend_per_day=1000.0, key=header_key("x-user-id"), scope="stream"),
)
async def stream(body: Ask, ai: AI[str]) -> EventStream:
    return await ai.stream({"messages": [{"role": "user", "content": body.message}]})


@app.post("/chat")
@guards.route(
    model=MODEL,
    max_tokens=100,
    budget=Budget(spend_per_day=1000.0, key=header_key("x-user-id"), scope="stream"),
    stream_format=UI_MESSAGE_STREAM,
)
async def chat(body: UIChatRequest, ai: AI[str]) -> EventStream:
    return await ai.stream(body.inputs())
