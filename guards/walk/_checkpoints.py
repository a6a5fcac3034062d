"""A task's checkpoints: the steps one request of a task route loads instead of calling, and
saves after calling (see `guards.policies._tasks` for tasks, and `AI.step`).

The task endpoint claims the task and leaves a `TaskRun` in the request's scope (`TASK_SCOPE`);
`AI.step` loads and saves through it; the endpoint completes or releases it when the request
ends."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from ..policies._tasks import MAX_STEPS, lease_s
from ..stores import StoreUnavailable
from ._events import Checkpointed, StoreFailed

if TYPE_CHECKING:
    from starlette.requests import Request

    from ..contracts._output import OutputGuard
    from ..spec._route_spec import GuardedRoute
    from ..stores import Store
    from ._observers import Observers

__all__ = ["TASK_SCOPE", "Called", "TaskRun", "resumed", "task_of"]

#: Where a task route's request keeps the task it holds (`TaskRun`).
TASK_SCOPE = "guards.task"


class Called(Protocol):
    """What a task asks of the request's handle when it ends: how many calls it made."""

    @property
    def attempts(self) -> int: ...


class TaskRun:
    """The task one request holds: its saved steps, and the lease to write them with."""

    __slots__ = (
        "_bytes",
        "_key",
        "_lease",
        "_lease_s",
        "_max_bytes",
        "_observe",
        "_route",
        "_steps",
        "_store",
        "called",
        "resumed",
    )

    def __init__(
        self,
        store: Store,
        route: GuardedRoute,
        key: str,
        lease: str,
        steps: Mapping[str, str],
        observe: Observers,
    ) -> None:
        assert route.task is not None
        self._store = store
        self._route = route
        self._key = key
        self._lease = lease
        self._lease_s = lease_s(route.timeout_s)
        self._steps = dict(steps)
        self._max_bytes = route.task.max_bytes
        self._observe = observe
        #: Bytes of the steps saved (as the store holds them).
        self._bytes = sum(len(value.encode()) for value in self._steps.values())
        #: The steps loaded instead of called, in order (`AI.resumed_steps`).
        self.resumed: tuple[str, ...] = ()
        #: The request's handle, once its endpoint made it: what it called (`release`).
        self.called: Called | None = None

    def load(self, name: str, output: OutputGuard) -> tuple[Any] | None:
        """The value saved for step `name`, validated against `output` (in a 1-tuple: a step
        may return None), or None when there is none or it no longer validates."""
        saved = self._steps.get(name)
        if saved is None:
            return None
        try:
            value = output.load(saved)
        except ValidationError:  # the step's type changed since: run it again
            self._bytes -= len(self._steps.pop(name).encode())
            return None
        self._observe.checkpointed(Checkpointed(self._route, "resumed"))
        self.resumed = (*self.resumed, name)
        return (value,)

    async def save(self, name: str, output: OutputGuard, value: Any) -> None:
        """Save step `name`'s `value` (a failure to save is logged, and the request goes on:
        the step only runs again if the request fails later)."""
        text = output.dump(value)
        size, before = len(text.encode()), self._steps.get(name)
        grown = self._bytes + size - (len(before.encode()) if before is not None else 0)
        if grown > self._max_bytes or (before is None and len(self._steps) >= MAX_STEPS):
            return
        try:
            saved = await self._store.task_save(self._key, self._lease, name, text, lease_s=self._lease_s)
        except StoreUnavailable:
            self._lost("task_save")
            return
        if saved:
            self._steps[name], self._bytes = text, grown
            self._observe.checkpointed(Checkpointed(self._route, "saved"))

    async def complete(self, stored: str) -> None:
        try:
            await self._store.task_complete(self._key, self._lease, stored)
        except StoreUnavailable:
            self._lost("task_complete")

    async def release(self) -> None:
        """The request ended without a success to keep: a request that called no model (it
        was refused before any call, or loaded every step) drops the task (`Store.task_drop`:
        a task with no saved step leaves nothing behind); any other releases its lease."""
        try:
            if self.called is None or self.called.attempts == 0:
                await self._store.task_drop(self._key, self._lease)
            else:
                await self._store.task_release(self._key, self._lease)
        except StoreUnavailable:  # the lease lapses by itself
            self._lost("task_release")

    def _lost(self, op: str) -> None:
        self._observe.store_failed(StoreFailed(self._route, None, "task", op=op))


def task_of(request: Request | None) -> TaskRun | None:
    """The task `request` holds, if any."""
    task: TaskRun | None = request.scope.get(TASK_SCOPE) if request is not None else None
    return task


def resumed(request: Request | None) -> tuple[str, ...]:
    """The steps the request's task loaded instead of calling (`AI.resumed_steps`)."""
    task = task_of(request)
    return task.resumed if task is not None else ()
