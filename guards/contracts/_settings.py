"""Settings checks: every public settings type checks its values where they are written.

A settings type (`Budget`, `Breaker`, `Retry`, `Price`, ...) and `Guards.route` check each
value's type and range when they are built, with the checks here, and raise
`ConfigurationError` naming the setting, the value and what it takes, so a mistake fails at
import with the fix in the message rather than as a `TypeError` deep in a request.
`keywords_checked` makes a misspelled keyword name the closest valid one. Start-up and
decoration time only: nothing here runs on a request's path.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re
from collections.abc import Callable, Collection
from enum import Enum
from typing import Final, ParamSpec, TypeVar

from ._errors import ConfigurationError

__all__ = ["UNSET", "Unset", "choice", "keywords_checked", "number", "settings", "unknown_keyword", "whole"]

T = TypeVar("T")
P = ParamSpec("P")


class Unset(Enum):
    """The type of `UNSET`: a setting left unset, where None means something of its own."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET


#: Python's own words for a keyword a callable does not take.
_UNEXPECTED = re.compile(r"got an unexpected keyword argument '(?P<name>[^']+)'")


def _shown(value: object) -> str:
    """`value` as a message shows it: its repr (cut short) and, unless plain, its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = type(value).__name__
        return f"{text} ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"
    return text


def _fail(setting: str, value: object, takes: str, none: str | None) -> ConfigurationError:
    also = f", or None ({none})" if none is not None else ""
    return ConfigurationError(f"{setting} must be {takes}{also}; got {_shown(value)}")


def whole(
    setting: str,
    value: object,
    *,
    least: int = 1,
    most: int | None = None,
    none: str | None = None,
) -> None:
    """`value` is a whole number (an `int`, never a bool) from `least` to `most`; or None when
    `none` says what None means. Raises `ConfigurationError` naming `setting` otherwise."""
    if value is None and none is not None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < least
        or (most is not None and value > most)
    ):
        takes = (
            f"a whole number from {least:,} to {most:,}"
            if most is not None
            else f"a whole number, at least {least:,}"
        )
        raise _fail(setting, value, takes, none)


def number(
    setting: str,
    value: object,
    *,
    above: float | None = None,
    least: float | None = None,
    most: float | None = None,
    unit: str = "",
    none: str | None = None,
) -> None:
    """`value` is a finite number (never a bool), above `above` (exclusive) or at least `least`,
    at most `most`; `unit` names what it counts ("seconds"). None passes when `none` says what
    it means. Raises `ConfigurationError` naming `setting` otherwise."""
    if value is None and none is not None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (above is not None and not value > above)
        or (least is not None and not value >= least)
        or (most is not None and not value <= most)
    ):
        kind = "a positive, finite number" if above == 0 else "a finite number"
        bounds = []
        if above is not None and above != 0:
            bounds.append(f"above {above:g}")
        if least is not None:
            bounds.append(f"at least {least:g}")
        if most is not None:
            bounds.append(f"at most {most:g}")
        takes = kind + (f" of {unit}" if unit else "") + (", " + " and ".join(bounds) if bounds else "")
        raise _fail(setting, value, takes, none)


def choice(setting: str, value: object, choices: Collection[str], *, none: str | None = None) -> None:
    """`value` is one of `choices` (or None when `none` says what it means); otherwise
    `ConfigurationError` names them, and the closest one to a misspelled string."""
    if (value is None and none is not None) or (isinstance(value, str) and value in choices):
        return
    names = [str(each) for each in choices]  # StrEnum members as their values
    error = _fail(setting, value, "one of " + ", ".join(map(repr, names)), none)
    if isinstance(value, str) and (close := difflib.get_close_matches(value, names, n=1)):
        error = ConfigurationError(f"{error}: did you mean {close[0]!r}?")
    raise error


def unknown_keyword(owner: str, name: str, valid: Collection[str]) -> ConfigurationError:
    """The error for a keyword `owner` does not take: the closest valid one, else them all."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    if close:
        return ConfigurationError(f"{owner} has no setting {name!r}: did you mean {close[0]}=...?")
    return ConfigurationError(f"{owner} has no setting {name!r}; it takes {', '.join(sorted(valid))}")


def keywords_checked(function: Callable[P, T], owner: str | None = None) -> Callable[P, T]:
    """`function` (a settings type's `__init__`, or `Guards.route`) raising, for a keyword it
    does not take, `ConfigurationError` naming the closest valid one (Python's `TypeError`
    does not). The signature is `function`'s; a `TypeError` raised inside it goes through."""
    parameters = inspect.signature(function).parameters
    valid = [
        p for p, each in parameters.items() if each.kind in (each.KEYWORD_ONLY, each.POSITIONAL_OR_KEYWORD)
    ]
    valid = [p for p in valid if p != "self" and not p.startswith("_")]
    where = owner or function.__qualname__.removesuffix(".__init__")

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        for name in kwargs:
            if name not in parameters:
                raise unknown_keyword(where, name, valid)
        return function(*args, **kwargs)

    return checked


def settings(cls: type[T]) -> type[T]:
    """A settings type whose `__init__` names the closest valid keyword for a misspelled one
    (`keywords_checked`). Put it above `@dataclass`."""
    cls.__init__ = keywords_checked(cls.__init__, cls.__name__)  # type: ignore[method-assign]
    return cls
