"""uvicorn's log lines under `python -m guards.serve`, in the supervisor and in each worker:
written by guards' log writer (`guards.observe._log.write_behind`: a full stderr or stdout never
blocks the event loop, nor the supervisor's signals; what the writer cannot take is dropped and
counted), and escaped, so that nothing a client sends moves a terminal's cursor or starts a log
line of its own."""

from __future__ import annotations

import logging

from ..observe._log import write_behind

__all__ = ["guard_uvicorn_logs"]

#: C0 and C1 control characters and DEL, each as `\xNN`.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
#: The same but the newline, which separates a traceback's lines.
_CONTROLS_BUT_NEWLINE = {c: text for c, text in _CONTROLS.items() if c != 0x0A}


_TRACEBACK = logging.Formatter()


class _EscapeControls(logging.Filter):
    """What a client sends cannot move a terminal's cursor, clear it, color it or start a log
    line of its own. Escapes a record's arguments (a client's address, path, header: every control
    character) and its message (all but the newlines of the code's own text) in place, before
    any formatter sees them (a traceback too); uvicorn's access formatter reads the arguments
    as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = record.msg.translate(_CONTROLS_BUT_NEWLINE)
        args = record.args
        if isinstance(args, tuple) and any(isinstance(arg, str) for arg in args):
            record.args = tuple(arg.translate(_CONTROLS) if isinstance(arg, str) else arg for arg in args)
        if record.exc_info and not record.exc_text:
            # A traceback's last line repeats its exception's message, which may quote a client.
            record.exc_text = _TRACEBACK.formatException(record.exc_info).translate(_CONTROLS_BUT_NEWLINE)
        return True


def guard_uvicorn_logs() -> None:
    """Put guards' log writer behind uvicorn's loggers and logging's last resort (asyncio's
    records reach it): a full stderr or stdout never blocks the event loop, nor the
    supervisor's signals, and what the writer cannot take is dropped and counted
    (`guards.observe._log.write_behind`); and escape what every handler of uvicorn's loggers writes
    (see `_EscapeControls`)."""
    names = ("uvicorn", "uvicorn.error", "uvicorn.access")
    write_behind(*names)
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _EscapeControls) for f in handler.filters):
                handler.addFilter(_EscapeControls())
