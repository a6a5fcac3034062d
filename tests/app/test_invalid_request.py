"""A 400 says what to fix, not what was sent: `problems` lists each field path and the pydantic
error type, never an input value, at most 10. Against the example app."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError

from app.service import DraftRequest, create_app
from app.settings import Settings
from fixtures import FakeWorkersAI
from guards import AI, Guards

from ..conftest import AppClient, LogLines, assert_error, no_sleep, problems, workers_ai_settings

CANARY = "CANARY-INPUT-4d1e77"
MEGABYTE = 1_000_000


class Wide(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int
    items: list[int] = []


class Scored(BaseModel):
    scores: dict[str, int]


@pytest.fixture
def app(fake_workers_ai: FakeWorkersAI) -> FastAPI:
    return create_app(workers_ai_settings(fake_workers_ai), sleep=no_sleep)


@pytest.fixture
def client(app: FastAPI, app_client: AppClient) -> httpx.Client:
    return app_client(app)


DRAFT_CASES = [
    pytest.param({"message": "x" * MEGABYTE}, [("body.message", "string_too_long")], id="1MB"),
    pytest.param({"message": "x" * 501}, [("body.message", "string_too_long")], id="501"),
    pytest.param({"message": " " * 10 + "x" * 501}, [("body.message", "string_too_long")], id="501-trimmed"),
    pytest.param({"message": ""}, [("body.message", "string_too_short")], id="empty"),
    pytest.param({"message": " \n\t\u3000 "}, [("body.message", "string_too_short")], id="blank"),
    pytest.param({}, [("body.message", "missing")], id="missing"),
    pytest.param({"message": None}, [("body.message", "string_type")], id="null"),
    pytest.param({"message": 42}, [("body.message", "string_type")], id="number"),
    pytest.param({"message": {"nested": CANARY}}, [("body.message", "string_type")], id="object"),
    pytest.param([], [("body", "model_attributes_type")], id="array"),
    pytest.param(CANARY, [("body", "model_attributes_type")], id="string"),
]


@pytest.mark.parametrize("path", ["/draft-reply", "/draft-reply/stream"])
@pytest.mark.parametrize(("body", "expected"), DRAFT_CASES)
def test_draft_reply_names_the_field_and_the_problem(
    client: httpx.Client, fake_workers_ai: FakeWorkersAI, path: str, body: Any, expected: Any
) -> None:
    response = client.post(path, json=body)
    assert_error(response, 400, "invalid_request", False)
    assert problems(response) == expected
    assert CANARY not in response.text
    assert fake_workers_ai.calls == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"text": "t" * MEGABYTE}, [("body.text", "string_too_long")]),
        ({"text": ""}, [("body.text", "string_too_short")]),
        ({"text": "   "}, [("body.text", "string_pattern_mismatch")]),
        ({"text": 7}, [("body.text", "string_type")]),
    ],
    ids=["1MB", "empty", "blank", "number"],
)
def test_summary_names_the_field_and_the_problem(client: httpx.Client, body: Any, expected: Any) -> None:
    response = client.post("/summary", json=body, headers={"x-user-id": "ada"})
    assert problems(response) == expected


def test_a_body_that_is_not_json_is_json_invalid(client: httpx.Client) -> None:
    for content in (f'{{"message": "{CANARY}'.encode(), b"\xff\xfe\xfa"):
        response = client.post("/draft-reply", content=content, headers={"content-type": "application/json"})
        assert problems(response) == [("body", "json_invalid")]
        assert CANARY not in response.text


def test_problems_are_bounded_and_logged_without_values(
    app: FastAPI, app_client: AppClient, guards_log: LogLines
) -> None:
    @app.post("/wide")
    @Guards.of(app).route(model="@cf/test/model")
    async def wide(body: Wide, ai: AI[str]) -> str:
        return await ai.run({"prompt": "hi"})

    # A wrong field, 40 wrong items and 40 unknown fields: 42 problems, 10 reported. An
    # unknown field is a key the client wrote: never told by name.
    body: dict[str, Any] = {f"extra_{i}_{CANARY}": 1 for i in range(40)}
    body["a"] = CANARY
    body["items"] = [CANARY] * 40
    response = app_client(app).post("/wide", json=body)
    found = problems(response)
    assert len(found) == 10
    assert found[0] == ("body.a", "int_parsing")
    assert ("body.items.0", "int_parsing") in found
    assert CANARY not in response.text
    [logged] = guards_log.events("request")
    assert logged["status"] == 400
    assert CANARY not in str(logged)


@pytest.mark.parametrize(
    "key", [CANARY, f"{CANARY}\x1b[31m\r\n\x00", "b"], ids=["plain", "controls", "short"]
)
def test_a_key_the_client_wrote_is_never_told(
    app: FastAPI, app_client: AppClient, guards_log: LogLines, key: str
) -> None:
    """A `dict` field's keys and unknown fields are the client's text: the 400's `problems` and
    its log line say `<key>` where they stand, never the key."""

    @app.post("/scored")
    @Guards.of(app).route(model="@cf/test/model")
    async def scored(body: Scored, ai: AI[str]) -> str:
        return await ai.run({"prompt": "hi"})

    @app.post("/wide-keys")
    @Guards.of(app).route(model="@cf/test/model")
    async def wide_keys(body: Wide, ai: AI[str]) -> str:
        return await ai.run({"prompt": "hi"})

    client = app_client(app)
    scored_answer = client.post("/scored", json={"scores": {key: "high"}})
    assert problems(scored_answer) == [("body.scores.<key>", "int_parsing")]
    wide_answer = client.post("/wide-keys", json={"a": 1, key: 2})
    assert problems(wide_answer) == [("body.<key>", "extra_forbidden")]
    logged = guards_log.events("request")
    assert [line["problems"] for line in logged] == [
        ["body.scores.<key>:int_parsing"],
        ["body.<key>:extra_forbidden"],
    ]
    for answer in (scored_answer, wide_answer):
        assert CANARY not in answer.text
    assert CANARY not in str(logged)


def test_openapi_documents_the_problems(app: FastAPI) -> None:
    schema = app.openapi()
    for path in ("/draft-reply", "/draft-reply/stream", "/summary"):
        body = schema["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        extra = body["allOf"][1]
        assert extra["required"] == ["problems"]
        assert extra["properties"]["problems"]["maxItems"] == 10
        assert extra["properties"]["problems"]["items"] == {"$ref": "#/components/schemas/Problem"}
    problem = schema["components"]["schemas"]["Problem"]
    assert problem["required"] == ["field", "problem"]


# --- /draft-reply's document says exactly what it accepts -----------------------------------------

WHITESPACE = "\t\n\v\f\r \u00a0\u1680\u2000\u2005\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
#: The message's schema in the example app's OpenAPI document.
MESSAGE = create_app(Settings()).openapi()["components"]["schemas"]["DraftRequest"]["properties"]["message"]


def accepted(message: str) -> bool:
    try:
        DraftRequest(message=message)
    except ValidationError:
        return False
    return True


def test_the_document_states_the_limits() -> None:
    assert MESSAGE["type"] == "string"
    assert "500" in MESSAGE["description"]
    pattern = re.compile(MESSAGE["pattern"])
    assert pattern.search("  " + "x" * 500 + "\n")
    assert not pattern.search("x" * 501)
    assert not pattern.search(" \u3000 ")


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(WHITESPACE), max_size=8),
    st.text(max_size=510),
    st.text(alphabet=st.sampled_from(WHITESPACE), max_size=8),
)
def test_the_pattern_documented_is_what_is_accepted(lead: str, middle: str, tail: str) -> None:
    pattern = re.compile(MESSAGE["pattern"])
    for message in (lead + middle + tail, middle, lead + "x" * 500 + tail, lead + "x" * 501 + tail):
        assert accepted(message) == (pattern.search(message) is not None), repr(message)
