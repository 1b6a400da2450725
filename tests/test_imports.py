"""The library's import graph: no circle, no arrow from `pipeline/core` to a later layer (CONTRIBUTING:
`core` → `models` → `text` → `study_a`, `study_b` → `results`, with `params` assembling them) and none out
of the library to `stages/` or `tools/`.

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


MODULES = {module_name(path): path for path in sorted((REPO / "pipeline").rglob("*.py"))}


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
    assert "pipeline.core.store" in graph["pipeline.core.contracts"]  # imported inside a function
    assert "pipeline.study_a.classes.base" not in graph["pipeline.study_a.reference"]  # if TYPE_CHECKING
    # importing `pipeline.study_b.recipes.base` runs the package's __init__ (the registry) first...
    base = "pipeline.study_b.recipes.base"
    assert targets(base, "pipeline.tools.bench.recipes") == {"pipeline.study_b", "pipeline.study_b.recipes", base}
    # ...but not from inside the package, which Python has begun to initialise before any of its modules
    assert targets(base, "pipeline.study_b.recipes.adamw") == {base}


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_core_imports_no_later_layer():
    arrows = [
        f"{module} -> {target}"
        for module, edges in import_graph().items()
        if module.startswith("pipeline.core")
        for target in sorted(edges)
        if target.split(".")[1:2] and target.split(".")[1] in LATER_LAYERS
    ]
    assert not arrows, "pipeline/core imports a later layer:\n" + "\n".join(arrows)


def test_the_library_imports_neither_stages_nor_tools():
    arrows = [
        f"{name} -> {imported}"
        for name in MODULES
        for imported in imports_of(name)
        if imported.split(".")[0] in ("stages", "tools")
    ]
    assert not arrows, "\n".join(arrows)
