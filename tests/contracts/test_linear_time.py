"""Hostile text in linear time: every parser and check that sees a provider's or a client's
text is fed the worst input we know for it, at the largest size that can reach it (1 MiB: the
body cap of an answer, of an event, and of a request), and must get through it in well under a
second of CPU.

The bound is generous on purpose (the target for checking an answer is 50 ms, `make bench`
prints the figure): these are not timing tests but complexity tests. A super-linear version
fails them by orders of magnitude (the code-fence regex these tests replaced took 77 s for
4,000 newlines, and would take days for a million), a linear one passes on a loaded machine.
Time is the thread's own CPU time, so other tenants of the machine do not count.

The audit, and why each place is here, is in the test names; places that need no test (our own
configuration, bounded inputs) are listed in the README's section on hostile input.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pydantic
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from app.labels import keyword_label, mentions_personal_data
from app.service import DraftRequest, SummaryRequest, create_app
from app.settings import Settings
from fixtures import FakeOpenAI, FakeWorkersAI, Raw, Reply
from guards import AI, AIResult, Guards, ProviderError
from guards.providers import OpenAICompatible, SSEParser, WorkersAI, parse_workers_ai_response

from ..conftest import AppClient, asgi_client, workers_ai_settings

MIB = 1 << 20
#: CPU seconds allowed for 1 MiB. Linear code takes milliseconds to tens of them.
BOUND_S = 1.0
MODEL = "@cf/test/model"


def cpu_seconds(work: Callable[[], Any]) -> float:
    # The objects earlier tests left are frozen out of the collector's passes while the work
    # runs: its own garbage is still collected, but a pass no longer walks the whole suite's
    # heap (which made a 95,000-event stream take a second late in a full run).
    gc.collect()
    gc.freeze()
    try:
        start = time.thread_time()
        work()
        return time.thread_time() - start
    finally:
        gc.unfreeze()


def assert_linear(work: Callable[[], Any]) -> None:
    spent = cpu_seconds(work)
    assert spent < BOUND_S, f"{spent:.2f} s of CPU for 1 MiB"


# --- the output guard: a model's answer -------------------------------------------------------


class Label(BaseModel):
    label: str
    confidence: float


#: Answers a model could send, each about 1 MiB, that are hard for a fence or JSON parser.
ANSWERS = {
    "fence-then-newlines": "```\n" + "\n" * (MIB - 4),
    "fence-tag-then-spaces": "```json" + " " * (MIB - 9) + "\nx",
    "fence-without-newline": "```" + "a" * (MIB - 3),
    "fence-then-backticks": "```\n" + "`" * (MIB - 4),
    "many-fences": "```\n" * (MIB // 4),
    "spaces-then-fence": " " * (MIB - 3) + "```",
    "newlines": "\n" * MIB,
    "deep-nesting": "[" * MIB,
    "deep-objects": '{"a":' * (MIB // 5),
    "huge-string": '{"label": "' + "a" * (MIB - 30) + '", "confidence": 0.5}',
    "many-keys": "{" + ",".join(f'"k{i}":1' for i in range(MIB // 10)) + "}",
    "escapes": '{"label": "' + "\\u00e9" * (MIB // 6 - 10) + '", "confidence": 0.5}',
}


class ReadyBinding:
    """Answers every call with one ready text: only guards' own work is timed."""

    def __init__(self) -> None:
        self.answer = ""

    async def run(self, model: str, inputs: Any) -> AIResult:
        return AIResult(self.answer, model=model)

    async def aclose(self) -> None:
        return None


@pytest.fixture
def answered() -> Callable[[str, str], httpx.Response]:
    """`answered(path, answer)`: one request to a guarded JSON-mode route (`/label`) or text
    route (`/text`) whose model answers `answer`, in process through ASGI."""
    binding = ReadyBinding()
    guards = Guards(binding)
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, fallback=Label(label="fallback", confidence=0.0))
    async def label(ai: AI[Label]) -> Label:
        return await ai.run({"prompt": "label"})

    @app.post("/text")
    @guards.route(model=MODEL)
    async def text(ai: AI[str]) -> str:
        return await ai.run({"prompt": "write"})

    async def call(path: str) -> httpx.Response:
        async with asgi_client(app) as client:
            return await client.post(path)

    def answer(path: str, text: str) -> httpx.Response:
        binding.answer = text
        return asyncio.run(call(path))

    answer("/label", "warm-up")
    return answer


@pytest.mark.parametrize("answer", ANSWERS.values(), ids=ANSWERS.keys())
def test_output_guard_checks_a_json_mode_answer_in_linear_time(
    answered: Callable[[str, str], httpx.Response], answer: str
) -> None:
    responses: list[httpx.Response] = []
    assert_linear(lambda: responses.append(answered("/label", answer)))
    assert responses[0].status_code == 200
    if answer.startswith('{"label"'):
        assert responses[0].json()["fallback"] is None
    else:
        assert responses[0].json()["fallback"]["reason"] in ("schema_invalid", "empty_response")


@pytest.mark.parametrize("answer", ANSWERS.values(), ids=ANSWERS.keys())
def test_output_guard_checks_a_text_answer_in_linear_time(
    answered: Callable[[str, str], httpx.Response], answer: str
) -> None:
    responses: list[httpx.Response] = []
    assert_linear(lambda: responses.append(answered("/text", answer)))
    assert responses[0].status_code in (200, 502)


class Batch(BaseModel):
    """A model whose collections are declared to fail fast: pydantic-core checks a model with
    the model's own compiled validator, so this is how a model's fields get the guarantee."""

    labels: list[Label] = Field(fail_fast=True)
    tags: dict[str, int] = Field(default_factory=dict, fail_fast=True)


#: Output types whose answer can hold an error per item, each with a valid answer (and the
#: value it validates to) and 1 MiB of invalid items, and the one error the check stops at.
ERROR_PER_ITEM: dict[str, tuple[Any, str, Any, str, str]] = {
    "list-of-models": (
        list[Label],
        '[{"label": "a", "confidence": 1}]',
        [{"label": "a", "confidence": 1.0}],
        "[" + "1," * (MIB // 2 - 1) + "1]",
        "0:model_type",
    ),
    "list-of-ints": (list[int], "[1, 2]", [1, 2], "[" + '"a",' * (MIB // 4 - 1) + '"a"]', "0:int_parsing"),
    "set": (set[int], "[1, 2]", [1, 2], "[" + '"a",' * (MIB // 4 - 1) + '"a"]', "0:int_parsing"),
    "tuple": (tuple[int, ...], "[1, 2]", [1, 2], "[" + '"a",' * (MIB // 4 - 1) + '"a"]', "0:int_parsing"),
    "nested-lists": (
        list[list[int]],
        "[[1], [2]]",
        [[1], [2]],
        "[" + '["a"],' * (MIB // 6 - 1) + '["a"]]',
        "0.0:int_parsing",
    ),
    "dict": (
        dict[str, int],
        '{"a": 1}',
        {"a": 1},
        "{" + ",".join(f'"k{i}":"x"' for i in range(MIB // 10)) + "}",
        "<key>:int_parsing",  # the key is the model's text
    ),
    "union-items": (
        list[Label | int],
        '[1, {"label": "a", "confidence": 1}]',
        [1, {"label": "a", "confidence": 1.0}],
        "[" + '"a",' * (MIB // 4 - 1) + '"a"]',
        "0.Label:model_type, 0.int:int_parsing",
    ),
    "model-fields": (
        Batch,
        '{"labels": [], "tags": {"a": 1}}',
        {"labels": [], "tags": {"a": 1}},
        '{"labels": [' + "1," * (MIB // 2 - 10) + "1]}",
        "labels.0:model_type",
    ),
}


@pytest.mark.parametrize("case", ERROR_PER_ITEM.values(), ids=ERROR_PER_ITEM.keys())
def test_an_answer_with_an_error_per_item_stops_at_the_first(case: tuple[Any, str, Any, str, str]) -> None:
    """1 MiB of invalid items: pydantic-core would report an error for each (half a million,
    180 to 280 ms of a worker's CPU) where the first already decides `schema_invalid`. The
    output guard's collections fail fast: the detail names the one error the check stopped at.
    A valid answer of the same type validates as before."""
    output, valid, value, invalid, first_error = case
    binding = ReadyBinding()
    guards = Guards(binding)
    app = FastAPI()
    guards.install(app)

    async def items(ai: AI[Any]) -> Any:
        return await ai.run({"prompt": "items"})

    items.__annotations__.update({"ai": AI[output], "return": output | None})  # the case's type
    app.post("/items")(guards.route(model=MODEL, fallback=None)(items))

    async def call() -> httpx.Response:
        async with asgi_client(app) as client:
            return await client.post("/items")

    binding.answer = valid
    body = asyncio.run(call()).json()
    assert (body["fallback"], body["data"]) == (None, value)
    binding.answer = invalid
    responses: list[httpx.Response] = []
    assert_linear(lambda: responses.append(asyncio.run(call())))
    fallback = responses[0].json()["fallback"]
    assert (fallback["reason"], fallback["detail"]) == (
        "schema_invalid",
        f"answer does not match the schema ({first_error})",
    )


def nested(depth: int, inside: Any) -> Any:
    for _ in range(depth):
        inside = [inside]
    return inside


#: Valid answers of about 1 MiB, each with one lone surrogate at the very end: the serializer's
#: pass (`list[str]`), and the walk past its depth limit (`Any`, 300 lists deep).
LONE_SURROGATE_LAST = {
    "serialized": (list[str], ["é"] * (MIB // 4) + ["\ud800"]),
    "walked-past-the-depth-limit": (Any, nested(300, ["é"] * (MIB // 4) + ["\ud800"])),
}


@pytest.mark.parametrize("case", LONE_SURROGATE_LAST.values(), ids=LONE_SURROGATE_LAST.keys())
def test_a_lone_surrogate_is_found_in_linear_time(case: tuple[Any, Any]) -> None:
    """The check of a valid answer for lone surrogates (a quarter of a million strings, the
    last holding one) finds it within the bound, whichever way it goes."""
    output, answer = case
    binding = ReadyBinding()
    binding.answer = answer
    guards = Guards(binding)
    app = FastAPI()
    guards.install(app)

    async def items(ai: AI[Any]) -> Any:
        return await ai.run({"prompt": "items"})

    items.__annotations__.update({"ai": AI[output], "return": output | None})  # the case's type
    app.post("/items")(guards.route(model=MODEL, fallback=None)(items))

    async def call() -> httpx.Response:
        async with asgi_client(app) as client:
            return await client.post("/items")

    responses: list[httpx.Response] = []
    assert_linear(lambda: responses.append(asyncio.run(call())))
    fallback = responses[0].json()["fallback"]
    assert (fallback["reason"], fallback["detail"]) == (
        "schema_invalid",
        "answer does not match the schema (invalid_unicode)",
    )


# --- the example app: its moderation, its fallback, its input patterns ------------------------

#: Texts that are worst cases for the e-mail and phone patterns of `/summary`'s moderation.
PERSONAL_DATA_PROBES = {
    "word-run": ("a" * MIB, False),
    "at-signs": ("a@" * (MIB // 2), False),
    "dotted-run": ("a." * (MIB // 2) + "@", False),
    "digits-then-spaces": ("12345678" + " " * (MIB - 8), False),
    "digit-then-parens": ("1" + "(" * (MIB - 1), False),
    "short-digit-runs": ("1234567x" * (MIB // 8), False),
    "spaced-digits": ("1 " * (MIB // 2), True),
    "email-at-the-end": ("a" * (MIB - 20) + " a.b+c@example.com", True),
}


@pytest.mark.parametrize(("text", "found"), PERSONAL_DATA_PROBES.values(), ids=PERSONAL_DATA_PROBES.keys())
def test_personal_data_moderation_is_linear(text: str, found: bool) -> None:
    results: list[bool] = []
    assert_linear(lambda: results.append(mentions_personal_data(text)))
    assert results == [found]


@pytest.mark.parametrize(
    "text",
    ["refund " * (MIB // 7), "a" * MIB, "a1 " * (MIB // 3)],
    ids=["keywords", "one-word", "short-words"],
)
def test_keyword_label_is_linear(text: str) -> None:
    assert_linear(lambda: keyword_label(text))


#: Client messages (JSON strings inside a 1 MiB body) that are hard for the `python-re`
#: patterns pydantic runs on `/draft-reply` and `/summary` bodies.
MESSAGES = {
    "spaces": " " * MIB,
    "word-then-spaces-then-word": "x" + " " * (MIB - 2) + "y",
    "words-then-spaces": "y" * 497 + " " * (MIB - 498) + "z",
    "no-spaces": "x" * MIB,
    "alternating": "x " * (MIB // 2),
    "unicode-spaces": "\u3000" * (MIB // 3),
}


@pytest.mark.parametrize("message", MESSAGES.values(), ids=MESSAGES.keys())
def test_input_patterns_are_linear(message: str) -> None:
    def validate() -> None:
        for model, field in ((DraftRequest, "message"), (SummaryRequest, "text")):
            with contextlib.suppress(ValueError):
                model.model_validate({field: message})

    assert_linear(validate)


def test_app_rejects_a_pathological_body_at_once(app_client: AppClient) -> None:
    """Through the app (in process): 1 MiB of whitespace, and a 1 MiB message between two words."""
    client = app_client(create_app(Settings(ai_provider="fake")))
    for message in (" " * (MIB - 20), "x" + " " * (MIB - 30) + "y"):
        started = time.monotonic()
        response = client.post("/draft-reply", json={"message": message})
        assert response.status_code == 400
        assert time.monotonic() - started < 5 * BOUND_S


def test_trace_ids_and_header_keys_are_linear() -> None:
    """A 1 MiB `x-trace-id` (not kept: a new one is made) and `x-user-id` (the budget key)."""
    app = create_app(Settings(ai_provider="fake"))
    headers = {"x-trace-id": "a" * MIB, "x-user-id": "b" * MIB}

    async def call() -> httpx.Response:
        async with asgi_client(app) as client:
            return await client.post("/summary", json={"text": "refund please"}, headers=headers)

    responses: list[httpx.Response] = []
    assert_linear(lambda: responses.append(asyncio.run(call())))
    assert len(responses[0].headers["x-trace-id"]) == 32


# --- the SSE parser: a provider's stream ------------------------------------------------------


def feed_in_pieces(body: bytes, size: int) -> list[Any]:
    parser = SSEParser()
    events: list[Any] = []
    for start in range(0, len(body), size):
        events += parser.feed(body[start : start + size])
    return events


#: Bodies of about 1 MiB, and the piece size they arrive in.
SSE_BODIES = {
    "one-line-trickled": (b"data: " + b"x" * (MIB - 8), 16),
    "one-line-trickled-cr": (b"data: " + b"x" * (MIB - 8) + b"\r", 13),
    "cr-lines": (b"data: a\r" * (MIB // 8) + b"\r", 33),
    "blank-lines": (b"\n" * MIB, MIB),
    "comments": (b": keep-alive\n" * (MIB // 13), 4096),
    "data-lines": (b"data: a\n" * (MIB // 8 - 1) + b"\n", 4096),
    "crlf-split": (b"data: a\r\n\r\n" * (MIB // 11), 64),
}


@pytest.mark.parametrize(("body", "size"), SSE_BODIES.values(), ids=SSE_BODIES.keys())
def test_sse_parser_is_linear_in_any_split(body: bytes, size: int) -> None:
    assert_linear(lambda: feed_in_pieces(body, size))


# --- the adapters: whole answers, stream events, headers --------------------------------------

#: Workers AI bodies of about 1 MiB that are hard to parse or to search.
WORKERS_AI_BODIES = {
    "deep-nesting": b"[" * MIB,
    "deep-result": b'{"result": ' + b'{"a":' * (MIB // 6) + b"1",
    "many-errors": json.dumps(
        {"success": False, "errors": [{"code": 3040, "message": "x"}] * (MIB // 30)}
    ).encode(),
    "long-message": json.dumps(
        {"success": False, "errors": [{"message": "JSON Mode couldn" * (MIB // 17)}]}
    ).encode(),
    "many-tool-calls": json.dumps(
        {"success": True, "result": {"response": "", "tool_calls": [{}] * (MIB // 4)}}
    ).encode(),
}


@pytest.mark.parametrize("body", WORKERS_AI_BODIES.values(), ids=WORKERS_AI_BODIES.keys())
def test_workers_ai_answers_parse_in_linear_time(body: bytes) -> None:
    """Every answer is a result or a `ProviderError` (a JSON nested past the parser's depth is
    a non-JSON body, not a `RecursionError`)."""

    def parse() -> None:
        with contextlib.suppress(ProviderError):
            parse_workers_ai_response(200, body, model=MODEL)

    assert_linear(parse)


OPENAI_BODIES = {
    "deep-nesting": b"[" * MIB,
    "deep-choices": b'{"choices": [{"message": ' + b'{"a":' * (MIB // 6),
    "long-error-tokens": json.dumps({"error": {"code": "a" * (MIB // 2), "type": "b" * (MIB // 2)}}).encode(),
    "many-content-parts": json.dumps(
        {"choices": [{"message": {"content": [{"type": "text", "text": "a"}] * (MIB // 30)}}]}
    ).encode(),
}


@pytest.mark.parametrize("body", OPENAI_BODIES.values(), ids=OPENAI_BODIES.keys())
def test_openai_answers_parse_in_linear_time(fake_openai: FakeOpenAI, body: bytes) -> None:
    fake_openai.script("m", Raw(200, body, "application/json"))

    async def call() -> None:
        binding = OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)
        try:
            await binding.run("m", {"prompt": "hi"})
        except ProviderError:
            pass
        finally:
            await binding.aclose()

    assert_linear(lambda: asyncio.run(call()))


#: Event streams of about 1 MiB that are hard for the chunk decoder.
STREAMS = {
    "done-then-spaces": b"data: [DONE]" + b" " * (MIB - 20) + b"\n\n",
    "deep-nesting": b"data: " + b"[" * (MIB - 20) + b"\n\ndata: [DONE]\n\n",
    "many-tool-calls": b"data: "
    + json.dumps({"response": "", "tool_calls": [{"name": "f", "arguments": {}}] * (MIB // 40)}).encode()
    + b"\n\ndata: [DONE]\n\n",
    "many-events": b'data: {"response": "a"}\n\n' * (MIB // 25) + b"data: [DONE]\n\n",
    "many-lines": b'data: {"response":\n' + b"data: \n" * (MIB // 8) + b'data: "a"}\n\ndata: [DONE]\n\n',
}


@pytest.mark.parametrize("body", STREAMS.values(), ids=STREAMS.keys())
def test_stream_events_decode_in_linear_time(fake_workers_ai: FakeWorkersAI, body: bytes) -> None:
    """Each stream ends with its `StreamEnd` (or a `ProviderError`), never another exception."""
    fake_workers_ai.script(MODEL, Raw(200, body, "text/event-stream"))

    async def stream() -> None:
        binding = WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        )
        try:
            async for _ in binding.stream(MODEL, {"prompt": "hi"}):
                pass
        finally:
            await binding.aclose()

    assert_linear(lambda: asyncio.run(stream()))


#: `Retry-After` / `retry-after-ms` values as long as a response head can carry (64 KB).
RETRY_AFTERS = {
    "digits": {"retry-after": "9" * 60_000},
    "date-with-spaces": {"retry-after": "Mon, 01 Jan 2024 " + " " * 60_000 + "00:00:00 GMT"},
    "commas": {"retry-after": "," * 60_000},
    "exponent": {"retry-after": "1e" + "9" * 60_000},
    "milliseconds": {"retry-after-ms": "9" * 60_000},
}


@pytest.mark.parametrize("headers", RETRY_AFTERS.values(), ids=RETRY_AFTERS.keys())
def test_retry_after_parses_in_linear_time(fake_openai: FakeOpenAI, headers: dict[str, str]) -> None:
    fake_openai.script("m", Raw(429, b'{"error": {"type": "requests"}}', "application/json", headers))

    async def call() -> ProviderError:
        binding = OpenAICompatible(api_key=fake_openai.api_key, base_url=fake_openai.base_url)
        try:
            await binding.run("m", {"prompt": "hi"})
        except ProviderError as error:
            return error
        finally:
            await binding.aclose()
        raise AssertionError("no failure")

    errors: list[ProviderError] = []
    assert_linear(lambda: errors.append(asyncio.run(call())))
    assert errors[0].status == 429


# --- over real HTTP: the worker keeps answering -----------------------------------------------


def test_a_pathological_answer_does_not_freeze_the_worker(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    """The example app under uvicorn; the model answers `/summary` (JSON mode) with a code fence
    and half a million newlines (1 MB on the wire). `/health` keeps answering within a second
    meanwhile, and `/summary` answers its fallback."""
    fake_workers_ai.default = Reply("```\n" + "\n" * 500_000)
    client = app_client(create_app(workers_ai_settings(fake_workers_ai, ai_timeout_s=30)), socket=True)
    url = str(client.base_url)
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=url, timeout=1.0) as health:
        summary = pool.submit(
            lambda: httpx.post(f"{url}/summary", json={"text": "refund please"}, timeout=30)
        )
        polls = 0
        while not summary.done() or polls < 5:
            assert health.get("/health").json()["ok"] is True  # a timeout fails the test
            polls += 1
            time.sleep(0.02)
        answer = summary.result()
    assert answer.status_code == 200
    assert answer.json()["fallback"]["reason"] == "schema_invalid"
    assert len(fake_workers_ai.calls) == 1


def _sharing_levels(count: int) -> type[BaseModel]:
    """A model holding the two before it, `count` levels deep."""
    models: list[type[BaseModel]] = []
    for n in range(count):
        fields: dict[str, Any] = {"value": (int, 0)}
        if n >= 2:
            fields |= {"a": (models[-1] | None, None), "b": (models[-2] | None, None)}
        models.append(pydantic.create_model(f"Level{n}", **fields))
    return models[-1]


#: 30 levels: a schema that shares its nodes along more than a million paths.
SharedLevels = _sharing_levels(30)


def test_a_route_whose_output_type_shares_models_is_declared_at_once() -> None:
    """The output guard walks each shared node of its type's schema once (its fail-fast copy
    and its declared names), so declaring the route takes milliseconds, not minutes."""
    guards = Guards(WorkersAI(account_id="a", api_token="t"))

    async def handler(ai: AI[SharedLevels]) -> str:
        return str(await ai.run({"prompt": "hi"}))

    started = time.perf_counter()
    guards.route(model="@cf/test/model")(handler)
    assert time.perf_counter() - started < 2.0
