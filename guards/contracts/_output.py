"""Output guard: unwrap the provider's answer, then reject it when it is empty, flagged by
moderation, or not an instance of the route's output type.

Order matters: an answer the provider flagged is `moderation_blocked` (even when the filter left
it empty); an empty answer is `empty_response` even if the type would also reject it; a flagged
answer is `moderation_blocked` before its shape is looked at.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import CoreSchema, InitErrorDetails, PydanticCustomError, SchemaValidator

from ._binding import AIResult
from ._errors import GuardTripped
from ._unicode import has_lone_surrogate
from ._vocabulary import Reason

__all__ = ["INVALID_UNICODE", "MAX_PROBLEMS", "Moderation", "OutputGuard", "output_guard"]

#: A moderation hook: receives the validated output, returns True to block it.
Moderation = Callable[[Any], bool | Awaitable[bool]]
#: The most validation errors a `schema_invalid` detail names (by location and type).
_LISTED_ERRORS = 20
#: The most problems a rejected answer carries (`GuardTripped.problems`), and the longest one.
MAX_PROBLEMS = 10
_MAX_PROBLEM_CHARS = 100
_BLOCKED = ("answer: moderation_blocked",)
_EMPTY = ("answer: empty_response",)
#: A held JSON answer whose start can no longer be JSON of the type (`impossible`).
_NOT_JSON = ("answer: json_invalid",)
#: The problem token of an answer holding a lone surrogate (U+D800 to U+DFFF, unpaired): valid
#: JSON (`"\\ud800"`), but no UTF-8 can carry it, so no response could.
INVALID_UNICODE = "invalid_unicode"
#: What an element of an error's location that the schema does not declare is told as: a key
#: the model wrote (a `dict` field's, an extra one), never by name.
_KEY = "<key>"


class OutputGuard:
    """Validates answers against one output type (`Any` accepts any non-empty answer)."""

    def __init__(self, output_type: Any, moderation: Moderation | None = None) -> None:
        self.output_type = output_type
        self.moderation = moderation
        self._adapter: TypeAdapter[Any] | None = None if output_type is Any else TypeAdapter(output_type)
        # The type's validator, compiled from the adapter's schema with every collection failing
        # fast, called directly (the adapter's methods add a layer).
        self._validator = (
            SchemaValidator(_fail_fast(self._adapter.core_schema)) if self._adapter is not None else None
        )
        #: What a location may name (`_declared`): anything else in it is `<key>`.
        self._declared = _declared(self._adapter.core_schema) if self._adapter is not None else frozenset()
        schema = self._adapter.json_schema() if self._adapter else None
        #: The JSON Schema to request JSON mode with; None when the route wants plain text.
        self.json_schema: dict[str, Any] | None = (
            schema if schema is not None and schema.get("type") != "string" else None
        )
        #: What asks a model for JSON mode with that schema (None: plain text).
        self.response_format: dict[str, Any] | None = (
            {"type": "json_schema", "json_schema": self.json_schema} if self.json_schema is not None else None
        )

    def dump(self, value: Any) -> str:
        """`value` (an output this guard passed) as JSON text, to keep it (a task's step)."""
        return (self._adapter or _ANY).dump_json(value).decode()

    def plain(self, value: Any) -> Any:
        """`value` (an output this guard passed) as plain JSON data (dicts, lists, strings,
        numbers): what a structured stream's `done` event carries as its `object`."""
        return (self._adapter or _ANY).dump_python(value, mode="json")

    def impossible(self, held: str) -> bool:
        """Whether `held`, the start of a JSON answer's text (a stream's first characters),
        can already not become an answer of this guard's type: the type is an object or an
        array and the first character that is not whitespace is neither `{` (`[` for an array)
        nor the backquote of a Markdown fence (which `unfenced` takes off). For a hold that
        reads a JSON route's stream before the commit point: True is a `schema_invalid`
        answer known before it completes. Linear in the whitespace it skips; False when only
        whitespace is held, and for any other type."""
        kind = self.json_schema.get("type") if self.json_schema is not None else None
        expected = _FIRST_CHARS.get(kind) if isinstance(kind, str) else None
        found = _NOT_SPACE.search(held) if expected is not None else None
        return found is not None and found[0] not in (expected, "`")

    def load(self, text: str) -> Any:
        """An output kept as JSON text, validated again (raises `pydantic.ValidationError`
        when it no longer matches the type)."""
        return (self._adapter or _ANY).validate_json(text)

    async def check(self, result: AIResult) -> Any:
        """Return the validated output, or raise `GuardTripped` with an output reason."""
        value = self.check_shape(result)
        if self.moderation is not None:
            flagged = self.moderation(value)
            if inspect.isawaitable(flagged):
                flagged = await flagged
            if flagged:
                raise GuardTripped(
                    Reason.moderation_blocked, "the moderation hook blocked the completion", problems=_BLOCKED
                )
        return value

    async def check_held(self, text: str, complete: bool, *, tool_calls: bool = False) -> None:
        """The output guard on the held start of a streamed answer (`route(stream_hold=...)`):
        its `text` so far, `complete` when the answer ended inside the hold, `tool_calls` when
        it called a tool. Raises `GuardTripped` for an answer that completed with no text (blank
        text included) and no tool call (`empty_response`), and for held text the moderation
        hook blocks (`moderation_blocked`: the hook is given the text held so far). On a JSON
        route (a structured stream), `schema_invalid` for held text that can no longer become
        an answer of the type (`impossible`) and, when the answer completed inside the hold,
        for a whole answer the schema rejects (`check_shape`, as at a structured stream's end)."""
        if complete and not tool_calls and not text.strip():
            raise GuardTripped(
                Reason.empty_response, "the model returned an empty completion", problems=_EMPTY
            )
        if self.json_schema is not None and not tool_calls:
            if complete:
                self.check_shape(AIResult(response=text, model=""))
            elif self.impossible(text):
                raise GuardTripped(
                    Reason.schema_invalid,
                    "answer does not match the schema (json_invalid)",
                    problems=_NOT_JSON,
                )
        if self.moderation is not None and text:
            flagged = self.moderation(text)
            if inspect.isawaitable(flagged):
                flagged = await flagged
            if flagged:
                raise GuardTripped(
                    Reason.moderation_blocked, "the moderation hook blocked the completion", problems=_BLOCKED
                )

    def check_shape(self, result: AIResult) -> Any:
        """Everything `check` does but the moderation hook (synchronous)."""
        answer = result.response
        if result.moderated:  # even when the filter left nothing: the cause is the filter
            raise GuardTripped(
                Reason.moderation_blocked, "the provider flagged the completion", problems=_BLOCKED
            )
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise GuardTripped(
                Reason.empty_response, "the model returned an empty completion", problems=_EMPTY
            )
        try:
            return self._validated(answer)
        except ValidationError as exc:
            # Only error locations and types: the input values may echo the prompt. Collections
            # stop at their first invalid item (`_fail_fast`), but a model can still report an
            # error per extra key (`extra="forbid"`): past a few, only their number is told.
            count = exc.error_count()
            if count > _LISTED_ERRORS:
                where = f"{count} errors"
            else:
                errors = exc.errors(include_url=False, include_context=False, include_input=False)
                where = ", ".join(sorted({_loc(self._told(e["loc"])) + e["type"] for e in errors}))[:200]
            raise GuardTripped(
                Reason.schema_invalid,
                f"answer does not match the schema ({where})",
                problems=self.problems(exc, "answer"),
            ) from None

    def validate(self, value: Any) -> Any:
        """`value` (JSON text, or an object) validated against the type, as an answer is
        (raises `pydantic.ValidationError`, with `problems` to tell it): what a tool call's
        arguments go through."""
        assert self._validator is not None, "a guard of a type, not Any"
        return self._validated(value)

    def _validated(self, answer: Any) -> Any:
        """`answer` validated (JSON text when the type asks for JSON), else
        `pydantic.ValidationError`: a lone surrogate anywhere in it, keys included, is one
        (`invalid_unicode`), after the type's own errors. pydantic-core's JSON parser refuses
        one in JSON text (`json_invalid`); an object or a text answer is checked here, once
        it validated (a rejected answer costs no check)."""
        validator = self._validator
        if validator is None:
            value = answer
        elif self.json_schema is not None and isinstance(answer, str):
            return validator.validate_json(unfenced(answer))
        else:
            value = validator.validate_python(answer)
        if has_lone_surrogate(answer):
            raise ValidationError.from_exception_data(
                "answer", [InitErrorDetails(type=_INVALID_UNICODE, loc=(), input=None)]
            )
        return value

    def problems(self, exc: ValidationError, path: str) -> tuple[str, ...]:
        """What `exc` (raised by this guard) found wrong, as problems under `path`:
        `answer.score: missing`, `answer: json_invalid`, `answer.scores.<key>: int_parsing`
        (field paths and pydantic's error types, never the input's values nor a key the model
        wrote), at most `MAX_PROBLEMS`, each at most 100 characters (past `_LISTED_ERRORS`
        errors, only `<path>: too_many_errors`: listing them all would cost what failing fast
        saved)."""
        if exc.error_count() > _LISTED_ERRORS:
            return (f"{path}: too_many_errors",)
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        found: dict[str, None] = {}
        for error in errors:
            where = ".".join((path, *map(str, self._told(error["loc"]))))
            found[f"{where}: {error['type']}"[:_MAX_PROBLEM_CHARS]] = None
            if len(found) == MAX_PROBLEMS:
                break
        return tuple(found)

    def _told(self, loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
        """An error's location as it may be told: indices, and the names the schema declares
        (`_declared`); any other element is a key the model wrote, told as `<key>`."""
        declared = self._declared
        return tuple(part if isinstance(part, int) or part in declared else _KEY for part in loc)


#: What the JSON text of an object and of an array starts with (pydantic's lax mode takes a
#: number or a boolean from a string, so other types are not told apart by their first one).
_FIRST_CHARS = {"object": "{", "array": "["}
#: A character that is not whitespace.
_NOT_SPACE = re.compile(r"\S")

#: The error `_validated` raises for a lone surrogate (its message is never told).
_INVALID_UNICODE = PydanticCustomError(INVALID_UNICODE, "a lone surrogate")

_ANY: TypeAdapter[Any] = TypeAdapter(Any)

#: The core schema types whose validation can stop at the first invalid item (`fail_fast`).
_COLLECTIONS = frozenset({"list", "tuple", "set", "frozenset", "dict"})
#: The keys of a core schema that hold other schemas (or mappings and lists of them): the only
#: ones walked, so defaults, literals and metadata (user values) are never touched.
_SUBSCHEMAS = frozenset(
    {
        "schema",
        "items_schema",
        "keys_schema",
        "values_schema",
        "extras_schema",
        "extras_keys_schema",
        "choices",
        "fields",
        "definitions",
        "steps",
        "lax_schema",
        "strict_schema",
        "json_schema",
        "python_schema",
        "arguments_schema",
    }
)


def _fail_fast(schema: CoreSchema) -> CoreSchema:
    """A copy of `schema` in which every list, tuple, set, frozenset and dict stops at its first
    invalid item.

    By default pydantic-core validates every item and reports an error for each: 1 MiB of
    `1,1,1,...` against `list[Label]` is half a million errors, 180 ms of one worker's CPU for a
    verdict (`schema_invalid`) the first error already gives. Failing fast, it takes what parsing
    the JSON takes (about 10 ms). Only validation changes: the JSON Schema sent to the model and
    the adapter that dumps and loads saved outputs are the type's own.

    A pydantic model inside the type keeps its own compiled validator (pydantic-core reuses it
    whatever the schema says): a collection field of a model fails fast only when it is declared
    so, `Field(fail_fast=True)`.
    """
    return _fail_fast_node(schema, {})  # type: ignore[no-any-return]


def _fail_fast_node(node: Any, copies: dict[int, Any]) -> Any:
    """`node`'s fail-fast copy. A schema shares nodes (a model used in several places is one
    dict, along as many paths as it is reached by): each is copied once (`copies`, by
    identity), and the copy shares it the same way, in time linear in the schema's nodes."""
    if not isinstance(node, dict | list | tuple):
        return node
    copied = copies.get(id(node))
    if copied is not None:
        return copied
    if isinstance(node, dict):
        if not isinstance(node.get("type"), str):  # a mapping of schemas: fields, tagged choices
            copy: Any = {key: _fail_fast_node(value, copies) for key, value in node.items()}
        else:
            copy = {
                key: _fail_fast_node(value, copies) if key in _SUBSCHEMAS else value
                for key, value in node.items()
            }
            if copy["type"] in _COLLECTIONS:
                copy["fail_fast"] = True
    else:  # schemas, or (schema, label) choices of a union
        copy = type(node)(_fail_fast_node(item, copies) for item in node)
    copies[id(node)] = copy
    return copy


def _declared(schema: CoreSchema) -> frozenset[str]:
    """The strings an error location in `schema` may hold that the schema itself declares: its
    fields' names and aliases, its tagged unions' tags, the label of each member of a union
    (its own, else the name pydantic-core gives it: `int`, `list[int]`, a model's class name),
    and `[key]` (a dict key's own error). Everything else a location may hold is a key of the
    input: the model's text."""
    names: set[str] = {"[key]"}
    definitions: list[Any] = []
    choices: dict[int, Any] = {}
    # A schema shares nodes (a model used in several places is one dict): each is seen once.
    seen: set[int] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict | list | tuple) or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, list | tuple):
            stack.extend(node)
            continue
        if not isinstance(node.get("type"), str):  # a mapping of schemas: fields, tagged choices
            for key in node:
                names.add(str(getattr(key, "value", key)))
            stack.extend(node.values())
            continue
        kind = node["type"]
        if kind == "dataclass-field" and isinstance(node.get("name"), str):
            names.add(node["name"])
        alias = node.get("validation_alias")
        if alias is not None:  # a name, a path, or a list of paths
            aliases = alias if isinstance(alias, list) else [alias]
            names.update(part for part in aliases if isinstance(part, str))
            names.update(p for path in aliases if isinstance(path, list) for p in path if isinstance(p, str))
        if kind == "definitions":
            definitions.extend(node.get("definitions", ()))
        if kind == "union":
            for choice in node.get("choices", ()):
                if isinstance(choice, tuple):
                    names.add(choice[1])
                else:
                    choices[id(choice)] = choice
        stack.extend(node[key] for key in _SUBSCHEMAS if key in node)
    for choice in choices.values():
        try:
            names.add(
                SchemaValidator({"type": "definitions", "schema": choice, "definitions": definitions}).title
            )
        except Exception:  # pydantic-core's own name, not to be had: the label is told as `<key>`
            continue
    return frozenset(names)


def input_names(parameters: Iterable[inspect.Parameter]) -> frozenset[str]:
    """What a location of a route's invalid input may name that the route declares: its
    parameters' names and aliases, and what each parameter's type declares (`_declared`).
    Anything else in a location is a key the client wrote (`guards.routes._invalid_input._problems`)."""
    names: set[str] = set()
    for param in parameters:
        names.update((param.name, param.name.replace("_", "-")))  # a header's, as FastAPI reads it
        annotation = param.annotation
        # Annotated[T, Query(alias=...)], or `= Query(alias=...)`: the alias is what it reads.
        for info in (*getattr(annotation, "__metadata__", ()), param.default):
            alias = getattr(info, "alias", None)
            if isinstance(alias, str):
                names.add(alias)
        try:
            names |= _declared(TypeAdapter(annotation).core_schema)
        except Exception:  # not a type pydantic reads (Request, a dependency): it declares nothing
            continue
    return frozenset(names)


@functools.lru_cache(maxsize=256)
def output_guard(output_type: Any) -> OutputGuard:
    """The output guard of `output_type`, without moderation (one per type, kept): what a
    call with an output type other than its route's validates against (`AI.step`)."""
    return OutputGuard(output_type)


def unfenced(answer: str) -> str:
    """The inside of a Markdown code fence around the whole answer (```` ```json ... ``` ````, the
    language tag optional), else the answer itself.

    String methods only, so linear in the answer's size: the regex this replaces backtracked
    cubically on a fence followed by a run of newlines (minutes for a few thousand), during
    which the event loop answered nothing.
    """
    text = answer.strip()
    if len(text) < 7 or not text.startswith("```") or not text.endswith("```"):
        return answer
    head, newline, inside = text[3:-3].partition("\n")
    tag = head.rstrip()
    if not newline or (tag and not (tag.isascii() and tag.isalpha())):
        return answer
    return inside


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(map(str, loc)) + ":" if loc else ""
