"""`dumps`: the one JSON encoder of what guards writes itself (log lines), in C (orjson).

The standard library's encoder spends about 35,000 CPU instructions on a request line (its
floats' shortest repr, its per-value dispatch); orjson about 4,000. Its text is the standard
library's, `json.dumps(value, separators=(",", ":"), default=str)`, for every value guards
writes: where the two would differ (a character outside ASCII, which the standard library
escapes as `\\uXXXX`; a lone surrogate or an integer past 64 bits, which orjson refuses; a value
that is neither str, number, bool, None, list nor dict, which `default=str` names, e.g. a date),
the standard library writes the line. (An enum is written as its value: guards passes `.value`;
a float below 1e-4 or past 1e16 without an exponent where repr has one: the same number.)
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["dumps"]

_standard = json.JSONEncoder(separators=(",", ":"), default=str).encode
#: Dates and dataclasses go to `default` (then the standard library writes them), as others orjson does not know.
_OPTIONS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def dumps(value: dict[str, Any]) -> str:
    """`value` as compact JSON text, ASCII only (what `json.dumps` with `separators=(",", ":")`
    and `default=str` writes)."""
    try:
        text = orjson.dumps(value, default=_refuse, option=_OPTIONS).decode()
    except TypeError:  # orjson.JSONEncodeError: not a value it writes as the standard library does
        return _standard(value)
    if not text.isascii():  # `\\uXXXX` escapes, as the standard library writes them
        return _standard(value)
    return text


def _refuse(value: Any) -> Any:
    """Any value orjson would hand to `default`: the standard library writes the line."""
    raise TypeError
