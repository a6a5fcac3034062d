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
    from ._guards import Guards
    from .contracts._binding import AIResult, Binding, Usage
    from .contracts._classify import Classification, classify
    from .contracts._clock import Clock, SystemClock
    from .contracts._envelope import Envelope, ErrorBody, FallbackInfo, Problem
    from .contracts._errors import ConfigurationError, GuardsError, GuardTripped, ProviderError
    from .contracts._output import Moderation
    from .contracts._responses import PublicError, public_error
    from .contracts._stream import (
        ReasoningDelta,
        StreamEnd,
        StreamEvent,
        StreamingBinding,
        TextDelta,
        ToolCallDelta,
        is_output,
    )
    from .contracts._tokens import estimate_tokens
    from .contracts._tools import ToolCall
    from .contracts._vocabulary import Attribution, CircuitState, ErrorCode, GuardName, Kind, Level, Reason
    from .observe._ledger import Attempt, Ledger, LogLedger
    from .observe._log import flush_logs
    from .observe._metrics import render_metrics
    from .policies._budget import Budget, Price, SharedLimit, StoreFailureMode, client_key, header_key
    from .policies._call import Retry
    from .policies._chain import Chain, Deployment, Deployments, Model, ModelRef, Profile, flatten_chain
    from .policies._cooldown import Cooldown
    from .policies._hedge import Hedge
    from .policies._last_good import LastGood
    from .policies._price_table import GenAIPrices
    from .policies._retry_budget import RetryBudget
    from .policies._tasks import Task
    from .routes._effort import Effort, Tier, estimate_effort, override_effort
    from .routes._route import FallbackFunction
    from .spec._levels import ModelDown, ServiceLevel
    from .status import StatusReport, bearer_token
    from .stores._breaker import Breaker, Outcome
    from .streams._event_stream import GUARDS_EVENTS, EventStream, StreamFormat, StreamWriter
    from .streams._hold import StreamHold
    from .streams._kept import Resumable
    from .streams._ui_stream import UI_MESSAGE_STREAM, UIChatRequest, UIMessage, UIPart
    from .waits._first_output import first_output_arrived
    from .waits._throttle import Throttled
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
    "GenAIPrices",
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
    "StreamHold",
    "StreamWriter",
    "UIChatRequest",
    "UIMessage",
    "UIPart",
    "UI_MESSAGE_STREAM",
    "Hedge",
    "Deployment",
    "Deployments",
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
    "Resumable",
    "Retry",
    "RetryBudget",
    "ServiceLevel",
    "SharedLimit",
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
    "AIResult": ".contracts._binding",
    "Binding": ".contracts._binding",
    "Usage": ".contracts._binding",
    "Breaker": ".stores._breaker",
    "CircuitState": ".contracts._vocabulary",
    "Outcome": ".stores._breaker",
    "Budget": ".policies._budget",
    "Price": ".policies._budget",
    "StoreFailureMode": ".policies._budget",
    "client_key": ".policies._budget",
    "header_key": ".policies._budget",
    "Retry": ".policies._call",
    "Chain": ".policies._chain",
    "Model": ".policies._chain",
    "Deployment": ".policies._chain",
    "Deployments": ".policies._chain",
    "ModelRef": ".policies._chain",
    "Profile": ".policies._chain",
    "flatten_chain": ".policies._chain",
    "flush_logs": ".observe._log",
    "Classification": ".contracts._classify",
    "classify": ".contracts._classify",
    "Clock": ".contracts._clock",
    "SystemClock": ".contracts._clock",
    "Cooldown": ".policies._cooldown",
    "Effort": ".routes._effort",
    "Tier": ".routes._effort",
    "estimate_effort": ".routes._effort",
    "override_effort": ".routes._effort",
    "Envelope": ".contracts._envelope",
    "ErrorBody": ".contracts._envelope",
    "FallbackInfo": ".contracts._envelope",
    "Problem": ".contracts._envelope",
    "ConfigurationError": ".contracts._errors",
    "GuardTripped": ".contracts._errors",
    "GuardsError": ".contracts._errors",
    "ProviderError": ".contracts._errors",
    "EventStream": ".streams._event_stream",
    "GUARDS_EVENTS": ".streams._event_stream",
    "StreamFormat": ".streams._event_stream",
    "StreamHold": ".streams._hold",
    "StreamWriter": ".streams._event_stream",
    "first_output_arrived": ".waits._first_output",
    "Guards": "._guards",
    "LastGood": ".policies._last_good",
    "GenAIPrices": ".policies._price_table",
    "Attempt": ".observe._ledger",
    "Ledger": ".observe._ledger",
    "LogLedger": ".observe._ledger",
    "ModelDown": ".spec._levels",
    "ServiceLevel": ".spec._levels",
    "render_metrics": ".observe._metrics",
    "Moderation": ".contracts._output",
    "PublicError": ".contracts._responses",
    "public_error": ".contracts._responses",
    "RetryBudget": ".policies._retry_budget",
    "SharedLimit": ".policies._budget",
    "Hedge": ".policies._hedge",
    "FallbackFunction": ".routes._route",
    "ReasoningDelta": ".contracts._stream",
    "StreamEnd": ".contracts._stream",
    "StreamEvent": ".contracts._stream",
    "StreamingBinding": ".contracts._stream",
    "TextDelta": ".contracts._stream",
    "ToolCallDelta": ".contracts._stream",
    "is_output": ".contracts._stream",
    "Task": ".policies._tasks",
    "Throttled": ".waits._throttle",
    "estimate_tokens": ".contracts._tokens",
    "ToolCall": ".contracts._tools",
    "Resumable": ".streams._kept",
    "UIChatRequest": ".streams._ui_stream",
    "UIMessage": ".streams._ui_stream",
    "UIPart": ".streams._ui_stream",
    "UI_MESSAGE_STREAM": ".streams._ui_stream",
    "Attribution": ".contracts._vocabulary",
    "ErrorCode": ".contracts._vocabulary",
    "GuardName": ".contracts._vocabulary",
    "Kind": ".contracts._vocabulary",
    "Level": ".contracts._vocabulary",
    "Reason": ".contracts._vocabulary",
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
