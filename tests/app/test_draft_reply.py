"""The strict matrix: `POST /draft-reply` of the example service, in process (ASGI), calling
the fake Workers AI server over real HTTP. Each case checks the status, the whole body and the
number of calls the provider saw."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.service import create_app
from fixtures import Drop, Fail, FakeWorkersAI, Hang, Raw, Reply
from guards import AI, Guards

from ..conftest import AppClient, ExampleClient, assert_error, no_sleep, workers_ai_settings

MODEL = "@cf/test/model"


@pytest.fixture
def client(example_client: ExampleClient) -> httpx.Client:
    return example_client(retry_after_s=17)


def post(client: httpx.Client, message: Any = "Where is my parcel?") -> httpx.Response:
    return client.post("/draft-reply", json={"message": message})


def test_success_answers_the_trimmed_reply_in_one_call(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Reply("  Your parcel ships today.  \n"))
    response = post(client)
    assert response.status_code == 200
    trace_id = response.headers["x-trace-id"]
    assert response.json() == {
        "model": MODEL,
        "reply": "Your parcel ships today.",
        "attempts": 1,
        "trace_id": trace_id,
    }
    [call] = fake_workers_ai.calls
    assert call.model == MODEL
    assert call.inputs["messages"][-1] == {"role": "user", "content": "Where is my parcel?"}
    assert "response_format" not in call.inputs  # plain text route: no JSON mode


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"message": None},
        {"message": 42},
        {"message": ["a"]},
        {"message": ""},
        {"message": "   \n\t "},
        {"message": "x" * 501},
        {"text": "wrong field"},
        [],
        "just a string",
    ],
    ids=[
        "missing",
        "null",
        "number",
        "list",
        "empty",
        "blank",
        "501-chars",
        "wrong-field",
        "array",
        "string",
    ],
)
def test_invalid_input_is_400_without_a_call(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, body: Any
) -> None:
    response = client.post("/draft-reply", json=body)
    assert_error(response, 400, "invalid_request", False)
    assert fake_workers_ai.calls == []


def test_non_json_body_is_400(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    response = client.post("/draft-reply", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_request", False)
    assert fake_workers_ai.calls == []


def test_500_trimmed_characters_are_accepted(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    response = post(client, "  " + "y" * 500 + "  ")
    assert response.status_code == 200
    assert len(fake_workers_ai.calls) == 1


def test_quota_exhausted_is_503_in_one_call(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Fail(code=3036, status=429))
    response = post(client)
    assert_error(response, 503, "model_quota_exhausted", False)
    assert response.headers["retry-after"] == "600"  # the model's cooldown: a known wait is sent
    assert len(fake_workers_ai.calls) == 1


def test_rate_limit_without_code_is_503_in_one_call(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Fail(status=429))
    response = post(client)
    assert_error(response, 503, "model_rate_limited", False)
    assert response.headers["retry-after"] == "30"  # the model's cooldown: a known wait is sent
    assert len(fake_workers_ai.calls) == 1


@pytest.mark.parametrize(
    ("failure", "error", "wait"),
    [
        (Fail(status=429, retry_after="7"), "model_rate_limited", "7"),
        (Fail(code=3036, status=429, retry_after="120"), "model_quota_exhausted", "120"),
        # Longer than the longest cooldown (10 min): the client is told the maximum.
        (Fail(status=429, retry_after="7200"), "model_rate_limited", "600"),
    ],
    ids=["rate-limited", "quota", "past-the-cooldown-cap"],
)
def test_provider_wait_is_sent_as_retry_after_but_not_retryable(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, failure: Fail, error: str, wait: str
) -> None:
    fake_workers_ai.script(MODEL, failure)
    response = post(client)
    assert_error(response, 503, error, False)
    assert response.headers["retry-after"] == wait
    # The model cools down for that long: the next request skips it (circuit_open), same wait.
    again = post(client)
    assert_error(again, 503, "circuit_open", True)
    assert abs(int(again.headers["retry-after"]) - int(wait)) <= 1
    assert len(fake_workers_ai.calls) == 1


@pytest.mark.parametrize(("code", "status"), [(3040, 429), (3007, 408), (None, 408)])
def test_transient_failure_recovers_on_the_retry(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, code: int | None, status: int
) -> None:
    fake_workers_ai.script(MODEL, Fail(code=code, status=status), Reply("Recovered."))
    response = post(client)
    assert response.status_code == 200
    assert response.json()["attempts"] == 2
    assert response.json()["reply"] == "Recovered."
    assert len(fake_workers_ai.calls) == 2


@pytest.mark.parametrize(("code", "status"), [(3040, 429), (3007, 408), (None, 408)])
def test_transient_failure_that_persists_is_503_with_retry_after(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, code: int | None, status: int
) -> None:
    fake_workers_ai.script(MODEL, Fail(code=code, status=status), Fail(code=code, status=status), Reply())
    response = post(client)
    assert_error(response, 503, "model_temporarily_unavailable", True)
    assert response.headers["retry-after"] == "17"
    assert len(fake_workers_ai.calls) == 2  # one retry, never more


@pytest.mark.parametrize("code", [5004, 5005, 5007, 5016, 5018, 5035, 3042])
def test_incompatible_model_is_502_in_one_call(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, code: int
) -> None:
    status = {5005: 405, 5016: 403, 5018: 403, 5035: 403, 3042: 404}.get(code, 400)
    fake_workers_ai.script(MODEL, Fail(code=code, status=status))
    assert_error(post(client), 502, "model_incompatible", False)
    assert len(fake_workers_ai.calls) == 1


@pytest.mark.parametrize(
    "answer",
    [{"reply": "an object"}, 42, ["a", "list"], "z" * 1201, "", "  \n  ", None],
    ids=["object", "number", "list", "1201-chars", "empty", "blank", "null"],
)
def test_malformed_output_is_502_incompatible_response(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, answer: Any
) -> None:
    fake_workers_ai.script(MODEL, Reply(answer))
    assert_error(post(client), 502, "incompatible_model_response", False)
    assert len(fake_workers_ai.calls) == 1


def test_1200_characters_of_reply_are_accepted(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Reply("r" * 1200))
    assert post(client).status_code == 200


def test_handler_crash_is_500_application_failure(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    """The model's answer was fine; the route's own code raised: not the model's fault."""
    app = create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep)

    @app.post("/crashing-draft")
    @Guards.of(app).route(model=MODEL)
    async def crashing_draft(ai: AI[str]) -> dict[str, str]:
        reply = await ai.run({"prompt": "hello"})
        return {"words": str(len(reply.split()) / 0)}

    client = app_client(app)
    response = client.post("/crashing-draft")
    assert_error(response, 500, "application_failure", False)
    assert len(fake_workers_ai.calls) == 1


def test_success_false_with_http_200_is_a_failure(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Fail(code=5006, status=200))
    assert_error(post(client), 503, "model_unavailable", False)
    assert len(fake_workers_ai.calls) == 1


def test_transient_code_with_http_200_is_retried(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Fail(code=3040, status=200), Reply("Second time lucky."))
    response = post(client)
    assert response.status_code == 200
    assert response.json()["attempts"] == 2


def test_hang_answers_by_the_deadline_and_closes_the_connection(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(create_app(workers_ai_settings(fake_workers_ai, ai_timeout_s=0.5, retry_after_s=9)))
    fake_workers_ai.script(MODEL, Hang())
    response = post(client)
    assert_error(response, 503, "model_temporarily_unavailable", True)
    assert response.headers["retry-after"] == "9"
    assert response.elapsed.total_seconds() < 2.0
    # The provider request was really cancelled: the fake server saw its connection close.
    assert fake_workers_ai.wait_for(lambda calls: len(calls) == 1 and calls[0].disconnected, timeout=5)


def test_dropped_connection_is_retried(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(MODEL, Drop(), Reply("After the drop."))
    response = post(client)
    assert response.status_code == 200
    assert response.json()["attempts"] == 2


def test_dropped_connection_twice_is_503_temporarily_unavailable(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Drop(), Drop())
    assert_error(post(client), 503, "model_temporarily_unavailable", True)
    assert len(fake_workers_ai.calls) == 2


def test_html_error_page_from_a_proxy_is_transient(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(MODEL, Raw(502, b"<html><body>502 Bad Gateway</body></html>"), Reply("Fine now."))
    response = post(client)
    assert response.status_code == 200
    assert response.json()["attempts"] == 2


def test_bad_token_is_503_model_unavailable(fake_workers_ai: FakeWorkersAI, app_client: AppClient) -> None:
    client = app_client(
        create_app(workers_ai_settings(fake_workers_ai, cloudflare_api_token="wrong"), sleep=no_sleep)
    )
    assert_error(post(client), 503, "model_unavailable", False)


def test_every_response_carries_the_trace_id_it_logged(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, guards_log: Any
) -> None:
    fake_workers_ai.script(MODEL, Fail(code=3040, status=429), Reply("ok"))
    ok = post(client)
    invalid = post(client, "")
    logged = [e["trace_id"] for e in guards_log.events("request")]
    assert logged == [ok.headers["x-trace-id"], invalid.headers["x-trace-id"]]
    [retry] = guards_log.events("retry")
    assert retry["trace_id"] == ok.headers["x-trace-id"]
    assert retry["kind"] == "model_temporarily_unavailable"


def test_undecodable_body_is_400(client: httpx.Client, fake_workers_ai: FakeWorkersAI) -> None:
    response = client.post(
        "/draft-reply", content=b"\xff\xfe\xfa", headers={"content-type": "application/json"}
    )
    assert_error(response, 400, "invalid_request", False)
    assert fake_workers_ai.calls == []
