"""The optional dependencies: each comes with an extra of the `route-guards` distribution, and
a missing one is an error that names the extra to install, never a bare traceback."""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(error: ModuleNotFoundError, extra: str, what: str) -> ModuleNotFoundError:
    """The error to raise for `error` (an import of `extra`'s dependency that failed) when `what`
    needs it: `what needs uvicorn: pip install 'route-guards[serve]'`."""
    return ModuleNotFoundError(
        f"{what} needs {error.name}: pip install 'route-guards[{extra}]'", name=error.name
    )
