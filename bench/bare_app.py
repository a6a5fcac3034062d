"""The baseline of `make bench`'s time to first answer (`bench/startup.py`): a FastAPI app with
one route and nothing else, served as the example app is (`python -m guards.serve`)."""

from __future__ import annotations

from fastapi import FastAPI

app = FastAPI()


@app.get("/hello")
async def hello() -> dict[str, str]:
    return {"hello": "world"}
