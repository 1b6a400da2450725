"""`lmgeo bench`: the smoke run writes valid reports; the measurement helpers are right.

Nothing here times anything against a number: speed is what `lmgeo bench` reports, not what a test
asserts. What is asserted is that the bench runs, that its outputs are well-formed, and the
properties that do not depend on the machine (fit_layer agrees with the reference, the fan-out
runs give identical outputs, FLOP formulas match torch's own count).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.study_b.baseline import baseline
from pipeline.study_b.recipes import RECIPES
from tools.bench.fits import compare_with_reference
from tools.bench.measure import Timings, bar, interleaved, peak_rss_bytes, reset_peak_rss, run_fresh
from tools.bench.recipe_costs import COSTS, newton_schulz_flops
from tools.bench.synthetic import synthetic_states

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("extraction", "fits", "knn_memory", "knn_vs_faiss", "patching", "recipes", "fanout", "gpu")


def _reject_constant(name: str) -> float:
    raise AssertionError(f"bench.json holds a non-finite number: {name}")


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "stages.cli", "bench", "--quick", "--out", str(out),
         "--params", str(REPO / "params.yaml")],
        cwd=out, env=env, capture_output=True, text=True, timeout=400, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.slow  # `lmgeo bench --quick` in a subprocess
def test_quick_bench_writes_json_with_every_section_and_finite_numbers(quick_bench):
    report = json.loads((quick_bench / "bench.json").read_text(), parse_constant=_reject_constant)
    for key in ("command", "quick", "started_utc", "wall_s", "machine", "versions", "ratios", "profiles", *SECTIONS):
        assert key in report, key
    assert report["quick"] is True and report["command"].startswith("lmgeo bench --quick")
    assert all(math.isfinite(x) for x in _numbers(report))
    assert {"cpu", "logical_cores", "memory_gib", "gpus"} <= report["machine"].keys()
    assert {"python", "torch", "transformers", "ray", "lmgeo"} <= report["versions"].keys()
    names = [r["name"] for r in report["ratios"]]
    for prefix in ("extraction: extract path", "extraction: peak RSS", "fits diag_psd", "fits lowrank",
                   "fits orthogonal", "kNN: working memory", "kNN vs FAISS", "patching: suffix vs full",
                   "recipes: hilbert /", "recipes: hilbert_equi",
                   "fan-out"):
        assert any(name.startswith(prefix) for name in names), prefix
    for row in report["ratios"]:
        assert row.keys() >= {"name", "value", "op", "threshold", "passed", "unit", "note"}
        assert row["op"] in (">=", "<=") and isinstance(row["passed"], bool)


@pytest.mark.slow  # `lmgeo bench --quick` in a subprocess
def test_quick_bench_properties_that_do_not_depend_on_the_machine(quick_bench):
    report = json.loads((quick_bench / "bench.json").read_text())
    agreement = [r for r in report["ratios"] if "max |fit_layer − reference|" in r["name"]]
    assert len(agreement) == 3 and all(r["passed"] for r in agreement)  # same numbers to 1e-4
    assert report["fanout"]["same_outputs"] is True
    assert all(run["same_neighbours"] == 1.0 for run in report["knn_vs_faiss"]["runs"])
    assert report["patching"]["max_relative_kl_difference"] <= 1e-3
    assert report["patching"]["paths"] == ["cached"]  # neox's cache reproduces the full forward
    assert set(report["recipes"]["vs_baseline"]) == set(RECIPES.names())
    assert report["recipes"]["vs_baseline"][baseline().name] == pytest.approx(1.0)
    assert report["gpu"]["available"] == torch.cuda.is_available()


@pytest.mark.slow  # `lmgeo bench --quick` in a subprocess
def test_quick_bench_markdown_has_the_ratio_table(quick_bench):
    md = (quick_bench / "bench.md").read_text()
    report = json.loads((quick_bench / "bench.json").read_text())
    assert "## How to read this" in md and "## Ratios" in md and "## Machine and versions" in md
    assert "| benchmark | measured | bar | verdict | note |" in md
    for row in report["ratios"]:
        assert f"| {row['name']} |" in md
    if any(not r["passed"] for r in report["ratios"]):
        assert "## Missed bars: profiles and levers" in md


# ------------------------------------------------------------------------------------- helpers
def test_interleaves_cases_after_an_untimed_warmup_alternating_the_order():
    calls = []
    timings = interleaved(
        {"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, repeats=3, warmup=1
    )
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert [len(t) for t in timings.times.values()] == [3, 3]
    assert timings.results == {"a": [1, 1, 1], "b": [2, 2, 2]}


def test_ratio_is_the_median_of_paired_ratios():
    # A load spike in round 2 slows both sides; the paired ratio stays 2 where the ratio of
    # medians would not.
    timings = Timings({"a": [2.0, 20.0, 2.0, 2.2], "b": [1.0, 10.0, 1.0, 0.5]})
    assert timings.ratio("a", "b") == pytest.approx(2.0)
    assert timings.median("a") / timings.median("b") != pytest.approx(2.0)


def test_bar_verdicts():
    assert bar("x", 0.9, ">=", 0.8).passed and not bar("x", 0.7, ">=", 0.8).passed
    assert bar("x", 1.3, "<=", 1.3).passed and not bar("x", 1.31, "<=", 1.3).passed
    assert not bar("x", 25.0, ">=", 20, extra_ok=False).passed
    assert not bar("x", math.nan, "<=", 1.0).passed


def test_every_recipe_and_nothing_else_has_its_bench_costs():
    assert set(COSTS) == set(RECIPES.names())
    bars = [bar for cost in COSTS.values() for bar in (cost.step_time_bar, cost.head_step_bar) if bar]
    assert bars and all(base in RECIPES and ratio > 0 for base, ratio in bars)


def test_newton_schulz_flops_match_torchs_flop_counter():
    from torch.optim._muon import (
        DEFAULT_A,
        DEFAULT_B,
        DEFAULT_C,
        _zeropower_via_newtonschulz,
    )
    from torch.utils.flop_counter import FlopCounterMode

    for shape in [(300, 24), (24, 300), (40, 40)]:
        with FlopCounterMode(display=False) as counter:
            _zeropower_via_newtonschulz(torch.randn(shape), (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7)
        assert counter.get_total_flops() == newton_schulz_flops(*shape, steps=5)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux-only")
def test_peak_rss_sees_a_freed_allocation_until_reset():
    block = 256 * 2**20
    reset_peak_rss()
    start = peak_rss_bytes()
    data = np.ones(block // 8)
    del data
    assert peak_rss_bytes() >= start + 0.9 * block
    assert reset_peak_rss()
    assert peak_rss_bytes() < start + 0.5 * block


def _child_environment(threads: int, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getpid()


@pytest.mark.slow  # a fresh process, twice
def test_run_fresh_runs_in_another_process_with_the_thread_count():
    value, pid = run_fresh(_child_environment, 3, env={"LMGEO_BENCH_PROBE": "yes"}, name="OMP_NUM_THREADS")
    assert value == "3" and pid != os.getpid()
    assert run_fresh(_child_environment, 1, env={"LMGEO_BENCH_PROBE": "yes"}, name="LMGEO_BENCH_PROBE")[0] == "yes"
    assert "LMGEO_BENCH_PROBE" not in os.environ


def test_compare_with_reference_finds_a_difference_and_a_null_mismatch():
    from pipeline.study_a.classes import FIT_CLASSES
    from pipeline.study_a.config import AnalysisConfig
    from pipeline.study_a.fits import choose_anchors, fit_layer
    from pipeline.study_a.reference import reference_rows

    states = synthetic_states(n_seq=6, seq_len=10, d=5, n_layers=1, seed=0)
    seq = np.repeat(np.arange(6), 10)
    cfg = AnalysisConfig(k=8, anchors=5, rank=2, p=2)
    anchors = choose_anchors(60, 5, seed=0)
    table = fit_layer(states[0], states[1], seq, seq, seq, anchors, ["lowrank"], cfg)[0]["lowrank"]
    rows = reference_rows(
        states[0].astype(np.float64), states[1].astype(np.float64), seq, anchors, FIT_CLASSES["lowrank"], cfg
    )
    same = compare_with_reference(table, rows)
    assert same["max_abs_diff"] < 1e-4 and same["null_mismatches"] == 0
    rows[2]["rel_err"] += 0.5
    rows[3]["proj_res"] = None
    changed = compare_with_reference(table, rows)
    assert changed["max_abs_diff"] == pytest.approx(0.5, abs=1e-4) and changed["null_mismatches"] == 1


def test_an_unknown_section_is_one_error_line_with_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "stages.cli", "bench", "--section", "nope", "--out", str(tmp_path),
         "--params", str(REPO / "params.yaml")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("lmgeo: error: unknown bench section nope; choose among")
