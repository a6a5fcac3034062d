"""The Gemini API's request body for Workers-AI-shaped inputs (the binding protocol's), one pure
function: `gemini_request`.

    messages (system / developer)      -> systemInstruction.parts (their text, in order)
    messages (user / assistant / tool) -> contents, roles user / model / user; one turn per run
                                          of a role (the API wants them alternating)
    assistant tool_calls               -> functionCall parts (args parsed from their JSON text,
                                          a `thought_signature` sent back as thoughtSignature)
    tool results                       -> functionResponse parts, named by the call they answer
    prompt                             -> one user turn
    response_format json_schema        -> generationConfig.responseMimeType application/json
                                          and the schema as responseJsonSchema (as it is)
    tools (OpenAI's or Workers AI's)   -> tools[0].functionDeclarations, the parameters as
                                          parametersJsonSchema; tool_choice -> toolConfig
    max_tokens, temperature, top_p ... -> generationConfig (maxOutputTokens, topP ...)

Anything else is dropped (Gemini answers 400 to a field it does not know). Content parts that
are not text (images) are dropped too: not supported yet.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["gemini_request"]

#: Sampling keys of the inputs and their `generationConfig` names.
GENERATION_KEYS = {
    "max_tokens": "maxOutputTokens",
    "max_completion_tokens": "maxOutputTokens",
    "temperature": "temperature",
    "top_p": "topP",
    "top_k": "topK",
    "seed": "seed",
    "presence_penalty": "presencePenalty",
    "frequency_penalty": "frequencyPenalty",
}
_ROLES = {"user": "user", "assistant": "model", "model": "model", "tool": "user", "function": "user"}
_SYSTEM_ROLES = frozenset({"system", "developer"})
_CHOICES = {"auto": "AUTO", "none": "NONE", "required": "ANY", "any": "ANY"}


def gemini_request(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The `generateContent` body for `inputs` (see the module's docstring)."""
    system: list[str] = []
    contents: list[dict[str, Any]] = []
    messages = inputs.get("messages")
    if isinstance(messages, list):
        _translate(messages, system, contents)
    elif isinstance(inputs.get("prompt"), str):
        contents.append({"role": "user", "parts": [{"text": inputs["prompt"]}]})
    body: dict[str, Any] = {"contents": contents}
    if system:
        body["systemInstruction"] = {"parts": [{"text": text} for text in system]}
    config = _generation_config(inputs)
    if config:
        body["generationConfig"] = config
    declarations = _declarations(inputs.get("tools"))
    if declarations:
        body["tools"] = [{"functionDeclarations": declarations}]
        tool_config = _tool_config(inputs.get("tool_choice"))
        if tool_config is not None:
            body["toolConfig"] = tool_config
    return body


def _translate(messages: list[Any], system: list[str], contents: list[dict[str, Any]]) -> None:
    names: dict[str, str] = {}  # tool call id -> the function it called (tool results name it)
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role in _SYSTEM_ROLES:
            text = _text(message.get("content"))
            if text:
                system.append(text)
            continue
        turn = _ROLES.get(role) if isinstance(role, str) else None
        if turn is None:
            continue
        if role in ("tool", "function"):
            parts = [_function_response(message, names)]
        else:
            parts = _parts(message, names)
        if not parts:
            continue
        if contents and contents[-1]["role"] == turn:
            contents[-1]["parts"].extend(parts)  # consecutive turns of one role are one turn
        else:
            contents.append({"role": turn, "parts": parts})


def _text(content: Any) -> str:
    """A message's text: a string, or the text of its OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
        return "".join(t for t in texts if isinstance(t, str))
    return ""


def _parts(message: Mapping[str, Any], names: dict[str, str]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    text = _text(message.get("content"))
    if text:
        parts.append({"text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        if not isinstance(call, Mapping):
            continue
        function = call.get("function")
        spec: Mapping[str, Any] = function if isinstance(function, Mapping) else call
        name = spec.get("name")
        if not isinstance(name, str):
            continue
        call_id = call.get("id")
        if isinstance(call_id, str):
            names[call_id] = name
        part: dict[str, Any] = {"functionCall": {"name": name, "args": _object(spec.get("arguments"))}}
        signature = call.get("thought_signature")
        if isinstance(signature, str):
            part["thoughtSignature"] = signature
        parts.append(part)
    return parts


def _function_response(message: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """A tool result as a `functionResponse` part: named by the call it answers (else the
    message's own `name`), its content as the response object (`{"result": ...}` unless it is
    a JSON object)."""
    call_id = message.get("tool_call_id")
    name = names.get(call_id) if isinstance(call_id, str) else None
    given = message.get("name")
    name = name or (given if isinstance(given, str) else "") or "tool"
    content = message.get("content")
    text = _text(content)
    response = _object(text) if text.lstrip().startswith("{") else {"result": text}
    return {"functionResponse": {"name": name, "response": response}}


def _object(arguments: Any) -> dict[str, Any]:
    """Arguments as an object: as they are, parsed from JSON text, or empty."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str) and arguments.strip():
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return {"result": arguments}
        return parsed if isinstance(parsed, dict) else {"result": parsed}
    return {}


def _generation_config(inputs: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for key, name in GENERATION_KEYS.items():
        value = inputs.get(key)
        if value is not None and name not in config:
            config[name] = value
    stop = inputs.get("stop")
    if isinstance(stop, str):
        config["stopSequences"] = [stop]
    elif isinstance(stop, list) and stop:
        config["stopSequences"] = [s for s in stop if isinstance(s, str)]
    given = inputs.get("response_format")
    if isinstance(given, Mapping) and given.get("type") in ("json_object", "json_schema"):
        config["responseMimeType"] = "application/json"
        schema = given.get("json_schema")
        if isinstance(schema, Mapping):
            if isinstance(schema.get("schema"), Mapping) and isinstance(schema.get("name"), str):
                schema = schema["schema"]  # OpenAI's wrapper
            config["responseJsonSchema"] = dict(schema)
    return config


def _declarations(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's `{"type": "function", "function": {...}}` or Workers AI's flat `{"name",
    "description", "parameters"}` as Gemini's function declarations."""
    found: list[dict[str, Any]] = []
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function")
        spec: Mapping[str, Any] = function if isinstance(function, Mapping) else tool
        name = spec.get("name")
        if not isinstance(name, str):
            continue
        declaration: dict[str, Any] = {"name": name}
        if isinstance(spec.get("description"), str):
            declaration["description"] = spec["description"]
        if isinstance(spec.get("parameters"), Mapping):
            declaration["parametersJsonSchema"] = dict(spec["parameters"])
        found.append(declaration)
    return found


def _tool_config(choice: Any) -> dict[str, Any] | None:
    """OpenAI's `tool_choice` as Gemini's `functionCallingConfig`."""
    if isinstance(choice, str) and choice in _CHOICES:
        return {"functionCallingConfig": {"mode": _CHOICES[choice]}}
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if isinstance(name, str):
        return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [name]}}
    return None
