"""Browsers may call the example app when the operator allows their origin
(`CORS_ALLOW_ORIGINS`): the preflight a page's `fetch` sends, then the streamed answer with the
headers the page may read. Nothing changes by default."""

from __future__ import annotations

import httpx
import pytest

from app.service import create_app
from app.settings import Settings, SettingsError, load_settings
from fixtures import FakeWorkersAI, Stream, Text

from ..conftest import AppClient, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"
PAGE = "https://support.example.com"


def preflight(client: httpx.Client, origin: str, path: str = "/draft-reply/stream") -> httpx.Response:
    """What a browser sends before `fetch(url, {method: "POST", headers: {"content-type":
    "application/json"}})` from a page on `origin`."""
    return client.options(
        path,
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,x-user-id",
        },
    )


def test_allowed_origin_can_stream_from_a_page(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORS_ALLOW_ORIGINS", f"{PAGE}, https://admin.example.com")
    settings = load_settings()
    settings = workers_ai_settings(fake_workers_ai, cors_allow_origins=settings.cors_allow_origins)
    client = app_client(create_app(settings, sleep=no_sleep))

    allowed = preflight(client, PAGE)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == PAGE
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert {"content-type", "x-user-id"} <= set(
        allowed.headers["access-control-allow-headers"].lower().split(", ")
    )

    fake_workers_ai.script(MODEL, Stream(parts=(Text("On "), Text("its way."))))
    with client.stream(
        "POST", "/draft-reply/stream", json={"message": "Where is my parcel?"}, headers={"origin": PAGE}
    ) as streamed:
        body = streamed.read().decode()
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers["access-control-allow-origin"] == PAGE
    exposed = set(streamed.headers["access-control-expose-headers"].lower().split(", "))
    assert {"x-trace-id", "x-ai-model", "retry-after"} <= exposed
    assert 'data: {"text":"its way."}' in body
    assert "event: done" in body

    refused = preflight(client, "https://evil.example.com")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


def test_no_cors_by_default(fake_workers_ai: FakeWorkersAI, app_client: AppClient) -> None:
    assert Settings().cors_allow_origins == ""
    client = app_client(create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep))
    assert "access-control-allow-origin" not in preflight(client, PAGE).headers
    answer = client.post("/draft-reply", json={"message": "Hi"}, headers={"origin": PAGE})
    assert answer.status_code == 200
    assert "access-control-allow-origin" not in answer.headers


def test_a_malformed_origin_fails_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORS_ALLOW_ORIGINS", "https://ok.example.com,support.example.com/page")
    with pytest.raises(SettingsError, match="CORS_ALLOW_ORIGINS"):
        load_settings()
