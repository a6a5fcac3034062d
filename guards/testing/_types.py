"""The types of the pytest plugin's fixtures, for a test's annotations (`mypy --strict`), here so
that importing `guards.testing` never imports pytest."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from .fake_binding import FakeBinding

__all__ = ["UseFakeAI", "UseFakeServers"]

#: The `use_fake_ai` fixture: `use_fake_ai(app)` returns the fake the app now calls.
UseFakeAI = Callable[[FastAPI], FakeBinding]
#: The `use_fake_servers` fixture: `use_fake_servers(app)`.
UseFakeServers = Callable[[FastAPI], None]
