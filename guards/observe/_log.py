"""Structured events: one JSON object per log record message, on the `guards` logger.

Only fields from a closed list of safe values are written (event, route, guard, reason, kind,
attempts, model, latency, trace id, status...). Prompts, completions, provider messages,
credentials and budget keys (user ids) are never passed here.

Lines show up without any logging set-up: `Guards.install` puts a console handler on the
`guards` logger (`show_logs`) that writes to stderr only while no other handler would receive
the line, i.e. until the app configures logging of its own (a handler on `guards` or on an
ancestor it propagates to, such as the root logger: then each line is written once, there).

No line is written on the request's thread. `emit` checks the level, makes the line's text
(`guards.observe._json`, in C: a few microseconds, less than handing the fields to another
thread to format would cost in all), then hands it to this process's `LineWriter`, a queue read
by one writer thread, which writes it: straight to stderr (in batches) when the console handler
is the only receiver, else as a `LogRecord` through the `guards` logger, so the app's handlers
run there too, never on the event loop. The queue is bounded (`GUARDS_LOG_BUFFER_LINES`, 10,000 by
default): when the writer falls behind (a full pipe to a log shipper, a paused container
runtime), new lines are dropped and counted, never waited for (`guards_log_lines_dropped_total`,
and a `log_lines_dropped` warning line once the writer catches up). `skip` lines are summarized
there as well: at most one per route, reason and second, with a `count`. `flush_logs()` waits,
for a bounded time, until what was emitted before it is written (the tests, a serverless
handler before its process is frozen, shutdown: it also runs at interpreter exit).

The same writer takes the lines of other loggers whose handlers would write to a stream on the
event loop (`write_behind`: `guards.serve` puts uvicorn's handlers, the access log included, and
logging's last resort, which asyncio's records reach, behind it): such a line is formatted where
it is logged, then queued with guards' own, written to its handler's stream by the writer, and
dropped and counted with them when the writer is behind. The writer writes to a real file's
descriptor itself: blocked on a full pipe, it holds no lock another thread needs (the stream's
own lock, which `flush()` at exit would wait for).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from queue import Empty, SimpleQueue
from types import TracebackType
from typing import Any, TextIO

from ..contracts._errors import ConfigurationError
from ._json import dumps

__all__ = ["flush_logs", "logger", "show_logs", "write_behind"]

logger = logging.getLogger("guards")

#: The most stack frames an application failure logs (the innermost ones).
MAX_FRAMES = 20
#: Lines waiting for the writer at most (`GUARDS_LOG_BUFFER_LINES`): past it, lines are dropped.
BUFFER_LINES = 10_000
#: Lines the writer takes off its queue at a time (written with one `write` and one `flush`).
BATCH_LINES = 4096
#: After writing, the writer lets lines gather this long before it takes the next ones (a
#: `flush_logs()` wakes it at once): under load, fewer and larger writes, and fewer turns of the
#: GIL between the event loop and the writer. 10 ms served a logged worker about 0.7x of one
#: with logs off, 100 ms about 0.8x to 1.0x (noisy A/B runs, 2026-12-02); a line is at most this
#: late.
GATHER_S = 0.1
#: `flush_logs()`'s wait at most, by default (and at interpreter exit).
FLUSH_TIMEOUT_S = 1.0
#: The longest line of another logger's that the queue holds (a traceback, an exception's
#: message that quotes a client): past it, the middle is cut, so that the queue's lines hold at
#: most `BUFFER_LINES` times this.
MAX_LINE_CHARS = 16_384

#: A line to write: (level, text, created, the stream handler it is for: None for guards' own,
#: whose text has no end; a handler's line ends with its terminator).
_Line = tuple[int, str, float, "logging.StreamHandler[TextIO] | None"]
#: What the queue carries: a line made (`summary` None), or a `skip` to count into its second's
#: summary line: (INFO, "", time.time() when emitted, None, (route, reason), its fields).
_Item = tuple[int, str, float, "logging.StreamHandler[TextIO] | None", "tuple[str, str] | None", Any]


def emit(event: str, /, **fields: Any) -> None:
    if logger.isEnabledFor(logging.INFO):
        _writer.put((logging.INFO, _line(event, fields), time.time(), None, None, None))


def emit_warning(event: str, /, **fields: Any) -> None:
    if logger.isEnabledFor(logging.WARNING):
        _writer.put((logging.WARNING, _line(event, fields), time.time(), None, None, None))


def emit_error(event: str, /, **fields: Any) -> None:
    if logger.isEnabledFor(logging.ERROR):
        _writer.put((logging.ERROR, _line(event, fields), time.time(), None, None, None))


def emit_line(line: dict[str, Any], /) -> None:
    """An INFO line made by its caller: `{"event": ..., fields...}`, its fields in order, none
    of them None (the request line: `guards.walk._outcome`)."""
    _writer.put((logging.INFO, dumps(line), time.time(), None, None, None))


def emit_skip(route: str, reason: str, /, **fields: Any) -> None:
    """A `skip` line, summarized with the other skips of `route` for `reason` in its second."""
    if logger.isEnabledFor(logging.INFO):
        fields["route"], fields["reason"] = route, reason
        _writer.put((logging.INFO, "", time.time(), None, (route, reason), fields))


def flush_logs(timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Wait until every guards line emitted so far is written (the `skip` summaries of the
    current second too), for `timeout_s` at most. True when they were; False when the writer
    is stuck (its stream does not take them) and the wait ran out. Call it from a thread, or
    before an event loop stops, not from a coroutine that the writer may wait for."""
    return _writer.flush(timeout_s)


def dropped_lines() -> int:
    """Lines this process dropped because its writer was behind (only grows)."""
    return _writer.dropped


class LineWriter:
    """The process's queue of lines and the thread that writes them (started with the first
    line, and again in a forked child)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.dropped = 0
        self._queue: SimpleQueue[_Item | threading.Event] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        #: Set by `flush` to end the writer's gathering pause at once.
        self._wake = threading.Event()
        #: The dropped lines already said so in a `log_lines_dropped` line (writer thread).
        self._reported = 0
        #: Open `skip` summaries: (route, reason) -> [second, first fields, count, models].
        self._skips: dict[tuple[str, str], list[Any]] = {}

    def put(self, item: _Item) -> None:
        if self._thread is None:
            self._start()
        queue = self._queue
        if queue.qsize() >= self.capacity:
            self.dropped += 1
            return
        queue.put(item)

    def flush(self, timeout_s: float) -> bool:
        if self._thread is None or threading.current_thread() is self._thread:
            return True
        done = threading.Event()
        self._queue.put(done)
        self._wake.set()
        return done.wait(timeout_s)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="guards-log-writer", daemon=True)
                thread.start()
                self._thread = thread

    def _forked(self) -> None:
        """In a forked child: the parent's thread is not there; the parent writes its lines."""
        self._queue = SimpleQueue()
        self._thread = None
        self._start_lock = threading.Lock()
        self._wake = threading.Event()
        self._skips = {}

    def _run(self) -> None:
        queue = self._queue
        while True:
            timeout = None
            if self._skips:  # wake when the oldest open second ends
                oldest = min(entry[0] for entry in self._skips.values())
                timeout = max(0.0, oldest + 1 - time.time())
            try:
                first = queue.get(timeout=timeout)
            except Empty:
                self._write(self._close_skips(time.time()))
                continue
            items = [first]
            try:
                while len(items) < BATCH_LINES:
                    items.append(queue.get_nowait())
            except Empty:
                pass
            try:
                self._take(items)
            except Exception:  # a bug here must not stop every later line: this batch is lost
                for item in items:
                    if isinstance(item, threading.Event):
                        item.set()
                    else:
                        self.dropped += 1
            if self._wake.wait(GATHER_S):
                self._wake.clear()

    def _take(self, items: list[_Item | threading.Event]) -> None:
        lines: list[_Line] = []
        for item in items:
            if isinstance(item, threading.Event):
                lines += self._close_skips(None)
                self._write(lines)
                lines = []
                item.set()
                continue
            level, text, created, handler, summary, fields = item
            if summary is not None:
                lines += self._summarize(summary, fields, created)
            else:
                lines.append((level, text, created, handler))
        lines += self._close_skips(time.time())
        self._write(lines)

    def _summarize(self, key: tuple[str, str], fields: Mapping[str, Any], created: float) -> list[_Line]:
        """Count a skip into its second's summary (closing the summary of an earlier second)."""
        second = int(created)
        entry = self._skips.get(key)
        closed = []
        if entry is not None and entry[0] != second:
            closed.append(_skip_line(entry))
            entry = None
        if entry is None:
            self._skips[key] = [second, fields, 1, {fields.get("model")}]
        else:
            entry[2] += 1
            if len(entry[3]) < 16:  # a route's chain, not input: bounded all the same
                entry[3].add(fields.get("model"))
        return closed

    def _close_skips(self, now: float | None) -> list[_Line]:
        """The summaries of seconds that ended before `now` (None: every one)."""
        closed = []
        for key, entry in list(self._skips.items()):
            if now is None or entry[0] + 1 <= now:
                closed.append(_skip_line(entry))
                del self._skips[key]
        return closed

    def _write(self, lines: list[_Line]) -> None:
        dropped = self.dropped
        if dropped != self._reported:
            count, self._reported = dropped - self._reported, dropped
            lines.append((logging.WARNING, _line("log_lines_dropped", {"count": count}), time.time(), None))
        if not lines:
            return
        console = _console_only()
        # Each stream's text, in order (by the stream's identity: uvicorn's handler and guards'
        # console both write to the same `sys.stderr`).
        streams: dict[int, tuple[TextIO, list[str]]] = {}
        for level, text, created, handler in lines:
            if handler is None and not console:
                record = logger.makeRecord(logger.name, level, *_SOURCE, text, (), None, _SOURCE_FUNCTION)
                record.created, record.msecs = created, (created - int(created)) * 1000
                logger.handle(record)
                continue
            # guards' console: stderr as it is now (servers and test tools may swap it).
            stream = sys.stderr if handler is None else handler.stream
            if stream is not None:
                texts = streams.setdefault(id(stream), (stream, []))[1]
                texts.append(text + "\n" if handler is None else text)  # (a handler's has its end)
        for stream, texts in streams.values():
            _write_text(stream, "".join(texts))


def _write_text(stream: TextIO, text: str) -> None:
    """Write `text` to `stream`: to its descriptor when it has one (then a write blocked on a
    full pipe holds none of the stream's locks), else through the stream."""
    try:
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # no file under it (a test's capture)
            stream.write(text)
            stream.flush()
            return
        data = text.encode(getattr(stream, "encoding", None) or "utf-8", "backslashreplace")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except Exception:  # a closed or broken stream: nothing to tell it with
        pass


def _line(event: str, fields: Mapping[str, Any]) -> str:
    line = {"event": event}
    for name, value in fields.items():
        if value is not None:
            line[name] = value
    return dumps(line)


def _skip_line(entry: list[Any]) -> _Line:
    second, fields, count, models = entry
    line = dict(fields, count=count)
    if len(models) > 1:
        line["models"] = sorted(str(model) for model in models)
    return logging.INFO, _line("skip", line), float(second), None


#: Where the records of the app's handlers say they come from (file, line; function): the
#: writer, as `findCaller` would find it.
_SOURCE = (LineWriter._write.__code__.co_filename, LineWriter._write.__code__.co_firstlineno)
_SOURCE_FUNCTION = LineWriter._write.__code__.co_name


def _buffer_lines() -> int:
    value = os.environ.get("GUARDS_LOG_BUFFER_LINES", "")
    if not value:
        return BUFFER_LINES
    try:
        lines = int(value)
    except ValueError:
        lines = 0
    if lines < 1:
        raise ConfigurationError(
            f"GUARDS_LOG_BUFFER_LINES must be a whole number of lines, at least 1 (got {value!r})"
        )
    return lines


_writer = LineWriter(_buffer_lines())
os.register_at_fork(after_in_child=_writer._forked)
atexit.register(flush_logs)


def frames(tb: TracebackType | None) -> tuple[list[dict[str, Any]], int]:
    """Where an exception went, outermost first: each frame's file, line and function (never
    its local values), the innermost `MAX_FRAMES`; and how many outer frames were left out."""
    found = []
    while tb is not None:
        code = tb.tb_frame.f_code
        found.append({"file": code.co_filename, "line": tb.tb_lineno, "function": code.co_name})
        tb = tb.tb_next
    return found[-MAX_FRAMES:], max(0, len(found) - MAX_FRAMES)


class _ConsoleFallback(logging.Handler):
    """Writes a `guards` line to stderr unless another handler receives it (the app's own).
    guards' own lines reach it only through the writer; a record logged on `guards` by other
    code goes to the writer's queue from here."""

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread() is _writer._thread or _handled_elsewhere(self):
            return
        _writer.put((record.levelno, record.getMessage(), record.created, None, None, None))


def _handled_elsewhere(console: logging.Handler | None) -> bool:
    """Whether a handler other than `console` receives the `guards` logger's records (the walk
    `Logger.callHandlers` makes: up the hierarchy while loggers propagate)."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(handler is not console for handler in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _console_only() -> bool:
    """Whether the console fallback is the only receiver of guards' lines (and no filter or
    switch on the logger would change that): then the writer writes to stderr itself."""
    if logger.disabled or logger.filters:
        return False
    console = next((h for h in logger.handlers if isinstance(h, _ConsoleFallback)), None)
    return console is not None and not _handled_elsewhere(console)


def show_logs() -> None:
    """Make guards' lines visible in an app that configured no logging: the console fallback on
    the `guards` logger (once per process), and INFO when the app set no level for it."""
    if not any(isinstance(handler, _ConsoleFallback) for handler in logger.handlers):
        logger.addHandler(_ConsoleFallback())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


class _BehindWriter(logging.Handler):
    """Stands in for a stream handler (`write_behind`): formats each record as it would, here,
    and queues the line for the writer, which writes it to that handler's stream (its `stream`
    then: logging's last resort always names the current `sys.stderr`)."""

    def __init__(self, handler: logging.StreamHandler[TextIO]) -> None:
        super().__init__(handler.level)
        self.handler = handler
        self.formatter = handler.formatter
        self.filters = list(handler.filters)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a bad log call (its arguments do not fit its message): not written
            _writer.dropped += 1  # (`handleError` would write to the blocked stream)
            return
        if len(text) > MAX_LINE_CHARS:
            half = MAX_LINE_CHARS // 2
            text = f"{text[:half]} [... {len(text) - 2 * half} characters cut ...] {text[-half:]}"
        _writer.put(
            (record.levelno, text + self.handler.terminator, record.created, self.handler, None, None)
        )


def write_behind(*names: str) -> None:
    """Put the writer behind the loggers `names`' stream handlers (exactly `StreamHandler`s: a
    file, socket or custom handler stays as it is) and behind logging's last resort (the
    handler of records that no handler takes, asyncio's among them when the root logger has
    none): what they log is never written on the logging thread, and is dropped and counted
    with guards' own lines when the writer is behind (see the module's docstring)."""
    for name in names:
        handlers = logging.getLogger(name).handlers
        for index, handler in enumerate(handlers):
            if type(handler) is logging.StreamHandler:
                handlers[index] = _BehindWriter(handler)
    last_resort = logging.lastResort
    if isinstance(last_resort, logging.StreamHandler):
        logging.lastResort = _BehindWriter(last_resort)
