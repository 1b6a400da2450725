"""The library's import graph: no circle, no arrow from `lmgeo/core` to a later layer (CONTRIBUTING:
`core` → `models` → `text` → `study_a`, `study_b` → `results`, with `params` assembling them) and none out
of the library to the driver, the stages, the commands or the CLI above it.

Every import counts, lazy ones inside functions included (they run as soon as the function does), except
those under `if TYPE_CHECKING:`, which never run. Importing `a.b.c` runs `a/__init__` and `a/b/__init__`
first, so those are arrows too, except from a module inside that package (see `targets`).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LATER_LAYERS = ("models", "text", "study_a", "study_b", "results", "params")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted((REPO / "lmgeo").rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(tree: ast.AST, package: str) -> list[str]:
    """Dotted names of what `tree` imports at run time (absolute; relative imports resolved)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)  # kept only where a module
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def targets(name: str, importer: str) -> set[str]:
    """The library modules `importer` runs by importing `name`: `name` (if a module) and the packages above
    it, less the importer's own packages: Python initialises those before the importer, so a submodule's
    `from pkg.base import X` is not what runs `pkg/__init__` (naming `pkg` itself still is)."""
    return ({name} | ancestors(name) - ancestors(importer)) & MODULES.keys()


def imports_of(name: str) -> list[str]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imported_names(ast.parse(path.read_text()), package)


def import_graph() -> dict[str, set[str]]:
    return {name: set().union(*(targets(each, name) for each in imports_of(name))) - {name} for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` (its modules, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_sees_lazy_imports_and_package_inits():
    graph = import_graph()
    assert "lmgeo.core.store" in graph["lmgeo.core.contracts"]  # imported inside a function
    assert "lmgeo.study_a.classes.base" not in graph["lmgeo.study_a.reference"]  # if TYPE_CHECKING
    # importing `lmgeo.study_b.recipes.base` runs the package's __init__ (the registry) first...
    base = "lmgeo.study_b.recipes.base"
    assert targets(base, "lmgeo.tools.bench.recipes") == {"lmgeo.study_b", "lmgeo.study_b.recipes", base}
    # ...but not from inside the package, which Python has begun to initialise before any of its modules
    assert targets(base, "lmgeo.study_b.recipes.adamw") == {base}


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_core_imports_no_later_layer():
    arrows = [
        f"{module} -> {target}"
        for module, edges in import_graph().items()
        if module.startswith("lmgeo.core")
        for target in sorted(edges)
        if target.split(".")[1:2] and target.split(".")[1] in LATER_LAYERS
    ]
    assert not arrows, "lmgeo/core imports a later layer:\n" + "\n".join(arrows)


# The package's floors, lowest first: the library (its own layers checked above), the driver, the stages, the
# commands beside them, the CLI on top. A module imports from its own floor and those below it only.
FLOORS = (
    ("core", "models", "text", "study_a", "study_b", "results", "params"),
    ("driver",),
    ("stages",),
    ("commands",),
    ("cli",),
)


def floor(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(FLOORS) if part in names), 0)


def test_no_import_runs_back_up_a_floor():
    arrows = [
        f"{module} -> {target}"
        for module, edges in import_graph().items()
        for target in sorted(edges)
        if floor(target) > floor(module)
    ]
    assert not arrows, "\n".join(arrows)
    assert (
        floor("lmgeo.cli") > floor("lmgeo.commands.analyse") > floor("lmgeo.stages.fit") > floor("lmgeo.driver.layout")
    )
