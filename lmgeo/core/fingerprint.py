"""The code version of a shard: a hash of exactly the project code that can change its numbers.

A stage's code is its module (`stages/<stage>.py`) and every project module it imports, directly or
through other project modules, at any depth and inside functions (lazy imports run too), with the
packages' `__init__` files. It is computed from the source files, not hand-listed, so moving science
between modules can never leave a shard's key stale. What is hashed is each file's syntax tree without
docstrings: comments, formatting and docstrings change no output and redo no shard. Three kinds of module
are left out, each for a reason a test checks:

- configuration modules (`*/config.py`, `lmgeo/params.py`) define values and their validation only
  (a value's logic that a task uses, like `TrainConfig.for_run`, reaches it through the params hash);
- infrastructure (`INFRASTRUCTURE`: progress lines, the Ray loop, code versions, provenance, the stage
  runtime and paths) cannot change a number, and none of it is reachable from the science packages
  (`NUMERIC_PACKAGES`);
- registry indexes (`INDEXES`) only list their members, one module each, named as the member. A shard's
  code holds the members it uses (`members`: its run's recipe and family, the classes it fits), so adding
  a recipe, or editing one, redoes only the shards that use it.

The datasets' declarations enter by value: a stage passes the declared schemas of what it writes
(`CodeSpec.schemas`), and the declarations themselves (`NAME = Dataset(...)`) are left out of the hashed
contracts module, so a schema edit redoes exactly the datasets whose schema changed, while an edit of the
contracts' code (id codecs, readers) redoes everything that uses it. The environment that pins the kernels
(`lmgeo.core.determinism`) is part of every version, since it decides the floating-point results.

Modules are found the way a Ray worker finds them: a workspace that holds the packages comes first, then
the installed packages.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import importlib.util
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

PROJECT_PACKAGES = ("lmgeo",)
# Modules that cannot change a number, so no code version holds them (tests/test_fingerprint.py checks that
# the science packages never reach them).
INFRASTRUCTURE = (
    "lmgeo.core.progress",
    "lmgeo.core.execution",
    "lmgeo.core.fingerprint",
    "lmgeo.core.provenance",
    "lmgeo.driver.runtime",
    "lmgeo.driver.sharded",
    "lmgeo.driver.layout",
)
# A dataset's declaration (`NAME = Dataset(...)`, in the data contracts) enters a code version by value,
# through the declared schemas of what a stage writes (`CodeSpec.schemas`); the rest of the contracts module
# (id codecs, readers) is hashed like any code.
DECLARATION = "Dataset"
NUMERIC_PACKAGES = ("lmgeo.models", "lmgeo.text", "lmgeo.study_a", "lmgeo.study_b")
# Registry index → its members, the modules `<index>.<name>`; an index holds nothing but the list.
INDEXES = ("lmgeo.study_b.recipes", "lmgeo.study_a.classes", "lmgeo.models.families")
# Part of every version: the pinned kernels decide the last bits of every float.
ALWAYS = ("lmgeo.core.determinism",)


def is_config_module(name: str) -> bool:
    return name == "lmgeo.params" or name.endswith(".config")


@dataclass(frozen=True)
class ModuleFile:
    name: str
    path: Path


@dataclass(frozen=True)
class CodeSpec:
    """What a shard's code version covers: `module` (a stage), the registry `members` it uses (module
    names), and the declared `schemas` of what it writes (their text). Hashable, so a worker computes
    each version once."""

    module: str
    members: tuple[str, ...] = ()
    schemas: tuple[str, ...] = ()


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


def closure(
    modules: str | Iterable[str],
    roots: Sequence[Path] = (),
    *,
    with_config: bool = False,
    members: Literal["chosen", "all"] = "chosen",
) -> list[ModuleFile]:
    """`modules` and every project module they import, transitively, with their packages, sorted by name,
    infrastructure left out (neither followed nor listed).

    Registry members are reached only as named in `modules`, and the indexes are left out
    (`members="chosen"`: a code version), or all of them are, with their indexes (`"all"`: the code a
    DVC stage depends on, which may run any member). Configuration modules are left out, unless
    `with_config`: then they are included, and from one only the configuration modules it imports are
    followed (the registries a validator loads to check a name are not the stage's code).
    """
    named = [modules] if isinstance(modules, str) else list(modules)
    found: dict[str, Path] = {}
    pending = [(name, False) for name in named]
    while pending:
        name, from_config = pending.pop()
        if from_config and not is_config_module(name):
            continue
        for candidate in [*_packages_of(name), name]:
            if candidate in found or candidate in INFRASTRUCTURE or (is_config_module(candidate) and not with_config):
                continue
            if members == "chosen" and candidate in INDEXES and candidate not in named:
                continue
            path = resolve(candidate, roots)
            if path is None:
                if candidate in named:
                    raise ModuleNotFoundError(f"cannot find the project module {candidate!r}")
                continue  # `from pkg import name` where name is not a module
            found[candidate] = path
            config = is_config_module(candidate)
            pending.extend((imported, config) for imported in _imported(candidate, path))
    return [ModuleFile(name, found[name]) for name in sorted(found)]


def index_members(index: str, roots: Sequence[Path] = ()) -> list[str]:
    """The member modules registry `index` lists: those it imports from its own package by name."""
    path = resolve(index, roots)
    if path is None:
        raise ModuleNotFoundError(f"cannot find the registry index {index!r}")
    return [
        f"{index}.{alias.name}"
        for node in _parse(path.read_bytes()).body
        if isinstance(node, ast.ImportFrom) and node.module == index
        for alias in node.names
    ]


def all_members(roots: Sequence[Path] = ()) -> tuple[str, ...]:
    """Every registered member: what a stage that reads about every member (the report) depends on."""
    return tuple(member for index in INDEXES for member in index_members(index, roots))


def code_version(spec: CodeSpec | str, roots: Sequence[Path] = ()) -> str:
    """`<package version>+<code_digest>`: the same on every machine for the same code."""
    return f"{_package_version()}+{code_digest(spec, roots)}"


def code_digest(spec: CodeSpec | str, roots: Sequence[Path] = ()) -> str:
    """The hash of the spec's closure, members and schemas: what a Ray worker that runs code shipped by the
    driver checks (a worker node may have another version of lmgeo installed, or none)."""
    spec = CodeSpec(spec) if isinstance(spec, str) else spec
    digest = hashlib.sha256()
    for entry in closure([spec.module, *spec.members, *ALWAYS], roots):
        _update(digest, entry.name, normalised_source(entry.path))
    for schema in spec.schemas:
        _update(digest, "schema", schema)
    return digest.hexdigest()[:16]


def _update(digest: hashlib._Hash, name: str, text: str) -> None:
    for part in (name.encode(), text.encode()):
        digest.update(len(part).to_bytes(8, "little") + part)


def normalised_source(path: Path) -> str:
    """The file's syntax tree without docstrings and dataset declarations, as text: equal for sources that
    differ only in comments, formatting, docstrings or the declared datasets (which enter by value)."""
    tree = _without_docstrings(path)
    tree.body = [node for node in tree.body if not _is_declaration(node)]
    return ast.dump(tree, include_attributes=False)


def _is_declaration(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == DECLARATION


def has_code(path: Path) -> bool:
    """Whether the file holds anything besides docstrings and comments."""
    return any(not isinstance(node, ast.Pass) for node in _without_docstrings(path).body)


def _without_docstrings(path: Path) -> ast.Module:
    tree = _parsed(path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return tree


def _parsed(path: Path) -> ast.Module:
    """A fresh syntax tree of the file (callers may edit it), parsed once per content."""
    return copy.deepcopy(_parse(path.read_bytes()))


@functools.lru_cache(maxsize=1024)
def _parse(source: bytes) -> ast.Module:
    return ast.parse(source)


def _packages_of(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(module: str, path: Path) -> Iterator[str]:
    """Project modules `path` imports (anywhere in the file, except under `if TYPE_CHECKING:`); for
    `from a import b`, both `a` and the candidate module `a.b`."""
    for node in _runtime_nodes(_parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise ValueError(f"{path}: a relative import; code versions follow absolute imports only")
        elif isinstance(node, ast.ImportFrom) and node.module:
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
