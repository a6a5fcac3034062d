"""Structured events: one JSON object per log record message, on the `guards` logger.

Only fields from a closed list of safe values are written (event, route, guard, reason, kind,
attempts, model, latency, trace id, status...). Prompts, completions, provider messages,
credentials and budget keys (user ids) are never passed here.
"""

from __future__ import annotations

import json
import logging
from typing import Any

__all__ = ["logger"]

logger = logging.getLogger("guards")


def emit(event: str, /, **fields: Any) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    record = {"event": event}
    record.update((k, v) for k, v in fields.items() if v is not None)
    logger.info(json.dumps(record, separators=(",", ":"), default=str))


def emit_warning(event: str, /, **fields: Any) -> None:
    record = {"event": event}
    record.update((k, v) for k, v in fields.items() if v is not None)
    logger.warning(json.dumps(record, separators=(",", ":"), default=str))
