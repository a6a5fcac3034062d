"""The wire to one Redis server: `Wire`, one connection carrying every operation of one event
loop (commands packed and replies parsed by hiredis, in C, as the bytes come; at most
`MAX_IN_FLIGHT` commands unanswered; the steps of one loop turn coalesced into one script
call, `Wire.send_step`), and the lag-aware limit that bounds connecting (`Bound`) and each
reply (`Wire`). A reply overdue drops the connection and fails every
operation waiting on it (they were behind that reply); a socket error raises
`StoreUnavailable`, whose message names the error class (or the Redis error's code, such as
`WRONGPASS`) only, never the URL, host, port or password. hiredis is imported here alone: the
extra `[redis]` is named when it is missing.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, cast

from ...contracts._extras import missing_extra

try:
    import hiredis
except ModuleNotFoundError as _error:  # the extra [redis]
    raise missing_extra(_error, "redis", "RedisStore") from None

from .._base import StoreUnavailable

__all__ = [
    "LATE_S",
    "MAX_IN_FLIGHT",
    "MAX_TIMEOUTS",
    "Bound",
    "ReplyError",
    "Wire",
    "new_reader",
    "packed",
    "patience",
    "reply_code",
    "unavailable",
]

#: An error reply (`-ERR ...`), as hiredis gives it: a result, not raised.
ReplyError = hiredis.ReplyError


def new_reader() -> hiredis.Reader:
    """A parser of replies (strings decoded as UTF-8)."""
    return hiredis.Reader(encoding="utf-8")


def packed(*command: str | int) -> bytes:
    """A command in Redis' wire format (hiredis' packer; its stub types the tuple wrongly)."""
    return cast(bytes, hiredis.pack_command(command))  # type: ignore[arg-type]


#: The most commands one connection may have unanswered: past it, operations fail at once
#: (`StoreUnavailable`) rather than queue without end behind a server that does not answer.
MAX_IN_FLIGHT = 10_000
#: The most steps one script call carries (`Wire.send_step`), and the most bytes of their keys
#: and fields: past either, the turn's next steps start another call.
MAX_BATCH_STEPS = 64
MAX_BATCH_BYTES = 64 * 1024


class _Batch:
    """The steps given in one loop turn (`Wire.send_step`), written as one EVALSHA of the
    script's `steps` (or, alone, as the step's own `step`). Stands in the wire's queue where a
    command's future would: its reply is shared out to each step's future."""

    __slots__ = ("futures", "keys", "now", "pack", "sizes", "steps")

    def __init__(self, pack: Any, now: str) -> None:
        self.pack = pack  # (op, keys, now, args) -> bytes: `guards.stores._redis._scripts.pack`
        self.now = now
        self.keys: list[str] = []
        self.steps: list[str] = []
        self.sizes = 0
        self.futures: list[asyncio.Future[Any]] = []

    def add(self, keys: list[str], args: tuple[str, ...], future: asyncio.Future[Any]) -> None:
        self.keys += keys
        self.steps += [str(len(keys)), str(len(args)), *args]
        self.sizes += sum(map(len, keys)) + sum(map(len, args))
        self.futures.append(future)

    def packed(self) -> bytes:
        if len(self.futures) == 1:  # alone: the step's own call, as if never coalesced
            return cast(bytes, self.pack("step", self.keys, self.now, self.steps[2:]))
        return cast(bytes, self.pack("steps", self.keys, self.now, (str(len(self.futures)), *self.steps)))

    def done(self) -> bool:
        return all(future.done() for future in self.futures)

    def set_result(self, reply: Any) -> None:
        futures = self.futures
        if len(futures) > 1 and reply.__class__ is list:
            if len(reply) != len(futures):  # not the script's answer: nobody's
                self.set_exception(StoreUnavailable("Redis store unavailable (ProtocolError)"))
                return
            for future, each in zip(futures, reply, strict=True):
                if not future.done():
                    future.set_result(each)
            return
        for future in futures:  # one step's reply, or an error for the whole call (NOSCRIPT)
            if not future.done():
                future.set_result(reply)

    def set_exception(self, error: BaseException) -> None:
        for future in self.futures:
            if not future.done():
                future.set_exception(error)


class Wire(asyncio.Protocol):
    """One connection to Redis, carrying every operation of one event loop (pipelining).

    Commands given in one loop turn are written together, at the turn's end, in one write:
    a burst of requests costs a few round trips, not one each, and Redis answers in order, so
    each reply goes to the next command waiting. Nothing blocks on a reply: a caller that gives
    up (cancelled) leaves its reply to be read and dropped, and the connection stays usable.

    Replies are waited for under one timer, on the oldest command unanswered: it is overdue
    `timeout_s` after it was written. A limit timed on the event loop also passes when the loop
    itself is held up by other work of the worker (a burst of requests, a blocking call) while
    Redis answered in time: the reply is then waiting in the socket. So a limit that comes due
    is checked first: when it fires late (by `LATE_S` or more), or the loop then takes `LATE_S`
    or more to come round once more (which also reads a reply already there), the worker, not
    Redis, was slow, and the limit waits another `timeout_s`. It expires when the loop keeps up
    and no reply came, or after `MAX_TIMEOUTS` timeouts; then the connection is dropped and
    every command waiting on it fails (`StoreUnavailable`): they were behind that reply. The
    next operation dials again.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self._timeout_s = timeout_s
        self._reader = hiredis.Reader(encoding="utf-8")
        self._transport: asyncio.Transport | None = None
        self._opening: asyncio.Task[None] | None = None  # the dial in progress (a strong reference)
        #: Commands not written yet (until the turn ends, or the connection is made), and their
        #: callers' futures (None: a reply nobody waits for); a batch of steps stands for both.
        self._out: list[bytes | _Batch] = []
        self._queued: list[asyncio.Future[Any] | _Batch | None] = []
        #: The batch the turn's next step joins (None: the next step starts one).
        self._batch: _Batch | None = None
        #: Commands written and not answered yet, in order: (future, when it was written).
        self._waiting: collections.deque[tuple[asyncio.Future[Any] | _Batch | None, float]] = (
            collections.deque()
        )
        #: How many of the first replies answer the handshake (an error there fails the connection).
        self._handshake = 0
        self._flushing = False
        self._timer: asyncio.Handle | None = None
        self._watched: tuple[asyncio.Future[Any] | _Batch | None, float] | None = None
        self._due = 0.0
        self._probing = False
        #: Why the connection is unusable (None while it is usable).
        self.failure: str | None = None
        #: SCRIPT LOADs sent on this connection.
        self.loads = 0
        #: The reading of its server's settings (a strong reference: `Checks.check_settings`).
        self.checking: asyncio.Task[None] | None = None
        #: Its server's `evicted_keys` when last asked (None: not yet), and when it may be
        #: asked again (monotonic): `Checks.watch_evictions`.
        self.evicted: int | None = None
        self.evictions_due = 0.0
        #: The store's count of resets at that answer.
        self.resets_seen = 0
        #: Done once the socket is closed (if it was ever connected).
        self._made = False
        self._lost: asyncio.Future[None] = loop.create_future()

    # --- the store's side ----------------------------------------------------------------------

    def begin(self, handshake: list[bytes], opening: asyncio.Task[None]) -> None:
        self._handshake = len(handshake)
        self._out.extend(handshake)
        self._queued.extend([None] * len(handshake))
        self._opening = opening

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """`command` (packed), written at the end of this loop turn; the future of its reply
        (an error reply as a `hiredis.ReplyError` result)."""
        if self.failure is not None:
            raise StoreUnavailable(self.failure)
        if len(self._waiting) + len(self._queued) >= MAX_IN_FLIGHT:
            raise StoreUnavailable("Redis store unavailable (too many operations in flight)")
        future = self.loop.create_future()
        self._out.append(command)
        self._queued.append(future)
        self._batch = None  # a step given after it goes after it
        if not self._flushing and self._transport is not None:
            self._flushing = True
            self.loop.call_soon(self._flush)
        return future

    def send_step(self, pack: Any, keys: list[str], args: tuple[str, ...], now: str) -> asyncio.Future[Any]:
        """A step of the script (its KEYS, its fields from ARGV[3], the time argument `now`),
        written at the end of this loop turn with the turn's other steps in one script call
        (`steps`; up to `MAX_BATCH_STEPS` steps and `MAX_BATCH_BYTES`), or alone as its own
        `step` when no other came: nothing waits for company. The future of its reply, as
        `send`'s. `pack`: the script's packer (`guards.stores._redis._scripts.pack`)."""
        if self.failure is not None:
            raise StoreUnavailable(self.failure)
        if len(self._waiting) + len(self._queued) >= MAX_IN_FLIGHT:
            raise StoreUnavailable("Redis store unavailable (too many operations in flight)")
        future = self.loop.create_future()
        batch = self._batch
        if batch is None or len(batch.futures) >= MAX_BATCH_STEPS or batch.sizes >= MAX_BATCH_BYTES:
            batch = self._batch = _Batch(pack, now)
            self._out.append(batch)
            self._queued.append(batch)
        batch.add(keys, args, future)
        if not self._flushing and self._transport is not None:
            self._flushing = True
            self.loop.call_soon(self._flush)
        return future

    def load(self, command: bytes) -> None:
        """A SCRIPT LOAD, ahead of the commands given after it."""
        self.loads += 1
        self._out.append(command)
        self._queued.append(None)
        self._batch = None

    async def close(self) -> None:
        """Close the connection; returns once its socket is closed."""
        self.fail(StoreUnavailable("Redis store unavailable (closed)"))
        if self._made:
            await self._lost

    def fail(self, error: StoreUnavailable) -> None:
        """The connection is done for: every command waiting on it fails with `error`."""
        if self.failure is None:
            self.failure = str(error)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.abort()
        futures = [future for future, _ in self._waiting] + self._queued
        self._waiting.clear()
        self._out, self._queued, self._batch = [], [], None
        for future in futures:
            if future is not None and not future.done():
                future.set_exception(StoreUnavailable(self.failure))

    def _flush(self) -> None:
        self._flushing = False
        if self._transport is None or self.failure is not None or not self._out:
            return
        out, queued = self._out, self._queued
        self._out, self._queued, self._batch = [], [], None
        for index, item in enumerate(out):
            if isinstance(item, _Batch):
                out[index] = item.packed()
        self._transport.write(b"".join(cast(list[bytes], out)))
        now = self.loop.time()
        self._waiting.extend([(future, now) for future in queued])
        if self._timer is None:
            self._timer = self.loop.call_at(now + self._timeout_s, self._check)

    def _check(self) -> None:
        """The timer: is the oldest reply overdue? (See the class docstring.)"""
        self._timer = None
        if not self._waiting or self.failure is not None:
            return
        oldest = self._waiting[0]
        now = self.loop.time()
        if oldest is not self._watched:  # answered since: the next one's own limit
            self._watched, self._due, self._probing = oldest, oldest[1] + self._timeout_s, False
        if now < self._due:
            self._timer = self.loop.call_at(self._due, self._check)
            return
        later = patience(
            now, self._due, oldest[1] + MAX_TIMEOUTS * self._timeout_s, self._probing, self._timeout_s
        )
        if later is None:
            self.fail(StoreUnavailable("Redis store unavailable (TimeoutError)"))
            return
        self._due, self._probing = later
        self._timer = (
            self.loop.call_soon(self._check) if self._probing else self.loop.call_at(self._due, self._check)
        )

    # --- asyncio's side ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an `asyncio.Transport` (uvloop's are not).
        transport = cast("asyncio.Transport", transport)
        self._made = True
        if self.failure is not None:  # given up meanwhile
            transport.abort()
            return
        self._transport = transport
        self._flush()

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                future = waiting.popleft()[0]  # IndexError: a reply nobody asked for
                if future is not None:
                    if not future.done():  # else its caller gave up
                        future.set_result(reply)
                elif self._handshake:
                    self._handshake -= 1
                    if isinstance(reply, hiredis.ReplyError):  # AUTH or SELECT refused
                        self.fail(StoreUnavailable(f"Redis store unavailable ({reply_code(reply)})"))
                        return
                    if isinstance(reply, list) and reply and reply[0] != "master":  # ROLE: a replica
                        self.fail(StoreUnavailable("Redis store unavailable (READONLY)"))
                        return
        except (hiredis.ProtocolError, IndexError, ValueError):  # ValueError: not UTF-8
            self.fail(StoreUnavailable("Redis store unavailable (ProtocolError)"))

    def eof_received(self) -> bool:
        return False  # the server closed it: close our side too (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.fail(unavailable(exc or ConnectionResetError()))
        self._lost.set_result(None)


def reply_code(reply: hiredis.ReplyError) -> str:
    """An error reply's code (`WRONGPASS`, `NOAUTH`, `ERR`...): never the rest of its text."""
    code = str(reply).split(" ", 1)[0][:32]
    return code if code.isalnum() else "ResponseError"


#: How late (seconds past its time) a limit must fire to have found the loop held up.
LATE_S = 0.01
#: The longest a limit waits in all, in timeouts, however held up the loop is.
MAX_TIMEOUTS = 10


class Bound:
    """`with Bound(timeout_s):` in a task: the store's limit on connecting. When it expires,
    the task is cancelled where it waits and the block raises `TimeoutError`; like the limit
    on replies (`Wire`), it waits longer when the worker's own event loop was held up."""

    __slots__ = (
        "_cancelling",
        "_end",
        "_expired",
        "_handle",
        "_loop",
        "_probing",
        "_task",
        "_timeout_s",
        "_when",
    )

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("connecting to Redis must run in a task")
        self._task = task
        self._timeout_s = timeout_s
        now = self._loop.time()
        self._when = now + timeout_s
        self._end = now + MAX_TIMEOUTS * timeout_s
        self._expired = self._probing = False
        self._cancelling = 0
        self._handle: asyncio.Handle = self._loop.call_at(self._when, self._fire)

    def __enter__(self) -> Bound:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._handle.cancel()
        # `uncancel` whatever the exception: the expiry's cancel request is spent. A cancellation
        # also requested from elsewhere goes on as `CancelledError`.
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def _fire(self) -> None:
        later = patience(self._loop.time(), self._when, self._end, self._probing, self._timeout_s)
        if later is None:
            self._expired = True
            self._cancelling = self._task.cancelling()
            self._task.cancel()
            return
        self._when, self._probing = later
        self._handle = (
            self._loop.call_soon(self._fire) if self._probing else self._loop.call_at(self._when, self._fire)
        )


def patience(
    now: float, due: float, end: float, probing: bool, timeout_s: float
) -> tuple[float, bool] | None:
    """A lag-aware limit's rule (see `Wire`), when the limit due at `due` (at most `end`) comes
    round at `now`: when to look again and whether that look is the probe of the loop's next
    turn; None when the limit has expired."""
    if now < end:
        if now - due >= LATE_S:  # the loop was held up: wait another timeout
            return min(now + timeout_s, end), False
        if not probing:  # due on time: see how the loop's next turn goes
            return now, True
    return None


def unavailable(exc: BaseException) -> StoreUnavailable:
    # The class name only: socket errors' messages carry the host and port.
    return StoreUnavailable(f"Redis store unavailable ({type(exc).__name__})")
