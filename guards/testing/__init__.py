"""Test doubles for apps guarded by guards: scripted provider outcomes (whole answers and
streams), in-process and over real HTTP (Workers AI, OpenAI-compatible, AI Gateway's resume,
Gemini), a controllable clock, and a pytest plugin (`guards.testing.pytest_plugin`, registered
through the `pytest11` entry point: installing the package is enough) that hands them out."""

from ._types import UseFakeAI, UseFakeServers
from .clock import ManualClock
from .fake_anthropic import FakeAnthropic
from .fake_azure_openai import FakeAzureOpenAI
from .fake_bedrock import FakeBedrock
from .fake_binding import FakeBinding
from .fake_gemini import FakeGemini
from .fake_openai import FakeOpenAI
from .fake_workers_ai import FakeWorkersAI
from .script import (
    Call,
    Chooser,
    Drop,
    Fail,
    Hang,
    Meta,
    Raw,
    Reasoning,
    Refusal,
    Reply,
    Script,
    Stream,
    Text,
    ToolArgs,
    ToolCall,
    ToolName,
)

__all__ = [
    "Call",
    "Chooser",
    "Drop",
    "Fail",
    "FakeAnthropic",
    "FakeAzureOpenAI",
    "FakeBedrock",
    "FakeBinding",
    "FakeGemini",
    "FakeOpenAI",
    "FakeWorkersAI",
    "Hang",
    "ManualClock",
    "Meta",
    "Raw",
    "Reasoning",
    "Refusal",
    "Reply",
    "Script",
    "Stream",
    "Text",
    "ToolArgs",
    "ToolCall",
    "ToolName",
    "UseFakeAI",
    "UseFakeServers",
]
