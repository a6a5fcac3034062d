"""The README's example route runs as written, with the fake binding swapped in."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import httpx

from fixtures import Fail, Reply

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> dict[str, Any]:
    section = README.read_text().split("## Guard a route of your own", 1)[1]
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
