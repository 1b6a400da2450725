"""The build of mamba-ssm's and causal-conv1d's wheels for the CUDA machine (`scripts/gpucheck/mamba_wheels.py`),
everything but the compilation: the setup.py patch, the split of the slow translation unit, the prepared
trees and the commands (`build --dry-run`), keeping what a build returns, and what `make gpu-check` installs.
nvcc's compilation itself runs on the CUDA machine. Tests that need the real sdists skip without them
(`make mamba-sdists` fetches them)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.gpucheck import mamba_wheels
from scripts.gpucheck.mamba_wheels import SDISTS, RecipeError, patch_setup, split_instantiations

REPO = Path(__file__).resolve().parents[1]
HAVE_SDISTS = all((mamba_wheels.SDIST_DIR / s.filename).is_file() for s in SDISTS)
needs_sdists = pytest.mark.skipif(not HAVE_SDISTS, reason="no sdists in .sdist/: run `make mamba-sdists`")

# causal-conv1d 1.7.0's setup.py, cut to the lines the patch reads (the architectures, the source list).
SETUP = textwrap.dedent("""
    if not SKIP_CUDA_BUILD:
        cc_flag = []
        if HIP_BUILD:
            cc_flag.append("-DBUILD_PYTHON_PACKAGE")
        else:
            cc_flag.append("-gencode")
            cc_flag.append("arch=compute_75,code=sm_75")
            cc_flag.append("-gencode")
            cc_flag.append("arch=compute_80,code=sm_80")
            if bare_metal_version >= Version("11.8"):
                cc_flag.append("-gencode")
                cc_flag.append("arch=compute_90,code=sm_90")
            if bare_metal_version >= Version("13.0"):
                cc_flag.append("-gencode")
                cc_flag.append("arch=compute_121,code=sm_121")
        nvcc = ["-O3"] + cc_flag
        ext_modules.append(
            CUDAExtension(
                name="causal_conv1d_cuda",
                sources=[
                    "csrc/causal_conv1d.cpp",
                    "csrc/causal_conv1d_bwd.cu",
                ],
            )
        )
""")


def string_constants(text: str) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_the_patch_keeps_sm_90_only_compressed_and_lists_the_parts():
    patched = patch_setup(SETUP, {"csrc/causal_conv1d_bwd.cu": ["csrc/a.cu", "csrc/b.cu"]})
    constants = string_constants(patched)
    assert [c for c in constants if "compute_" in c] == ["arch=compute_90,code=sm_90"]
    assert "--compress-mode=size" in constants and "-DBUILD_PYTHON_PACKAGE" in constants  # HIP branch untouched
    assert "csrc/causal_conv1d_bwd.cu" not in constants and {"csrc/a.cu", "csrc/b.cu"} <= set(constants)


def test_the_patch_refuses_sources_it_was_not_written_for():
    with pytest.raises(RecipeError, match="architecture block"):
        patch_setup(SETUP.replace("compute_121,code=sm_121", "compute_130,code=sm_130"))
    with pytest.raises(RecipeError, match="listed exactly once"):
        patch_setup(SETUP, {"csrc/elsewhere.cu": ["x.cu"]})


def test_a_unit_splits_into_parts_holding_everything_before_and_three_instantiations_each():
    head = "#include <x.h>\ntemplate<typename T> void f(P &p, S s) {}\n\n"
    lines = [f"template void f<T{i}>(P &params, S stream);\n" for i in range(7)]
    parts = split_instantiations(head + "".join(lines) + "\n")
    assert len(parts) == 3 and all(part.startswith(head) for part in parts)
    assert [part[len(head) :] for part in parts] == ["".join(lines[0:3]), "".join(lines[3:6]), lines[6]]
    with pytest.raises(RecipeError, match="at the end"):
        split_instantiations(head + lines[0] + "int g() { return 1; }\n")


@needs_sdists
def test_the_real_sources_are_prepared_as_the_recipe_says(tmp_path):
    trees = mamba_wheels.prepare(mamba_wheels.SDIST_DIR, tmp_path)
    for sdist in SDISTS:
        setup = (trees[sdist.name] / "setup.py").read_text()
        constants = string_constants(setup)
        assert [c for c in constants if "compute_" in c] == ["arch=compute_90,code=sm_90"]
        assert sdist.force_build in constants  # the variable the build sets is the one setup.py reads
    conv = trees["causal_conv1d"]
    parts = sorted((conv / "csrc").glob("causal_conv1d_bwd_part*.cu"))
    assert len(parts) == 6 and not (conv / "csrc/causal_conv1d_bwd.cu").exists()
    listed = [c for c in string_constants((conv / "setup.py").read_text()) if c.startswith("csrc/")]
    assert sorted(listed) == sorted(
        [
            "csrc/causal_conv1d.cpp",
            "csrc/causal_conv1d_fwd.cu",
            "csrc/causal_conv1d_update.cu",
            *(f"csrc/{p.name}" for p in parts),
        ]
    )
    # the parts together are the original unit: one copy of what precedes the 18 instantiations, each once
    original = subprocess.run(
        [
            "tar",
            "xzOf",
            str(mamba_wheels.SDIST_DIR / SDISTS[1].filename),
            "causal_conv1d-1.7.0/csrc/causal_conv1d_bwd.cu",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    instantiations = [line for line in original.splitlines() if line.startswith("template void ")]
    found = [line for p in parts for line in p.read_text().splitlines() if line.startswith("template void ")]
    assert len(instantiations) == 18 and found == instantiations
    head = original[: original.index(instantiations[0])]
    assert all(p.read_text().startswith(head) for p in parts)


@needs_sdists
def test_a_dry_run_prepares_and_prints_both_builds_without_compiling(tmp_path):
    done = subprocess.run(
        ["bash", "scripts/gpucheck/build_mamba_wheels.sh", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", "GPU_PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if "pip wheel" in line]
    assert len(commands) == 2
    assert all("--no-build-isolation --no-deps" in c for c in commands)
    assert any(c.startswith("mamba-wheels: MAMBA_FORCE_BUILD=TRUE MAX_JOBS=10") for c in commands)
    assert any(c.startswith("mamba-wheels: CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=6") for c in commands)
    assert "causal_conv1d_bwd_part5.cu" in done.stdout and not list(tmp_path.glob("*.whl"))
    facts = json.loads(re.search(r"mamba-wheels: (\{.*\})", done.stdout).group(1))
    assert "problems" in facts  # reported, not enforced, in a dry run


def test_the_jobs_fit_the_machines_16_cores():
    assert sum(s.max_jobs for s in SDISTS) == 16


def test_the_preflight_names_a_missing_header_and_a_non_cuda_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(mamba_wheels.sysconfig, "get_config_var", lambda name: str(tmp_path))
    problems = mamba_wheels.preflight()["problems"]
    assert any("no Python.h" in p for p in problems)
    assert any("not a CUDA build" in p or "does not import" in p for p in problems)  # this CPU machine


# ------------------------------------------------------------------------------- keeping, installing
def fake_build(folder: Path, torch_version: str = "2.11.0+cu130") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for sdist in SDISTS:
        wheel = folder / f"{sdist.name}-{sdist.version}-cp312-cp312-linux_x86_64.whl"
        wheel.write_bytes(f"not a real wheel: {sdist.name}".encode())
        results[sdist.name] = {
            "status": "built",
            "seconds": 1.0,
            "wheel": wheel.name,
            "wheel_sha256": mamba_wheels.sha256(wheel),
        }
    mamba_wheels.write_manifest(folder, {"torch": torch_version}, results)
    return folder


def test_a_build_is_kept_with_its_sums_and_manifest_and_installed_only_on_its_torch(tmp_path):
    source, house = fake_build(tmp_path / "came-back"), tmp_path / "wheelhouse"
    kept = mamba_wheels.adopt(source, house)
    assert [p.name.split("-")[0] for p in kept] == ["causal_conv1d", "mamba_ssm"]
    manifest = json.loads((house / "BUILD.json").read_text())
    assert set(manifest["recipe"]["scripts_sha256"]) == {
        "scripts/gpucheck/build_mamba_wheels.sh",
        "scripts/gpucheck/mamba_wheels.py",
    }
    assert mamba_wheels.plan_kernel_install(house, "2.11.0+cu130").wheels == kept
    other = mamba_wheels.plan_kernel_install(house, "2.12.0+cu130")
    assert other.wheels == [] and "rebuild" in other.reason
    assert mamba_wheels.plan_kernel_install(tmp_path / "empty", "2.11.0").wheels == []
    kept[0].write_bytes(b"tampered")
    with pytest.raises(RecipeError, match="not the wheel"):
        mamba_wheels.plan_kernel_install(house, "2.11.0+cu130")


def test_a_build_missing_a_package_is_not_kept(tmp_path):
    source = fake_build(tmp_path / "came-back")
    (source / "SHA256SUMS").write_text((source / "SHA256SUMS").read_text().splitlines()[0] + "\n")
    with pytest.raises(RecipeError, match="a wheel of each"):
        mamba_wheels.adopt(source, tmp_path / "wheelhouse")


def test_the_sdists_are_ignored_by_git_and_the_wheelhouse_is_not():
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, check=False).returncode == 0

    assert ignored(".sdist/mamba_ssm-2.3.2.post1.tar.gz")
    assert not ignored("scripts/gpucheck/wheelhouse/mamba_ssm-2.3.2.post1-cp312-cp312-linux_x86_64.whl")
