"""Structured events: one JSON object per log record message, on the `guards` logger.

Only fields from a closed list of safe values are written (event, route, guard, reason, kind,
attempts, model, latency, trace id, status...). Prompts, completions, provider messages,
credentials and budget keys (user ids) are never passed here.

Lines show up without any logging set-up: `Guards.install` puts a console handler on the
`guards` logger (`show_logs`) that writes to stderr only while no other handler would receive
the line, i.e. until the app configures logging of its own (a handler on `guards` or on an
ancestor it propagates to, such as the root logger: then each line is written once, there).
"""

from __future__ import annotations

import json
import logging
import sys
from types import TracebackType
from typing import Any

__all__ = ["logger", "show_logs"]

logger = logging.getLogger("guards")

#: The most stack frames an application failure logs (the innermost ones).
MAX_FRAMES = 20


#: One encoder for every line (`json.dumps` with options builds a new one per call).
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


def emit(event: str, /, **fields: Any) -> None:
    if logger.isEnabledFor(logging.INFO):
        _emit_at(logging.INFO, event, fields)


def emit_warning(event: str, /, **fields: Any) -> None:
    if logger.isEnabledFor(logging.WARNING):
        _emit_at(logging.WARNING, event, fields)


def emit_error(event: str, /, **fields: Any) -> None:
    if logger.isEnabledFor(logging.ERROR):
        _emit_at(logging.ERROR, event, fields)


def _emit_at(level: int, event: str, fields: dict[str, Any]) -> None:
    """The line as `logger.log` would make it, without `findCaller`'s walk up the stack, which
    would find this function every time: the record names it."""
    line = {"event": event}
    for name, value in fields.items():
        if value is not None:
            line[name] = value
    logger.handle(logger.makeRecord(logger.name, level, *_SOURCE, _encode(line), (), None, _SOURCE_FUNCTION))


#: Where `_emit_at`'s records say they come from (file, line; function), as `findCaller` would.
_SOURCE = (_emit_at.__code__.co_filename, _emit_at.__code__.co_firstlineno)
_SOURCE_FUNCTION = _emit_at.__code__.co_name


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
    """Writes a `guards` line to stderr unless another handler receives it (the app's own)."""

    def emit(self, record: logging.LogRecord) -> None:
        if self._handled_elsewhere():
            return
        try:
            # sys.stderr as it is now (servers and test tools may swap it after start-up).
            sys.stderr.write(record.getMessage() + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)

    def _handled_elsewhere(self) -> bool:
        # The walk `Logger.callHandlers` makes: up the hierarchy while loggers propagate.
        current: logging.Logger | None = logger
        while current is not None:
            if any(handler is not self for handler in current.handlers):
                return True
            current = current.parent if current.propagate else None
        return False


def show_logs() -> None:
    """Make guards' lines visible in an app that configured no logging: the console fallback on
    the `guards` logger (once per process), and INFO when the app set no level for it."""
    if not any(isinstance(handler, _ConsoleFallback) for handler in logger.handlers):
        logger.addHandler(_ConsoleFallback())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
