"""docs/architecture.md against the tree: every module, package and test folder its map of
capabilities names exists, every test folder is in the map, and its layers are `LAYERS` of
tests/test_imports.py, bottom first, with every package of guards in one."""

from __future__ import annotations

import re
from pathlib import Path

from .test_imports import LAYERS

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"

#: A path the page names in backquotes: of the package, or of the tests.
NAMED = re.compile(r"`((?:guards|tests)/[^`]*)`")


def section(title: str) -> str:
    """The text of the page's `## title` section, up to the next `## `."""
    text = PAGE.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def capability_rows() -> list[list[str]]:
    """The cells of each row of the capabilities table (the header and its rule left out)."""
    lines = [line for line in section("Capabilities").splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def exists(path: str) -> bool:
    """Whether `path` is in the tree. A test path is a file or a folder; a module of guards is
    named with or without `.py`, and is a module file or a package of that name (so a module
    split into a package keeps its line), a package by its folder."""
    if path.startswith("tests/"):
        return (ROOT / path).exists()
    stem = ROOT / path.rstrip("/").removesuffix(".py")
    return stem.with_suffix(".py").is_file() or (stem / "__init__.py").is_file()


def module_of(path: str) -> str:
    """`guards/contracts/` is `guards.contracts`, `guards/__init__.py` is `guards`."""
    name = path.rstrip("/").removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def test_every_path_the_map_names_exists() -> None:
    rows = capability_rows()
    assert len(rows) >= 20  # the table is read
    for capability, read, implemented, tested in rows:
        modules, tests = NAMED.findall(implemented), NAMED.findall(tested)
        pages = re.findall(r"\]\(([^)#]+)", read)
        assert modules, capability
        assert tests, capability
        assert pages, capability
        assert all(name.startswith("guards/") for name in modules), capability
        assert all(name.startswith("tests/") for name in tests), capability
        missing = [name for name in modules + tests if not exists(name)]
        missing += [page for page in pages if not (ROOT / "docs" / page).is_file()]
        assert missing == [], capability


def test_every_test_folder_is_in_the_map() -> None:
    folders = {f"tests/{init.parent.name}/" for init in (ROOT / "tests").glob("*/__init__.py")}
    named = {name for row in capability_rows() for name in NAMED.findall(row[3])}
    mapped = {folder for folder in folders if any(name.startswith(folder) for name in named)}
    assert "tests/walk/" in folders
    assert folders - mapped == set()


def test_the_layers_are_those_of_the_import_rule_with_every_package_in_one() -> None:
    items = re.findall(r"^\d+\. (.*)$", section("Layers"), re.MULTILINE)
    layers = tuple(tuple(module_of(name) for name in NAMED.findall(item.split(":")[0])) for item in items)
    assert layers == LAYERS
    packages = {
        module_of(str(init.parent.relative_to(ROOT))) for init in (ROOT / "guards").glob("*/__init__.py")
    }
    assert "guards.walk" in packages
    assert packages - {name for names in layers for name in names} == set()


def test_the_checker_finds_a_missing_path() -> None:
    named = ["guards/stores/_memory", "guards/stores/_memory.py", "guards/walk/", "guards/__init__.py"]
    assert [name for name in [*named, "tests/walk/"] if not exists(name)] == []
    assert [name for name in ["guards/stores/_nowhere", "tests/nowhere/"] if exists(name)] == []
    assert module_of("guards/contracts/") == "guards.contracts"
    assert module_of("guards/__init__.py") == "guards"
    assert module_of("guards/_guards.py") == "guards._guards"
