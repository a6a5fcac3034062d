"""The package's import structure, read from the source (not by importing it), so a circle
that happens to import fine in one order still fails here.

Every import counts: at module level, inside a function (moving an import into a function does
not break a circle, it only hides it) and under `TYPE_CHECKING` (a type-only import is still a
dependency: the module cannot be understood, or type-checked, without the other).
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
    assert (
        "guards._route_spec" in graph["guards.walk._handle"] | graph["guards.walk._state"]
    )  # the graph is real
    assert "guards._shared" in graph["guards._route"]  # type-only imports are in it
    combined = {name: graph[name] | nested[name] for name in graph}
    assert find_cycle(combined) is None, " -> ".join(find_cycle(combined) or ())


def test_no_function_imports_a_package_module_but_the_optional_redis_client() -> None:
    _, nested = import_graph()
    hidden = {(name, target) for name, targets in nested.items() for target in targets}
    assert hidden <= LAZY, sorted(hidden - LAZY)


def test_only_the_package_imports_the_guards_facade() -> None:
    """`Guards` is the facade: the modules below it are typed against what they use (the
    `Shared` protocol, or a smaller one), so each can be built without it."""
    graph, nested = import_graph()
    importers = {name for name in graph if "guards._guards" in graph[name] | nested[name]}
    assert importers == {"guards"}


def walk_modules() -> list[str]:
    return sorted(name for name in import_graph()[0] if name.startswith("guards.walk."))


@pytest.mark.parametrize(
    "module",
    ["guards._endpoint", "guards._openapi", "guards._levels", "guards._tasks", "guards._task_endpoint"],
)
def test_what_serves_a_request_does_not_import_the_decorator(module: str) -> None:
    """The walk, the endpoint, the OpenAPI document, the levels and tasks read the route's
    description (`guards._route_spec`), never the decorator's module (`guards._route`)."""
    graph, nested = import_graph()
    for name in [module, *walk_modules()]:
        assert not ({"guards._route", "guards._guards"} & (graph[name] | nested[name])), name


#: The request path's modules that may reach metrics, log lines and traces: the observer seam
#: and the request's outcome, which it calls.
OBSERVERS = {"guards.walk._observers", "guards.walk._outcome"}


def test_the_walk_calls_no_metric_logger_or_tracer_but_through_its_observers() -> None:
    graph, nested = import_graph()
    watchers = {"guards._metrics", "guards._log", "guards._tracing", "guards._ledger"}
    calling = {
        name: sorted(watchers & (graph[name] | nested[name]))
        for name in walk_modules()
        if name not in OBSERVERS
    }
    assert {name: found for name, found in calling.items() if found} == {}
    assert set(walk_modules()) >= OBSERVERS


@pytest.mark.parametrize(
    "path", ["walk/*.py", "_route.py", "_endpoint.py", "_task_endpoint.py", "_tasks.py", "_route_spec.py"]
)
def test_no_file_of_the_request_path_is_over_400_lines(path: str) -> None:
    sizes = {found.name: len(found.read_text().splitlines()) for found in PACKAGE.glob(path)}
    assert sizes
    assert {name: lines for name, lines in sizes.items() if lines > 400} == {}


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


#: The public names of `guards`, exactly: what users may import from it (a name added or
#: removed here is a change of the public API, and of the docs' reference).
PUBLIC = {
    "AI", "AIResult", "Attempt", "Attribution", "Binding", "Breaker", "Budget", "Chain",
    "CircuitState", "Classification", "Clock", "ConfigurationError", "Cooldown", "Effort",
    "Envelope", "ErrorBody", "ErrorCode", "EventStream", "FallbackFunction", "FallbackInfo",
    "GUARDS_EVENTS", "GuardName", "GuardTripped", "Guards", "GuardsError", "Kind", "LastGood",
    "Ledger", "Level", "LogLedger", "ModelDown", "ModelRef", "Moderation", "Outcome", "Price",
    "Problem", "Profile", "ProviderError", "PublicError", "Reason", "ReasoningDelta", "Retry",
    "RetryBudget", "ServiceLevel", "StatusReport", "StoreFailureMode", "StreamEnd", "StreamEvent",
    "StreamFormat", "StreamWriter", "StreamingBinding", "SystemClock", "Task", "TextDelta",
    "Throttled", "Tier", "ToolCallDelta", "UIChatRequest", "UIMessage", "UIPart",
    "UI_MESSAGE_STREAM", "Usage", "bearer_token", "classify", "client_key", "estimate_effort",
    "flatten_chain", "flush_logs", "header_key", "is_output", "override_effort", "public_error",
    "render_metrics",
}  # fmt: skip


def test_guards_all_lists_exactly_the_public_names() -> None:
    """`guards.__all__` is the public API: every name it lists is there, and every public
    name `guards` has (not a submodule) is listed, once."""
    import types

    import guards

    assert len(guards.__all__) == len(set(guards.__all__))
    assert set(guards.__all__) == PUBLIC
    public = {
        name
        for name, value in vars(guards).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == PUBLIC
    for name in guards.__all__:
        assert getattr(guards, name) is not None


def test_every_subpackage_says_what_it_exports() -> None:
    """Every public module of the package has an `__all__` (anyio's rule)."""
    missing = [
        module_name(path)
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.name.startswith("_") or path.name == "__init__.py"
        if "__all__" not in path.read_text()
    ]
    assert missing == []
