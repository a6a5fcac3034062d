"""The HTTP client library the adapters use: the one place that decides between `httpx` and
`httpx2`, its maintained fork with the same API (the official OpenAI SDK's default).

`httpx2` when it is installed, else `httpx` (a dependency of guards); `GUARDS_HTTP_CLIENT=httpx`
or `=httpx2` decides instead, read once when the first adapter is imported. The two differ in
one way an operator sees: `httpx2` verifies TLS against the system's trust store (through
`truststore`), `httpx` against `certifi`'s bundle (see docs/providers/index.md).

An adapter given a client of the other library refuses it at construction (`check_client`):
its errors would not be the ones the adapter classifies.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..contracts._errors import ConfigurationError

__all__ = ["CHOSEN", "check_client", "httpx"]

#: The setting that picks the library, and the names it takes.
SETTING = "GUARDS_HTTP_CLIENT"
_CHOICES = ("httpx", "httpx2")


def _choose() -> ModuleType:
    wanted = os.environ.get(SETTING, "").strip()
    if wanted and wanted not in _CHOICES:
        raise ConfigurationError(f"{SETTING} must be httpx or httpx2; got {wanted!r}")
    if wanted:
        return importlib.import_module(wanted)
    try:
        return importlib.import_module("httpx2")
    except ModuleNotFoundError:
        return importlib.import_module("httpx")


if TYPE_CHECKING:
    import httpx
else:
    httpx = _choose()

#: The library chosen: `"httpx"` or `"httpx2"`.
CHOSEN: str = httpx.__name__


def check_client(client: Any, owner: str) -> None:
    """Refuse a client of the library guards did not choose (None is fine: the adapter's own)."""
    if client is None or isinstance(client, httpx.AsyncClient):
        return
    given = type(client).__module__.split(".")[0]
    raise ConfigurationError(
        f"{owner}(client=...) must be an {CHOSEN}.AsyncClient (guards uses {CHOSEN}); got a "
        f"{given} client: pass an {CHOSEN}.AsyncClient, or set {SETTING}={given}"
    )
