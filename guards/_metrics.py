"""Prometheus metrics guards counts (`prometheus-client`, default registry).

Labels come from closed sets only (guard names, failure modes, operations): never a user id, a
route's input or a free-text detail.
"""

from __future__ import annotations

from prometheus_client import Counter

__all__ = ["STORE_UNAVAILABLE"]

STORE_UNAVAILABLE = Counter(
    "guards_store_unavailable",
    "Store operations that failed (store down or slower than its timeout), by guard and what the "
    "guard did: open (admitted), closed (refused), or the op that was lost after the call.",
    ["guard", "action"],
)
