"""Adapters from the binding protocol to real providers, and the incremental Server-Sent Events
parser their streams share."""

from ._openai import OpenAICompatible
from ._sse import EventTooLarge, SSEEvent, SSEParser
from ._workers_ai import WorkersAI, parse_workers_ai_response

__all__ = [
    "EventTooLarge",
    "OpenAICompatible",
    "SSEEvent",
    "SSEParser",
    "WorkersAI",
    "parse_workers_ai_response",
]
