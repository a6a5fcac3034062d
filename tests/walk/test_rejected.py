"""Rejected answers move on (`route(on_rejected=...)`) and tool calls are validated
(`route(tools=...)`), over real HTTP: the app served by uvicorn, its first model a fake
Workers AI server and its second a fake OpenAI server (each wire once), with call counts per
model, the attribution headers, the ledger, the request line, the deadline and the attempt
budget. The rejected text (a canary) never reaches a log line, a header or a reasked turn."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from fixtures import Fail, FakeOpenAI, FakeWorkersAI, Reply
from guards import AI, Attempt, Breaker, ConfigurationError, EventStream, Guards, ToolCall
from guards.providers import OpenAICompatible, WorkersAI

from ..conftest import AppClient, LogLines, assert_error, no_sleep

PRIMARY = "@cf/test/primary"
BACKUP = "gpt-test-backup"
SECOND = f"backup:{BACKUP}"
CANARY = "REJECTED-CANARY-5d1e"


class Label(BaseModel):
    label: str


class Ask(BaseModel):
    text: str


class GetWeather(BaseModel):
    """The weather now in a city."""

    city: str


class Recorder:
    """A ledger that keeps every record."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)


GOOD = Reply({"label": "shipping"})
#: Fails the schema (`label` must be a string); its value is the canary.
BAD = Reply({"label": [CANARY]})

Build = Callable[..., httpx.Client]


@pytest.fixture
def ledger() -> Recorder:
    return Recorder()


@pytest.fixture
def build(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, app_client: AppClient, ledger: Recorder
) -> Build:
    """`build(on_rejected=..., messages=False, degrading=False, **route_options)`: `POST /label`
    calls PRIMARY (Workers AI) then SECOND (OpenAI), with a `prompt` (or `messages`)."""

    def make(
        *, messages: bool = False, degrading: bool = False, attribution: Any = "detailed", **options: Any
    ) -> httpx.Client:
        guards = Guards(
            WorkersAI(
                account_id=fake_workers_ai.account_id,
                api_token=fake_workers_ai.api_token,
                base_url=fake_workers_ai.base_url,
            ),
            providers={
                "backup": OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)
            },
            sleep=no_sleep,
            ledger=ledger,
            attribution=attribution,
        )
        app = FastAPI()
        guards.install(app)
        extra: dict[str, Any] = {"fallback": Label(label="unknown")} if degrading else {}

        @app.post("/label")
        @guards.route(
            model=PRIMARY, fallbacks=[SECOND], breaker=Breaker(failure_threshold=1000), **extra, **options
        )
        async def label(body: Ask, ai: AI[Label]) -> Label:
            if messages:
                return await ai.run({"messages": [{"role": "user", "content": body.text}]})
            return await ai.run({"prompt": body.text})

        return app_client(app, socket=True)

    return make


def ask(client: httpx.Client) -> httpx.Response:
    return client.post("/label", json={"text": "where is my parcel"})


def outcomes(ledger: Recorder) -> list[tuple[int, str, str, tuple[str, ...]]]:
    return [(a.attempt, a.model, a.outcome, a.problems) for a in ledger.attempts]


def test_next_model_answers_a_schema_failing_first_model_from_the_second(
    build: Build,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    ledger: Recorder,
    guards_log: LogLines,
) -> None:
    fake_workers_ai.script(PRIMARY, BAD)
    fake_openai.script(BACKUP, GOOD)
    response = ask(build(on_rejected="next_model"))
    assert response.status_code == 200
    assert response.json() == {"label": "shipping"}
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (1, 1)
    assert response.headers["x-ai-model"] == BACKUP
    assert response.headers["x-ai-fallback"] == SECOND
    assert response.headers["x-ai-rejected"] == PRIMARY
    assert outcomes(ledger) == [
        (1, PRIMARY, "rejected", ("answer.label: string_type",)),
        (2, SECOND, "ok", ()),
    ]
    assert ledger.attempts[0].usage is not None  # a rejected answer was billed all the same
    (line,) = guards_log.events("request")
    assert line["outcome"] == "ok"
    assert line["attempts"] == 2
    assert line["rejected"] == [{"model": PRIMARY, "problems": ["answer.label: string_type"]}]


def test_an_answer_that_came_on_a_retry_is_checked_in_the_walk_and_moves_on(
    build: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, ledger: Recorder
) -> None:
    """The first call fails transiently, its retry answers a schema-failing answer: that answer
    is judged in the walk like a first call's, and the next model answers."""
    fake_workers_ai.script(PRIMARY, Fail(code=3040, status=429), BAD)
    fake_openai.script(BACKUP, GOOD)
    response = ask(build(on_rejected="next_model"))
    assert response.status_code == 200
    assert response.json() == {"label": "shipping"}
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (2, 1)
    assert response.headers["x-ai-rejected"] == PRIMARY
    assert [(a.model, a.outcome) for a in ledger.attempts] == [
        (PRIMARY, "model_temporarily_unavailable"),
        (PRIMARY, "rejected"),
        (SECOND, "ok"),
    ]
    assert [a.attempt for a in ledger.attempts] == [1, 2, 3]


@pytest.mark.parametrize(("attribution", "header"), [("redacted", "2"), ("off", None)])
def test_x_ai_rejected_follows_the_attribution_mode(
    build: Build,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    attribution: str,
    header: str | None,
) -> None:
    fake_workers_ai.script(PRIMARY, BAD, BAD)
    fake_openai.script(BACKUP, GOOD)
    response = ask(build(on_rejected="reask", attribution=attribution))
    assert response.json() == {"label": "shipping"}
    assert response.headers.get("x-ai-rejected") == header
    assert PRIMARY not in str(response.headers)


@pytest.mark.parametrize("on_rejected", [None, "fallback"])
def test_by_default_a_rejected_answer_ends_the_request(
    build: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, ledger: Recorder, on_rejected: Any
) -> None:
    fake_workers_ai.script(PRIMARY, BAD)
    options = {} if on_rejected is None else {"on_rejected": on_rejected}
    response = ask(build(**options))
    assert_error(response, 502, "incompatible_model_response", False)
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (1, 0)
    assert "x-ai-rejected" not in response.headers
    # As before: the call answered ("ok"); the output guard's verdict is the request's.
    assert outcomes(ledger) == [(1, PRIMARY, "ok", ())]


@pytest.mark.parametrize(
    ("first", "problem"),
    [
        (Reply("   "), "answer: empty_response"),
        (Reply("not json at all"), "answer: json_invalid"),
        (Reply({"label": "mail me at a@example.com"}), "answer: moderation_blocked"),
    ],
    ids=["empty", "not-json", "moderation"],
)
def test_next_model_moves_on_from_every_rejection(
    build: Build,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    ledger: Recorder,
    first: Reply,
    problem: str,
) -> None:
    fake_workers_ai.script(PRIMARY, first)
    fake_openai.script(BACKUP, GOOD)
    client = build(on_rejected="next_model", moderation=lambda label: "@" in label.label)
    response = ask(client)
    assert response.json() == {"label": "shipping"}
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (1, 1)
    assert outcomes(ledger)[0] == (1, PRIMARY, "rejected", (problem,))


def test_when_every_answer_is_rejected_the_route_ends_as_for_one(
    build: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    fake_workers_ai.script(PRIMARY, BAD)
    fake_openai.script(BACKUP, Reply({"colour": "red"}))
    client = build(on_rejected="next_model", degrading=True)
    response = ask(client)
    body = response.json()
    assert body["data"] == {"label": "unknown"}
    assert (body["fallback"]["guard"], body["fallback"]["reason"]) == ("output", "schema_invalid")
    # The envelope's detail names each rejection, by model, with its problems.
    assert body["fallback"]["detail"] == (
        f"every model failed: {PRIMARY}: rejected (answer.label: string_type); "
        f"{SECOND}: rejected (answer.label: missing)"
    )
    assert response.headers["x-ai-rejected"] == f"{PRIMARY},{SECOND}"
    assert response.headers["x-ai-model"] == BACKUP  # the last model that answered
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (1, 1)


def last_user_turn(inputs: Any) -> str:
    """What the last user turn of a request body says (a Workers AI `prompt` or `messages`)."""
    if "prompt" in inputs:
        return str(inputs["prompt"])
    return str([m for m in inputs["messages"] if m["role"] == "user"][-1]["content"])


@pytest.mark.parametrize("messages", [False, True], ids=["prompt", "messages"])
def test_reask_asks_the_same_model_again_with_the_problems_only(
    build: Build,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    ledger: Recorder,
    guards_log: LogLines,
    messages: bool,
) -> None:
    fake_workers_ai.script(PRIMARY, BAD, GOOD)
    response = ask(build(on_rejected="reask", messages=messages))
    assert response.json() == {"label": "shipping"}
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (2, 0)
    assert response.headers["x-ai-model"] == PRIMARY
    assert "x-ai-fallback" not in response.headers
    assert response.headers["x-ai-rejected"] == PRIMARY
    first, second = (call.inputs for call in fake_workers_ai.calls)
    if messages:
        # One user message more, after the conversation as it was; nothing else changed.
        assert second["messages"][:-1] == first["messages"]
        assert second["messages"][-1]["role"] == "user"
        turn = second["messages"][-1]["content"]
    else:
        # A paragraph after the prompt (the request keeps Workers AI's `prompt` shape).
        assert second["prompt"].startswith(first["prompt"] + "\n\n")
        turn = second["prompt"][len(first["prompt"]) + 2 :]
    assert (
        turn
        == "Your previous answer was rejected: answer.label: string_type. Answer again, and fix these problems."
    )
    assert {k: v for k, v in second.items() if k not in ("messages", "prompt")} == {
        k: v for k, v in first.items() if k not in ("messages", "prompt")
    }
    assert outcomes(ledger) == [
        (1, PRIMARY, "rejected", ("answer.label: string_type",)),
        (2, PRIMARY, "ok", ()),
    ]
    # The privacy canary: the rejected text is nowhere but in the fake's own record of it.
    assert CANARY not in json.dumps(second)
    assert CANARY not in str(response.headers)
    assert CANARY not in "\n".join(guards_log.lines)


def test_reask_then_next_model(
    build: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, ledger: Recorder
) -> None:
    fake_workers_ai.script(PRIMARY, BAD, Reply("   "))
    fake_openai.script(BACKUP, GOOD)
    response = ask(build(on_rejected="reask"))
    assert response.json() == {"label": "shipping"}
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (2, 1)
    assert response.headers["x-ai-rejected"] == f"{PRIMARY},{PRIMARY}"
    assert response.headers["x-ai-fallback"] == SECOND
    # The next model is asked the original question: the reask's turn was its model's alone.
    assert last_user_turn(fake_openai.calls[0].inputs) == "where is my parcel"
    assert [(a.model, a.outcome) for a in ledger.attempts] == [
        (PRIMARY, "rejected"),
        (PRIMARY, "rejected"),
        (SECOND, "ok"),
    ]


def test_the_attempt_budget_bounds_the_reasks_and_the_chain(
    build: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, guards_log: LogLines
) -> None:
    fake_workers_ai.script(PRIMARY, BAD, BAD)
    fake_openai.script(BACKUP, GOOD)
    response = ask(build(on_rejected="reask", attempts=2))
    assert_error(response, 502, "incompatible_model_response", False)
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (2, 0)
    (line,) = guards_log.events("request")
    assert (line["attempts"], line["attempt_budget"]) == (2, 2)
    assert [r["model"] for r in line["rejected"]] == [PRIMARY, PRIMARY]


def test_one_deadline_bounds_every_model_and_reask(
    build: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    """Each answer alone comes well within the deadline; the two together do not."""
    fake_workers_ai.script(PRIMARY, Reply({"label": [CANARY]}, delay_s=0.6))
    fake_openai.script(BACKUP, Reply({"label": "shipping"}, delay_s=0.6))
    client = build(on_rejected="next_model", timeout_s=1.0, first_output_s=None)  # the deadline alone
    began = time.monotonic()
    response = ask(client)
    elapsed = time.monotonic() - began
    assert_error(response, 503, "model_temporarily_unavailable", True)
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (1, 1)
    assert 1.0 <= elapsed < 2.0


# --- tools ---------------------------------------------------------------------------------------


@pytest.fixture
def build_tools(
    fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, app_client: AppClient, ledger: Recorder
) -> Build:
    """`POST /weather` with the `get_weather` tool: answers the validated calls' cities, or the
    text when the model called no tool."""

    def make(**options: Any) -> httpx.Client:
        guards = Guards(
            WorkersAI(
                account_id=fake_workers_ai.account_id,
                api_token=fake_workers_ai.api_token,
                base_url=fake_workers_ai.base_url,
            ),
            providers={
                "backup": OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)
            },
            sleep=no_sleep,
            ledger=ledger,
        )
        app = FastAPI()
        guards.install(app)

        @app.post("/weather")
        @guards.route(model=PRIMARY, fallbacks=[SECOND], tools={"get_weather": GetWeather}, **options)
        async def weather(body: Ask, ai: AI[str]) -> dict[str, Any]:
            text = await ai.run({"messages": [{"role": "user", "content": body.text}]})
            cities = []
            for call in ai.tool_calls:
                match call:
                    case ToolCall(name="get_weather", arguments=GetWeather(city=city)):
                        cities.append(city)
            return {"text": text, "cities": cities, "ids": [call.id for call in ai.tool_calls]}

        return app_client(app, socket=True)

    return make


def weather(client: httpx.Client) -> httpx.Response:
    return client.post("/weather", json={"text": "weather in Paris?"})


def tool_call(arguments: Any, name: str = "get_weather") -> Reply:
    return Reply(None, tool_calls=({"name": name, "arguments": arguments},), finish_reason="tool_calls")


SENT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city.",
            "parameters": GetWeather.model_json_schema(),
        },
    }
]


@pytest.mark.parametrize("wire", ["workers-ai", "openai"])
def test_a_valid_tool_call_reaches_the_handler_typed(
    build_tools: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, wire: str
) -> None:
    if wire == "workers-ai":
        fake_workers_ai.script(PRIMARY, tool_call({"city": "Paris"}))
    else:  # the first model down: the second (OpenAI's wire, arguments as JSON text) answers
        fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
        fake_openai.script(BACKUP, tool_call('{"city": "Paris"}'))
    response = weather(build_tools())
    assert response.status_code == 200
    assert response.json() == {
        "text": "",
        "cities": ["Paris"],
        "ids": [None if wire == "workers-ai" else "call_0"],
    }
    # The tools' definitions went with the call, on each wire.
    server = fake_workers_ai if wire == "workers-ai" else fake_openai
    assert server.calls[-1].inputs["tools"] == SENT_TOOLS


@pytest.mark.parametrize(
    ("answer", "problems"),
    [
        (tool_call({"town": CANARY}), ("tool[get_weather].city: missing",)),
        (tool_call('{"city": '), ("tool[get_weather]: json_invalid",)),
        (tool_call({"city": "Paris"}, name=f"delete_{CANARY}"), ("tool_calls[0]: unknown_tool",)),
        (tool_call([CANARY]), ("tool[get_weather]: model_type",)),
        (tool_call({"city": f"\ud800{CANARY}"}), ("tool[get_weather]: invalid_unicode",)),
        (
            Reply(f"\ud800{CANARY}", tool_calls=({"name": "get_weather", "arguments": {"city": "Paris"}},)),
            ("answer: invalid_unicode",),
        ),
    ],
    ids=[
        "missing-field",
        "not-json",
        "unknown-tool",
        "not-an-object",
        "lone-surrogate",
        "lone-surrogate-text",
    ],
)
def test_a_tool_call_that_does_not_validate_is_a_rejected_answer(
    build_tools: Build,
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    ledger: Recorder,
    guards_log: LogLines,
    answer: Reply,
    problems: tuple[str, ...],
) -> None:
    fake_workers_ai.script(PRIMARY, answer)
    fake_openai.script(BACKUP, tool_call('{"city": "Lyon"}'))
    response = weather(build_tools(on_rejected="next_model"))
    assert response.json()["cities"] == ["Lyon"]
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (1, 1)
    assert outcomes(ledger) == [(1, PRIMARY, "rejected", problems), (2, SECOND, "ok", ())]
    assert response.headers["x-ai-rejected"] == PRIMARY
    assert CANARY not in str(response.headers)
    assert CANARY not in "\n".join(guards_log.lines)


@pytest.mark.parametrize("wire", ["workers-ai", "openai"])
def test_without_on_rejected_a_bad_tool_call_ends_the_request(
    build_tools: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI, wire: str
) -> None:
    if wire == "workers-ai":
        fake_workers_ai.script(PRIMARY, tool_call({"town": "Paris"}))
    else:  # the first model down: the second's arguments (JSON text) name no city
        fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
        fake_openai.script(BACKUP, tool_call('{"town": "Paris"}'))
    response = weather(build_tools())
    assert_error(response, 502, "incompatible_model_response", False)
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (
        (1, 0) if wire == "workers-ai" else (1, 1)
    )


def test_a_tool_route_still_answers_text(build_tools: Build, fake_workers_ai: FakeWorkersAI) -> None:
    fake_workers_ai.script(PRIMARY, Reply("It is sunny."))
    response = weather(build_tools())
    assert response.json() == {"text": "It is sunny.", "cities": [], "ids": []}


def test_reask_of_a_bad_tool_call_names_its_problems(
    build_tools: Build, fake_workers_ai: FakeWorkersAI, fake_openai: FakeOpenAI
) -> None:
    fake_workers_ai.script(PRIMARY, tool_call({"town": CANARY}), tool_call({"city": "Paris"}))
    response = weather(build_tools(on_rejected="reask"))
    assert response.json()["cities"] == ["Paris"]
    assert (len(fake_workers_ai.calls), len(fake_openai.calls)) == (2, 0)
    turn = fake_workers_ai.calls[1].inputs["messages"][-1]
    assert turn == {
        "role": "user",
        "content": "Your previous answer was rejected: tool[get_weather].city: missing. "
        "Answer again, and fix these problems.",
    }


# --- declared wrong ------------------------------------------------------------------------------


def declare(**options: Any) -> None:
    guards = Guards(WorkersAI(account_id="a", api_token="t"))

    @guards.route(model=PRIMARY, **options)
    async def x(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hi"})


def declare_json(**options: Any) -> None:
    guards = Guards(WorkersAI(account_id="a", api_token="t"))

    @guards.route(model=PRIMARY, **options)
    async def x(ai: AI[Label]) -> Label:
        return await ai.run({"prompt": "hi"})


def declare_stream(**options: Any) -> None:
    guards = Guards(WorkersAI(account_id="a", api_token="t"))

    @guards.route(model=PRIMARY, **options)
    async def x(ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": "hi"})


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (
            lambda: declare(on_rejected="retry"),
            "on_rejected must be one of 'fallback', 'next_model', 'reask'",
        ),
        (lambda: declare(tools={}), "tools must be a non-empty mapping"),
        (lambda: declare(tools={"get weather": GetWeather}), "tool name 'get weather'"),
        (lambda: declare(tools={"get_weather": dict}), "tool 'get_weather' must map to a pydantic model"),
        (lambda: declare_json(tools={"get_weather": GetWeather}), "declare `ai: AI[str]`"),
        (lambda: declare_stream(on_rejected="next_model"), "cannot declare on_rejected or tools"),
        (lambda: declare_stream(tools={"get_weather": GetWeather}), "cannot declare on_rejected or tools"),
    ],
    ids=["unknown-policy", "no-tools", "bad-name", "not-a-model", "json-output", "stream", "stream-tools"],
)
def test_declared_wrong_fails_at_start_up(declared: Callable[[], None], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace("[", r"\[")):
        declared()


class ClosedLabel(BaseModel):
    """A label that allows no other key, with scores by name and a kind of three."""

    model_config = ConfigDict(extra="forbid")

    label: str
    scores: dict[str, int] = {}
    kind: Literal["parcel", "refund", "other"] = "other"


#: A key the model wrote: terminal escapes, a line break, a NUL, and the canary.
KEY = f"\x1b[31m\r\n\x00{CANARY}"


@pytest.mark.parametrize("degrading", [False, True], ids=["strict", "degrading"])
def test_a_key_the_model_wrote_is_never_told_by_name(
    fake_workers_ai: FakeWorkersAI,
    app_client: AppClient,
    ledger: Recorder,
    guards_log: LogLines,
    degrading: bool,
) -> None:
    """A key of a `dict` field, or one the schema does not declare, is the model's text: the
    problems, the reasked turn, the response (a 502's body, a fallback's detail), the ledger and
    the log lines say `<key>`, never the key; a `Literal`'s input is not told either."""
    guards = Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        ),
        sleep=no_sleep,
        ledger=ledger,
    )
    app = FastAPI()
    guards.install(app)
    extra: dict[str, Any] = {"fallback": ClosedLabel(label="unknown")} if degrading else {}

    @app.post("/label")
    @guards.route(model=PRIMARY, on_rejected="reask", breaker=None, **extra)
    async def label(body: Ask, ai: AI[ClosedLabel]) -> ClosedLabel:
        return await ai.run({"prompt": body.text})

    answer = {"label": "shipping", "scores": {KEY: "high"}, "kind": KEY, KEY: 1}
    fake_workers_ai.script(PRIMARY, *[Reply(answer)] * 2)
    response = ask(app_client(app, socket=True))
    problems = (
        "answer.scores.<key>: int_parsing",
        "answer.kind: literal_error",
        "answer.<key>: extra_forbidden",
    )
    if degrading:
        assert response.json()["fallback"]["reason"] == "schema_invalid"
        assert "scores.<key>:int_parsing" in response.json()["fallback"]["detail"]
    else:
        assert_error(response, 502, "incompatible_model_response", False)
    assert len(fake_workers_ai.calls) == 2
    assert (
        fake_workers_ai.calls[1]
        .inputs["prompt"]
        .endswith(
            f"Your previous answer was rejected: {'; '.join(problems)}. Answer again, and fix these problems."
        )
    )
    assert [a.problems for a in ledger.attempts] == [problems] * 2
    assert CANARY not in json.dumps(fake_workers_ai.calls[1].inputs)
    assert CANARY not in response.text + str(response.headers)
    assert CANARY not in "\n".join(guards_log.lines)
    assert all(KEY not in a.problems for a in ledger.attempts)


@pytest.mark.parametrize(
    ("wire", "answer", "output"),
    [
        ("workers-ai", "\ud800 Your parcel is on its way.", str),
        ("openai", "Your parcel \udfff is on its way.", str),
        ("workers-ai", {"label": "ship\udc00ping"}, Label),
        ("workers-ai", {"label": "shipping", "\ud800": 1}, Label),
    ],
    ids=["text-workers-ai", "text-openai", "nested-string", "ignored-key"],
)
def test_a_lone_surrogate_is_a_rejected_answer_never_a_500(
    fake_workers_ai: FakeWorkersAI,
    fake_openai: FakeOpenAI,
    app_client: AppClient,
    ledger: Recorder,
    guards_log: LogLines,
    wire: str,
    answer: Any,
    output: Any,
) -> None:
    """A `\\ud800` escape is valid JSON, but no response can carry it: an answer holding one
    (text, a string in an object, a key) is rejected (`schema_invalid`, `invalid_unicode`)
    before the request is logged; the next model answers."""
    guards = Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        ),
        providers={"backup": OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)},
        sleep=no_sleep,
        ledger=ledger,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/text")
    @guards.route(model=PRIMARY, fallbacks=[SECOND], breaker=None)
    async def text(body: Ask, ai: AI[str]) -> dict[str, str]:
        return {"reply": await ai.run({"prompt": body.text})}

    @app.post("/label")
    @guards.route(model=PRIMARY, fallbacks=[SECOND], on_rejected="next_model", breaker=None)
    async def label(body: Ask, ai: AI[Label]) -> Label:
        return await ai.run({"prompt": body.text})

    client = app_client(app, socket=True)
    if output is str:
        if wire == "workers-ai":
            fake_workers_ai.script(PRIMARY, Reply(answer))
        else:  # the first model down: the second (OpenAI's wire) answers
            fake_workers_ai.script(PRIMARY, Fail(code=5035, status=403))
            fake_openai.script(BACKUP, Reply(answer))
        response = client.post("/text", json={"text": "where is my parcel"})
        assert_error(response, 502, "incompatible_model_response", False)
        (line,) = guards_log.events("request")
        assert (line["outcome"], line["reason"]) == ("error", "schema_invalid")
    else:
        fake_workers_ai.script(PRIMARY, Reply(answer))
        fake_openai.script(BACKUP, GOOD)
        response = ask(client)
        assert response.json() == {"label": "shipping"}
        assert outcomes(ledger) == [
            (1, PRIMARY, "rejected", ("answer: invalid_unicode",)),
            (2, SECOND, "ok", ()),
        ]
