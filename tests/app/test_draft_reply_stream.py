"""`POST /draft-reply/stream` of the example app: the same input checks and the same error
contract as `POST /draft-reply` before the first event, the same answer once streamed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fixtures import Drop, Fail, FakeWorkersAI, Hang, ManualClock, Reply, Stream, Text

from ..conftest import ExampleClient

MODEL = "@cf/test/model"


@pytest.fixture
def client(example_client: ExampleClient, manual_clock: ManualClock) -> httpx.Client:
    return example_client(ai_timeout_s=0.5, breaker_failure_threshold=1000, clock=manual_clock)


def contract(response: httpx.Response) -> tuple[Any, ...]:
    """What a client relies on in an error answer: status, body token, retryable, Retry-After."""
    body = response.json()
    return response.status_code, body["error"], body["retryable"], response.headers.get("retry-after")


# Each outcome is scripted twice (a retry may consume the second).
FAILURES = {
    "quota-3036": Fail(code=3036, status=429),
    "rate-limited-429": Fail(status=429),
    "capacity-3040-twice": Fail(code=3040, status=429),
    "incompatible-5035": Fail(code=5035, status=403),
    "bad-token": Fail(code=10000, status=401),
    "server-error-twice": Fail(status=503),
    "dropped-twice": Drop(),
    "hang": Hang(),
}


@pytest.mark.parametrize("outcome", FAILURES.values(), ids=FAILURES.keys())
def test_errors_before_the_first_event_match_the_non_streaming_route(
    outcome: Any, client: httpx.Client, fake_workers_ai: FakeWorkersAI, manual_clock: ManualClock
) -> None:
    answers = []
    for path in ("/draft-reply", "/draft-reply/stream"):
        manual_clock.advance(3_601)  # past a cooldown the other path's 429 started (shared per model)
        fake_workers_ai.reset()
        fake_workers_ai.script(MODEL, outcome, outcome)
        answers.append(
            (client.post(path, json={"message": "Where is my parcel?"}), len(fake_workers_ai.calls))
        )
    (plain, plain_calls), (streamed, streamed_calls) = answers
    assert streamed.headers["content-type"] == "application/json"
    assert contract(streamed) == contract(plain)
    assert streamed_calls == plain_calls


@pytest.mark.parametrize(
    "body",
    [{}, {"message": ""}, {"message": "   "}, {"message": "x" * 501}, {"message": 3}],
    ids=["missing", "empty", "blank", "too-long", "wrong-type"],
)
def test_invalid_input_is_the_same_400_without_a_call(
    body: dict[str, Any], client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    plain = client.post("/draft-reply", json=body)
    streamed = client.post("/draft-reply/stream", json=body)
    assert contract(streamed) == contract(plain) == (400, "invalid_request", False, None)
    assert fake_workers_ai.calls == []


def test_the_streamed_text_is_the_reply(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Reply("Your parcel is on its way."))
    plain = client.post("/draft-reply", json={"message": "Where is my parcel?"}).json()["reply"]
    fake_workers_ai.script(MODEL, Stream(parts=(Text("Your parcel"), Text(" is on its way."))))
    streamed = client.post("/draft-reply/stream", json={"message": "Where is my parcel?"})
    deltas = [line for line in streamed.text.splitlines() if line.startswith('data: {"text"')]
    assert "".join(line[len('data: {"text":"') : -len('"}')] for line in deltas) == plain
    assert fake_workers_ai.calls[-1].inputs["stream"] is True
    assert streamed.text.rstrip().splitlines()[-2] == "event: done"


def test_the_stream_is_documented_as_server_sent_events(client: httpx.Client) -> None:
    operation = client.get("/openapi.json").json()["paths"]["/draft-reply/stream"]["post"]
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert {"400", "502", "503"} <= set(operation["responses"])
