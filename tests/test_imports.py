"""The package's modules import one another without a circle (issue 13): read from the source,
not by importing it, so a circle that happens to import fine in one order still fails here.

An import counts wherever it runs (module level or inside a function): moving an import into a
function does not break a circle, it only hides it. Imports under `TYPE_CHECKING` never run and
are left out (they name types for the type checker).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "guards"

#: Imports a function makes on purpose, to load an optional dependency only when it is used
#: (the Redis client): not a way round a circle, and each one checked for circles all the same.
LAZY = {
    ("guards.stores", "guards.stores._redis"),
    ("guards.stores._url", "guards.stores._redis"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """The package modules `path` imports: (at module level, inside functions)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top: set[str] = set()
    nested: set[str] = set()

    def targets(node: ast.Import | ast.ImportFrom) -> set[str]:
        found = set()
        if isinstance(node, ast.Import):
            found = {alias.name for alias in node.names}
        else:
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            stem = node.module or ""
            origin = (f"{base}.{stem}" if stem else base) if node.level else stem
            found = {origin}
            found |= {f"{origin}.{alias.name}" for alias in node.names}  # `from . import x`
        return {target for target in found if target in modules}

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            (nested if in_function else top).update(targets(node))
            return
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    top.discard(name)
    nested.discard(name)
    return top, nested


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph, nested = {}, {}
    for path in paths:
        graph[module_name(path)], nested[module_name(path)] = imports_of(path, modules)
    return graph, nested


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, as the modules along it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = walk(target)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = walk(node)
        if cycle is not None:
            return cycle
    return None


def test_the_package_has_no_import_circle() -> None:
    graph, nested = import_graph()
    assert "guards._route_spec" in graph["guards._ai"]  # the graph is real
    combined = {name: graph[name] | nested[name] for name in graph}
    assert find_cycle(combined) is None, " -> ".join(find_cycle(combined) or ())


def test_no_function_imports_a_package_module_but_the_optional_redis_client() -> None:
    _, nested = import_graph()
    hidden = {(name, target) for name, targets in nested.items() for target in targets}
    assert hidden <= LAZY, sorted(hidden - LAZY)


@pytest.mark.parametrize("module", ["guards._ai", "guards._openapi", "guards._levels", "guards._tasks"])
def test_what_serves_a_request_does_not_import_the_decorator(module: str) -> None:
    """The walk, the OpenAPI document, the levels and tasks read the route's description
    (`guards._route_spec`), never the decorator's module (`guards._route`) or `Guards`."""
    graph, nested = import_graph()
    assert not ({"guards._route", "guards._guards"} & (graph[module] | nested[module]))


def test_the_checker_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def external_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in `path`, wherever it runs."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_package_imports_neither_the_example_app_nor_the_repositorys_fixtures() -> None:
    """The wheel installs `guards` alone: nothing in it may need `app` or `fixtures`."""
    offending = {
        module_name(path): sorted(external_imports(path) & {"app", "fixtures"})
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert {name: names for name, names in offending.items() if names} == {}


def test_only_the_pytest_plugin_imports_pytest() -> None:
    """`guards.testing` is usable without pytest (the fakes, the clock); only the plugin, which
    pytest itself loads, imports it."""
    importers = {module_name(path) for path in PACKAGE.rglob("*.py") if "pytest" in external_imports(path)}
    assert importers == {"guards.testing.pytest_plugin"}


def test_the_engine_does_not_import_its_test_doubles() -> None:
    graph, nested = import_graph()
    engine = {name for name in graph if not name.startswith("guards.testing")}
    reached = {target for name in engine for target in graph[name] | nested[name]}
    assert "guards.testing.script" in graph["guards.testing.fake_binding"]  # the graph sees testing
    assert not {target for target in reached if target.startswith("guards.testing")}
