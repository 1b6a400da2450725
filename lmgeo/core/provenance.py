"""Facts about the machine, the software and the inputs that a result was produced with: the one
collector that the report's provenance section and the bench both use, and the check that committed
results are what the committed code computes. Every part tolerates a missing tool or file."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

PACKAGES = ("torch", "transformers", "ray", "duckdb", "dvc", "pyarrow", "numpy", "scipy", "matplotlib")


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, GPUs (by nvidia-smi, so torch need not be imported), platform, load."""
    import psutil

    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpus.splitlines() if gpus else [],
        "platform": platform.platform(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def versions(packages: Sequence[str] = PACKAGES) -> dict[str, str]:
    """Python's and each package's version; lmgeo's with the code version of `code_module` when given."""
    found = {"python": platform.python_version()}
    for package in ("lmgeo", *packages):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def git_state(workspace: Path, inputs: Sequence[str]) -> dict[str, Any]:
    """The revision, and whether any of `inputs` (the files that decide the results: code, params, pins)
    differs from it. The outputs a run rewrites (dvc.lock, reports/) are not inputs, so a clean tree stays
    clean while its own run writes them."""
    rev = _run(["git", "rev-parse", "HEAD"], workspace)
    if rev is None:
        return {"revision": "unknown (not a git checkout, or no commit yet)"}
    status = _run(["git", "status", "--porcelain", "--untracked-files=all", "--", *inputs], workspace)
    return {"revision": rev, "uncommitted_changes": bool(status)}


def committed_results_problems(workspace: Path, recorded: dict[str, Any], inputs: Sequence[str]) -> list[str]:
    """Why results whose provenance says `recorded` (a `git_state`) are not what the code at HEAD computes:
    written with uncommitted inputs, at a revision that is not HEAD's ancestor, or at one whose inputs
    differ from HEAD's (each path named). Nothing when they are."""
    rev = recorded.get("revision", "")
    if recorded.get("uncommitted_changes") is not False:
        return [f"the results were written with uncommitted code or params (at {rev!r}); commit, then `dvc repro`"]
    if _run(["git", "merge-base", "--is-ancestor", rev, "HEAD"], workspace) is None:
        return [f"the results name revision {rev!r}, which is not HEAD or an ancestor of it"]
    changed = _run(["git", "diff", "--name-only", rev, "HEAD", "--", *inputs], workspace)
    return [
        f"{path} changed after the results' revision {rev[:12]}: run `dvc repro` and commit its outputs"
        for path in (changed or "").splitlines()
    ]


def checksums(workspace: Path, names: Sequence[str]) -> dict[str, str]:
    """`sha256:<hex>` of each of the workspace files `names` that exists."""
    return {
        name: "sha256:" + hashlib.sha256((workspace / name).read_bytes()).hexdigest()
        for name in names
        if (workspace / name).is_file()
    }


def locked_outputs(lock_text: str) -> dict[str, str]:
    """path -> md5 of every stage output recorded in dvc.lock; nothing when it is not a DVC lock file."""
    try:
        lock = yaml.safe_load(lock_text)
    except yaml.YAMLError:
        return {}
    stages = lock.get("stages") if isinstance(lock, dict) else None
    if not isinstance(stages, dict):
        return {}
    outs = {
        o["path"]: f"md5:{o['md5']}"
        for stage in stages.values()
        if isinstance(stage, dict)
        for o in stage.get("outs", [])
        if isinstance(o, dict) and "path" in o and "md5" in o
    }
    return dict(sorted(outs.items()))


def _run(cmd: Sequence[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()
