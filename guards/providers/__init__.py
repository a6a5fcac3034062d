"""Adapters from the binding protocol to real providers, the HTTP client they share (with its
admission limit), and the incremental Server-Sent Events parser their streams share."""

from ._azure_openai import AzureOpenAI
from ._bedrock import Bedrock
from ._http import http_client
from ._openai import OpenAICompatible
from ._sse import EventTooLarge, SSEEvent, SSEParser
from ._workers_ai import WorkersAI, parse_workers_ai_response

__all__ = [
    "AzureOpenAI",
    "Bedrock",
    "EventTooLarge",
    "OpenAICompatible",
    "SSEEvent",
    "SSEParser",
    "WorkersAI",
    "http_client",
    "parse_workers_ai_response",
]
