"""Same code and params, same bytes (SPEC §1, "Reproducibility"): the tiny study run twice from scratch, once
with one Ray worker on a quiet machine, once with two while another process loads the cores and the outer
environment asks for other kernels and thread counts (as another machine would give), records identical
digests for every dataset under data/, the result tables and metrics.json in dvc.lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from study_helpers import REPO, new_study, sh, write_params

from lmgeo.core.config import flatten_overrides, load_yaml

pytestmark = pytest.mark.slow

# What another machine's environment could say; lmgeo's pins must override every one of these.
ANOTHER_MACHINE = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "AUTO",
    "OPENBLAS_CORETYPE": "Prescott",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
    "FAISS_SIMD_LEVEL": "AVX512",
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
    "OPENBLAS_NUM_THREADS": "2",
}


def locked_digests(workspace: Path) -> dict[str, str]:
    """path → md5 of every output dvc.lock records under data/ and reports/ (tables, metrics.json)."""
    lock = yaml.safe_load((workspace / "dvc.lock").read_text())
    return {
        out["path"]: out["md5"]
        for stage in lock["stages"].values()
        for out in stage.get("outs", [])
        if out["path"].startswith("data/") or out["path"] in ("reports/tables", "reports/metrics.json")
    }


def tiny_study(workspace: Path, workers: int) -> Path:
    new_study(workspace)
    overrides = flatten_overrides(load_yaml(REPO / "presets" / "tiny.yaml")) | {"ray.num_cpus": str(workers)}
    write_params(workspace, overrides)
    return workspace


def test_two_runs_on_different_workers_load_and_environment_give_identical_digests(tmp_path: Path) -> None:
    quiet = tiny_study(tmp_path / "quiet", workers=1)
    sh("dvc", "repro", cwd=quiet)

    loaded = tiny_study(tmp_path / "loaded", workers=2)
    load = subprocess.Popen([sys.executable, "-c", "while True: sum(i * i for i in range(10**6))"])
    try:
        sh("dvc", "repro", cwd=loaded, env=ANOTHER_MACHINE)
    finally:
        load.kill()

    first, second = locked_digests(quiet), locked_digests(loaded)
    assert {
        "data/models",
        "data/train",
        "data/activations",
        "data/fits",
        "data/perturb",
        "reports/metrics.json",
    } <= first.keys()
    assert first == second, {path: (first[path], second.get(path)) for path in first if first[path] != second.get(path)}
    # The times are telemetry: measured, but outside what the digests cover.
    assert sorted(p.name for p in (loaded / "telemetry" / "train").iterdir()) == sorted(
        p.name for p in (quiet / "telemetry" / "train").iterdir()
    )
