"""`ARRIVED`: the scope key of a request's arrival at the app, where its clock starts.

Under a burst on one event loop, taking a request in (reading its body, validating it, routing
it) took 0.45 to 0.72 s at the median and up to 1 s before its guarded endpoint even began: a
deadline counted from there was kept that much late. So `Guards.install`'s middleware
(`guards.routes._middleware`), outside the app's routing, stamps every HTTP request's scope
with the moment it reached the app (`time.perf_counter()`, the reading it makes anyway), and a
guarded request counts from it: its first walk's deadline (`timeout_s`), its stream's
`stream_max_s`, its `latency_ms`. A request without a stamp (the request that installed guards on an app without `install`: see
`Guards._ensure_installed`) counts from its guarded endpoint's start.
"""

from __future__ import annotations

__all__ = ["ARRIVED"]

#: `scope[ARRIVED]`: when the request reached the app (`time.perf_counter()`).
ARRIVED = "guards.arrived"
