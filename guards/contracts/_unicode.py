"""Lone surrogates: U+D800 to U+DFFF, unpaired. JSON may carry one (`"\\ud800"` is valid
JSON, and `json.loads` gives it back), but no UTF-8 can: a response holding one fails to encode
after the fact (a plain-text 500, or a stream cut). A model's answer is checked for them before
it is passed on (`has_lone_surrogate`); a streamed part after the first output has them replaced
(`well_formed`).

In a Python `str`, a pair that JSON escaped (`"\\ud83d\\ude00"`) is already one character: any
surrogate left is a lone one.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic_core import PydanticSerializationError, to_json

__all__ = ["has_lone_surrogate", "well_formed"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string in `value` (a str, or the dicts and lists of an answer as parsed, keys
    included) holds a lone surrogate. Linear: a text is encoded once (C speed); an object is
    serialized once by pydantic-core (about what validating it costs, a few times faster than
    a walk in Python), which refuses to encode one; only when that fails for another reason
    (an answer nested past its depth limit, an object of a type it does not know) does a
    walk decide."""
    if isinstance(value, str):
        return not value.isascii() and _unencodable(value)
    try:
        to_json(value)
    except PydanticSerializationError:
        return _walked(value)
    return False


def _walked(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _unencodable(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _unencodable(text: str) -> bool:
    try:
        text.encode()  # C speed: 3 ms for a MiB of non-ASCII text, a regex search takes 12
    except UnicodeEncodeError:
        return True
    return False


def well_formed(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD (the replacement character)."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)
