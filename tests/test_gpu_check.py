"""The GPU check (`make gpu-check`) on the CPU: what it decides and writes, the wheels it carries, and the
whole plan run end to end with the CPU standing in for the GPU (CUDA-only items skipped with a reason).
The check's GPU figures themselves can only come from a CUDA machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from packaging.requirements import Requirement

from scripts.gpucheck import compat, plan, summary, wheels
from scripts.gpucheck.compare import hilbert_invariant
from scripts.gpucheck.plan import Item
from scripts.gpucheck.summary import Outcome, Result
from scripts.gpucheck.tolerances import TOLERANCES, Tolerance, agree, combine, largest

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------- tolerances
def test_agreement_is_elementwise_atol_plus_rtol_and_reports_how_close():
    tol = Tolerance(atol=1e-3, rtol=1e-2, why="")
    cpu = np.array([0.0, 1.0, 100.0])
    assert agree(cpu + [9e-4, 1e-2, 0.9], cpu, tol).passed  # each within atol + rtol·|cpu|
    failed = agree(cpu + [0.0, 0.0, 1.2], cpu, tol)
    assert not failed.passed and failed.max_abs_diff == pytest.approx(1.2)
    assert failed.worst_ratio == pytest.approx(1.2 / (1e-3 + 1.0))


def test_a_nan_must_be_nan_on_both_sides():
    tol = TOLERANCES["fits"]
    assert agree([np.nan, 1.0], [np.nan, 1.0], tol).passed
    one_sided = agree([np.nan, 1.0], [0.5, 1.0], tol)
    assert not one_sided.passed and one_sided.nonfinite_mismatches == 1
    assert not agree([np.inf], [-np.inf], tol).passed


def test_zero_tolerance_accepts_only_equality_and_scale_makes_atol_relative():
    exact = Tolerance(0.0, 0.0, "")
    assert agree([1.0, 2.0], [1.0, 2.0], exact).passed
    assert not agree([1.0, 2.0 + 1e-15], [1.0, 2.0], exact).passed
    values = np.array([1000.0, -2000.0])
    assert largest(values) == 2000.0 and largest(np.array([np.nan, 0.0])) == 1.0
    assert agree(values + 0.01, values, TOLERANCES["activations"], scale=largest(values)).passed  # 5e-6 of 2000
    assert not agree(values + 0.1, values, TOLERANCES["activations"], scale=largest(values)).passed


def test_combined_agreement_takes_the_worst_of_each():
    good, bad = agree([1.0], [1.0], TOLERANCES["kl"]), agree([1.0], [2.0], TOLERANCES["kl"])
    both = combine({"a": good, "b": bad})
    assert not both.passed and both.max_abs_diff == 1.0 and both.size == 2


def test_every_tolerance_says_why():
    assert all(len(t.why) > 40 for t in TOLERANCES.values())


def test_the_hilbert_invariant_counts_violations_and_sampled_diameters():
    rows = [
        {"hilbert_realized": 0.5, "hilbert_bound": 1.0, "head_diam_sampled": False},
        {"hilbert_realized": 1.1, "hilbert_bound": 1.0, "head_diam_sampled": False},  # violated
        {"hilbert_realized": 0.5, "hilbert_bound": 1.0, "head_diam_sampled": True},  # not exact: not held
        {"hilbert_realized": None, "hilbert_bound": None, "head_diam_sampled": None},  # not logged
    ]
    found = hilbert_invariant(pa.Table.from_pylist(rows))
    assert found == {"logged": 3, "held": 1, "max_ratio": pytest.approx(1.1)}


# ------------------------------------------------------------------------------ fit comparisons
def _fit_table():
    from lmgeo.commands.bench.synthetic import synthetic_states
    from lmgeo.study_a.config import AnalysisConfig
    from lmgeo.study_a.fits import choose_anchors, fit_layer

    states = synthetic_states(n_seq=8, seq_len=12, d=6, n_layers=1, seed=2)
    seq = np.repeat(np.arange(8), 12)
    cfg = AnalysisConfig(k=12, anchors=6, rank=2, p=2)
    anchors = choose_anchors(96, 6, seed=0)
    return fit_layer(states[0], states[1], seq, seq, seq, anchors, ["orthogonal"], cfg)[0]["orthogonal"]


def _with(table: pa.Table, name: str, values: list) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, table.schema.field(name).type))


def test_fit_comparisons_are_null_aware_and_leave_tied_anchors_out_of_the_subspace_columns():
    from lmgeo.core.contracts import arrow_to_vectors, vectors_to_arrow
    from scripts.gpucheck.compare import compare_fit_tables

    cpu = _fit_table()
    assert all(cpu["operator_identified"].to_pylist())  # k = 2d: every anchor is compared
    same = compare_fit_tables(cpu, cpu)
    assert not same.mismatched and same.tied == 0 and all(a.passed for a in same.values.values())
    # A tied anchor (on either device) is left out of proj_full / proj_res, whatever its values there.
    tied_flag = [True] + cpu["subspace_tied"].to_pylist()[1:]
    off = [v + 0.5 for v in cpu["proj_res"].to_pylist()]
    both = compare_fit_tables(
        _with(_with(cpu, "proj_res", off), "subspace_tied", tied_flag), _with(cpu, "subspace_tied", tied_flag)
    )
    assert both.tied == 1 and not both.values["proj_res"].passed  # the other anchors' values are off
    only_tied = [v + 0.5 if i == 0 else v for i, v in enumerate(cpu["proj_res"].to_pylist())]
    left_out = compare_fit_tables(
        _with(_with(cpu, "proj_res", only_tied), "subspace_tied", tied_flag), _with(cpu, "subspace_tied", tied_flag)
    )
    assert left_out.values["proj_res"].passed and left_out.values["proj_res"].size == len(only_tied) - 1
    # A flag that differs is named (the tie itself must agree)...
    assert "subspace_tied" in compare_fit_tables(_with(cpu, "subspace_tied", tied_flag), cpu).mismatched
    # ...so is a column null on one device only; its values are compared where both have one.
    nulled = compare_fit_tables(_with(cpu, "rel_err", [None] + cpu["rel_err"].to_pylist()[1:]), cpu)
    assert nulled.mismatched == ["rel_err"] and nulled.values["rel_err"].passed
    vectors = arrow_to_vectors(cpu["patched"]).copy()
    vectors[2, 0] += 1e-2
    moved = compare_fit_tables(
        cpu.set_column(cpu.schema.get_field_index("patched"), "patched", vectors_to_arrow(vectors)), cpu
    )
    assert not moved.values["patched"].passed and not moved.mismatched


# ---------------------------------------------------------------------------- runner and summary
def _raise() -> Outcome:
    raise RuntimeError("boom")


@pytest.mark.slow
def test_the_runner_isolates_failures_skips_cuda_only_items_and_reports_after_each():
    reported = []
    items = [
        Item("s", "raises", _raise),
        Item("s", "fails", lambda: Outcome("off", passed=False)),
        Item("s", "gpu only", lambda: Outcome("never"), cuda_only="needs the allocator"),
        Item("t", "measures", lambda: Outcome("3 tokens/s")),
        Item("t", "holds", lambda: Outcome("close", passed=True)),
    ]
    results = plan.run(items, CPU, budget_s=60, report=lambda r: reported.append(len(r)))
    assert [r.status for r in results] == ["error", "FAIL", "skipped", "measured", "pass"]
    assert "RuntimeError: boom" in results[0].summary and "_raise" in results[0].detail["traceback"]
    assert results[2].summary == "CUDA only: needs the allocator"
    assert reported == [1, 2, 3, 4, 5]


def test_items_past_the_budget_are_skipped_with_the_reason():
    items = [Item("s", "first", lambda: Outcome("ok", passed=True)), Item("s", "second", lambda: Outcome("ok"))]
    results = plan.run(items, CPU, budget_s=-1, report=lambda r: None)
    assert all(r.status == "skipped" and "budget" in r.summary for r in results)


def test_gpu_test_outcomes_are_read_from_pytests_junit_report():
    from xml.etree import ElementTree

    cases = ElementTree.fromstring(
        '<testsuite><testcase name="a"/><testcase name="b"><failure message="assert 1 == 2&#10;more"/></testcase>'
        '<testcase name="c"><skipped message="no CUDA: run it there"/></testcase><testcase name="d"><error/></testcase>'
        "</testsuite>"
    )
    assert [plan.case_outcome(c) for c in cases] == [
        ("passed", ""),
        ("failed", "assert 1 == 2"),
        ("skipped", "no CUDA: run it there"),
        ("error", ""),
    ]


def test_summaries_hold_every_result_tables_and_failures(tmp_path):
    results = [
        Result("Study A", "fit x", "pass", 1.0, "max |Δ| 1e-9", {"worst": np.float64(1e-9), "nan": float("nan")}),
        Result("Study A", "fit y", "error", 0.5, "ValueError: bad", {"traceback": "Traceback …\nValueError: bad"}),
        Result(
            "speed",
            "steps",
            "measured",
            2.0,
            "fast",
            {
                "tables": {"per recipe": {"columns": ["recipe", "ms"], "rows": [["muon", 12.5], ["adamw", None]]}},
                "array": np.arange(3),
            },
        ),
    ]
    header = {
        "mode": "CUDA",
        "command": "make gpu-check",
        "device": "NVIDIA H200",
        "started_utc": "now",
        "budget_s": 420.0,
        "wall_s": 3.5,
        "finished": True,
        "versions": {"torch": "2.11.0"},
        "install": {"installed": ["pydantic.whl"], "unmet_requirements": ["lmgeo needs ray"]},
    }
    summary.write(tmp_path, header, results)
    document = json.loads((tmp_path / summary.JSON_NAME).read_text())
    assert document["counts"] == {"pass": 1, "FAIL": 0, "error": 1, "skipped": 0, "measured": 1}
    assert document["results"][0]["detail"] == {"worst": 1e-9, "nan": None}  # JSON has no NaN
    assert document["results"][2]["detail"]["array"] == [0, 1, 2]
    assert set(document["tolerances"]) == set(TOLERANCES)
    md = (tmp_path / summary.MARKDOWN_NAME).read_text()
    assert md.startswith("# GPU check — CUDA") and "## Study A" in md and "## speed" in md
    assert "| fit x | pass | max \\|Δ\\| 1e-9 | 1.0 |" in md
    assert "**steps: per recipe**" in md and "| muon | 12.5 |" in md and "| adamw | — |" in md
    assert "### error: Study A / fit y" in md and "ValueError: bad" in md
    assert "lmgeo needs ray" in md and "## Tolerances" in md


# ------------------------------------------------------------------------- issue #39's training items
def test_the_step_bars_are_adamw_within_20_ms_and_every_recipe_within_1_3_times_it():
    from scripts.gpucheck.speed import step_bars

    bars = step_bars({"adamw": 18.0, "muon": 23.0, "hilbert": 24.0})
    assert [(name, bar["passed"]) for name, bar in bars.items()] == [
        ("adamw ≤ 20 ms", True),
        ("muon ≤ 1.3× adamw", True),
        ("hilbert ≤ 1.3× adamw", False),
    ]
    assert bars["hilbert ≤ 1.3× adamw"]["value"] == pytest.approx(24 / 18)
    assert not step_bars({"adamw": 21.0})["adamw ≤ 20 ms"]["passed"]


def test_mamba_on_its_kernels_is_compared_with_the_fallback_or_skipped_saying_why(monkeypatch):
    sizes = plan.full_sizes()
    cuda = torch.device("cuda")
    monkeypatch.setattr(plan, "kernels_chosen", lambda: False)
    without = plan.mamba_kernel_items(sizes.mamba_kernels, cuda)
    assert [i.name for i in without] == ["extraction mamba", "patching mamba", "train mamba muon"]
    results = plan.run(without, cuda, budget_s=60, report=lambda r: None)
    assert all(r.status == "skipped" and "build_mamba_wheels.sh" in r.summary for r in results)
    monkeypatch.setattr(plan, "kernels_chosen", lambda: True)
    assert all(i.unavailable is None for i in plan.mamba_kernel_items(sizes.mamba_kernels, cuda))
    assert plan.standin_sizes().mamba_kernels is None  # on the CPU both sides would be the fallback


def test_without_kernels_mambas_path_is_reported_and_not_judged_on_the_cpu():
    from scripts.gpucheck.speed import heaviest_kernels, mamba_kernel_path

    found = mamba_kernel_path(CPU)
    assert found.passed is None and "not installed" in found.summary
    assert set(found.detail["implementations"]) == {
        "mamba_inner_fn",
        "causal_conv1d_fn",
        "causal_conv1d_update",
        "mamba_selective_scan",
        "mamba_selective_state_update",
    }
    assert heaviest_kernels(lambda: None, CPU)["rows"] == []  # device kernels exist on CUDA only


# ------------------------------------------------------------------------------------- wheels
def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "\n".join([f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)])
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")
    return path


def test_the_wheel_list_is_what_the_machine_lacks_plus_version_floors():
    requires = {
        "pydantic": [Requirement("pydantic-core==2.5"), Requirement("typing-extensions>=4.16"), Requirement("torch")],
        "pydantic-core": [Requirement("typing_extensions>=4.14")],
        "mambapy": [Requirement("torch")],
    }
    pins = {"pydantic": "2.14", "pydantic-core": "2.5", "typing-extensions": "4.16.0", "mambapy": "1.2"}
    carried = wheels.wheel_list(
        ["Pydantic", "torch", "mambapy"], lambda n: requires.get(n, []), frozenset({"torch", "typing-extensions"}), pins
    )
    pinned = ["mambapy==1.2", "pydantic==2.14", "pydantic-core==2.5", "typing-extensions==4.16.0"]
    assert [c.pin for c in carried] == pinned
    assert "installed only if" in carried[-1].reason
    with pytest.raises(ValueError, match="pydantic"):
        wheels.wheel_list(["pydantic"], lambda n: [], frozenset(), {})


def test_installing_takes_what_is_missing_or_too_old_and_names_what_nothing_satisfies(tmp_path):
    folder = [
        _wheel(tmp_path, "pydantic", "2.14.4", ["typing-extensions>=4.16", "pydantic-core==2.50.5"]),
        _wheel(tmp_path, "pydantic_core", "2.50.5", ["typing-extensions>=4.16"]),
        _wheel(tmp_path, "typing_extensions", "4.16.0", []),
        _wheel(tmp_path, "mambapy", "1.2.0", ["torch"]),
    ]
    machine = {"typing-extensions": "4.15.0", "torch": "2.11.0", "mambapy": "1.2.0"}
    roots = [Requirement("mambapy>=1.2"), Requirement("pydantic>=2.8"), Requirement("ray>=2.40")]
    chosen = wheels.plan_install(folder, roots, machine.get)
    assert [w.name.split("-")[0] for w in chosen.install] == ["pydantic", "pydantic_core", "typing_extensions"]
    assert chosen.present == {"mambapy": "1.2.0"}
    assert chosen.unmet == ["lmgeo needs ray>=2.40; this machine has none"]
    recent = wheels.plan_install(folder, roots, (machine | {"typing-extensions": "4.16.0"}).get)
    assert "typing_extensions" not in {w.name.split("-")[0] for w in recent.install}  # the machine's will do


@pytest.mark.slow  # exercises the library path in a fresh interpreter
def test_the_real_wheel_list_carries_pydantic_and_mambapy_and_nothing_the_machine_has():
    listed = wheels.carried_list()
    carried = {c.name for c in listed}
    assert {"pydantic", "pydantic-core", "mambapy"} <= carried
    assert not carried & {"ray", "dvc", "duckdb"}  # too big to travel; the check's path must not need them
    floors = {c.name for c in listed if "installed only if" in c.reason}
    assert not (carried - floors) & wheels.machine_packages()


def test_pins_and_machine_list_read_canonical_names():
    pins = wheels.read_pins()
    assert pins["typing-extensions"] and pins["pydantic-core"] and "torch" in pins
    machine = wheels.machine_packages()
    assert {"torch", "transformers", "typing-extensions", "pyarrow"} <= machine and "pydantic" not in machine


def test_the_wheel_folder_is_ignored_by_git():
    wheel = ".whl/pydantic-2.14.4-py3-none-any.whl"
    ignored = subprocess.run(["git", "check-ignore", "-q", wheel], cwd=REPO, check=False)
    assert ignored.returncode == 0


def test_the_repo_travels_within_the_limit_and_with_the_wheels_too():
    assert wheels.travelling_bytes(carried=None) < wheels.TRAVEL_LIMIT_BYTES
    if not any(wheels.WHEEL_DIR.glob("*.whl")):
        pytest.skip("no .whl/ here: run `make gpu-wheels` to check the wheels' size too")
    assert wheels.travelling_bytes() < wheels.TRAVEL_LIMIT_BYTES


# ------------------------------------------------------------------------------------- compat
def test_a_module_needing_an_uncarried_package_is_not_a_failure(tmp_path, monkeypatch):
    package = tmp_path / "fakelib"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fine.py").write_text("import json\n")
    (package / "needs_big.py").write_text("import bigpackage_not_here\n")
    (package / "needs_other.py").write_text("import smallpackage_not_here\n")
    (package / "broken.py").write_text("raise ValueError('bad module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(compat, "NOT_CARRIED", ("bigpackage_not_here",))
    outcome = compat.import_every_module("fakelib")
    assert not outcome.passed and outcome.detail["modules"] == 4
    assert list(outcome.detail["not_carried"]) == ["fakelib.needs_big"]
    assert set(outcome.detail["failed"]) == {"fakelib.needs_other", "fakelib.broken"}
    assert "ValueError: bad module" in outcome.detail["failed"]["fakelib.broken"]


# --------------------------------------------------------------------------------- entry point
def _check(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run(
        [sys.executable, "-m", "scripts.gpucheck", "--out", str(out), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
@pytest.mark.slow  # the check in a subprocess
def test_without_cuda_the_check_says_so_and_succeeds(tmp_path):
    done = _check(out=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("no CUDA: skipped"), done.stdout + done.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_whole_plan_runs_end_to_end_with_the_cpu_standing_in(tmp_path):
    done = _check("--device", "cpu", "--wheels", str(tmp_path / "none"), out=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((tmp_path / summary.JSON_NAME).read_text())
    results = {(r["section"], r["name"]): r for r in document["results"]}
    expected = plan.items(plan.standin_sizes(), CPU)
    assert list(results) == [(i.section, i.name) for i in expected]
    for item in expected:
        status = results[(item.section, item.name)]["status"]
        skipped = item.cuda_only or item.unavailable
        assert status == (
            "skipped" if skipped else "measured" if item.section.startswith("measurements") else "pass"
        ), (item.name, results[(item.section, item.name)]["summary"])
    gpu_tests = results[("environment", "GPU tests (pytest -m gpu)")]["summary"]
    assert "skipped (no CUDA" in gpu_tests  # each test skipped itself, saying why
    assert document["finished"] and document["mode"].startswith("CPU stand-in")
    assert "it says nothing about a GPU" in (tmp_path / summary.MARKDOWN_NAME).read_text()
