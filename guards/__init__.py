"""guards: keep AI routes standing.

Decorate a FastAPI route with `Guards.route` and every provider failure becomes either the
same-shape envelope (a degrading route) or a stable public error (a strict route).
"""

#: The version of the `route-guards` distribution (the one place it is written).
__version__ = "0.1.0"

from ._binding import AIResult, Binding, Usage
from ._breaker import Breaker, CircuitState, Outcome
from ._budget import Budget, Price, StoreFailureMode, client_key, header_key
from ._call import Retry
from ._chain import Chain, ModelRef, Profile, flatten_chain
from ._classify import Classification, classify
from ._clock import Clock, SystemClock
from ._cooldown import Cooldown
from ._effort import Effort, Tier, estimate_effort, override_effort
from ._envelope import Envelope, ErrorBody, FallbackInfo, Problem
from ._errors import ConfigurationError, GuardsError, GuardTripped, ProviderError
from ._event_stream import GUARDS_EVENTS, EventStream, StreamFormat, StreamWriter
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
    "ToolCallDelta",
    "Usage",
    "bearer_token",
    "classify",
    "client_key",
    "estimate_effort",
    "flatten_chain",
    "flush_logs",
    "header_key",
    "is_output",
    "override_effort",
    "public_error",
    "render_metrics",
]
