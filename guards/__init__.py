"""guards: keep AI routes standing.

Decorate a FastAPI route with `Guards.route` and every provider failure becomes either the
same-shape envelope (a degrading route) or a stable public error (a strict route).
"""

from ._binding import AIResult, Binding, Usage
from ._breaker import Breaker, CircuitState, Outcome
from ._budget import Budget, Price, StoreFailureMode, client_key, header_key
from ._call import Retry
from ._classify import Classification, Kind, classify
from ._clock import Clock, SystemClock
from ._envelope import Envelope, ErrorBody, ErrorCode, FallbackInfo, GuardName, Reason
from ._errors import ConfigurationError, GuardsError, GuardTripped, ProviderError
from ._guards import Guards
from ._output import Moderation
from ._responses import PublicError, public_error
from ._route import AI, FallbackFunction
from ._throttle import Throttled

__all__ = [
    "AI",
    "AIResult",
    "Binding",
    "Breaker",
    "Budget",
    "CircuitState",
    "Classification",
    "Clock",
    "ConfigurationError",
    "Envelope",
    "ErrorBody",
    "ErrorCode",
    "FallbackFunction",
    "FallbackInfo",
    "GuardName",
    "GuardTripped",
    "Guards",
    "GuardsError",
    "Kind",
    "Moderation",
    "Outcome",
    "Price",
    "ProviderError",
    "PublicError",
    "Reason",
    "Retry",
    "StoreFailureMode",
    "SystemClock",
    "Throttled",
    "Usage",
    "classify",
    "client_key",
    "header_key",
    "public_error",
]
