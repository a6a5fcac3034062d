"""Anthropic's Messages API (PROTOCOLS.md, "Anthropic Messages"): the binding, and the request
it sends. What comes back is read in `._anthropic_wire`.

`Anthropic` translates the Workers-AI-shaped inputs of the binding protocol into a Messages
request (`POST {base}/v1/messages`).

A JSON route's schema is sent as a tool the model must call (`tool_choice` forces it), and the
tool's `input` is the answer: it works on every model the API serves and takes a route's
pydantic schema as it is. Structured outputs (`output_config.format`) constrain decoding, but
only on recent models and only for a subset of JSON Schema (objects closed, no bounds on
numbers or strings): a pydantic schema would have to be rewritten, and the output guard
validates either way. An output type that is not an object (a list, a number) cannot be a
tool's input: its schema is asked for in the system prompt instead.

No retries and no sleeping here: the call guard's classifier is the only retry policy.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from ..contracts._binding import AIResult
from ..contracts._errors import ConfigurationError
from ..contracts._stream import StreamEvent
from ._anthropic_wire import JSON_TOOL, PROVIDER, JsonMode, MessagesDecoder, parse_messages_answer
from ._http import DEFAULT_MAX_BODY_BYTES, IDENTITY, new_client, post_capped
from ._httpx import check_client, httpx
from ._stream_http import DEFAULT_IDLE_TIMEOUT_S, stream_sse

__all__ = ["Anthropic", "messages_request"]

DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_VERSION = "2023-06-01"
#: `max_tokens` when the inputs set none (the API requires it): what every Claude model can
#: write, the oldest included.
DEFAULT_MAX_TOKENS = 4096
#: Inputs sent as they are (Anthropic's own names); every other key is dropped (the API answers
#: 400 to an argument it does not know).
PASSTHROUGH_KEYS = frozenset({"temperature", "top_p", "top_k", "stop_sequences", "metadata", "thinking"})
#: Anthropic's own content blocks, sent as they are in a message's content list.
_NATIVE_BLOCKS = frozenset({"text", "image", "document", "tool_use", "tool_result", "thinking"})
_MAX_TOKENS = 1 << 53


class Anthropic:
    """A binding that runs Claude models through `POST {base_url}/v1/messages`.

    `api_key` travels as `x-api-key`, `anthropic_version` as `anthropic-version`; `headers`
    are added to every request (e.g. `anthropic-beta`). `provider` names the provider in
    `ProviderError`s and logs. Pass an `httpx.AsyncClient` to share one across bindings;
    otherwise the binding makes its own and closes it in `aclose`. Bodies are read up to
    `max_body_bytes` (while streaming: each event, and each line), as sent (`Accept-Encoding:
    identity`; another `Content-Encoding` fails unread).

    `run` translates Workers-AI-shaped inputs: `system` turns become the top-level `system`,
    `tool` turns `tool_result` blocks, an assistant's `tool_calls` `tool_use` blocks, a
    `prompt` one user turn; `max_tokens` (or `max_completion_tokens`) is always sent, else
    `default_max_tokens`; `stop` becomes `stop_sequences`; OpenAI-shaped `tools` and
    `tool_choice` become Anthropic's; `response_format` asks for JSON (see the module's
    docstring); Anthropic's own `temperature`, `top_p`, `top_k`, `stop_sequences`, `metadata`
    and `thinking` pass through; other keys are dropped. The answer's text blocks joined are
    `AIResult.response` (a JSON route's: the object), `tool_use` blocks its `tool_calls`
    (OpenAI's shape), thinking blocks are not kept; `stop_reason` `refusal` is a content
    filter, `max_tokens` a truncated answer.

    `stream` sends the same request with `"stream": true` and reads the named events (see
    `MessagesDecoder`). A stream with no complete event for `idle_timeout_s` fails as stalled
    (Anthropic's `ping` events count: they say the model is still working).

    `run` reports its answer's first byte (`guards.first_output_arrived`) when the status line
    and headers arrived.
    """

    #: OpenTelemetry's `gen_ai.provider.name` for Anthropic.
    gen_ai_provider_name = "anthropic"

    def __init__(
        self,
        *,
        api_key: str,
        base_url: str = DEFAULT_BASE_URL,
        anthropic_version: str = DEFAULT_VERSION,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        client: httpx.AsyncClient | None = None,
        headers: Mapping[str, str] | None = None,
        provider: str = PROVIDER,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if not api_key:
            raise ConfigurationError("Anthropic needs an api_key (ANTHROPIC_API_KEY)")
        if not base_url.startswith(("http://", "https://")):
            raise ConfigurationError("Anthropic needs an http:// or https:// base_url")
        if not anthropic_version:
            raise ConfigurationError("Anthropic needs an anthropic_version (e.g. '2023-06-01')")
        if not 0 < default_max_tokens <= _MAX_TOKENS:
            raise ConfigurationError("Anthropic needs default_max_tokens > 0")
        if not provider:
            raise ConfigurationError("Anthropic needs a provider name")
        if not idle_timeout_s > 0:
            raise ConfigurationError("Anthropic needs idle_timeout_s > 0")
        check_client(client, "Anthropic")
        self._options: dict[str, Any] = {
            "api_key": api_key,
            "base_url": base_url,
            "anthropic_version": anthropic_version,
            "default_max_tokens": default_max_tokens,
            "client": client,
            "headers": headers,
            "provider": provider,
            "max_body_bytes": max_body_bytes,
            "idle_timeout_s": idle_timeout_s,
        }
        self.provider = provider
        self._url = f"{base_url.rstrip('/')}/v1/messages"
        self._headers = httpx.Headers(headers or {})
        self._headers.update(IDENTITY)  # per request: a client of the caller's own asks for it too
        self._headers["x-api-key"] = api_key
        self._headers["anthropic-version"] = anthropic_version
        self._stream_headers = httpx.Headers(self._headers)
        self._stream_headers["accept"] = "text/event-stream"
        self._default_max_tokens = default_max_tokens
        self._owns_client = client is None
        self._client = client or new_client()
        self._max_body_bytes = max_body_bytes
        self._idle_timeout_s = idle_timeout_s

    def __repr__(self) -> str:  # never show the key or the extra headers
        return f"Anthropic(provider={self.provider!r}, url={self._url!r})"

    def replace(self, **changes: Any) -> Anthropic:
        """A new binding made with this one's arguments, `changes` applied (e.g. `base_url` and
        `api_key` of a test server). It shares this one's `client` when one was given; an
        unknown argument raises `TypeError`."""
        return Anthropic(**{**self._options, **changes})

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        """Run `model` on `inputs`; raises `ProviderError` for every failure. Cancelling the task
        closes the response, and with it the connection."""
        body, json_mode = messages_request(model, inputs, default_max_tokens=self._default_max_tokens)
        response, raw = await post_capped(
            self._client,
            self._url,
            provider=self.provider,
            max_bytes=self._max_body_bytes,
            headers=self._headers,
            json=body,
        )
        return parse_messages_answer(
            response.status_code,
            response.headers,
            raw,
            model=model,
            provider=self.provider,
            json_mode=json_mode,
        )

    def stream(self, model: str, inputs: Mapping[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        """Run `model` on `inputs` as a stream and yield its events as they arrive (the
        `guards.StreamingBinding` contract: deltas, then one `StreamEnd` at `message_stop`;
        every failure a `ProviderError`, an `error` event included). Closing the iterator, or
        cancelling its consumer, closes the connection."""
        body, json_mode = messages_request(model, inputs, default_max_tokens=self._default_max_tokens)
        body["stream"] = True
        provider = self.provider

        def parse_whole(response: httpx.Response, raw: bytes) -> AIResult:
            return parse_messages_answer(
                response.status_code,
                response.headers,
                raw,
                model=model,
                provider=provider,
                json_mode=json_mode,
            )

        return stream_sse(
            self._client,
            self._url,
            body=body,
            headers=self._stream_headers,
            provider=provider,
            decoder=MessagesDecoder(provider, model, json_mode=json_mode),
            parse_whole=parse_whole,
            idle_timeout_s=self._idle_timeout_s,
            max_reconnects=0,
            resume_base=None,
            max_event_bytes=self._max_body_bytes,
        )

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


# --- the request ----------------------------------------------------------------------------------


def messages_request(
    model: str, inputs: Mapping[str, Any], *, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> tuple[dict[str, Any], JsonMode]:
    """The Messages request body for Workers-AI-shaped `inputs`, and how a JSON answer will
    come back (None: the inputs ask for no JSON)."""
    system, turns = _turns(inputs)
    body: dict[str, Any] = {"model": model, "max_tokens": _max_tokens(inputs, default_max_tokens)}
    body.update((key, value) for key, value in inputs.items() if key in PASSTHROUGH_KEYS)
    stop = inputs.get("stop")
    if "stop_sequences" not in body and stop:
        body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    tools = [tool for given in inputs.get("tools") or () if (tool := _tool(given)) is not None]
    choice = _tool_choice(inputs.get("tool_choice"))
    schema = _json_schema(inputs.get("response_format"))
    json_mode: JsonMode = None
    if schema is not None and schema.get("type") == "object":
        json_mode = "tool"
        tools.append({"name": JSON_TOOL, "description": "Give the answer.", "input_schema": schema})
        thinking = body.get("thinking")
        if isinstance(thinking, Mapping) and thinking.get("type") != "disabled":
            choice = {"type": "auto"}  # a forced tool is refused with extended thinking
        elif len(tools) > 1:
            choice = {"type": "any"}  # the answer, or one of the caller's own tools
        else:
            choice = {"type": "tool", "name": JSON_TOOL}
    elif schema is not None:
        json_mode = "text"
        system.append(
            "Answer with JSON only, no other text, matching this JSON Schema: "
            + json.dumps(schema, separators=(",", ":"))
        )
    if system:
        body["system"] = "\n\n".join(system)
    body["messages"] = turns
    if tools:
        body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = choice
    return body, json_mode


def _max_tokens(inputs: Mapping[str, Any], default: int) -> int:
    for key in ("max_tokens", "max_completion_tokens"):
        value = inputs.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def _turns(inputs: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The system texts and the user / assistant turns of `inputs` (`messages`, or a
    `prompt`). Consecutive turns of one role are left as they are: the API merges them."""
    messages = inputs.get("messages")
    if not isinstance(messages, list | tuple):
        prompt = inputs.get("prompt")
        return [], [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role, content = message.get("role"), message.get("content")
        if role in ("system", "developer"):
            if text := _text(content):
                system.append(text)
        elif role == "tool":
            result = {"type": "tool_result", "tool_use_id": str(message.get("tool_call_id") or "")}
            turns.append({"role": "user", "content": [{**result, "content": _text(content)}]})
        elif role == "assistant":
            blocks = _blocks(content)
            blocks += [_tool_use(i, call) for i, call in enumerate(message.get("tool_calls") or ())]
            turns.append({"role": "assistant", "content": blocks})
        else:
            turns.append(
                {"role": "user", "content": content if isinstance(content, str) else _blocks(content)}
            )
    return system, turns


def _text(content: Any) -> str:
    """A turn's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(b["text"] for b in _blocks(content) if b.get("type") == "text")


def _blocks(content: Any) -> list[dict[str, Any]]:
    """A turn's content as Anthropic's blocks: a string as one text block (none when empty),
    Anthropic's own blocks (text parts included, but empty ones) as they are; other parts (an
    OpenAI `image_url`) are dropped."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[dict[str, Any]] = []
    for part in content if isinstance(content, list | tuple) else ():
        if not isinstance(part, Mapping) or part.get("type") not in _NATIVE_BLOCKS:
            continue
        if part["type"] != "text" or (isinstance(part.get("text"), str) and part["text"]):
            blocks.append(dict(part))  # as it is: a `cache_control` marker stays on its block
    return blocks


def _tool_use(index: int, call: Any) -> dict[str, Any]:
    """An assistant's tool call (OpenAI's shape, or Workers AI's flat one) as a `tool_use` block."""
    call = call if isinstance(call, Mapping) else {}
    function = call.get("function")
    spec: Mapping[str, Any] = function if isinstance(function, Mapping) else call
    arguments = spec.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    call_id = call.get("id")
    return {
        "type": "tool_use",
        "id": call_id if isinstance(call_id, str) and call_id else f"toolu_{index}",
        "name": str(spec.get("name") or ""),
        "input": arguments if isinstance(arguments, dict) else {},
    }


def _tool(given: Any) -> dict[str, Any] | None:
    """A tool definition in Anthropic's words: OpenAI's `{"type": "function", "function":
    {...}}`, Workers AI's flat `{"name", "parameters"}`, or Anthropic's own (as it is)."""
    if not isinstance(given, Mapping):
        return None
    function = given.get("function")
    spec: Mapping[str, Any] = function if isinstance(function, Mapping) else given
    if "input_schema" in spec or ("type" in given and given.get("type") != "function"):
        return dict(given)  # Anthropic's own (a server tool has a `type` of its own)
    name = spec.get("name")
    if not isinstance(name, str):
        return None
    parameters = spec.get("parameters")
    tool: dict[str, Any] = {"name": name}
    if isinstance(spec.get("description"), str):
        tool["description"] = spec["description"]
    tool["input_schema"] = dict(parameters) if isinstance(parameters, Mapping) else {"type": "object"}
    return tool


def _tool_choice(given: Any) -> dict[str, Any] | None:
    """OpenAI's `tool_choice` in Anthropic's words (Anthropic's own passes as it is)."""
    if given in ("auto", "none"):
        return {"type": given}
    if given in ("required", "any"):
        return {"type": "any"}
    if isinstance(given, Mapping):
        function = given.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return {"type": "tool", "name": function["name"]}
        if given.get("type") in ("auto", "any", "tool", "none"):
            return dict(given)
    return None


def _json_schema(given: Any) -> dict[str, Any] | None:
    """The JSON Schema a `response_format` asks for: Workers AI's `{"type": "json_schema",
    "json_schema": <schema>}` or OpenAI's wrapper `{"name", "schema"}`; None for anything else."""
    if not isinstance(given, Mapping) or given.get("type") != "json_schema":
        return None
    schema = given.get("json_schema")
    if not isinstance(schema, Mapping):
        return None
    if isinstance(schema.get("schema"), Mapping) and isinstance(schema.get("name"), str):
        schema = schema["schema"]  # OpenAI's wrapper
    return dict(schema)
