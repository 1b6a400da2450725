"""Workspaces that hold this repo's tracked files in a git + DVC repo of their own, for the tests that run
`dvc repro` as a user does (tests/test_e2e.py, tests/test_reproducibility.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from lmgeo.params import apply_overrides, load_params

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(*cmd: str, cwd: Path, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`cmd` in `cwd` with this venv first on PATH and an embedded Ray (`env` adds or overrides variables)."""
    full = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "RAY_ADDRESS": "", **(env or {})}
    done = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=900)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
    return done


def new_study(workspace: Path) -> Path:
    """`workspace` as a git repo holding this repo's tracked files (the default study's params.yaml),
    without the committed lock and reports, which belong to the default study's run."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, files.stdout.split("\0")):
        if (REPO / name).is_file():
            (workspace / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, workspace / name)
    (workspace / "dvc.lock").unlink(missing_ok=True)
    shutil.rmtree(workspace / "reports", ignore_errors=True)
    sh("git", "init", "-q", cwd=workspace)
    commit(workspace, "the default study's params")
    return workspace


def commit(workspace: Path, message: str) -> None:
    sh("git", "add", "-A", cwd=workspace)
    sh("git", "-c", "user.email=ci@lmgeo", "-c", "user.name=ci", "commit", "-qm", message, cwd=workspace)


def write_params(workspace: Path, overrides: dict[str, str]) -> None:
    """Set the given keys and nothing else (as `dvc exp run -S` does), so no other stage's params change."""
    apply_overrides(load_params(workspace / "params.yaml"), overrides)  # valid, or fail here
    raw = yaml.safe_load((workspace / "params.yaml").read_text())
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        section = raw
        for key in parents:
            if not isinstance(section.get(key), dict):  # absent, or null (a section switched off, e.g. the sweep)
                section[key] = {}
            section = section[key]
        section[leaf] = yaml.safe_load(value)
    (workspace / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
