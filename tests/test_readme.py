"""The README's example route runs as written, with the fake binding swapped in."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import httpx

from fixtures import Fail, FakeBinding, Reply, Stream, Text

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example(heading: str = "## Guard a route of your own") -> dict[str, Any]:
    section = README.read_text().split(heading, 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code.group(1), str(README), "exec"), namespace)
    return namespace


def test_readme_example_degrades_as_documented(use_fake_ai: Any) -> None:
    example = readme_example()
    fake = use_fake_ai(example["app"])
    fake.script("*", Reply({"label": "billing", "urgent": False}), Fail(code=3036, status=429))

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=example["app"])
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"text": "The site is down!"}
            return [await client.post("/triage", json=body) for _ in range(2)] + [
                await client.post("/triage", json={"text": ""})
            ]

    answered, degraded, invalid = anyio.run(scenario)
    assert answered.json() == {"ok": True, "data": {"label": "billing", "urgent": False}, "fallback": None}
    assert degraded.json()["data"] == {"label": "outage", "urgent": True}
    assert degraded.json()["fallback"]["reason"] == "provider_error"
    assert invalid.status_code == 400
    assert len(fake.calls) == 2


def test_readme_chain_example_falls_back_as_documented() -> None:
    example = readme_example("## Fallback chains")
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script("*", Fail(code=5035, status=403))
    openai.script("*", Fail(code=5035, status=403))
    main.script("@cf/meta/llama-3.1-8b-instruct", Reply("Hello from the small model."))

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=example["app"])
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/reply", params={"message": "hi"})

    response = anyio.run(scenario)
    assert response.json() == "Hello from the small model."
    assert response.headers["x-ai-fallback"] == "@cf/meta/llama-3.1-8b-instruct"
    assert [call.model for call in main.calls + openai.calls] == [
        "@cf/meta/llama-3.3-70b-instruct-fp8-fast",
        "@cf/meta/llama-3.1-8b-instruct",
        "gpt-4o-mini",
    ]


def test_readme_streaming_example_streams_through_the_chain() -> None:
    example = readme_example("## Fallback chains")
    section = README.read_text().split("## Streaming routes", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    exec(compile(code.group(1), str(README), "exec"), example)
    guards = example["guards"]
    main, openai = FakeBinding(), FakeBinding()
    guards.binding, guards.providers["openai"] = main, openai
    main.script("*", Fail(code=5035, status=403))
    openai.script("*", Stream(parts=(Text("Hello"), Text(" there."))))

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=example["app"])
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/reply/stream", params={"message": "hi"})

    response = anyio.run(scenario)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-ai-fallback"] == "openai:gpt-4o-mini"
    assert 'data: {"text":"Hello"}' in response.text
    assert response.text.rstrip().splitlines()[-2] == "event: done"


def test_readme_task_example_resumes_and_replays(use_fake_ai: Any) -> None:
    example = readme_example("## Multi-step tasks")
    fake = use_fake_ai(example["app"])
    fake.script(
        "*", Reply("A summary."), Reply({"label": "billing", "confidence": 0.9}), Fail(code=5035, status=403)
    )

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=example["app"])
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"Idempotency-Key": "ticket-42", "x-user-id": "ada"}
            answers = [await client.post("/report", json={"text": "Charged twice"}, headers=headers)]
            fake.script("*", Reply("Sorry, refunded."))
            for _ in range(2):
                answers.append(await client.post("/report", json={"text": "Charged twice"}, headers=headers))
            return answers

    failed, resumed, replayed = anyio.run(scenario)
    assert failed.status_code == 502
    assert resumed.json() == {
        "summary": "A summary.",
        "label": "billing",
        "reply": "Sorry, refunded.",
        "resumed_steps": ["summarize", "classify"],
    }
    assert replayed.content == resumed.content
    assert replayed.headers["idempotent-replayed"] == "true"
    assert len(fake.calls) == 4
