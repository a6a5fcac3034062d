"""Adapters from the binding protocol to real providers, the HTTP client they share (with its
admission limit), and the incremental Server-Sent Events parser their streams share.

`http_library` is the HTTP client library the adapters use, `httpx` or `httpx2`
(docs/providers/index.md): build a `client=` of your own with `http_library.AsyncClient(...)`
(`verify=tls_context()` shares the TLS context guards' own clients use)."""

from ._anthropic import Anthropic
from ._azure_openai import AzureOpenAI
from ._bedrock import Bedrock
from ._gemini import Gemini
from ._http import http_client, tls_context
from ._httpx import httpx as http_library
from ._openai import OpenAICompatible
from ._sse import EventTooLarge, SSEEvent, SSEParser
from ._workers_ai import WorkersAI, parse_workers_ai_response

__all__ = [
    "Anthropic",
    "AzureOpenAI",
    "Bedrock",
    "EventTooLarge",
    "Gemini",
    "OpenAICompatible",
    "SSEEvent",
    "SSEParser",
    "WorkersAI",
    "http_client",
    "http_library",
    "parse_workers_ai_response",
    "tls_context",
]
