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

from lmgeo.commands.bench.fits import compare_with_reference
from lmgeo.commands.bench.measure import Timings, bar, interleaved, peak_rss_bytes, reset_peak_rss, run_fresh
from lmgeo.commands.bench.recipe_costs import COSTS, newton_schulz_flops
from lmgeo.commands.bench.sizes import fit_bench_classes
from lmgeo.commands.bench.synthetic import synthetic_states
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.recipes import RECIPES

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
        [
            sys.executable,
            "-m",
            "lmgeo.cli",
            "bench",
            "--quick",
            "--out",
            str(out),
            "--params",
            str(REPO / "params.yaml"),
        ],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
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
    for prefix in (
        "extraction: extract path",
        "extraction: peak RSS",
        "fits diag_psd",
        "fits lowrank",
        "fits mlp",
        "fits orthogonal",
        "kNN: working memory",
        "kNN vs FAISS",
        "patching: suffix vs full",
        "recipes: hilbert /",
        "recipes: hilbert_equi",
        "fan-out",
    ):
        assert any(name.startswith(prefix) for name in names), prefix
    for row in report["ratios"]:
        assert row.keys() >= {"name", "value", "op", "threshold", "passed", "unit", "note"}
        assert row["op"] in (">=", "<=") and isinstance(row["passed"], bool)


@pytest.mark.slow  # `lmgeo bench --quick` in a subprocess
def test_quick_bench_properties_that_do_not_depend_on_the_machine(quick_bench):
    report = json.loads((quick_bench / "bench.json").read_text())
    agreement = [r for r in report["ratios"] if "max |fit_layer − reference|" in r["name"]]
    assert len(agreement) == len(fit_bench_classes()) and all(r["passed"] for r in agreement)  # to 1e-4
    assert report["fanout"]["same_outputs"] is True
    assert all(run["same_neighbours"] == 1.0 for run in report["knn_vs_faiss"]["runs"])
    assert report["patching"]["max_relative_kl_difference"] <= 1e-3
    assert report["patching"]["paths"] == ["cached"]  # neox's cache reproduces the full forward
    assert set(report["recipes"]["vs_baseline"]) == set(RECIPES.names())
    assert report["recipes"]["vs_baseline"][baseline().name] == pytest.approx(1.0)
    assert set(report["recipes"]["muon_kernels"]) == {"pinned as the stages run", "this machine's own"}
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
    from torch.utils.flop_counter import FlopCounterMode

    from lmgeo.study_b.muon import newton_schulz

    for shape in [(300, 24), (24, 300), (40, 40)]:
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(shape), steps=5)
        assert counter.get_total_flops() == newton_schulz_flops(*shape, steps=5)


def test_the_equidistance_searchs_products_are_what_its_cost_model_counts(monkeypatch):
    """The matrix products of the solver's candidate search (`search`), against torch's FLOP counter: the
    Gram matrix up to BUCKET_ROWS rows (2·V²·d), the sketch and the buckets' Gram above (2·V·d·s +
    2·V·B·s). `hilbert_equi_flops` counts two searches a step."""
    from torch.utils.flop_counter import FlopCounterMode

    from lmgeo.study_b import equidistance
    from lmgeo.study_b.lmo import sketch_projection

    monkeypatch.setattr(equidistance, "BUCKET_ROWS", 256)
    for rows, width in [(200, 24), (1024, 96)]:
        u = torch.nn.functional.normalize(torch.randn(rows, width), dim=1)
        projection = sketch_projection(width, u) if rows > 256 else None
        with FlopCounterMode(display=False) as counter:
            equidistance.search(u, projection)
        s = min(width, 64) if rows > 256 else width
        bucket = 256 if rows > 256 else rows
        expected = 2 * rows * bucket * s + (2 * rows * width * 64 if width > 64 and rows > 256 else 0)
        assert counter.get_total_flops() == expected


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
    from lmgeo.study_a.classes import FIT_CLASSES
    from lmgeo.study_a.config import AnalysisConfig
    from lmgeo.study_a.fits import choose_anchors, fit_layer
    from lmgeo.study_a.reference import reference_rows

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


def test_suffix_flops_count_the_weight_products_torch_counts_and_every_causal_attention_pair():
    """`suffix_flops` against torch's FLOP counter on a forward (the blocks' and head's products; the counter
    does not see fused attention) plus the attention pairs counted one query at a time."""
    from torch.utils.flop_counter import FlopCounterMode

    from lmgeo.commands.bench.study_a import suffix_flops
    from lmgeo.models.config import ModelSize
    from lmgeo.models.registry import build_model

    d, n_blocks, vocab, seq_len = 32, 3, 97, 16
    model = build_model("neox", ModelSize(d_model=d, n_layers=n_blocks, n_heads=4), vocab, seq_len, seed=0).eval()
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (2, seq_len)), use_cache=False)
    products = sum(counter.get_flop_counts()["Global"].values())
    attention = 2 * sum(4 * d * n_blocks * (t + 1) for t in range(seq_len))
    assert suffix_flops(model, n_blocks, np.zeros(2, dtype=int), seq_len) == products + attention
    # From positions 5 and 9 on, one block: the head on every suffix position, one block's products and pairs
    per_token_one_block = sum(p.numel() for p in model.gpt_neox.layers[-1].parameters() if p.ndim >= 2)
    want = sum(
        2 * (per_token_one_block + vocab * d) + 4 * d * (t + 1) for first in (5, 9) for t in range(first, seq_len)
    )
    assert suffix_flops(model, 1, np.array([5, 9]), seq_len) == want


@pytest.mark.slow  # a fresh interpreter
def test_bench_only_refuses_an_unknown_section_naming_the_choices(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmgeo.cli",
            "bench",
            "--only",
            "extraction",
            "--only",
            "fitz",
            "--out",
            str(tmp_path),
            "--params",
            str(REPO / "params.yaml"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("lmgeo: error:") == 1 and "--only fitz" in done.stderr
    assert "choose from extraction, fits," in done.stderr and not list(tmp_path.iterdir())


def test_collect_bars_takes_the_sections_that_ran():
    """`lmgeo bench --only` leaves the other sections out of the report; their bars are not looked for."""
    from lmgeo.commands.bench.command import collect_bars

    report = {
        "patching": {"bars": [bar("p", 1.0, ">=", 0.5)], "speedup": 2.0},
        "recipes": {"bars": [], "profile": {"r": ["line"]}},
    }
    collected = collect_bars(report)
    assert [b.name for b in collected["ratios"]] == ["p"] and collected["profiles"] == {"r": ["line"]}


def _tiny_layer(n_anchors: int = 3, k: int = 12, d: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(np.random.default_rng(5).normal(size=(n_anchors, k, d)))
    return x, x + torch.tanh(x @ torch.ones(d, d, dtype=torch.float64) / d)


def test_mlp_step_row_times_every_anchor_for_exactly_its_steps(monkeypatch):
    from lmgeo.commands.bench.mlp_step import fit_steps
    from lmgeo.study_a.classes import mlp
    from lmgeo.study_a.config import AnalysisConfig

    batches: list[int] = []
    step = mlp._Training.adam_step
    monkeypatch.setattr(mlp._Training, "adam_step", lambda self, *a: (batches.append(len(self.rows)), step(self, *a)))
    xn, yn = _tiny_layer()
    cfg = AnalysisConfig(mlp_steps=400)
    fit_steps(xn, yn, cfg, 7)
    assert batches == [3] * 7
    batches.clear()  # the study's own criterion ends (or shrinks) the batch sooner: what tol = −∞ rules out
    mlp.fit_mlp(xn, yn, cfg.mlp_hidden, cfg.mlp_steps, cfg.mlp_tol, cfg.ridge, cfg.seed)
    assert len(batches) < cfg.mlp_steps or batches[-1] < 3


def test_plain_batched_adam_step_is_each_anchors_own_adam_step():
    from lmgeo.commands.bench.mlp_step import PlainMLP
    from lmgeo.study_a.classes.mlp import LEARNING_RATE

    xn, yn = _tiny_layer()
    ridge = 1e-3
    plain = PlainMLP(xn, yn - xn, hidden=5, ridge=ridge, seed=2)
    start = [w.detach().clone() for w in plain.weights]
    for _ in range(3):
        plain.step()
    for a in range(len(xn)):
        w1, b1, w2, b2 = (w[a].clone().requires_grad_(True) for w in start)
        own = torch.optim.Adam([w1, b1, w2, b2], lr=LEARNING_RATE)
        for _ in range(3):
            own.zero_grad()
            out = torch.tanh(xn[a] @ w1.T + b1) @ w2.T + b2
            loss = ((yn[a] - xn[a] - out) ** 2).mean() + ridge * ((w1**2).sum() + (w2**2).sum())
            loss.backward()
            own.step()
        for mine, batched in zip((w1, b1, w2, b2), plain.weights, strict=True):
            torch.testing.assert_close(batched[a].detach(), mine.detach(), rtol=1e-10, atol=1e-12)
