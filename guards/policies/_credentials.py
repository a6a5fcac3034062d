"""Credentials a provider rejects (HTTP 401 or 403) are named in the logs as such, once per model
and minute: a wrong or revoked token must not look like an outage.

    {"event": "provider_rejected_credentials", "model": "@cf/...", "status": 401, "code": 10000}

at warning level (`code` when the provider sent a numeric one; never its message).
"""

from __future__ import annotations

import time

from ..contracts._errors import ProviderError
from ..observe._log import emit_warning
from ..stores import Store, StoreUnavailable

__all__ = ["CredentialWarnings"]

#: The statuses of a provider that refuses who we are (or what our account may do).
REJECTED_STATUSES = frozenset({401, 403})
#: At most one warning per model in this many seconds (per process).
WARN_EVERY_S = 60.0


class CredentialWarnings:
    """When each model's last warning was logged, by the store's clock. Holds one entry per
    model of the app's chains: bounded by the configuration, not by traffic."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    async def failed(self, store: Store, model: str, error: BaseException) -> None:
        """Log a warning when `error` is a 401 or 403 and `model` had none in the last minute."""
        if not isinstance(error, ProviderError) or error.status not in REJECTED_STATUSES:
            return
        try:
            now = await store.now()
        except StoreUnavailable:
            now = time.time()
        # Checked and set with no await in between: concurrent failures log once.
        last = self._last.get(model)
        if last is not None and 0 <= now - last < WARN_EVERY_S:
            return
        self._last[model] = now
        emit_warning("provider_rejected_credentials", model=model, status=error.status, code=error.code)
