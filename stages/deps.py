"""The code each DVC stage depends on, computed from its imports (`pipeline.core.fingerprint`), and the
check that `dvc.yaml` lists exactly that: `python -m stages.deps` prints the lists, `--write` puts them
into `dvc.yaml` (keeping its data deps, order and comments). `tests/test_fingerprint.py` fails when they
drift, so `dvc repro` and the shard manifests agree on what a code change invalidates."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from pipeline.core.fingerprint import ALWAYS, closure, has_code
from pipeline.core.store import atomic_write
from stages import report

STAGES = ("prepare", "train", "external", "extract", "fit", "perturb", "aggregate", "report")
CODE_ROOTS = ("pipeline/", "stages/")


def code_deps(stage: str, workspace: Path) -> list[str]:
    """Workspace-relative source files of `stages.<stage>` and everything it imports, config and every
    registry member included, infrastructure left out (package `__init__` files without code are left out
    too: they cannot change anything)."""
    root = workspace.resolve()
    files = closure([f"stages.{stage}", *ALWAYS], roots=[workspace], with_config=True, members="all")
    return sorted(
        entry.path.resolve().relative_to(root).as_posix()
        for entry in files
        # code installed elsewhere is not the workspace's (a workspace without its own copy has none)
        if entry.path.resolve().is_relative_to(root) and (entry.path.name != "__init__.py" or has_code(entry.path))
    )


# Besides the code: what decides the results too (the params, the stage graph, the pinned packages, and the
# committed records the report states: tuning, the locality sweep, the matched-budget sweep's provenance).
DECIDING_FILES = ("params.yaml", "dvc.yaml", "pyproject.toml", "constraints.txt", *report.RECORDS)


def result_inputs(workspace: Path) -> list[str]:
    """Every file that may decide the pipeline's results, conservatively: all of the library's and the
    stages' sources (not only those a code version holds), and `DECIDING_FILES`. The report's provenance
    says whether they were committed, and the committed results are checked against them."""
    code = {path.relative_to(workspace).as_posix() for root in CODE_ROOTS for path in (workspace / root).rglob("*.py")}
    return sorted(code | set(DECIDING_FILES))


def is_code(dep: str) -> bool:
    return dep.startswith(CODE_ROOTS) and dep.endswith(".py")


def write(dvc_yaml: Path) -> None:
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096
    document = yaml.load(dvc_yaml.read_text())
    for stage in STAGES:
        deps = document["stages"][stage]["deps"]
        data = [d for d in deps if not is_code(str(d))]
        deps.clear()
        deps.extend(data + code_deps(stage, dvc_yaml.parent))
    text = io.StringIO()
    yaml.dump(document, text)
    atomic_write(dvc_yaml, text.getvalue())  # an interrupted rewrite must not leave dvc.yaml half-written


def main(argv: list[str]) -> None:
    workspace = Path.cwd()
    if argv == ["--write"]:
        write(workspace / "dvc.yaml")
        return
    for stage in STAGES:
        print(f"{stage}:\n" + "\n".join(f"  - {dep}" for dep in code_deps(stage, workspace)))


if __name__ == "__main__":
    main(sys.argv[1:])
