"""Tool-call validation: a route that declares its tools (`route(tools={"name": Model})`) has
each tool call of an answer validated against its tool's pydantic model, as the output guard
validates an answer; a call that does not validate makes the answer `schema_invalid`.

A provider names a call's tool and sends its arguments in one of two shapes (`AIResult.tool_calls`
holds them as they came): Workers AI's flat `{"name", "arguments": {...}}` and OpenAI's
`{"id", "type": "function", "function": {"name", "arguments": "<JSON text>"}}`. Both are read
here. Problems name the tool as the route declared it (`tool[get_weather].city: missing`); a
call to a tool the route did not declare is named by its position (`tool_calls[2]:
unknown_tool`), never by the name the model wrote; a key the model wrote in the arguments is
`<key>` (`OutputGuard.problems`). Arguments or an id holding a lone surrogate are
`invalid_unicode`.

Imported when a route declares tools (at start-up), never by a route that does not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ._binding import AIResult
from ._errors import ConfigurationError, GuardTripped
from ._output import INVALID_UNICODE, MAX_PROBLEMS, OutputGuard
from ._unicode import has_lone_surrogate
from ._vocabulary import Reason

__all__ = ["MAX_TOOL_CALLS", "ToolCall", "Tools"]

#: The most tool calls one answer may carry: more is `tool_calls: too_many` (nothing is parsed).
MAX_TOOL_CALLS = 32
#: What a tool's name may be (OpenAI's rule, which Workers AI's models follow).
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The longest tool-call id handed to the handler (the provider's text: kept short).
_MAX_ID_CHARS = 200


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of an answer, validated: `name` is a tool the route declared, `arguments`
    an instance of its model, `id` the provider's id of the call (None when it sent none, as
    Workers AI's flat calls do). Match on the arguments' type for typed access:
    `case ToolCall(arguments=GetWeather(city=city))`."""

    name: str
    arguments: BaseModel
    id: str | None = None


class Tools:
    """A route's tools: each name with its arguments' model, checked at start-up."""

    __slots__ = ("_guards", "definitions")

    def __init__(self, tools: Mapping[str, type[BaseModel]], where: str) -> None:
        if not isinstance(tools, Mapping) or not tools:
            raise ConfigurationError(
                f"{where}: tools must be a non-empty mapping of tool name to a pydantic model of its arguments"
            )
        guards: dict[str, OutputGuard] = {}
        for name, model in tools.items():
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise ConfigurationError(
                    f"{where}: tool name {name!r}: 1 to 64 letters, digits, '_' or '-' (the name the "
                    "model calls it by)"
                )
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise ConfigurationError(
                    f"{where}: tool {name!r} must map to a pydantic model of its arguments"
                )
            guards[name] = OutputGuard(model)
        self._guards = guards
        #: What is sent as the `tools` input when a call does not set it (OpenAI's shape, which
        #: Workers AI's function-calling models accept too).
        self.definitions: tuple[dict[str, Any], ...] = tuple(
            {
                "type": "function",
                "function": {
                    "name": name,
                    **({"description": doc} if (doc := _description(tools[name])) else {}),
                    "parameters": guard.json_schema,
                },
            }
            for name, guard in guards.items()
        )

    def check(self, result: AIResult) -> tuple[ToolCall, ...]:
        """The answer's tool calls, each validated against its tool's model; raises
        `GuardTripped` (`schema_invalid`, with its problems) when one does not validate or
        names no declared tool, or when there are more than `MAX_TOOL_CALLS`."""
        calls = result.tool_calls
        if len(calls) > MAX_TOOL_CALLS:
            raise GuardTripped(
                Reason.schema_invalid,
                f"the answer has {len(calls)} tool calls: at most {MAX_TOOL_CALLS} are read",
                problems=("tool_calls: too_many",),
            )
        checked: list[ToolCall] = []
        problems: list[str] = []
        for index, call in enumerate(calls):
            function = call.get("function")
            spec: Mapping[str, Any] = function if isinstance(function, Mapping) else call
            name = spec.get("name")
            guard = self._guards.get(name) if isinstance(name, str) else None
            if guard is None or not isinstance(name, str):
                problems.append(f"tool_calls[{index}]: unknown_tool")
                continue
            arguments = spec.get("arguments")
            try:
                value = guard.validate({} if arguments is None or arguments == "" else arguments)
            except ValidationError as exc:
                problems.extend(guard.problems(exc, f"tool[{name}]"))
                continue
            call_id = call.get("id")
            if isinstance(call_id, str) and has_lone_surrogate(call_id):
                problems.append(f"tool_calls[{index}]: {INVALID_UNICODE}")
                continue
            checked.append(
                ToolCall(name, value, call_id[:_MAX_ID_CHARS] if isinstance(call_id, str) else None)
            )
        if problems:
            listed = tuple(dict.fromkeys(problems))[:MAX_PROBLEMS]
            raise GuardTripped(
                Reason.schema_invalid,
                f"tool calls do not match their tools ({', '.join(listed)})"[:300],
                problems=listed,
            )
        return tuple(checked)


def _description(model: type[BaseModel]) -> str | None:
    """The model's own docstring (what pydantic puts in its JSON Schema), else None."""
    doc = model.__doc__
    return doc.strip() if doc and doc is not BaseModel.__doc__ else None
