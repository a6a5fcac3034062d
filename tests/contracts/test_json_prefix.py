"""`OutputGuard.impossible`: whether the first characters of a JSON answer (what a stream's
hold has read) can already not become an answer of the route's type. A table of cases, and
the bound: linear in what it reads, whatever the text."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import BaseModel, RootModel

from guards.contracts._output import OutputGuard


class Triage(BaseModel):
    label: str
    urgent: bool


class Labels(RootModel[list[str]]):
    pass


CASES: dict[str, tuple[Any, str, bool]] = {
    "object-nothing-yet": (Triage, "", False),
    "object-whitespace-only": (Triage, " \n\t ", False),
    "object-brace": (Triage, '{"la', False),
    "object-brace-after-whitespace": (Triage, '\n  {"label"', False),
    "object-fence": (Triage, "```json\n{", False),
    "object-prose": (Triage, "Sure! Here", True),
    "object-prose-after-whitespace": (Triage, "  Sure", True),
    "object-array": (Triage, "[1,", True),
    "object-string": (Triage, '"{\\"label', True),
    "array-bracket": (list[Triage], "[{", False),
    "array-object": (list[Triage], "{", True),
    "root-array-bracket": (Labels, '["a"', False),
    "root-array-prose": (Labels, "a, b", True),
    # pydantic's lax mode takes a number from a string: the first character says nothing.
    "integer-string": (int, '"4', False),
    "integer-prose": (int, "four", False),
    "text-route": (str, "anything", False),
}


@pytest.mark.parametrize(("output_type", "held", "impossible"), CASES.values(), ids=CASES.keys())
def test_impossible_json_starts(output_type: Any, held: str, impossible: bool) -> None:
    assert OutputGuard(output_type).impossible(held) is impossible


@pytest.mark.parametrize("held", [" " * (1 << 20), " " * (1 << 20) + "x", "{" + "x" * (1 << 20)])
def test_impossible_is_linear_in_what_it_reads(held: str) -> None:
    guard = OutputGuard(Triage)
    started = time.process_time()
    guard.impossible(held)
    assert time.process_time() - started < 0.25
