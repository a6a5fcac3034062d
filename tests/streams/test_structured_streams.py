"""Structured streams over real HTTP: a streaming route typed `AI[Model]` asks for JSON mode,
relays the JSON text as it comes, validates the whole answer at the end with the output guard,
and ends with `done` (carrying the validated object) or the output guard's `error`.

Both wires (a Workers AI model on the `fake_workers_ai` server, an OpenAI-compatible one on
`fake_openai`) and both formats (guards' events, the AI SDK's UI message stream), under uvicorn."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fixtures import FakeOpenAI, FakeWorkersAI, Reply, Stream, Text
from guards import (
    AI,
    UI_MESSAGE_STREAM,
    Attempt,
    Breaker,
    ConfigurationError,
    EventStream,
    Guards,
    StreamHold,
)
from guards.providers import OpenAICompatible, WorkersAI

from ..app.test_ui_stream import check_ui_stream
from ..conftest import AppClient, no_sleep
from .test_streaming import parse_sse

WORKERS = "@cf/test/model"
OPENAI = "gpt-4o-mini"
#: Each wire's model, as the route names it.
WIRES = {"workers-ai": WORKERS, "openai": f"openai:{OPENAI}"}
FORMATS = ("guards", "ui-message-stream")
MAX_CHARS = 200


class Triage(BaseModel):
    label: str
    urgent: bool
    scores: dict[str, int] = {}


GOOD = ('{"label": ', '"billing", ', '"urgent": true}')
#: The validated object: the default filled in.
OBJECT = {"label": "billing", "urgent": True, "scores": {}}
#: Valid JSON that fails the schema: `urgent` is missing, and a score under a key the model wrote
#: is not a number.
BAD = ('{"label": "billing", ', '"scores": {"secret-key-7": "the model\'s own words"}}')


class Recorder:
    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)


@dataclass
class Answer:
    """A structured stream read to its end, in either format: the JSON text relayed, and its
    last event's name (`done`/`error`) and data."""

    status: int
    text: str
    last: str
    data: dict[str, Any]
    body: str
    #: The UI message stream's `data-object` chunks (empty in guards' events).
    objects: list[Any]


Post = Callable[[str, str], Answer]


@pytest.fixture
def ledger() -> Recorder:
    return Recorder()


def both_wires(fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, ledger: Recorder) -> Guards:
    """Guards whose main binding is the Workers AI fake and whose `openai` provider the
    OpenAI-compatible one, recording every attempt in `ledger`."""
    return Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        ),
        providers={"openai": OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)},
        sleep=no_sleep,
        ledger=ledger,
    )


@pytest.fixture
def post(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, app_client: AppClient, ledger: Recorder
) -> Post:
    """`post(wire, format)`: one request to a structured streaming route whose model is on
    `wire`, answered in `format`, read to its end."""
    guards = both_wires(fake_workers_ai, fake_openai, ledger)
    app = FastAPI()
    guards.install(app)
    for wire, model in WIRES.items():
        for name, stream_format in (("guards", None), ("ui-message-stream", UI_MESSAGE_STREAM)):
            options: dict[str, Any] = {} if stream_format is None else {"stream_format": stream_format}

            async def triage(ai: AI[Triage]) -> EventStream:
                return await ai.stream({"prompt": "Triage this message."})

            app.post(f"/{wire}/{name}")(
                guards.route(
                    model=model,
                    timeout_s=5,
                    breaker=Breaker(failure_threshold=100),
                    stream_max_chars=MAX_CHARS,
                    **options,
                )(triage)
            )
    client = app_client(app, socket=True)

    def send(wire: str, stream_format: str) -> Answer:
        response = client.post(f"/{wire}/{stream_format}")
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return Answer(response.status_code, "", "", response.json(), response.text, [])
        if stream_format == "guards":
            events = parse_sse(response.text)
            text = "".join(data["text"] for name, data in events if name == "delta")
            last, data = events[-1]
            return Answer(response.status_code, text, last, data, response.text, [])
        chunks = check_ui_stream(response)
        text = "".join(c["delta"] for c in chunks if c["type"] == "text-delta")
        objects = [c["data"] for c in chunks if c["type"] == "data-object"]
        end = chunks[-1]
        if end["type"] == "finish":
            return Answer(
                response.status_code, text, "done", end["messageMetadata"]["guards"], response.text, objects
            )
        [metadata] = [c for c in chunks if c["type"] == "message-metadata"]
        return Answer(
            response.status_code, text, "error", metadata["messageMetadata"]["guards"], response.text, objects
        )

    return send


def script(
    wire: str, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, *outcomes: Any
) -> FakeWorkersAI | FakeOpenAI:
    """Script the model of `wire`; its server."""
    if wire == "workers-ai":
        fake_workers_ai.script(WORKERS, *outcomes)
        return fake_workers_ai
    fake_openai.script(OPENAI, *outcomes)
    return fake_openai


@pytest.mark.parametrize("stream_format", FORMATS)
@pytest.mark.parametrize("wire", WIRES)
def test_a_structured_stream_relays_its_json_and_ends_with_the_validated_object(
    wire: str, stream_format: str, post: Post, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    server = script(wire, fake_workers_ai, fake_openai, Stream(parts=tuple(map(Text, GOOD))))
    answer = post(wire, stream_format)
    assert answer.status == 200
    assert answer.text == "".join(GOOD)  # the JSON text, as it came
    assert answer.last == "done"
    # JSON mode, asked for as `run` asks for it.
    [call] = server.calls
    asked = call.inputs["response_format"]
    schema = asked["json_schema"] if wire == "workers-ai" else asked["json_schema"]["schema"]
    assert schema["properties"].keys() == {"label", "urgent", "scores"}
    if stream_format == "guards":
        assert answer.data["object"] == OBJECT
    else:  # the object in a data part; the metadata keeps the `done` fields
        assert answer.objects == [OBJECT]
        assert "object" not in answer.data
    assert answer.data["attempts"] == 1


@pytest.mark.parametrize("stream_format", FORMATS)
@pytest.mark.parametrize("wire", WIRES)
def test_a_structured_stream_that_fails_its_schema_ends_with_the_output_guards_error(
    wire: str,
    stream_format: str,
    post: Post,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    ledger: Recorder,
) -> None:
    server = script(wire, fake_workers_ai, fake_openai, Stream(parts=tuple(map(Text, BAD))))
    answer = post(wire, stream_format)
    assert answer.status == 200
    assert answer.text == "".join(BAD)  # relayed as it came: the check is at the end
    assert answer.last == "error"
    assert (answer.data["guard"], answer.data["reason"]) == ("output", "schema_invalid")
    detail = answer.data["detail"]
    # Nothing the model wrote is told: not its values, not its own keys.
    assert detail == "answer does not match the schema (scores.<key>:int_parsing, urgent:missing)"
    assert answer.objects == []
    assert len(server.calls) == 1  # committed: no other model, no second call
    # Counted as a rejected answer: the provider answered (no failure for its breaker).
    [attempt] = ledger.attempts
    assert attempt.outcome == "rejected"
    assert set(attempt.problems) == {"answer.urgent: missing", "answer.scores.<key>: int_parsing"}


@pytest.mark.parametrize("stream_format", FORMATS)
def test_a_structured_stream_that_is_not_json_ends_with_the_output_guards_error(
    stream_format: str, post: Post, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    script("workers-ai", fake_workers_ai, fake_openai, Stream(parts=(Text("Sure! "), Text("Here it is."))))
    answer = post("workers-ai", stream_format)
    assert answer.last == "error"
    assert (answer.data["guard"], answer.data["reason"]) == ("output", "schema_invalid")
    assert "Sure" not in answer.data["detail"]


@pytest.mark.parametrize("stream_format", FORMATS)
@pytest.mark.parametrize("wire", WIRES)
def test_the_size_limit_still_bounds_a_structured_stream(
    wire: str, stream_format: str, post: Post, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    pieces = ('{"label": "', *["x" * 50] * 10, '", "urgent": true}')
    script(wire, fake_workers_ai, fake_openai, Stream(parts=tuple(map(Text, pieces))))
    answer = post(wire, stream_format)
    assert len(answer.text) <= MAX_CHARS
    assert answer.last == "error"
    assert (answer.data["guard"], answer.data["reason"]) == ("call", "provider_error")
    assert answer.data["detail"] == f"the stream reached its size limit ({MAX_CHARS} characters)"


def test_an_empty_structured_stream_recovers_with_a_validated_object(
    post: Post, fake_workers_ai: FakeWorkersAI
) -> None:
    # The empty stream, then the one non-streaming recovery call: a JSON-mode object.
    fake_workers_ai.script(WORKERS, Stream(parts=()), Reply({"label": "billing", "urgent": True}))
    answer = post("workers-ai", "guards")
    assert answer.last == "done"
    assert json.loads(answer.text) == OBJECT
    assert answer.data["object"] == OBJECT
    assert all("response_format" in call.inputs for call in fake_workers_ai.calls)


def test_the_openapi_document_describes_the_structured_done(app_client: AppClient) -> None:
    guards = Guards(WorkersAI(account_id="a", api_token="t"))
    app = FastAPI()
    guards.install(app)

    @app.post("/triage")
    @guards.route(model=WORKERS)
    async def triage(ai: AI[Triage]) -> EventStream:
        return await ai.stream({"prompt": "Triage this message."})

    @app.post("/text")
    @guards.route(model=WORKERS)
    async def text(ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": "Hi."})

    schema = app_client(app).get("/openapi.json").json()

    def done(path: str) -> dict[str, Any]:
        events = schema["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        [found] = [e for e in events["oneOf"] if e["properties"]["event"] == {"const": "done"}]
        data: dict[str, Any] = found["properties"]["data"]["contentSchema"]
        return data

    structured = done("/triage")
    assert "object" in structured["required"]
    described = structured["properties"]["object"]
    if "$ref" in described:
        described = schema["components"]["schemas"][described["$ref"].rsplit("/", 1)[1]]
    assert described["properties"].keys() == {"label", "urgent", "scores"}
    assert "object" not in done("/text")["properties"]


def test_a_streaming_route_typed_with_text_that_is_not_str_is_refused_at_start_up() -> None:
    guards = Guards(WorkersAI(account_id="a", api_token="t"))
    with pytest.raises(ConfigurationError, match="must declare `AI\\[str\\]`, or a JSON output type"):

        @guards.route(model=WORKERS)
        async def label(ai: AI[Literal["billing", "other"]]) -> EventStream:
            return await ai.stream({"prompt": "Label this message."})


def test_a_rejected_structured_answer_is_no_failure_for_the_breaker(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    """The model answered: its breaker counts a success (one failure would open it here)."""
    guards = Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        ),
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/triage")
    @guards.route(model=WORKERS, breaker=Breaker(failure_threshold=1))
    async def triage(ai: AI[Triage]) -> EventStream:
        return await ai.stream({"prompt": "Triage this message."})

    fake_workers_ai.script(WORKERS, *[Stream(parts=tuple(map(Text, BAD)))] * 2)
    client = app_client(app, socket=True)
    for _ in range(2):
        response = client.post("/triage")
        assert response.status_code == 200
        name, data = parse_sse(response.text)[-1]
        assert (name, data["reason"]) == ("error", "schema_invalid")
    assert len(fake_workers_ai.calls) == 2


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(("Sure! Here is ", "the triage: ", "{}"), id="not-json-from-its-start"),
        pytest.param(BAD, id="complete-json-failing-its-schema"),
    ],
)
@pytest.mark.parametrize("stream_format", FORMATS)
def test_a_structured_answer_rejected_inside_the_hold_is_answered_by_the_next_model_unseen(
    first: tuple[str, ...],
    stream_format: str,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    app_client: AppClient,
    ledger: Recorder,
) -> None:
    """With a hold, a JSON route's held start that can no longer be JSON of its type, or a
    whole answer inside the hold that fails its schema, moves on to the next model before the
    commit: the client sees only the next model's answer."""
    guards = both_wires(fake_workers_ai, fake_openai, ledger)
    app = FastAPI()
    guards.install(app)
    options: dict[str, Any] = {} if stream_format == "guards" else {"stream_format": UI_MESSAGE_STREAM}

    @app.post("/triage")
    @guards.route(
        model=WORKERS,
        fallbacks=[f"openai:{OPENAI}"],
        timeout_s=5,
        stream_hold=StreamHold(chars=MAX_CHARS),
        stream_max_chars=MAX_CHARS,
        **options,
    )
    async def triage(ai: AI[Triage]) -> EventStream:
        return await ai.stream({"prompt": "Triage this message."})

    fake_workers_ai.script(WORKERS, Stream(parts=tuple(map(Text, first))))
    fake_openai.script(OPENAI, Stream(parts=tuple(map(Text, GOOD))))
    response = app_client(app, socket=True).post("/triage")
    assert response.status_code == 200
    if stream_format == "guards":
        events = parse_sse(response.text)
        text = "".join(data["text"] for name, data in events if name == "delta")
        last, data = events[-1]
        assert (last, data["object"]) == ("done", OBJECT)
    else:
        chunks = check_ui_stream(response)
        text = "".join(c["delta"] for c in chunks if c["type"] == "text-delta")
        assert [c["data"] for c in chunks if c["type"] == "data-object"] == [OBJECT]
    assert text == "".join(GOOD)  # none of the first model's text
    assert "Sure" not in response.text
    assert "secret-key-7" not in response.text
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (1, 1)
    rejected = ledger.attempts[0]
    assert (rejected.outcome, rejected.model) == ("rejected", WORKERS)
