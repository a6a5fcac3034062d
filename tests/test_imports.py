"""The package's import structure, read from the source (not by importing it), so a circle
that happens to import fine in one order still fails here.

Every import counts: at module level, inside a function (moving an import into a function does
not break a circle, it only hides it) and under `TYPE_CHECKING` (a type-only import is still a
dependency: the module cannot be understood, or type-checked, without the other).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "guards"

#: Imports a function makes on purpose, to load a module only when it is used (the Redis and
#: SQLite stores; effort routing, tasks, a budget's local fallback, tracing and the status page when an app configures
#: them; the OpenAPI additions when the document is first asked for): each runs at start-up or
#: on first use, never on a request's path. Not a way round a circle, and each one checked for
#: circles all the same. (`guards/__init__.py` imports its public names on first use through
#: `importlib`: see `test_the_packages_lazy_names_are_its_type_checking_imports`.)
LAZY = {
    ("guards.stores", "guards.stores._redis"),
    ("guards.stores", "guards.stores._sqlite"),
    ("guards.stores._url", "guards.stores._redis"),
    ("guards.stores._url", "guards.stores._sqlite"),
    ("guards._guards", "guards.routes._openapi"),
    ("guards._guards", "guards.spec._tracing"),
    ("guards._guards", "guards.status"),
    ("guards.routes._route", "guards.routes._effort"),
    ("guards.routes._route", "guards.routes._downgrade"),
    ("guards.routes._route", "guards.routes._task_endpoint"),
    ("guards.spec._route_checks", "guards.contracts._tools"),
    ("guards.routes._route", "guards.walk._rejected"),
    ("guards.routes._route", "guards.policies._local_budget"),
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
        "guards.spec._route_spec" in graph["guards.walk._handle"] | graph["guards.walk._state"]
    )  # the graph is real
    assert "guards.spec._shared" in graph["guards.routes._route"]  # type-only imports are in it
    combined = {name: graph[name] | nested[name] for name in graph}
    assert find_cycle(combined) is None, " -> ".join(find_cycle(combined) or ())


def test_no_function_imports_a_package_module_but_those_loaded_on_first_use() -> None:
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
    [
        "guards.routes._endpoint",
        "guards.routes._openapi",
        "guards.spec._levels",
        "guards.policies._tasks",
        "guards.routes._task_endpoint",
    ],
)
def test_what_serves_a_request_does_not_import_the_decorator(module: str) -> None:
    """The walk, the endpoint, the OpenAPI document, the levels and tasks read the route's
    description (`guards.spec._route_spec`), never the decorator's module (`guards.routes._route`)."""
    graph, nested = import_graph()
    for name in [module, *walk_modules()]:
        assert not ({"guards.routes._route", "guards._guards"} & (graph[name] | nested[name])), name


#: The request path's modules that may reach metrics, log lines and traces: the observer seam
#: and the request's outcome, which it calls.
OBSERVERS = {"guards.walk._observers", "guards.walk._outcome"}


def test_the_walk_calls_no_metric_logger_or_tracer_but_through_its_observers() -> None:
    graph, nested = import_graph()
    watchers = {
        "guards.observe._metrics",
        "guards.observe._families",
        "guards.observe._tallies",
        "guards.observe._prometheus",
        "guards.observe._log",
        "guards.spec._tracing",
        "guards.observe._ledger",
    }
    calling = {
        name: sorted(watchers & (graph[name] | nested[name]))
        for name in walk_modules()
        if name not in OBSERVERS
    }
    assert {name: found for name, found in calling.items() if found} == {}
    assert set(walk_modules()) >= OBSERVERS


@pytest.mark.parametrize(
    "path",
    [
        "walk/*.py",
        "routes/_route.py",
        "routes/_endpoint.py",
        "routes/_task_endpoint.py",
        "policies/_tasks.py",
        "spec/_route_spec.py",
    ],
)
def test_no_file_of_the_request_path_is_over_400_lines(path: str) -> None:
    sizes = {found.name: len(found.read_text().splitlines()) for found in PACKAGE.glob(path)}
    assert sizes
    assert {name: lines for name, lines in sizes.items() if lines > 400} == {}


#: The layers of the package, bottom first: a module may import its own layer's modules and
#: those of the layers below, never above (a type-only import or one inside a function counts
#: the same). Each layer is a package whose docstring says what it owns; the facade (`Guards`
#: and the package's public names), the server's entry point and the test doubles are on top.
LAYERS = (
    ("guards.contracts",),
    ("guards.observe",),
    ("guards.waits",),
    ("guards.stores",),
    ("guards.providers",),
    ("guards.policies",),
    ("guards.streams",),
    ("guards.spec",),
    ("guards.walk",),
    ("guards.routes",),
    ("guards.status",),
    ("guards.serving",),
    ("guards", "guards._guards", "guards.serve"),
    ("guards.testing",),
)


def layer_of(module: str) -> int:
    """The index in `LAYERS` of the package (or top-level module) `module` belongs to."""
    for index, names in enumerate(LAYERS):
        if module in names or any(module.startswith(f"{name}.") for name in names if name != "guards"):
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to one in LAYERS")


def test_no_import_climbs_the_layers() -> None:
    graph, nested = import_graph()
    assert layer_of("guards.walk._handle") > layer_of("guards.spec._route_spec")  # the order is real
    climbing = sorted(
        f"{name} -> {target}"
        for name in graph
        for target in graph[name] | nested[name]
        if layer_of(target) > layer_of(name)
    )
    assert climbing == []


def test_the_checker_finds_a_climb() -> None:
    assert layer_of("guards.contracts._errors") < layer_of("guards.walk._handle") < layer_of("guards._guards")
    assert layer_of("guards.testing.script") == len(LAYERS) - 1
    with pytest.raises(AssertionError, match="no layer"):
        layer_of("guards.nowhere._module")


def test_every_layer_is_a_package_that_says_what_it_owns() -> None:
    for names in LAYERS:
        for name in names:
            if name.startswith("guards."):
                init = PACKAGE.parent / name.replace(".", "/") / "__init__.py"
                if init.exists():
                    assert ast.get_docstring(ast.parse(init.read_text())), name


#: Modules still over 600 lines (none: issue 39 split the last ones).
STILL_OVER_600: set[str] = set()


def test_no_module_is_over_600_lines() -> None:
    sizes = {module_name(path): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    over = {name for name, lines in sizes.items() if lines > 600}
    assert over <= STILL_OVER_600, sorted(over - STILL_OVER_600)


def test_no_package_root_holds_more_than_about_15_modules() -> None:
    roots = {path.parent for path in PACKAGE.rglob("__init__.py")}
    counts = {
        str(root.relative_to(PACKAGE.parent)): len(
            [path for path in root.glob("*.py") if path.name != "__init__.py"]
        )
        for root in roots
    }
    assert counts["guards"] <= 3  # the facade: `Guards`, the server's entry point, one spare
    assert {root: count for root, count in counts.items() if count > 16} == {}


#: Functions still over 80 lines (none: issue 39 shortened the last ones).
STILL_LONG: set[str] = set()


def function_lengths(source: str, module: str) -> dict[str, int]:
    """Each function of `source` (methods and nested functions included, as
    `module:Class.method`) and its length in lines, from its `def` to its last line, its
    docstring left out (a nested function counts in the one that holds it too)."""
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if ast.get_docstring(child) is not None:
                    docstring = child.body[0]
                    lines -= (docstring.end_lineno or docstring.lineno) - docstring.lineno + 1
                lengths[f"{module}:{prefix}{child.name}"] = lines
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, f"{prefix}{child.name}." if isinstance(child, ast.ClassDef) else prefix)

    visit(ast.parse(source), "")
    return lengths


def test_no_function_is_over_80_lines() -> None:
    lengths = {
        name: lines
        for path in PACKAGE.rglob("*.py")
        for name, lines in function_lengths(path.read_text(), module_name(path)).items()
    }
    assert lengths["guards.walk._handle:AI.run"] > 0  # methods are counted
    over = {name: lines for name, lines in lengths.items() if lines > 80}
    assert set(over) <= STILL_LONG, {name: over[name] for name in sorted(set(over) - STILL_LONG)}


def test_the_checker_counts_a_function_without_its_docstring() -> None:
    body = "".join(f"            x{line} = {line}\n" for line in range(79))
    source = f'class A:\n    def f(self):\n        """Says\n\n        what."""\n        def g():\n{body}'
    lengths = function_lengths(f"{source}        return g\n", "m")
    assert lengths == {"m:A.f": 82, "m:A.f.g": 80}  # f: its def, g and its return


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
    "CircuitState", "Classification", "Clock", "ConfigurationError", "Cooldown", "Deployment",
    "Deployments", "Effort",
    "Envelope", "ErrorBody", "GenAIPrices", "Resumable", "ErrorCode", "EventStream", "FallbackFunction", "FallbackInfo",
    "GUARDS_EVENTS", "GuardName", "GuardTripped", "Guards", "GuardsError", "Hedge", "Kind", "LastGood",
    "Ledger", "Level", "LogLedger", "Model", "ModelDown", "ModelRef", "Moderation", "Outcome", "Price",
    "Problem", "Profile", "ProviderError", "PublicError", "Reason", "ReasoningDelta", "Retry",
    "RetryBudget", "ServiceLevel", "SharedLimit", "StatusReport", "StoreFailureMode", "StreamEnd", "StreamEvent",
    "StreamFormat", "StreamHold", "StreamWriter", "StreamingBinding", "SystemClock", "Task", "TextDelta",
    "Throttled", "Tier", "ToolCall", "ToolCallDelta", "UIChatRequest", "UIMessage", "UIPart",
    "UI_MESSAGE_STREAM", "Usage", "bearer_token", "classify", "client_key", "estimate_effort",
    "estimate_tokens", "first_output_arrived", "flatten_chain", "flush_logs", "header_key", "is_output", "override_effort", "public_error",
    "render_metrics",
}  # fmt: skip


def test_guards_all_lists_exactly_the_public_names() -> None:
    """`guards.__all__` is the public API: every name it lists is there, and every public
    name `guards` has (not a submodule) is listed, once. (The names are imported on first use:
    each is looked up first.)"""
    import types

    import guards

    assert len(guards.__all__) == len(set(guards.__all__))
    assert set(guards.__all__) == PUBLIC
    for name in guards.__all__:
        assert getattr(guards, name) is not None
    public = {
        name
        for name, value in vars(guards).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == PUBLIC
    assert set(dir(guards)) >= PUBLIC


def test_the_packages_lazy_names_are_its_type_checking_imports() -> None:
    """`guards._PUBLIC` (where `__getattr__` finds each name) says what the imports under
    `TYPE_CHECKING` say (what type checkers, IDEs and the docs read), name for name."""
    import guards

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    checking = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "typing.TYPE_CHECKING"
    )
    imported = {
        alias.asname or alias.name: "." * node.level + (node.module or "")
        for node in checking.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == guards._PUBLIC
    assert set(imported) == PUBLIC


def test_every_subpackage_says_what_it_exports() -> None:
    """Every public module of the package has an `__all__` (anyio's rule)."""
    missing = [
        module_name(path)
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.name.startswith("_") or path.name == "__init__.py"
        if "__all__" not in path.read_text()
    ]
    assert missing == []


#: Run in a fresh interpreter: `import fastapi`, `import guards`, then a guarded app on the
#: memory store (built, installed, and one request served through ASGI), printing the modules
#: each stage imported.
_MINIMAL_APP = """
import asyncio, json, sys

def loaded():
    return set(sys.modules)

from fastapi import FastAPI
start = loaded()
import guards
after_import = loaded()
from guards import AI, AIResult, Guards

class Answer:
    async def run(self, model, inputs):
        return AIResult("hello", model=model)
    async def aclose(self):
        return None

guards_ = Guards(Answer())
app = FastAPI()
guards_.install(app)

@app.post("/hello")
@guards_.route(model="m")
async def hello(ai: AI[str]) -> str:
    return await ai.run({"prompt": "hi"})

built = loaded()
sent = []

async def receive():
    return {"type": "http.request", "body": b"", "more_body": False}

async def send(message):
    sent.append(message)

scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
         "scheme": "http", "path": "/hello", "raw_path": b"/hello", "query_string": b"",
         "root_path": "", "headers": [(b"host", b"test")], "client": ("127.0.0.1", 1),
         "server": ("127.0.0.1", 80)}
asyncio.run(app(scope, receive, send))
assert sent[0]["status"] == 200, sent
answered = loaded()
print(json.dumps({
    "import": sorted(after_import - start),
    "built": sorted(built - start),
    "request": sorted(answered - built),
}))
"""

#: What a guarded route that uses none of these features never imports.
NOT_IMPORTED = {
    "sqlite3": "the SQLite store's driver",
    "guards.stores._sqlite": "the SQLite store",
    "guards.stores._redis": "the Redis store",
    "redis": "the Redis client",
    "guards.status": "the status page",
    "guards.status._report": "the status page's models",
    "guards.routes._effort": "effort routing",
    "guards.routes._downgrade": "downgrading near a cap",
    "guards.routes._task_endpoint": "tasks",
    "guards.spec._tracing": "tracing",
    "opentelemetry": "OpenTelemetry",
    "guards.waits._throttle": "the throttle",
    "aiolimiter": "the throttle's limiter",
    "guards.streams._ui_stream": "the AI SDK's UI message stream",
    "guards.contracts._tools": "tool-call validation",
    "guards.walk._rejected": "rejected answers moving on",
    "guards.routes._openapi": "the OpenAPI additions (until the document is asked for)",
    "prometheus_client": "prometheus-client (until the first flush or scrape)",
    "guards.providers": "the HTTP providers",
    "httpx": "the providers' HTTP client",
    "botocore": "Bedrock's signer (the `bedrock` extra)",
    "guards.testing": "the test doubles",
}


def run_fresh(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_plain_guarded_app_imports_no_feature_it_does_not_use() -> None:
    """Deterministic (module lists, not timings): `import guards` imports none of its modules;
    an app with one guarded route on the memory store imports none of `NOT_IMPORTED` (beyond
    what FastAPI imported itself); and serving a request imports nothing at all (what a route
    needs is imported when it is declared, never on a request's path)."""
    stages = json.loads(run_fresh(_MINIMAL_APP))
    assert [name for name in stages["import"] if name.startswith("guards")] == ["guards"]
    built = set(stages["built"])
    assert {"guards._guards", "guards.walk", "guards.stores._memory"} <= built  # the app is real
    imported = {name: why for name, why in NOT_IMPORTED.items() if name in built}
    assert imported == {}
    assert stages["request"] == []


def test_every_lazy_name_resolves_in_a_fresh_interpreter() -> None:
    """Each name of `guards.__all__` (and `guards.stores`'s) is found on first use, as the
    object its module defines, in an interpreter that imported nothing of guards before."""
    code = """
import importlib
import guards, guards.stores
for name in guards.__all__:
    value = getattr(guards, name)
    module = importlib.import_module(guards._PUBLIC[name], "guards")
    assert value is getattr(module, name), name
for name in guards.stores.__all__:
    assert getattr(guards.stores, name) is not None, name
assert guards.status.StatusReport is guards.StatusReport
print("ok")
"""
    assert run_fresh(code) == "ok\n"


def test_the_servers_supervisor_imports_neither_fastapi_nor_the_engine() -> None:
    """`python -m guards.serve` imports the package first: its supervisor process, which only
    starts and watches workers, must not pay for FastAPI, pydantic or the guards engine."""
    code = """
import json, sys
import guards.serve
print(json.dumps(sorted(sys.modules)))
"""
    loaded = set(json.loads(run_fresh(code)))
    assert not {"fastapi", "pydantic", "guards._guards", "guards.walk", "prometheus_client"} & loaded
