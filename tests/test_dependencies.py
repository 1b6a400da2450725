"""Every third-party package that lmgeo/, scripts/ and experiments/ import is declared in pyproject's dependencies, so
an install from the declared ranges alone has everything the code imports (a package pulled in only as
another's dependency can disappear when that one changes)."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"lmgeo", "scripts", "experiments"}


def top_level_imports(root: Path) -> dict[str, set[str]]:
    """Each top-level module imported anywhere under `root` (absolute imports, lazy ones included), with
    the files that import it."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(path.relative_to(REPO).as_posix())
    return found


def declared() -> set[str]:
    """The runtime dependencies and the optional runtime extras (`gpu`); not `dev`: the library must not
    need the test tools."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [r for name, extra in project["optional-dependencies"].items() if name != "dev" for r in extra]
    requirements = project["dependencies"] + extras
    return {canonicalize_name(Requirement(line).name) for line in requirements}


def test_every_third_party_import_is_a_declared_distribution():
    imports: dict[str, set[str]] = {}
    for package in FIRST_PARTY:
        for module, files in top_level_imports(REPO / package).items():
            imports.setdefault(module, set()).update(files)
    third_party = {m: f for m, f in imports.items() if m not in sys.stdlib_module_names | FIRST_PARTY | {"__future__"}}
    providers = metadata.packages_distributions()
    unknown = sorted(m for m in third_party if m not in providers)
    assert not unknown, f"imported but provided by no installed distribution: {unknown}"
    names = declared()
    undeclared = {
        module: sorted(files)
        for module, files in third_party.items()
        if not {canonicalize_name(dist) for dist in providers[module]} & names
    }
    assert not undeclared, f"imported but not declared in pyproject.toml's dependencies: {undeclared}"
    assert {"torch", "ray", "dvc", "ruamel", "rich"} <= set(third_party)  # the walk does see the imports
