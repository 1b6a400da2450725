"""The code each DVC stage depends on, computed from its imports (`lmgeo.core.fingerprint`), and every file
that may decide the committed results. `python -m scripts.dvc_deps --write` puts the lists into `dvc.yaml`;
`tests/test_fingerprint.py` fails when they drift, so `dvc repro` and the shard manifests agree on what a
code change invalidates."""

from __future__ import annotations

from pathlib import Path

from lmgeo.core.fingerprint import ALWAYS, closure, has_code
from lmgeo.driver.layout import RECORDS

STAGES = ("prepare", "train", "external", "extract", "fit", "perturb", "aggregate", "report")
CODE_ROOT = "lmgeo/"
# The commands beside the stages (`lmgeo analyse`, `bench`, `tune`, ...) compute no committed result.
NOT_RESULTS = "lmgeo/commands/"


def code_deps(stage: str, workspace: Path) -> list[str]:
    """Workspace-relative source files of `lmgeo.stages.<stage>` and everything it imports, config and every
    registry member included, infrastructure left out (package `__init__` files without code are left out
    too: they cannot change anything)."""
    root = workspace.resolve()
    files = closure([f"lmgeo.stages.{stage}", *ALWAYS], roots=[workspace], with_config=True, members="all")
    return sorted(
        entry.path.resolve().relative_to(root).as_posix()
        for entry in files
        # code installed elsewhere is not the workspace's (a workspace without its own copy has none)
        if entry.path.resolve().is_relative_to(root) and (entry.path.name != "__init__.py" or has_code(entry.path))
    )


# Besides the code: what decides the results too (the params, the stage graph, the pinned packages, and the
# committed records the report states: tuning, the locality sweep, the matched-budget sweep's provenance).
DECIDING_FILES = ("params.yaml", "dvc.yaml", "pyproject.toml", "constraints.txt", *RECORDS)


def result_inputs(workspace: Path) -> list[str]:
    """Every file that may decide the pipeline's results, conservatively: all of the library's and the
    stages' sources (not only those a code version holds), and `DECIDING_FILES`. The report's provenance
    says whether they were committed, and the committed results are checked against them."""
    files = (path.relative_to(workspace).as_posix() for path in (workspace / CODE_ROOT).rglob("*.py"))
    code = {name for name in files if not name.startswith(NOT_RESULTS)}
    return sorted(code | set(DECIDING_FILES))


def is_code(dep: str) -> bool:
    return dep.startswith(CODE_ROOT) and dep.endswith(".py")
