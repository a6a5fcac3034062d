"""How many tokens a request's inputs are estimated to take: what a model's context window is
checked against, and (issue 29) what a token budget holds before the call.

The estimate is the number of characters the model reads, divided by four and rounded up: the
usual rule of thumb for English text with the tokenizers of current models. A binding that knows
better (it has the model's tokenizer, or the provider counts) may define
`estimate_tokens(model, inputs) -> int`; guards then asks it instead (see `binding_estimate`).

The answer's tokens a call asks for, its `max_tokens`, are read here too (`max_tokens_of`): once
per call, so that what the budgets hold is what the provider is sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "CHARS_PER_TOKEN",
    "MAX_TOKENS",
    "TokenEstimate",
    "binding_estimate",
    "estimate_tokens",
    "max_tokens_of",
    "with_max_tokens",
]

#: Characters per token in the default estimate.
CHARS_PER_TOKEN = 4
#: The most answer tokens a call may ask for (`max_tokens`): more than any model writes, and
#: as large as the largest context windows; a larger ask is capped to it.
MAX_TOKENS = 1_000_000

#: `(model, inputs) -> tokens`: an estimate of the input tokens of a call.
TokenEstimate = Callable[[str, Mapping[str, Any]], int]


def _text_chars(content: Any) -> int:
    """Characters of text in a message's content: a string, or a list of parts (`{"type":
    "text", "text": ...}`); other parts (images) are not counted."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return 0


def estimate_tokens(model: str, inputs: Mapping[str, Any]) -> int:
    """The default estimate of the input tokens of `inputs` (Workers AI's shape): the
    characters of the prompt, of each message's text, and of the JSON of the tool and
    response-format schemas (the model reads them too), divided by `CHARS_PER_TOKEN`, rounded
    up. Linear in the size of the inputs. `model` is unused (the same rule for every model)."""
    chars = 0
    prompt = inputs.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    messages = inputs.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping):
                chars += _text_chars(message.get("content"))
    for schema in ("tools", "response_format"):
        value = inputs.get(schema)
        if value:
            chars += len(json.dumps(value, separators=(",", ":"), default=str))
    return -(-chars // CHARS_PER_TOKEN)


def binding_estimate(binding: object) -> TokenEstimate:
    """The estimate to use for calls through `binding`: its own `estimate_tokens(model, inputs)`
    when it has one, else `estimate_tokens`."""
    own = getattr(binding, "estimate_tokens", None)
    return own if callable(own) else estimate_tokens


def max_tokens_of(value: Any, default: int | None) -> int | None:
    """The `max_tokens` a call asks for, given the inputs' `value` and the route's `default`:
    `value` when it is a number of tokens (an `int`, or a `float` with no fraction, never a
    `bool`) of at least 1, capped to `MAX_TOKENS`; else `default`. A huge `int` is compared,
    never converted (linear in its digits, no `OverflowError`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    if value >= MAX_TOKENS:  # an int of any size, or a float up to infinity
        return MAX_TOKENS
    if value < 1 or (isinstance(value, float) and not value.is_integer()):  # NaN included
        return default
    return int(value)


def with_max_tokens(inputs: Mapping[str, Any], default: int | None) -> Mapping[str, Any]:
    """`inputs` as sent to the provider and held by the budgets: their `max_tokens` is
    `max_tokens_of` theirs and the route's `default`, an `int`, or absent when neither is one.
    `inputs` themselves when that is what they already say."""
    value = inputs.get("max_tokens")
    if type(value) is int and 0 < value <= MAX_TOKENS:  # the usual cases first, inline
        return inputs
    if value is None and "max_tokens" not in inputs:
        return inputs if default is None else {**inputs, "max_tokens": default}
    most = max_tokens_of(value, default)
    if most is None:
        return {k: v for k, v in inputs.items() if k != "max_tokens"}
    return {**inputs, "max_tokens": most}
