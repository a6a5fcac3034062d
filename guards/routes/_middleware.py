"""`GuardsMiddleware`: the one ASGI middleware `Guards.install` adds, outside the app's routing.

For each HTTP request, in this order:

- a resume request of a resumable streaming route (`GET <path>/<id>/stream`) is answered
  here (`guards.routes._resume`), never routed;
- every other request is stamped with its arrival (`guards.waits._arrival`), where a guarded
  request's clock starts, and keeps the worker's service level fresh (`Levels.tick`); while
  the level is not full, a guarded route's response gets `x-service-level`; with
  `Guards(max_in_flight=N)`, a guarded request is counted out of flight when its response is
  done (a stream included), however it ended (`Levels.enter` counts it in);
- its body is read through `LimitedReceive` (`guards.routes._body_limit`): a guarded route
  reads at most its `max_body_bytes`.

One middleware, not one per concern: each layer is a coroutine every request passes through.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from ..spec._levels import IN_FLIGHT
from ..waits._arrival import ARRIVED
from ._body_limit import LimitedReceive
from ._resume import ResumeRoutes

if TYPE_CHECKING:
    from ..spec._shared import Shared

__all__ = ["GuardsMiddleware"]


class GuardsMiddleware:
    """Guards' ASGI middleware (see the module docstring); `guards` is the app's `Guards`."""

    def __init__(self, app: ASGIApp, guards: Shared) -> None:
        self.app = app
        self._levels = guards.levels
        self._resumes = ResumeRoutes(guards)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (
            scope["method"] == "GET"
            and scope["path"].endswith("/stream")
            and await self._resumes.answer(scope, receive, send)
        ):
            return
        levels = self._levels
        receive = LimitedReceive(scope, receive)
        if ARRIVED in scope:
            # An app mounted in an app with guards installed (by hand, or by its first guarded
            # request): the outer middleware stamped the request, adds its header and counts it
            # out, once; this one keeps its own level fresh (another `Guards`' maybe).
            levels.tick(perf_counter())
            await self.app(scope, receive, send)
            return
        scope[ARRIVED] = now = perf_counter()
        levels.tick(now)
        if levels.header is not None:
            send = levels.with_header(scope, send)
        if levels.max_in_flight is None:
            await self.app(scope, receive, send)
            return
        scope[IN_FLIGHT] = False  # the endpoint sets it when it counts the request in
        try:
            await self.app(scope, receive, send)
        finally:
            if scope[IN_FLIGHT]:
                levels.in_flight -= 1
