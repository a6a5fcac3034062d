"""Resumable streams: a stream whose events are kept in the app's store, so that a client that
lost its connection gets the events it missed, and then the live rest, from any worker.

A resumable stream is produced by a task of its own (`keep`): it relays the committed attempt
(`guards.streams._relay.relay`, limits and accounting as ever) whatever its clients do, gives
each Server-Sent Event an `id` (`<stream id>:<n>`, n from 1), hands the events to the client of
the request that started it (in memory), and appends them to the store (`StreamKeeper`): at most
one write in flight per stream, the events that came meanwhile written together in the next
one, so a stream costs at most one store write per event, and fewer when they come in bursts.
Its client leaving does not cancel it: it runs to its end (its limits bound it), then its
events are kept `Resumable.ttl_s`. It stops being kept (the rest still goes to its client) past
`Resumable.max_events` events or `max_bytes` bytes, or when the store fails: then the kept
events end with a marker, and a resume after them ends with an `error` event.

`resume_events` reads a kept stream from a position, for a resume request on any worker: the
kept events, then each new one as it is kept (a bounded poll on stores that cannot wake their
readers), until the stream's last event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request

from ..contracts._errors import ConfigurationError
from ..observe._families import STREAM_KEPT
from ..observe._log import emit_warning
from ..observe._tallies import counter
from ..stores._base import StoreUnavailable
from ..stores._kept import StreamKeeper
from ._event_stream import StreamCut

__all__ = [
    "END",
    "KEPT_WAIT_S",
    "OVER",
    "Resumable",
    "caller",
    "chat_name",
    "keep",
    "new_stream_id",
    "numbered",
    "resume_events",
    "stop_kept_streams",
    "stream_key",
]

#: The item that follows a kept stream's last event; and the one that ends a stream that
#: stopped being kept before its end (past its caps, or its store failed).
END = "\x00end"
OVER = "\x00over"
#: How many kept events a resume reads per store operation.
_READ_BATCH = 256
#: The longest a producer waits for its last store write when it ends.
KEPT_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Resumable:
    """`guards.route(..., resumable=Resumable())`: keep the route's streams in the store, so a
    client can resume one (see docs/streaming.md, "Resuming a stream").

    `ttl_s`: how long a stream's events are kept after its end (default 5 minutes);
    `max_events`, `max_bytes`: the most events and bytes of one stream kept (default 10,000
    and 1 MiB): past either, the rest goes to its client but is not kept, and a resume past
    what was kept ends with an `error` event. A value out of range raises
    `ConfigurationError`."""

    ttl_s: float = 300.0
    max_events: int = 10_000
    max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not 0 < self.ttl_s <= 86_400:
            raise ConfigurationError(
                f"Resumable.ttl_s is more than 0 and at most 86400 (a day); got {self.ttl_s!r}"
            )
        if not 0 < self.max_events <= 1_000_000:
            raise ConfigurationError(f"Resumable.max_events is 1 to 1,000,000; got {self.max_events!r}")
        if not 0 < self.max_bytes <= 64 << 20:
            raise ConfigurationError(f"Resumable.max_bytes is 1 to 67108864 (64 MiB); got {self.max_bytes!r}")


def caller(keys: Sequence[Callable[[Request], str]], request: Request) -> str:
    """Who is asking, as a route's budgets name the caller (their keys of `request`): a
    stream is kept for, and resumed by, the same caller only."""
    return "\x1f".join(key(request) for key in keys)


def numbered(chunk: bytes, stream_id: str, first: int) -> bytes:
    """The Server-Sent Events of `chunk`, each given its `id` (`<stream_id>:<n>`, from
    `first`)."""
    events = chunk.split(b"\n\n")[:-1]
    prefix = f"id: {stream_id}:".encode()
    return b"".join(prefix + str(n).encode() + b"\n" + e + b"\n\n" for n, e in enumerate(events, first))


def new_stream_id() -> str:
    """A stream's id: 128 random bits, URL-safe (22 characters)."""
    return secrets.token_urlsafe(16)


def _scoped(route: str, caller: str, kind: str, name: str) -> str:
    digest = hashlib.sha256(f"{route}\x00{caller}".encode()).hexdigest()[:32]
    return f"guards:kept:{digest}:{kind}:{name}"


def stream_key(route: str, caller: str, stream_id: str) -> str:
    """The store key of a stream's events: scoped by the route and the caller (its budget
    key), so only the same caller on the same route finds it."""
    return _scoped(route, caller, "s", stream_id)


def chat_name(route: str, caller: str, chat_id: str) -> str:
    """The store name of a chat's current stream (the AI SDK's resume), scoped likewise."""
    return _scoped(route, caller, "c", chat_id)


#: The producers running in this process, by the app (`Shared`) whose route started them.
_producers: dict[int, set[asyncio.Task[None]]] = {}


async def stop_kept_streams(owner: object, timeout_s: float = 1.0) -> None:
    """End the resumable streams `owner`'s routes produce (at the app's shutdown, before the
    store closes): each ends with its `error` event, as a stream the server cuts, kept."""
    tasks = _producers.pop(id(owner), set())
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


class _Producer:
    """One resumable stream being produced: its events for its first client (`local`) and for
    the store (`pending`, written by `write`)."""

    def __init__(
        self, store: StreamKeeper, key: str, stream_id: str, spec: Resumable, live_ttl_s: float, route: str
    ) -> None:
        self.store, self.key, self.spec = store, key, spec
        self.prefix = f"id: {stream_id}:".encode()
        self.live_ttl_s = live_ttl_s
        self.n = 0
        self.local: deque[bytes] = deque()
        self.grown = asyncio.Event()
        self.ended = False
        self.pending: list[str] = []
        self.wake = asyncio.Event()
        self.keeping = True
        self.kept_bytes = 0
        self.written = 0  # items in the store
        self.first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.route = route
        self.events = counter(STREAM_KEPT, route, "events")
        self.writes = counter(STREAM_KEPT, route, "writes")

    def add(self, chunk: bytes) -> None:
        """The events of `chunk` (whole Server-Sent Events), each given its id."""
        out = []
        for event in chunk.split(b"\n\n")[:-1]:
            self.n += 1
            data = self.prefix + str(self.n).encode() + b"\n" + event + b"\n\n"
            out.append(data)
            if self.keeping:
                text = data.decode()
                size = len(data)
                if self.n > self.spec.max_events or self.kept_bytes + size > self.spec.max_bytes:
                    self._stop_keeping("caps")
                else:
                    self.kept_bytes += size
                    self.pending.append(text)
        if out:
            self.local.append(b"".join(out))
            self.grown.set()
            self.wake.set()

    def _stop_keeping(self, why: str) -> None:
        self.keeping = False
        self.pending.append(OVER)
        counter(STREAM_KEPT, self.route, "dropped").add()
        emit_warning("stream_not_kept", route=self.route, reason=why)

    def end(self) -> None:
        self.ended = True
        self.grown.set()
        self.wake.set()

    async def write(self) -> None:
        """Write what is pending, one write at a time (what came meanwhile goes together in the
        next), until the stream ended and all is written, or the store failed."""
        while True:
            if not self.pending and not self.ended:
                self.wake.clear()
                await self.wake.wait()
                continue
            batch, self.pending = self.pending, []
            last = self.ended
            if last and self.keeping:
                batch.append(END)
            if batch and self.written >= 0:
                try:
                    ttl_s = self.spec.ttl_s if last else self.live_ttl_s
                    ok = await self.store.kept_append(self.key, batch, at=self.written, ttl_s=ttl_s)
                except StoreUnavailable:
                    ok = False
                self.writes.add()
                if ok:
                    self.written += len(batch)
                    self.events.add(sum(1 for item in batch if not item.startswith("\x00")))
                else:  # the store failed, or forgot the stream: not kept from now on
                    self.written = -1
                    if self.keeping:
                        self.keeping = False
                        counter(STREAM_KEPT, self.route, "dropped").add()
                        emit_warning("stream_not_kept", route=self.route, reason="store")
            if not self.first.done():
                self.first.set_result(None)
            if last:
                return

    async def reader(self) -> AsyncIterator[bytes]:
        """The events for the request's own client, as they come."""
        while True:
            if self.local:
                yield self.local.popleft()
                continue
            if self.ended:
                return
            self.grown.clear()
            await self.grown.wait()


async def keep(
    owner: object,
    store: StreamKeeper,
    key: str,
    stream_id: str,
    body: AsyncIterator[bytes],
    spec: Resumable,
    *,
    live_ttl_s: float,
    route: str,
    after: Callable[[], Awaitable[None]] | None = None,
    chat: str | None = None,
) -> AsyncIterator[bytes]:
    """Produce the stream `body` (the relay of a committed attempt) in a task of its own,
    keeping its events under `key` (while live for `live_ttl_s` after each write: the
    stream's own time limit and more), then `after()` (the response's background task).
    Returns, once its first events are in the store (or the store failed: then the stream is
    not kept), the events for the request's own client, with their ids. `chat`: the name
    under which the stream is kept as a chat's current stream."""
    if chat is not None:
        try:
            await store.kept_set(chat, stream_id, ttl_s=live_ttl_s)
        except StoreUnavailable:
            emit_warning("stream_not_kept", route=route, reason="store")
    producer = _Producer(store, key, stream_id, spec, live_ttl_s, route)

    async def produce() -> None:
        writing = asyncio.create_task(producer.write())
        try:
            try:
                async for chunk in body:
                    producer.add(chunk)
            except StreamCut as cut:  # the app shuts down (`stop_kept_streams`): its last event
                producer.add(cut.last)
            except asyncio.CancelledError:
                pass
            finally:
                producer.end()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(writing), KEPT_WAIT_S)
        finally:
            if after is not None:
                await after()

    task = asyncio.get_running_loop().create_task(produce())
    tasks = _producers.setdefault(id(owner), set())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    await asyncio.wait([producer.first, task], return_when=asyncio.FIRST_COMPLETED)
    return producer.reader()


async def resume_events(
    store: StreamKeeper,
    key: str,
    after: int,
    *,
    max_s: float,
    over: Callable[[int], bytes],
    late: Callable[[int], bytes],
) -> AsyncIterator[bytes] | None:
    """The events of the stream kept under `key` after its `after`-th (0: all of them), then
    each new one as it is kept, until its last; None when there is nothing to send (no such
    stream, it expired, or the client has its last event already). A stream that stopped
    being kept before its end ends with `over(n)` (n: the number of the event it makes),
    one that does not end within `max_s` (its worker died) with `late(n)`."""
    read = await store.kept_read(key, after, _READ_BATCH)
    if read is None:
        return None
    length, items = read
    if not items and after >= length:  # past what is kept: over, or still to be written?
        tail = await store.kept_read(key, length - 1, 1)
        if tail is not None and tail[1] and tail[1][0] in (END, OVER):
            items = tail[1]
    if items[:1] == [END]:
        return None  # the client has every event
    return _follow(store, key, after, items, max_s, over, late)


async def _follow(
    store: StreamKeeper,
    key: str,
    after: int,
    items: list[str],
    max_s: float,
    over: Callable[[int], bytes],
    late: Callable[[int], bytes],
) -> AsyncIterator[bytes]:
    """The kept events from `items` (read after the `after`-th) on, as they are kept."""
    deadline = time.monotonic() + max_s
    sent = after  # the events the client has
    position = after  # the next item to read
    while True:
        out: list[str] = []
        for item in items:
            if item in (END, OVER):
                if out:
                    yield "".join(out).encode()
                if item == OVER:
                    yield over(sent + len(out) + 1)
                return
            out.append(item)
        if out:
            yield "".join(out).encode()
        sent += len(out)
        position += len(items)
        if not items:
            left = deadline - time.monotonic()
            if left <= 0:
                yield late(sent + 1)
                return
            await store.kept_wait(key, position, min(left, 1.0))
        read = await store.kept_read(key, position, _READ_BATCH)
        if read is None:  # expired while read (its worker died long ago)
            yield late(sent + 1)
            return
        items = read[1]
