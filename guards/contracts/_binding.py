"""The binding protocol: the one seam between guards and a model provider.

Shaped like Workers AI's `env.AI.run(model, inputs)`. Real adapters (`guards.providers`) and the
fakes in `guards.testing` implement it, so a test swaps one for the other and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["AIResult", "Binding", "Usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    """A call's tokens, normalized whatever the provider's wire: `prompt_tokens` counts every
    input token, those read from the provider's prompt cache (`cached_input_tokens`) and
    written to it (`cache_write_tokens`) included, so that `Price.cost` bills each token once."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        """Both calls' tokens (a request's calls, summed: `AI.usage`)."""
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.total_tokens + other.total_tokens,
            self.cached_input_tokens + other.cached_input_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
        )


@dataclass(frozen=True, slots=True)
class AIResult:
    """A provider's successful answer.

    `response` is the text, or the parsed object in JSON mode (some models send a JSON string
    instead: the output guard accepts both). `model` is the model that served, when the provider
    says so. `moderated` is set when the provider itself flagged or filtered the answer;
    `truncated` when it stopped at its token limit (`finish_reason: length`). `finish_reason`
    is the provider's own, when it sends one (OpenAI-compatible answers do; Workers AI's do not).
    """

    response: Any
    model: str
    usage: Usage | None = None
    tool_calls: tuple[Mapping[str, Any], ...] = field(default=())
    moderated: bool = False
    truncated: bool = False
    finish_reason: str | None = None


@runtime_checkable
class Binding(Protocol):
    """Runs a model. Raises `ProviderError` for every provider failure, nothing else.

    `inputs` follows Workers AI's shape (`messages` or `prompt`, and `response_format`
    `{"type": "json_schema", "json_schema": ...}` for JSON mode); adapters for other providers
    translate it. Cancellation must really stop the call (close the connection).

    A binding may also define `estimate_tokens(model, inputs) -> int`: the input tokens of a
    call, when it knows better than `guards.estimate_tokens` (characters / 4), e.g. with the
    model's tokenizer. Guards then asks it before calling a model with a declared context
    window (`Guards(context_windows=...)`). Optional: a binding without it gets the default.

    A binding whose provider bills a stream that ends early (its client gone, or cut) in full
    says so with `bills_cancelled_streams_in_full = True`: such a stream then keeps its whole
    spend and token holds, instead of the estimate from its input and the characters
    delivered (see docs/guards/budget.md, "A stream that ends early").
    """

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult: ...

    async def aclose(self) -> None: ...
