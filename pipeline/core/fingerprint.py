"""The code version of a stage's shards: a hash of exactly the project code that runs when the stage runs.

A stage's code is its module (`stages/<stage>.py`) and every project module it imports, directly or
through other project modules, at any depth and inside functions (lazy imports run too), with the
packages' `__init__` files. It is computed from the source files, not hand-listed, so moving science
between modules can never leave a shard's key stale. What is hashed is each file's syntax tree without
docstrings: comments, formatting and docstrings change no output and redo no shard.

Configuration modules (`*/config.py`, `pipeline/params.py`) are neither hashed nor followed: they only
define values, and every value that reaches a shard is in its params hash. Tools (`pipeline/tools`) are
never imported by a stage, so they never take part.

Modules are found the way a Ray worker finds them: a workspace that holds the packages comes first (Ray
puts the driver's working directory on every worker's path), then the installed packages.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PROJECT_PACKAGES = ("pipeline", "stages")


def is_config_module(name: str) -> bool:
    return name == "pipeline.params" or name.endswith(".config")


@dataclass(frozen=True)
class ModuleFile:
    name: str
    path: Path


def resolve(name: str, roots: Sequence[Path] = ()) -> Path | None:
    """The file that `import name` loads: under the first of `roots` that holds it, else as installed."""
    parts = name.split(".")
    for root in roots:
        for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return candidate
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def closure(module: str, roots: Sequence[Path] = (), *, with_config: bool = False) -> list[ModuleFile]:
    """`module` and every project module it imports, transitively, with their packages, sorted by name.

    Configuration modules are left out, unless `with_config` (the code a DVC stage depends on): then they
    are included, and from one only the configuration modules it imports are followed (the registries a
    validator loads to check a name are not the stage's code).
    """
    found: dict[str, Path] = {}
    pending = [(module, False)]
    while pending:
        name, from_config = pending.pop()
        if from_config and not is_config_module(name):
            continue
        for candidate in [*_packages_of(name), name]:
            config = is_config_module(candidate)
            if candidate in found or (config and not with_config):
                continue
            path = resolve(candidate, roots)
            if path is None:
                if candidate == module:
                    raise ModuleNotFoundError(f"cannot find the project module {module!r}")
                continue  # `from pkg import name` where name is not a module
            found[candidate] = path
            pending.extend((imported, config) for imported in _imported(candidate, path))
    return [ModuleFile(name, found[name]) for name in sorted(found)]


def code_version(module: str, roots: Sequence[Path] = ()) -> str:
    """`<package version>+<hash of the closure of module>`: the same on every machine for the same code."""
    digest = hashlib.sha256()
    for entry in closure(module, roots):
        for part in (entry.name.encode(), normalised_source(entry.path).encode()):
            digest.update(len(part).to_bytes(8, "little") + part)
    return f"{_package_version()}+{digest.hexdigest()[:16]}"


def normalised_source(path: Path) -> str:
    """The file's syntax tree without docstrings, as text: equal for sources that differ only in
    comments, formatting or docstrings."""
    return ast.dump(_without_docstrings(path), include_attributes=False)


def has_code(path: Path) -> bool:
    """Whether the file holds anything besides docstrings and comments."""
    return any(not isinstance(node, ast.Pass) for node in _without_docstrings(path).body)


def _without_docstrings(path: Path) -> ast.Module:
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return tree


def _packages_of(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(module: str, path: Path) -> Iterator[str]:
    """Project modules `path` imports (anywhere in the file, except under `if TYPE_CHECKING:`); for
    `from a import b`, both `a` and the candidate module `a.b`."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        yield from (n for n in names if n.split(".")[0] in PROJECT_PACKAGES)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _package_version() -> str:
    try:
        return metadata.version("lmgeo")
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "0+uninstalled"
