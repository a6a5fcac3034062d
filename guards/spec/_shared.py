"""`Shared`: what the requests of one app share, as the modules below `Guards` see it.

The request path (`guards.walk`), the route decorator and its endpoint, tasks, service levels
and the status page are typed against this protocol, not against `Guards`: each reads only
these names, so it can be built and tested without the whole facade, and no module below
`guards._guards` imports it (`tests/test_imports.py` holds that). `Guards` satisfies it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Literal, Protocol

from ..contracts._binding import Binding
from ..contracts._vocabulary import Attribution
from ..observe._ledger import Ledger
from ..policies._budget import Price
from ..policies._chain import Profile
from ..policies._cooldown import Cooldown
from ..policies._credentials import CredentialWarnings
from ..policies._deployments import Balance
from ..policies._price_table import PriceTable
from ..policies._retry_budget import RetryWindows
from ..stores import Store
from ._levels import Levels, ServiceLevel
from ._route_spec import GuardedRoute, KnownRefusal
from ._tracing import Tracing

__all__ = ["Shared"]


class Shared(Protocol):
    """The bindings, the store, the clocks and the observers an app's requests share."""

    #: The main binding (provider `"default"`), and the other providers by name.
    binding: Binding
    providers: dict[str, Binding]
    profiles: Mapping[str, Profile]
    hints: Mapping[str, str]
    #: Budget, breaker, cooldown, task and last-good state (replaced only by `replace_store`).
    store: Store
    #: What retries wait with (a test injects a no-op).
    sleep: Callable[[float], Awaitable[None]]
    retry_after_s: float
    prices: dict[str, Price]
    #: Where prices missing from `prices` are looked up (`Guards(price_table=...)`), or None.
    price_table: PriceTable | None
    #: Each model's declared context window in tokens, by model key.
    context_windows: Mapping[str, int]
    cost_unit_usd: float
    attribution: Attribution
    ledger: Ledger
    #: Which calls the default ledger writes a line for; the share of successes logged.
    log_attempts: Literal["retries", "all"]
    log_sample: float
    #: The tracer when tracing is on, else None.
    tracing: Tracing | None
    retry_windows: RetryWindows
    credential_warnings: CredentialWarnings
    #: This worker's last success per model (breaker key) on `success_clock`.
    last_success: dict[str, list[float | None]]
    success_clock: Callable[[], float]
    #: What this worker last heard refuses each model (model key), until when, on
    #: `success_clock` (see `guards.walk._known`).
    known_refusals: dict[str, KnownRefusal]
    levels: Levels
    #: Every guarded route, in the order declared.
    routes: list[GuardedRoute]
    #: What the strategies of groups of deployments read (`guards.Deployments`).
    balance: Balance

    def cooldown_for(self, model: str) -> Cooldown: ...

    def service_level(self) -> ServiceLevel: ...

    def _ensure_installed(self, app: object, route: str) -> None:
        """Install on `app` unless guards are installed there: the first request a guarded
        route (named `route`) serves on an app whose `install` was forgotten."""
        ...
