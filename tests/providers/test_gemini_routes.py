"""Routes on the Gemini binding, over real HTTP against the fake Gemini server (issue 40's
"done when" for Gemini): a strict and a degrading route answer, a stream relays text and ends
with `done`, an overload moves to the next model, a rate limit sends a bounded `Retry-After`, a
context-length refusal is `400 context_length_exceeded`, a content filter is moderation, an
error event after the first output ends the stream with `error` and no second model, a bad key
or an unknown model is the operator's (502), and no key or provider text reaches a response or
a log line. And the in-process fake answers as the server does (`use_fake_ai` against
`use_fake_servers`)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from fixtures import Fail, FakeGemini, FakeOpenAI, Reply, Stream, Text
from guards import AI, EventStream, Guards
from guards.providers import Gemini, OpenAICompatible
from guards.testing import UseFakeAI, UseFakeServers

from ..conftest import AppClient, LogLines, assert_error, assert_fallback, no_sleep

MAIN, NEXT = "gemini-2.5-flash", "gemini-2.5-flash-lite"
GOOD = {"label": "billing", "confidence": 0.9}
FALLBACK = {"label": "general", "confidence": 0.1}
CANARY = "CANARY-PROVIDER-TEXT"
KEY_CANARY = "AIza-CANARY-KEY"


class Ask(BaseModel):
    text: str = Field(min_length=1, max_length=200)


class Label(BaseModel):
    label: str
    confidence: float = Field(ge=0, le=1)


def create_app(
    base_url: str = "http://127.0.0.1:9", api_key: str = "test-gemini-key", *, chain: bool = False
) -> FastAPI:
    """`/strict`, `/degrading` and `/stream` on `MAIN` (then `NEXT` with `chain`)."""
    guards = Guards(Gemini(api_key=api_key, base_url=base_url), sleep=no_sleep, retry_after_s=17)
    app = FastAPI()
    guards.install(app)
    options: dict[str, Any] = {"model": MAIN, "fallbacks": [NEXT] if chain else [], "timeout_s": 5}

    @app.post("/strict")
    @guards.route(**options)
    async def strict(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run(
            {"messages": [{"role": "system", "content": "Label it."}, {"role": "user", "content": body.text}]}
        )

    @app.post("/degrading")
    @guards.route(**options, fallback=Label(**FALLBACK))
    async def degrading(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run({"prompt": body.text})

    @app.post("/stream")
    @guards.route(**options, name="stream")
    async def stream(body: Ask, ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": body.text})

    return app


def client_for(app_client: AppClient, server: FakeGemini, **options: Any) -> httpx.Client:
    return app_client(create_app(server.base_url, server.api_key, **options))


def post(client: httpx.Client, path: str) -> httpx.Response:
    return client.post(path, json={"text": "I was charged twice."})


def events(response: httpx.Response) -> list[tuple[str, Any]]:
    found = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            found.append((lines["event"], json.loads(lines["data"])))
    return found


def test_a_strict_and_a_degrading_route_answer(app_client: AppClient, fake_gemini: FakeGemini) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(MAIN, Reply(GOOD), Reply(GOOD))
    strict = post(client, "/strict")
    assert (strict.status_code, strict.json()) == (200, GOOD)
    assert post(client, "/degrading").json() == {"ok": True, "data": GOOD, "fallback": None}
    sent = fake_gemini.calls[0].inputs
    assert sent["systemInstruction"] == {"parts": [{"text": "Label it."}]}
    assert sent["generationConfig"]["responseMimeType"] == "application/json"
    assert sent["generationConfig"]["responseJsonSchema"]["required"] == ["label", "confidence"]


def test_a_stream_relays_text_and_ends_with_done(app_client: AppClient, fake_gemini: FakeGemini) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(MAIN, Stream(parts=(Text("Hel"), Text("lo "), Text("there."))))
    found = events(post(client, "/stream"))
    assert "".join(data["text"] for name, data in found if name == "delta") == "Hello there."
    assert found[-1][0] == "done"


def test_an_overload_moves_to_the_next_model(app_client: AppClient, fake_gemini: FakeGemini) -> None:
    client = client_for(app_client, fake_gemini, chain=True)
    fake_gemini.script(MAIN, Fail(status=503), Fail(status=503))
    fake_gemini.script(NEXT, Reply(GOOD))
    response = post(client, "/strict")
    assert (response.status_code, response.json()) == (200, GOOD)
    assert [c.model for c in fake_gemini.calls] == [MAIN, MAIN, NEXT]  # retried once, then moved on


@pytest.mark.parametrize(("delay", "retry_after"), [("30", "30"), ("9999999", "600")], ids=["30s", "capped"])
def test_a_rate_limit_sends_a_bounded_retry_after(
    app_client: AppClient, fake_gemini: FakeGemini, delay: str, retry_after: str
) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(MAIN, Fail(status=429, retry_after=delay))
    response = post(client, "/strict")
    assert_error(response, 503, "model_rate_limited", False)
    assert response.headers["retry-after"] == retry_after
    assert len(fake_gemini.calls) == 1


def test_a_spent_daily_quota_is_quota_exhausted(app_client: AppClient, fake_gemini: FakeGemini) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(MAIN, Fail(status=429, error_code="insufficient_quota", retry_after="40"))
    assert_error(post(client, "/strict"), 503, "model_quota_exhausted", False)


def test_a_context_length_refusal_is_400(app_client: AppClient, fake_gemini: FakeGemini) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(MAIN, Fail(status=400, error_code="context_length_exceeded"))
    assert_error(post(client, "/strict"), 400, "context_length_exceeded", False)
    assert len(fake_gemini.calls) == 1  # never retried


@pytest.mark.parametrize(
    "filtered",
    [
        Reply(GOOD, finish_reason="SAFETY"),
        Reply(GOOD, finish_reason="PROHIBITED_CONTENT"),
        Reply(refusal="no"),
    ],
    ids=["safety", "prohibited", "prompt-blocked"],
)
def test_a_content_filter_is_moderation(
    app_client: AppClient, fake_gemini: FakeGemini, filtered: Reply
) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(MAIN, filtered, filtered)
    assert_fallback(post(client, "/degrading"), "output", "moderation_blocked", FALLBACK)
    assert_error(post(client, "/strict"), 502, "incompatible_model_response", False)
    assert len(fake_gemini.calls) == 2


def test_a_filtered_stream_ends_with_moderation(app_client: AppClient, fake_gemini: FakeGemini) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(MAIN, Stream(parts=(Text("Hel"),), finish_reason="SAFETY"))
    name, data = events(post(client, "/stream"))[-1]
    assert (name, data["reason"]) == ("error", "moderation_blocked")


def test_an_error_event_after_the_first_output_ends_the_stream(
    app_client: AppClient, fake_gemini: FakeGemini
) -> None:
    client = client_for(app_client, fake_gemini, chain=True)
    fake_gemini.script(MAIN, Stream(parts=(Text("Hel"), Text("lo.")), error_after=1, error_code=503))
    found = events(post(client, "/stream"))
    assert [name for name, _ in found] == ["delta", "error"]
    assert [c.model for c in fake_gemini.calls] == [MAIN]  # no second model after output


@pytest.mark.parametrize(
    "refusal",
    [Fail(status=404), Fail(status=403), Fail(status=400, error_type="FAILED_PRECONDITION")],
    ids=["unknown-model", "permission", "precondition"],
)
def test_the_operators_faults_are_502(app_client: AppClient, fake_gemini: FakeGemini, refusal: Fail) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(MAIN, refusal)
    assert_error(post(client, "/strict"), 502, "model_incompatible", False)


def test_a_bad_key_is_502_and_never_shown(
    app_client: AppClient, fake_gemini: FakeGemini, guards_log: LogLines
) -> None:
    client = app_client(create_app(fake_gemini.base_url, KEY_CANARY))
    response = post(client, "/strict")
    assert_error(response, 502, "model_incompatible", False)
    assert KEY_CANARY not in response.text + str(response.headers)
    assert not any(KEY_CANARY in line for line in guards_log.lines)


def test_no_provider_text_in_any_response_or_log_line(
    app_client: AppClient, fake_gemini: FakeGemini, guards_log: LogLines
) -> None:
    client = client_for(app_client, fake_gemini)
    fake_gemini.script(
        MAIN,
        Fail(status=429, message=CANARY),
        Fail(status=503, message=CANARY),
        Fail(status=503, message=CANARY),
    )
    fake_gemini.script(MAIN, Stream(parts=(Text("Hi"),), error_after=1, error_message=CANARY))
    answers = [post(client, "/strict"), post(client, "/degrading"), post(client, "/stream")]
    for answer in answers:
        assert CANARY not in answer.text + str(answer.headers)
    assert guards_log.lines
    assert not any(CANARY in line for line in guards_log.lines)


FAILURES = [
    pytest.param(Fail(status=429, retry_after="20"), (503, "model_rate_limited", False, "20"), 1, id="rate"),
    pytest.param(
        Fail(status=429, error_code="insufficient_quota"),
        (503, "model_quota_exhausted", False, "600"),
        1,
        id="quota",
    ),
    pytest.param(
        Fail(status=400, error_code="context_length_exceeded"),
        (400, "context_length_exceeded", False, None),
        1,
        id="context",
    ),
    pytest.param(Fail(status=503), (503, "model_temporarily_unavailable", True, "17"), 2, id="503"),
    pytest.param(
        Reply(GOOD, finish_reason="SAFETY"), (502, "incompatible_model_response", False, None), 1, id="safety"
    ),
]


@pytest.mark.parametrize(("failure", "public", "calls"), FAILURES)
def test_use_fake_ai_answers_as_the_server(
    use_fake_ai: UseFakeAI,
    use_fake_servers: UseFakeServers,
    fake_gemini: FakeGemini,
    app_client: AppClient,
    failure: Fail | Reply,
    public: tuple[int, str, bool, str | None],
    calls: int,
) -> None:
    faked, served = create_app(), create_app()
    fake = use_fake_ai(faked)
    use_fake_servers(served)
    assert fake.wire == "gemini"
    fake.script(MAIN, failure, failure)
    fake_gemini.script(MAIN, failure, failure)
    for app in (faked, served):
        response = post(app_client(app), "/strict")
        body = response.json()
        assert (
            response.status_code,
            body["error"],
            body["retryable"],
            response.headers.get("retry-after"),
        ) == public
    assert len(fake.calls) == len(fake_gemini.calls) == calls


def test_gemini_as_a_provider_of_a_chain(
    app_client: AppClient, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    """`providers={"gemini": Gemini(...)}`: a chain names `gemini:<model>` after an OpenAI model."""
    guards = Guards(
        OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url),
        providers={"gemini": Gemini(api_key=fake_gemini.api_key, base_url=fake_gemini.base_url)},
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/strict")
    @guards.route(model="gpt-4o-mini", fallbacks=[f"gemini:{MAIN}"], timeout_s=5)
    async def strict(body: Ask, ai: AI[Label]) -> dict[str, Any]:
        label = await ai.run({"prompt": body.text})
        return {**label.model_dump(), "model": ai.model}

    fake_openai.script("gpt-4o-mini", Fail(status=503), Fail(status=503))
    fake_gemini.script(MAIN, Reply(GOOD, model="gemini-2.5-flash-001"))
    response = post(app_client(app), "/strict")
    assert (response.status_code, response.json()) == (200, {**GOOD, "model": "gemini-2.5-flash-001"})
    assert [c.model for c in fake_gemini.calls] == [MAIN]
