"""What a test scripts: a provider's answers and failures (`Reply`, `Fail`, `Raw`, `Hang`,
`Drop`) and its streams (`Stream`, of `Part`s: `Text`, `Reasoning`, `ToolName`, `ToolArgs`,
`ToolCall`, `Refusal`, `Meta`), each wire-neutral: how a fake puts one on a provider's wire is
`guards.testing._wire`'s. Imported from `guards.testing.script`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Drop",
    "Fail",
    "Hang",
    "Meta",
    "Part",
    "Raw",
    "Reasoning",
    "Refusal",
    "Reply",
    "Stream",
    "Text",
    "ToolArgs",
    "ToolCall",
    "ToolName",
]


@dataclass(frozen=True)
class Reply:
    """A successful answer: `response` is text or (JSON mode) an object.

    `tool_calls` are sent when there are any, each in the wire's own shape whichever shape it is
    scripted in: Workers AI's flat `{"name", "arguments": {...}}`, or OpenAI's `{"id", "type":
    "function", "function": {"name", "arguments": "<JSON text>"}}`. Only the OpenAI wire knows
    `model` (the model that served; default: the one requested), `finish_reason`
    (`"content_filter"`, `"length"`...) and `refusal` (the model's refusal text, sent as
    `message.refusal` with `content: null`); Workers AI sends none of them.

    `delay_s` passes before the answer's first byte (its status line; a client that leaves
    meanwhile marks the call `disconnected`), `body_delay_s` between its head and its body: a
    model that starts answering at once and takes its time to finish (`FakeBinding` calls
    `guards.first_output_arrived()` between the two, as the HTTP adapters do when the head
    arrives). A `Reply` asked for as a stream plays with `delay_s` alone.
    """

    response: Any = "Hello from the fake model."
    usage: Mapping[str, Any] = field(
        default_factory=lambda: {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    )
    delay_s: float = 0.0
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    model: str | None = None
    finish_reason: str = "stop"
    refusal: str | None = None
    body_delay_s: float = 0.0


@dataclass(frozen=True)
class Fail:
    """A provider error, sent with HTTP `status` (a failure may come with 200) and the
    `retry-after` / `retry-after-ms` headers when given.

    On the Workers AI wire: the `errors` envelope with `code` (omitted when None) and `message`;
    `shape="aierror"` sends the `{"name": "AiError", "internalCode", ...}` shape instead. On the
    OpenAI wire: `{"error": {"message", "type", "code", "param"}}` with `error_type` (default:
    the one OpenAI sends with `status`) and the string `error_code` (e.g. `insufficient_quota`;
    a 429 with neither a type nor a code is OpenAI's `rate_limit_exceeded`). On both,
    `shape="gateway"` sends AI Gateway's `{"success": false, "error": [{"code", "message"}]}`
    envelope with the numeric `code`. `message` defaults to what each wire says for the status
    and code (Workers AI's `AiError: ...`, OpenAI's own sentences).

    The request's limits, on each wire: a context window exceeded is `Fail(code=3006,
    status=413)` on Workers AI (or `Fail(status=400, message="AiError: This model's maximum
    context length is ...")`, as its vLLM-served models say it) and `Fail(status=400,
    error_code="context_length_exceeded")` on OpenAI's; a content filter is `Fail(code=2016,
    status=400, shape="gateway")` behind AI Gateway's guardrails (2017: the answer blocked) and
    `Fail(status=400, error_code="content_filter")` on OpenAI's wire (Azure OpenAI's shape, with
    its `innererror`; OpenAI's own: `"content_policy_violation"`).
    """

    code: int | None = None
    status: int = 500
    message: str | None = None
    retry_after: str | None = None
    shape: str = "rest"
    delay_s: float = 0.0
    error_type: str | None = None
    error_code: str | None = None
    retry_after_ms: str | None = None


@dataclass(frozen=True)
class Raw:
    """Exactly these bytes with this status (a proxy's HTML page, a truncated JSON...), and
    `headers` besides the content type."""

    status: int
    body: bytes
    content_type: str = "text/html"
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Hang:
    """Never answer; wait until the caller gives up (cancels or disconnects)."""


@dataclass(frozen=True)
class Drop:
    """Close the connection without answering (a transport failure)."""


def _default_usage() -> Mapping[str, Any]:
    return {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


# --- streams ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """A piece of the answer's text: one event."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """A piece of visible reasoning: one event (`delta.reasoning_content`)."""

    text: str


@dataclass(frozen=True)
class ToolName:
    """The start of tool call `index`, its `id` and `name`, without arguments: one event (a
    preamble event: no output yet)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgs:
    """A fragment of the JSON arguments of tool call `index`: one event."""

    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """A whole tool call in one event, as Workers AI streams them natively (`{"name",
    "arguments": {...}}` at the event's top level); on OpenAI's chunks, one chunk with its id,
    name and whole arguments. `arguments` is an object or its JSON text."""

    name: str
    arguments: Any = field(default_factory=dict)
    index: int = 0
    id: str | None = None


@dataclass(frozen=True)
class Refusal:
    """The model refusing (structured outputs): one event, OpenAI's `delta.refusal`. The
    adapters end such a stream as filtered (`finish_reason: content_filter`)."""

    text: str


@dataclass(frozen=True)
class Meta:
    """A preamble-only event: OpenAI's role-only first chunk; an empty `response` on Workers
    AI's native wire."""


Part = Text | Reasoning | ToolName | ToolArgs | ToolCall | Refusal | Meta


@dataclass(frozen=True)
class Stream:
    """A streamed answer (`text/event-stream`, sent as it goes with chunked encoding).

    The events, in order: one per part, then, when `done`, the ending events, which differ by
    wire: OpenAI chunks (`FakeOpenAI`, `FakeWorkersAI(openai_chunks=True)`, `FakeBinding`) end
    with a `finish_reason` chunk, a usage chunk (empty `choices`) and `[DONE]` (3 events;
    `FakeOpenAI` sends the usage chunk only when the request asks for it with
    `stream_options: {"include_usage": true}`, as OpenAI does: 2 events otherwise);
    Workers AI's native wire with `{"response": "", "usage": ...}` and `[DONE]` (2 events);
    Anthropic's with `message_delta` and `message_stop` (2 events: there, an event is the group
    of named events that carries one part, see `anthropic_stream_wire`).
    `done=False` ends the body cleanly after the parts, without any ending event.

    N below counts the events sent from the start of the answer, every event included (a
    `Meta`, a `ToolName`, the ending events); the resume position `from=N` counts the same way:
    - `error_after=N`: the first N events, then an in-band error event (`error_message`, and
      the numeric `error_code` when given), then the body ends.
    - `cut_after=N`: the first N events, then the connection closes (no end of the chunked
      body: a transport failure for the client); with `partial_tail`, half of event N+1 is
      written first. N at or past the total: no cut.
    - `stall_after=N`: the first N events, then nothing until the client leaves (its idle
      timeout); `FakeBinding` waits until cancelled, or raises "stream stalled" after
      `stall_s` when given. With `trickle`, the stall is not silent: those bytes are sent
      every `trickle_s` seconds until the client leaves, for a provider that keeps a stream
      alive without a complete event (`b": ping\n"` comments, `b"\n"` blank lines, a line that
      never ends such as `b"data: x"`); `FakeBinding` has no bytes: a trickle is a stall there.
    - `endless=True`: the parts, again and again, until the client leaves (at most
      `HANG_LIMIT_S`), never an ending: a provider that streams forever.
    `delay_s` passes before the answer's head (a client that leaves meanwhile marks the call
    `disconnected`), `interval_s` before each event.

    Resume (`FakeOpenAI(gateway=True)`, and `FakeWorkersAI` at `{base_url}/run/...`): with
    `resumable`, the answer carries `cf-aig-run-id`, and the server keeps the run's whole event
    list (what an uncut stream sends) to serve `GET .../run/{id}/resume?from=N` with the events
    from position N on; the k-th resume of the run is cut after `resume_cuts[k]` of its events
    (None, or no entry: not cut), with `partial_tail` as above; `resume_headers` are sent with
    each resume's answer besides the event stream's own (e.g. a `content-encoding` the client
    did not ask for). `FakeBinding` has no resume.
    """

    parts: Sequence[Part] = (Text("Hello"), Text(" from the"), Text(" fake model."))
    done: bool = True
    cut_after: int | None = None
    partial_tail: bool = False
    error_after: int | None = None
    error_code: int | None = None
    error_message: str = "AiError: AiError: something went wrong mid-stream (0000)"
    stall_after: int | None = None
    stall_s: float | None = None
    trickle: bytes | None = None
    trickle_s: float = 0.05
    endless: bool = False
    usage: Mapping[str, Any] = field(default_factory=_default_usage)
    finish_reason: str = "stop"
    model: str | None = None
    delay_s: float = 0.0
    interval_s: float = 0.0
    resumable: bool = False
    resume_cuts: Sequence[int | None] = ()
    resume_headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        object.__setattr__(self, "resume_cuts", tuple(self.resume_cuts))

    @property
    def text(self) -> str:
        """The answer's whole text: the `Text` parts joined."""
        return "".join(p.text for p in self.parts if isinstance(p, Text))
