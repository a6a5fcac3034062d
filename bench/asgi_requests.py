"""`python -m bench.asgi_requests APP COUNT` (from the repository): serve `APP` of
`bench/http_apps.py` the bench's request through its ASGI interface, as a server calls the app
(no socket): its lifespan, 200 warm-up requests (an outage's breaker opens), then `COUNT` more.
`make bench-instructions` counts such runs' instructions under valgrind."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import bench.http_apps as apps
from bench.http_bench import BODY


def run(app_name: str, count: int) -> None:
    """In the process valgrind watches: start `app_name` (its lifespan), serve it the bench's
    warm-up requests, then `count` more, each as a server would call the app."""
    app = getattr(apps, app_name)
    body = BODY.encode()
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]

    async def request(user: int) -> int:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/label",
            "raw_path": b"/label",
            "query_string": b"",
            "root_path": "",
            "headers": [*headers, (b"x-user-id", f"user-{user % 1000}".encode())],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        status = 0

        async def receive() -> Any:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # (the client stays: read only on a disconnect)

        async def send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        return status

    async def main() -> None:
        async with app.router.lifespan_context(app):
            for user in range(200):  # the outage's breaker opens; every cache is warm
                await request(user)
            for user in range(count):
                if (status := await request(user)) != 200:
                    raise RuntimeError(f"{app_name} answered {status}")

    asyncio.run(main())


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]))
