"""guards: keep AI routes standing.

Decorate a FastAPI route with `Guards.route` and every provider failure becomes either the
same-shape envelope (a degrading route) or a stable public error (a strict route).

Every public name is imported on first use (PEP 562: `__getattr__` below): `import guards`
imports nothing else, `from guards import AI, Guards` imports what every guarded route uses, and
a feature's modules (effort routing, tasks, the status page, the throttle, the AI SDK's UI
message stream, the SQLite and Redis stores, tracing) load when an app uses it. So a process
that needs a part of guards does not pay for the rest: `python -m guards.serve`'s supervisor
imports neither FastAPI nor the engine. The imports under `TYPE_CHECKING` are for type checkers
and readers; `_PUBLIC` says the same to the interpreter (tests/test_imports.py checks that they
agree).
"""

#: The version of the `route-guards` distribution (the one place it is written).
__version__ = "0.1.0"

import importlib
import typing

if typing.TYPE_CHECKING:
    from ._binding import AIResult, Binding, Usage
    from ._breaker import Breaker, CircuitState, Outcome
    from ._budget import Budget, Price, StoreFailureMode, client_key, header_key
    from ._call import Retry
    from ._chain import Chain, Model, ModelRef, Profile, flatten_chain
    from ._classify import Classification, classify
    from ._clock import Clock, SystemClock
    from ._cooldown import Cooldown
    from ._effort import Effort, Tier, estimate_effort, override_effort
    from ._envelope import Envelope, ErrorBody, FallbackInfo, Problem
    from ._errors import ConfigurationError, GuardsError, GuardTripped, ProviderError
    from ._event_stream import GUARDS_EVENTS, EventStream, StreamFormat, StreamWriter
    from ._first_output import first_output_arrived
    from ._guards import Guards
    from ._last_good import LastGood
    from ._ledger import Attempt, Ledger, LogLedger
    from ._levels import ModelDown, ServiceLevel
    from ._log import flush_logs
    from ._metrics import render_metrics
    from ._output import Moderation
    from ._responses import PublicError, public_error
    from ._retry_budget import RetryBudget
    from ._route import FallbackFunction
    from ._stream import (
        ReasoningDelta,
        StreamEnd,
        StreamEvent,
        StreamingBinding,
        TextDelta,
        ToolCallDelta,
        is_output,
    )
    from ._tasks import Task
    from ._throttle import Throttled
    from ._tokens import estimate_tokens
    from ._tools import ToolCall
    from ._ui_stream import UI_MESSAGE_STREAM, UIChatRequest, UIMessage, UIPart
    from ._vocabulary import Attribution, ErrorCode, GuardName, Kind, Level, Reason
    from .status import StatusReport, bearer_token
    from .walk import AI

__all__ = [
    "AI",
    "AIResult",
    "Attempt",
    "Attribution",
    "Binding",
    "Breaker",
    "Budget",
    "Chain",
    "CircuitState",
    "Classification",
    "Clock",
    "ConfigurationError",
    "Cooldown",
    "Effort",
    "Envelope",
    "ErrorBody",
    "ErrorCode",
    "EventStream",
    "GUARDS_EVENTS",
    "FallbackFunction",
    "FallbackInfo",
    "GuardName",
    "GuardTripped",
    "Guards",
    "GuardsError",
    "Kind",
    "StreamFormat",
    "StreamWriter",
    "UIChatRequest",
    "UIMessage",
    "UIPart",
    "UI_MESSAGE_STREAM",
    "LastGood",
    "Ledger",
    "Level",
    "LogLedger",
    "Model",
    "ModelDown",
    "ModelRef",
    "Moderation",
    "Outcome",
    "Price",
    "Problem",
    "Profile",
    "ProviderError",
    "PublicError",
    "Reason",
    "ReasoningDelta",
    "Retry",
    "RetryBudget",
    "ServiceLevel",
    "StoreFailureMode",
    "StatusReport",
    "StreamEnd",
    "StreamEvent",
    "StreamingBinding",
    "SystemClock",
    "Task",
    "TextDelta",
    "Tier",
    "Throttled",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "bearer_token",
    "classify",
    "client_key",
    "estimate_effort",
    "estimate_tokens",
    "first_output_arrived",
    "flatten_chain",
    "flush_logs",
    "header_key",
    "is_output",
    "override_effort",
    "public_error",
    "render_metrics",
]

#: Where each public name is defined: `__getattr__` imports it from there on first use.
_PUBLIC = {
    "AIResult": "._binding",
    "Binding": "._binding",
    "Usage": "._binding",
    "Breaker": "._breaker",
    "CircuitState": "._breaker",
    "Outcome": "._breaker",
    "Budget": "._budget",
    "Price": "._budget",
    "StoreFailureMode": "._budget",
    "client_key": "._budget",
    "header_key": "._budget",
    "Retry": "._call",
    "Chain": "._chain",
    "Model": "._chain",
    "ModelRef": "._chain",
    "Profile": "._chain",
    "flatten_chain": "._chain",
    "flush_logs": "._log",
    "Classification": "._classify",
    "classify": "._classify",
    "Clock": "._clock",
    "SystemClock": "._clock",
    "Cooldown": "._cooldown",
    "Effort": "._effort",
    "Tier": "._effort",
    "estimate_effort": "._effort",
    "override_effort": "._effort",
    "Envelope": "._envelope",
    "ErrorBody": "._envelope",
    "FallbackInfo": "._envelope",
    "Problem": "._envelope",
    "ConfigurationError": "._errors",
    "GuardTripped": "._errors",
    "GuardsError": "._errors",
    "ProviderError": "._errors",
    "EventStream": "._event_stream",
    "GUARDS_EVENTS": "._event_stream",
    "StreamFormat": "._event_stream",
    "StreamWriter": "._event_stream",
    "first_output_arrived": "._first_output",
    "Guards": "._guards",
    "LastGood": "._last_good",
    "Attempt": "._ledger",
    "Ledger": "._ledger",
    "LogLedger": "._ledger",
    "ModelDown": "._levels",
    "ServiceLevel": "._levels",
    "render_metrics": "._metrics",
    "Moderation": "._output",
    "PublicError": "._responses",
    "public_error": "._responses",
    "RetryBudget": "._retry_budget",
    "FallbackFunction": "._route",
    "ReasoningDelta": "._stream",
    "StreamEnd": "._stream",
    "StreamEvent": "._stream",
    "StreamingBinding": "._stream",
    "TextDelta": "._stream",
    "ToolCallDelta": "._stream",
    "is_output": "._stream",
    "Task": "._tasks",
    "Throttled": "._throttle",
    "estimate_tokens": "._tokens",
    "ToolCall": "._tools",
    "UIChatRequest": "._ui_stream",
    "UIMessage": "._ui_stream",
    "UIPart": "._ui_stream",
    "UI_MESSAGE_STREAM": "._ui_stream",
    "Attribution": "._vocabulary",
    "ErrorCode": "._vocabulary",
    "GuardName": "._vocabulary",
    "Kind": "._vocabulary",
    "Level": "._vocabulary",
    "Reason": "._vocabulary",
    "StatusReport": ".status",
    "bearer_token": ".status",
    "AI": ".walk",
}
#: Subpackages an attribute of the package names (as `import guards.stores` would).
_SUBPACKAGES = frozenset({"stores", "status", "walk"})


def __getattr__(name: str) -> typing.Any:
    module = _PUBLIC.get(name)
    if module is None:
        if name in _SUBPACKAGES:  # `import guards` used to import these: `guards.stores` still works
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
