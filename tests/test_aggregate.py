"""Result tables on a hand-made tiny study whose summary numbers are known (lmgeo/aggregate.py)."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats as sps

from lmgeo.core.contracts import FIT_METRICS, parse_run_id, run_id, vectors_to_arrow
from lmgeo.core.contracts import RESULT_TABLES as TABLES
from lmgeo.core.store import ManifestKey, ShardWriter
from lmgeo.params import load_params
from lmgeo.results.aggregate import aggregate, build_tables, load_sources
from lmgeo.results.config import ReportConfig
from lmgeo.results.headline import HEADLINE, metrics
from lmgeo.results.stats import holm, mean_interval, spearman_by_layer
from lmgeo.results.study_a.claims import CLAIMS, LAYER_FIT
from lmgeo.results.study_b.tables import MAX_CURVE_POINTS
from lmgeo.study_a.classes import FIT_CLASSES

CFG = ReportConfig(bootstrap=200, ci=0.9, seed=3)
KEY = ManifestKey(inputs={}, params_hash="test", code_version="test")

# Final validation losses per run (the test loss is TEST_OFFSET above); `sign` diverges, `adamw` has one
# seed.
FINAL_VAL = {
    "gpt2-muon-s0": 3.0,
    "gpt2-muon-s1": 3.1,
    "gpt2-muon-s2": 3.3,
    "gpt2-hilbert-s0": 2.5,
    "gpt2-hilbert-s1": 2.6,
    "gpt2-hilbert-s2": 2.65,
    "gpt2-hilbert_equi-s0": 2.55,
    "gpt2-adamw-s0": 3.4,
    "gpt2-sign-s0": math.nan,
}
# The matched-budget sweep, planted on the default runs' seeds: at each budget `muon` costs MUON_COST over its own
# step (same seed); `hilbert` is `muon` at that budget plus DELTA, with a seed jitter of mean 0. So muon's best
# budget (on val) is 0.4, inside the grid, and hilbert's 0.2, on its edge.
SWEEP_TAUS = (0.2, 0.4, 0.8)
MUON_COST = {0.2: 0.3, 0.4: 0.1, 0.8: 0.2}
DELTA = {0.2: -0.2, 0.4: 0.05, 0.8: 0.1}
JITTER = (0.01, -0.02, 0.01)
STEP_SCALE = {"muon": 2.0, "hilbert": 0.5}  # the budget enlarges muon's own steps, shrinks hilbert's


def sweep_val(recipe: str, seed: int, tau: float) -> float:
    muon = FINAL_VAL[f"gpt2-muon-s{seed}"] + MUON_COST[tau]
    return muon + DELTA[tau] + JITTER[seed] if recipe == "hilbert" else muon


MATCHED_VAL = {
    run_id("gpt2", r, s, matched=True, cap=tau): sweep_val(r, s, tau)
    for r in ("muon", "hilbert")
    for s in range(3)
    for tau in SWEEP_TAUS
}
TEST_OFFSET = 0.05
EQUI_RATIO = {"hilbert": 0.4, "hilbert_equi": 0.6}
EQUI_RATIO_RANDOM = 0.55
STEPS = 20
GEOMETRY_EVERY = 5


def write_steps(data_dir: Path, run: str, steps: pa.Table) -> None:
    with ShardWriter(data_dir / "train", run, KEY) as writer:
        writer.write({"run": run}, steps, name="steps.parquet")


def sources(data_dir: Path):
    return load_sources(data_dir / "train", data_dir / "fits", data_dir / "perturb", data_dir / "models")


def steps_table(run: str, n_steps: int = STEPS) -> pa.Table:
    """Geometry every GEOMETRY_EVERY steps with realized = bound / 2, except one sampled-diameter step
    whose realized exceeds the bound (a sampled diameter is only a lower bound and must be ignored)."""
    recipe = run.split("-")[1]
    step = np.arange(n_steps, dtype=np.int64)
    geo = step % GEOMETRY_EVERY == 0
    bound = np.where(geo, 1.0 + step, np.nan)
    sampled = step == 2 * GEOMETRY_EVERY
    realized = np.where(sampled, 2 * bound, bound / 2)
    val = np.where((step == n_steps // 2) | (step == n_steps - 1), 3.0 + 1.0 / (1 + step), np.nan)

    def nullable(x: np.ndarray) -> pa.Array:
        return pa.array(x, mask=np.isnan(x))

    return pa.table(
        {
            "step": step,
            "tokens": step * 256,
            "lr": np.full(n_steps, 1e-3),
            "train_loss": 4.0 - step / n_steps,
            "val_loss": nullable(val),
            "head_diam": nullable(bound),
            "head_diam_sampled": pa.array(np.where(geo, sampled, False), mask=~geo),
            "head_update_rms": nullable(np.where(geo, 0.01, np.nan)),
            "head_update_spectral": pa.nulls(n_steps, pa.float64()),
            "hilbert_realized": nullable(np.where(geo, realized, np.nan)),
            "hilbert_bound": nullable(bound),
            "equi_ratio": nullable(np.where(geo, EQUI_RATIO.get(recipe, 0.2), np.nan)),
            "equi_ratio_random": nullable(np.where(geo, EQUI_RATIO_RANDOM, np.nan)),
            "head_alignment": nullable(np.where(geo, 0.3, np.nan)),
        }
    )


def diverged_steps(run: str) -> pa.Table:
    """The run diverges: its last logged step has NaN/Inf losses and geometry."""
    table = steps_table(run)
    bad = pa.table(
        {
            c: pa.array([math.inf if c == "train_loss" else math.nan])
            if table.schema.field(c).type == pa.float64()
            else table[c].slice(STEPS - 1)
            for c in table.column_names
        }
    )
    return pa.concat_tables([table.slice(0, STEPS - 1), bad.cast(table.schema)])


def write_run(data_dir: Path, run: str, val: float) -> None:
    """A run's steps and its final `run.json`; a NaN `val` is a run that diverged at step 7."""
    steps = diverged_steps(run) if math.isnan(val) else steps_table(run)
    spec = parse_run_id(run)
    if spec.cap is not None:  # a sweep run: every step rescaled to the budget
        steps = steps.append_column("head_step_scale", pa.array(np.full(len(steps), STEP_SCALE[spec.recipe])))
    write_steps(data_dir, run, steps)
    arch, recipe, head_budget_tau = spec.arch, spec.recipe, spec.cap
    record = {
        "run": run,
        "arch": arch,
        "recipe": recipe,
        "seed": spec.seed,
        "steps": STEPS,
        "steps_done": 7 if math.isnan(val) else STEPS,
        "tokens": STEPS * 256,
        "final_train_loss": None if math.isnan(val) else val - 0.1,
        "final_val_loss": None if math.isnan(val) else val,
        "diverged": math.isnan(val),
        "final_test_loss": None if math.isnan(val) else val + TEST_OFFSET,
        "head_budget_tau": head_budget_tau,
        "head_step": "tau=0.8" if recipe.startswith("hilbert") else "head_lr=0.02",
        "diverged_at_step": 7 if math.isnan(val) else None,
        "n_params": 1000,
        "params_hash": "abc",
    }
    with ShardWriter(data_dir / "models", run, KEY) as writer, writer.directory(f"{run}/final") as folder:
        (folder / "run.json").write_text(json.dumps(record))


def write_study_b(data_dir: Path, matched: bool = False) -> None:
    """FINAL_VAL's runs, and with `matched` MATCHED_VAL's."""
    for run, val in (FINAL_VAL | (MATCHED_VAL if matched else {})).items():
        write_run(data_dir, run, val)
    # A run that crashed before writing run.json still shows up, as not finished.
    write_steps(data_dir, "gpt2-rownorm-s0", steps_table("gpt2-rownorm-s0"))


# Study A: per (model dir, layer) the rel_err of the anchors; kl is a monotone function of rel_err
# (increasing after training, decreasing at init), so every Spearman is exactly ±1.
REL_ERR = {0: [0.1, 0.2, 0.3, 0.4, 0.5], 1: [0.25, 0.35, 0.45, 0.55, 0.65, 0.75]}
MODELS = {"gpt2-muon-s0.final": 1.0, "gpt2-muon-s0.init": -1.0, "org--tiny-mamba": 1.0}


def fit_columns(model: str, layer: int, fn: str) -> dict[str, np.ndarray]:
    """Deterministic metric columns; one row of layer 0 has a NaN rel_err (excluded, counted)."""
    rel = np.array(REL_ERR[layer])
    n = rel.size
    i = np.arange(n, dtype=float)
    init = model.endswith(".init")
    cols = {
        "rel_err": rel.copy(),
        "rel_err_state": rel / 10,
        "cos_full_tok": 0.95 - 0.01 * i - (0.5 if init else 0),
        "cos_full_res": 0.2 + 0.01 * i,
        "angle_res_tok": 30.0 + 25.0 * i + 5 * layer,
        "proj_full": 0.8 + 0.01 * i,
        "proj_res": 0.3 + 0.01 * i + (0.6 if init else 0),
        "proj_full_global": 0.7 + 0.0 * i,
        "proj_res_global": 0.2 + 0.02 * i,
        "norm_full": 1.0 + i,
        "norm_res": rel,
    }
    if fn == "identity":
        for c in ("cos_full_tok", "angle_res_tok", "proj_full", "proj_res", "proj_full_global", "proj_res_global"):
            cols[c] = np.full(n, np.nan)
    if layer == 0:
        cols["rel_err"][2] = np.nan
    return cols


def write_study_a(data_dir: Path, *, with_perturb: bool = True) -> None:
    for model, sign in MODELS.items():
        for layer in REL_ERR:
            for fn in ("lowrank", "identity"):
                cols = fit_columns(model, layer, fn)
                n = cols["rel_err"].size
                seq = np.arange(n, dtype=np.int32)
                table = pa.table(
                    {
                        "sample": ["real"] * n,
                        "seq_id": seq,
                        "pos": seq + 1,
                        "token_id": seq,
                        "k": np.full(n, 4, np.int32),
                        **{c: pa.array(v, mask=np.isnan(v) & (fn == "identity")) for c, v in cols.items()},
                        "value_identified": np.ones(n, bool),
                        "subspace_tied": np.zeros(n, bool),
                        "n_nonfinite": np.full(n, 2 if layer == 0 else 0, np.int32),
                        "patched": vectors_to_arrow(np.ones((n, 3))),
                    }
                )
                partition = {"model": model, "layer": layer, "fn": fn}
                # Two shards, the second with float32 metrics: the reader unifies them.
                second = table.slice(2)
                for c in FIT_METRICS:
                    second = second.set_column(second.schema.get_field_index(c), c, second[c].cast(pa.float32()))
                for i, part in enumerate((table.slice(0, 2), second)):
                    with ShardWriter(data_dir / "fits", f"{model}/{layer}/{fn}/{i}", KEY) as writer:
                        writer.write(partition, part)
                if with_perturb:
                    kl = np.exp(sign * np.array(REL_ERR[layer]))
                    with ShardWriter(data_dir / "perturb", f"{model}/{layer}/{fn}", KEY) as writer:
                        writer.write(partition, pa.table({"seq_id": seq, "pos": seq + 1, "kl": kl, "kl_seq": kl / 2}))
    # A file that no manifest lists (a shard killed before its manifest, a stray copy) is never read.
    stray = data_dir / "fits" / "model=org--tiny-mamba" / "layer=0" / "fn=lowrank" / "part-killed.parquet"
    stray.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, stray)


def write_tiny_study(data_dir: Path) -> None:
    write_study_b(data_dir)
    write_study_a(data_dir)


# ------------------------------------------------------------------ the default study's shape
# The grid of the repository's params.yaml (Study B: train's archs x recipes x seeds; Study A: analysis.runs at
# every checkpoint, every layer and class, every null sample and null patch), so the bounds on the report and
# the metrics follow the default study when it changes. Values are random (seeded): the verdicts mix.
DEFAULT = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
DEFAULT_RECIPES = tuple(DEFAULT.train.recipes)
DEFAULT_TRAIN_ARCHS = tuple(DEFAULT.train.archs)  # Study B's
DEFAULT_ARCHS = tuple(DEFAULT.analysis.runs.archs or DEFAULT.train.archs)  # Study A's
DEFAULT_ANCHORS = 16


def write_default_shape_study(data_dir: Path) -> None:
    rng = np.random.default_rng(0)
    train, analysis = DEFAULT.train, DEFAULT.analysis
    for arch in train.archs:
        for i, recipe in enumerate(train.recipes):
            for seed in train.seeds:
                write_run(data_dir, f"{arch}-{recipe}-s{seed}", 3.0 + 0.01 * i + 0.02 * seed + rng.normal(0, 0.01))
    runs = [
        f"{arch}-{recipe}-s{seed}"
        for arch in DEFAULT_ARCHS
        for recipe in (analysis.runs.recipes or train.recipes)
        for seed in (analysis.runs.seeds or train.seeds)
    ]
    for run in runs:
        for checkpoint in analysis.checkpoints:
            model = f"{run}.{checkpoint}"
            for layer in range(train.model.n_layers):
                for fn in analysis.classes:
                    write_random_stratum(data_dir, model, layer, fn, rng)
                    if FIT_CLASSES[fn].local:  # the same class fitted once for the layer (the locality baseline)
                        write_random_stratum(data_dir, model, layer, fn + LAYER_FIT, rng)


def write_random_stratum(
    data_dir: Path,
    model: str,
    layer: int,
    fn: str,
    rng: np.random.Generator,
    null_patches: bool = True,
    distinct: int = 4000,
) -> None:
    """One (model, layer, class): real and null fits of DEFAULT_ANCHORS anchors and their patches (with the
    null patches' KLs unless `null_patches` is false)."""
    n = DEFAULT_ANCHORS
    seq = np.arange(n, dtype=np.int32)
    d = DEFAULT.train.model.d_model  # the width of `patched`: the classes' capacities are computed at it
    patched = vectors_to_arrow(np.zeros((n, d)))
    parts = []
    for sample, shift in (("real", 1.0), ("shuffled", 0.0), ("gaussian", 0.2)):
        rel = rng.uniform(0.1, 0.9, n)
        cols = {c: rng.normal(0.5 + 0.3 * shift * (layer % 2), 0.2, n) for c in FIT_METRICS}
        cols |= {
            "rel_err": rel,
            "angle_res_tok": rng.normal(80 + 20 * shift, 10, n),
            "cos_full_tok": np.sqrt(1 - rel**2) + rng.uniform(0, 0.05, n),
        }
        parts.append(
            pa.table(
                {
                    "sample": [sample] * n,
                    "seq_id": seq,
                    "pos": seq + 1,
                    "token_id": seq,
                    "k": np.full(n, 96, np.int32),
                    **cols,
                    "value_identified": rng.random(n) >= 0.05,
                    "subspace_tied": np.zeros(n, bool),
                    "n_nonfinite": np.zeros(n, np.int32),
                    "n_distinct": np.full(n, distinct, np.int32),
                    "patched": patched,
                }
            )
        )
    partition = {"model": model, "layer": layer, "fn": fn}
    with ShardWriter(data_dir / "fits", f"{model}/{layer}/{fn}", KEY) as writer:
        writer.write(partition, pa.concat_tables(parts))
    kl = np.exp(rng.normal(0, 1, n))
    directions = DEFAULT.analysis.null_directions
    each = kl[:, None] * rng.uniform(0.3, 1.5, (n, directions))
    nulls = {
        "kl_random": each.mean(axis=1),
        "kl_other": kl * rng.uniform(0.5, 2.0, n),
        "kl_directions": pa.ListArray.from_arrays(
            pa.array(np.arange(n + 1) * directions, pa.int32()), pa.array(each.ravel())
        ),
    }
    with ShardWriter(data_dir / "perturb", f"{model}/{layer}/{fn}", KEY) as writer:
        writer.write(
            partition,
            pa.table(
                {
                    "seq_id": seq,
                    "pos": seq + 1,
                    "kl": kl,
                    "kl_seq": kl / 2,
                    **(nulls if null_patches else {}),
                    "n_random": np.full(n, DEFAULT.analysis.null_directions, np.int32),
                }
            ),
        )


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pa.Table]:
    data = tmp_path_factory.mktemp("data")
    write_tiny_study(data)
    return build_tables(sources(data), CFG)


def rows(table: pa.Table, **where: object) -> list[dict]:
    return [r for r in table.to_pylist() if all(r[k] == v for k, v in where.items())]


# ------------------------------------------------------------------------------------------ Study B
def test_runs_table_summarises_each_run(tables: dict[str, pa.Table]) -> None:
    runs = {r["run"]: r for r in tables["runs"].to_pylist()}
    assert set(runs) == set(FINAL_VAL) | {"gpt2-rownorm-s0"}
    r = runs["gpt2-hilbert-s1"]
    assert (r["arch"], r["recipe"], r["seed"], r["finished"], r["diverged"]) == ("gpt2", "hilbert", 1, True, False)
    assert r["final_val_loss"] == pytest.approx(2.6)
    assert r["final_test_loss"] == pytest.approx(2.6 + TEST_OFFSET)
    assert r["median_equi_ratio_random"] == pytest.approx(EQUI_RATIO_RANDOM)
    assert r["median_head_alignment"] == pytest.approx(0.3)
    assert r["frac_steps_enlarged"] is None and r["median_head_step_scale"] is None  # no head budget
    geo_steps = np.arange(0, STEPS, GEOMETRY_EVERY)
    assert r["median_hilbert_bound"] == pytest.approx(np.median(1.0 + geo_steps))
    # The sampled step (realized = 2 × bound) is excluded from tightness, so the max stays 1/2.
    assert r["median_tightness"] == pytest.approx(0.5)
    assert r["max_tightness"] == pytest.approx(0.5)
    assert r["n_exact_geometry_steps"] == len(geo_steps) - 1
    assert r["head_diam_sampled"] is True
    assert r["median_equi_ratio"] == pytest.approx(EQUI_RATIO["hilbert"])
    crashed = runs["gpt2-rownorm-s0"]
    assert (crashed["finished"], crashed["recipe"], crashed["seed"], crashed["final_val_loss"]) == (
        False,
        "rownorm",
        0,
        None,
    )
    diverged = runs["gpt2-sign-s0"]
    assert diverged["diverged"] is True
    # Its NaN/Inf last step is missing, not a value: summaries are those of the finite steps.
    assert diverged["max_tightness"] == pytest.approx(0.5)


def test_recipes_table_compares_test_loss_with_muon_on_the_same_seeds(tables: dict[str, pa.Table]) -> None:
    by = {r["recipe"]: r for r in tables["recipes"].to_pylist()}
    hilbert = np.array([2.5, 2.6, 2.65]) + TEST_OFFSET
    muon = np.array([3.0, 3.1, 3.3]) + TEST_OFFSET
    h = by["hilbert"]
    assert (h["n_seeds"], h["n_runs"], h["steps"], h["tokens"], h["n_paired"]) == (3, 3, STEPS, STEPS * 256, 3)
    assert h["test_loss_mean"] == pytest.approx(hilbert.mean())
    assert h["test_loss_sd"] == pytest.approx(hilbert.std(ddof=1))
    low, high = sps.t.interval(CFG.ci, 2, loc=hilbert.mean(), scale=sps.sem(hilbert))
    assert (h["test_loss_ci_low"], h["test_loss_ci_high"]) == (pytest.approx(low), pytest.approx(high))
    assert h["val_loss_mean"] == pytest.approx(hilbert.mean() - TEST_OFFSET)
    assert h["diff_vs_muon"] == pytest.approx((hilbert - muon).mean())
    assert h["diff_sd"] == pytest.approx((hilbert - muon).std(ddof=1))
    assert h["p_vs_muon"] == pytest.approx(sps.ttest_rel(hilbert, muon).pvalue, rel=1e-9)
    assert h["p_vs_muon_holm"] == pytest.approx(h["p_vs_muon"])  # the only tested comparison of gpt2
    assert h["diff_ci_low"] < h["diff_vs_muon"] < h["diff_ci_high"] < 0
    assert h["seeds_to_resolve"] >= 2 and h["detectable_diff"] > 0
    assert by["muon"]["p_vs_muon"] is None and by["muon"]["diff_vs_muon"] is None
    adamw = by["adamw"]  # one seed, paired with muon's seed 0: a difference, no test
    assert adamw["p_vs_muon"] is None and adamw["test_loss_sd"] is None and adamw["n_paired"] == 1
    assert adamw["diff_vs_muon"] == pytest.approx(3.4 - 3.0)
    sign = by["sign"]
    assert (sign["n_runs"], sign["n_seeds"], sign["n_diverged"], sign["test_loss_mean"]) == (1, 0, 1, None)


def test_holm_adjusts_the_comparisons_of_an_arch_together(tmp_path: Path) -> None:
    """Two recipes, each 4 seeds paired with muon: the adjusted p-values are Holm's of the two raw ones."""

    losses = {"muon": [3.0, 3.1, 3.2, 3.3], "hilbert": [2.9, 3.05, 3.12, 3.21], "sign": [3.05, 3.12, 3.26, 3.31]}
    for recipe, values in losses.items():
        for seed, loss in enumerate(values):
            run = f"neox-{recipe}-s{seed}"
            capped = np.where(np.arange(STEPS) % 4 == 0, 2.0, 0.5)  # a quarter of the steps enlarged
            write_steps(tmp_path, run, steps_table(run).append_column("head_step_scale", pa.array(capped)))
            record = {
                "run": run,
                "arch": "neox",
                "recipe": recipe,
                "seed": seed,
                "steps": STEPS,
                "steps_done": STEPS,
                "tokens": 1,
                "final_train_loss": 1.0,
                "final_val_loss": loss,
                "final_test_loss": loss,
                "head_budget_tau": 0.3,
                "head_step": "head_lr=0.1",
                "diverged": False,
                "diverged_at_step": None,
                "n_params": 1,
                "params_hash": "x",
            }
            with ShardWriter(tmp_path / "models", run, KEY) as writer, writer.directory(f"{run}/final") as folder:
                (folder / "run.json").write_text(json.dumps(record))
    tables = build_tables(sources(tmp_path), CFG)
    assert [r["frac_steps_enlarged"] for r in tables["runs"].to_pylist()] == pytest.approx([0.25] * 12)
    by = {r["recipe"]: r for r in tables["recipes"].to_pylist()}
    raw = [sps.ttest_rel(losses[r], losses["muon"]).pvalue for r in ("hilbert", "sign")]
    assert [by[r]["p_vs_muon"] for r in ("hilbert", "sign")] == pytest.approx(raw)
    assert [by[r]["p_vs_muon_holm"] for r in ("hilbert", "sign")] == pytest.approx(holm(raw))
    assert by["hilbert"]["head_budget_tau"] == 0.3


def test_the_sweep_compares_each_budget_with_muon_at_the_same_budget(tmp_path: Path) -> None:
    write_study_b(tmp_path, matched=True)
    tables = build_tables(sources(tmp_path), CFG)
    runs = {r["run"]: r for r in tables["runs"].to_pylist()}
    assert runs["gpt2-muon-s0-cap0.4"]["matched"] and not runs["gpt2-muon-s0"]["matched"]
    assert (runs["gpt2-muon-s0-cap0.4"]["seed"], runs["gpt2-muon-s0-cap0.4"]["head_budget_tau"]) == (0, 0.4)
    assert runs["gpt2-muon-s0-cap0.4"]["median_head_step_scale"] == 2.0
    recipes = {(r["recipe"], r["matched"], r["head_budget_tau"]): r for r in tables["recipes"].to_pylist()}
    assert {tau for (_, matched, tau) in recipes if matched} == set(SWEEP_TAUS)
    # default rows: as without the sweep (hilbert − muon, planted), no budget, no budget effect
    assert recipes[("hilbert", False, None)]["diff_vs_muon"] == pytest.approx(np.mean([-0.5, -0.5, -0.65]))
    assert recipes[("hilbert", False, None)]["budget_effect"] is None
    assert recipes[("hilbert", False, None)]["median_step_scale"] is None
    for tau in SWEEP_TAUS:
        muon, hilbert = recipes[("muon", True, tau)], recipes[("hilbert", True, tau)]
        assert (muon["median_step_scale"], hilbert["median_step_scale"]) == (2.0, 0.5)
        # the budget's effect, against the recipe's own-step (default) runs of the same seeds
        assert muon["budget_effect"] == pytest.approx(MUON_COST[tau], abs=1e-12)
        assert hilbert["diff_vs_muon"] == pytest.approx(DELTA[tau])
    # Holm over every comparison of the sweep (all budgets), not budget by budget
    raw = [recipes[("hilbert", True, tau)]["p_vs_muon"] for tau in SWEEP_TAUS]
    expected = [
        sps.ttest_rel(
            [sweep_val("hilbert", s, tau) for s in range(3)], [sweep_val("muon", s, tau) for s in range(3)]
        ).pvalue
        for tau in SWEEP_TAUS
    ]
    assert raw == pytest.approx(expected)
    assert [recipes[("hilbert", True, tau)]["p_vs_muon_holm"] for tau in SWEEP_TAUS] == pytest.approx(holm(raw))
    # the envelope: each recipe at its best budget on val (ties: the smaller), compared on test at the best
    envelope = {r["recipe"]: r for r in tables["envelope"].to_pylist()}
    assert {r: e["best_tau"] for r, e in envelope.items()} == {"muon": 0.4, "hilbert": 0.2}
    assert {r: e["best_interior"] for r, e in envelope.items()} == {"muon": True, "hilbert": False}
    assert envelope["hilbert"]["n_budgets"] == len(SWEEP_TAUS)
    best_diff = np.mean([sweep_val("hilbert", s, 0.2) - sweep_val("muon", s, 0.4) for s in range(3)])
    assert envelope["hilbert"]["diff_vs_muon"] == pytest.approx(best_diff)
    assert envelope["hilbert"]["own_step_test_loss"] == pytest.approx(np.mean([2.5, 2.6, 2.65]) + TEST_OFFSET)
    rows = {name: tables[name].to_pylist() for name in ("recipes", "envelope", "claim_tests")}
    assert metrics(rows)["envelope"] == pytest.approx(best_diff, abs=5e-5)
    beats = [c for c in tables["claims"].to_pylist() if c["claim"] == "beats_muon"]
    assert [c["subject"] for c in beats if c["fn"] == "hilbert"] == ["gpt2"]  # the default runs' claim only


def test_curves_keep_evaluations_and_mark_tightness(tables: dict[str, pa.Table]) -> None:
    curve = rows(tables["curves"], run="gpt2-muon-s0")
    assert [r["step"] for r in curve] == list(range(STEPS))  # short runs are not thinned
    tight = {r["step"]: r["tightness"] for r in curve if r["tightness"] is not None}
    assert tight == {s: pytest.approx(0.5) for s in range(0, STEPS, GEOMETRY_EVERY) if s != 2 * GEOMETRY_EVERY}


def test_long_curves_are_thinned_but_keep_evals_and_last_step(tmp_path: Path) -> None:
    n = 5 * MAX_CURVE_POINTS + 3
    write_steps(tmp_path, "gpt2-muon-s0", steps_table("gpt2-muon-s0", n))
    curve = build_tables(sources(tmp_path), CFG)["curves"].to_pylist()
    steps = {r["step"] for r in curve}
    assert len(curve) <= 2 * MAX_CURVE_POINTS + 10
    assert {n // 2, n - 1} <= steps  # evaluations and the last step
    geometry_rows = sum(r["hilbert_bound"] is not None for r in curve)
    assert MAX_CURVE_POINTS / 2 <= geometry_rows <= MAX_CURVE_POINTS + 1


# ------------------------------------------------------------------------------------------ Study A
def test_geometry_per_layer_matches_numpy(tables: dict[str, pa.Table]) -> None:
    geo = tables["geometry"]
    assert sorted({r["model"] for r in geo.to_pylist()}) == [
        "gpt2-muon-s0@final",
        "gpt2-muon-s0@init",
        "org/tiny-mamba",
    ]
    for model in MODELS:
        label = model.replace(".final", "@final").replace(".init", "@init").replace("--", "/")
        for layer in REL_ERR:
            (r,) = rows(geo, model=label, layer=layer, fn="lowrank", sample="real")
            cols = fit_columns(model, layer, "lowrank")
            assert r["n"] == len(REL_ERR[layer])
            assert r["n_nonfinite"] == (2 if layer == 0 else 0)
            assert r["n_nonfinite_values"] == (1 if layer == 0 else 0)
            for c, v in cols.items():
                finite = v[np.isfinite(v)]
                assert r[f"median_{c}"] == pytest.approx(np.median(finite), rel=1e-6), c
                assert r[f"mean_{c}"] == pytest.approx(np.mean(finite), rel=1e-6), c
            assert r["median_kl"] == pytest.approx(np.median(np.exp(MODELS[model] * np.array(REL_ERR[layer]))))
    (ident,) = rows(geo, model="gpt2-muon-s0@final", layer=1, fn="identity", sample="real")
    assert ident["median_cos_full_tok"] is None and ident["median_rel_err"] is not None  # undefined stays null


def test_geometry_pooled_over_layers(tables: dict[str, pa.Table]) -> None:
    (r,) = rows(tables["geometry_pooled"], model="gpt2-muon-s0@final", fn="lowrank")
    per_layer = [fit_columns("gpt2-muon-s0.final", ly, "lowrank")["angle_res_tok"] for ly in REL_ERR]
    assert r["median_angle_res_tok"] == pytest.approx(np.median(np.concatenate(per_layer)))
    assert r["layer_median_angle_res_tok"] == pytest.approx(np.median([np.median(a) for a in per_layer]))
    assert (r["n"], r["n_layers"], r["n_nonfinite"], r["n_nonfinite_values"]) == (11, 2, 2, 1)
    assert (r["run"], r["checkpoint"], r["arch"], r["family"]) == ("gpt2-muon-s0", "final", "gpt2", "transformer")
    (ext,) = rows(tables["geometry_pooled"], model="org/tiny-mamba", fn="lowrank")
    assert (ext["run"], ext["arch"], ext["checkpoint"], ext["family"]) == (None, None, None, "ssm")


def test_angle_histogram_matches_numpy(tables: dict[str, pa.Table]) -> None:
    hist = rows(tables["angles"], model="gpt2-muon-s0@final", fn="lowrank")
    angles = np.concatenate([fit_columns("gpt2-muon-s0.final", ly, "lowrank")["angle_res_tok"] for ly in REL_ERR])
    expected, _ = np.histogram(angles, bins=np.arange(0, 181, 10))
    assert [r["count"] for r in hist] == expected.tolist()
    assert sum(r["fraction"] for r in hist) == pytest.approx(1.0)
    assert not rows(tables["angles"], fn="identity")  # undefined angles make no histogram


def test_spearman_of_monotone_relation_is_plus_or_minus_one(tables: dict[str, pa.Table]) -> None:
    corr = tables["correlations"]
    for model, expected in (("gpt2-muon-s0@final", 1.0), ("gpt2-muon-s0@init", -1.0)):
        (stratified,) = rows(corr, model=model, fn="lowrank", scope="stratified")
        assert stratified["layer"] is None and stratified["n"] == 10  # the NaN rel_err anchor is dropped
        assert stratified["spearman"] == pytest.approx(expected)
        per_layer = rows(corr, model=model, fn="lowrank", scope="layer")
        assert [(r["layer"], r["n"]) for r in per_layer] == [(0, 4), (1, 6)]
        assert all(r["spearman"] == pytest.approx(expected) for r in per_layer)


def test_correlations_are_per_layer_and_stratified(tmp_path: Path) -> None:
    """Noisy data, two layers: per-layer and stratified rows are those of lmgeo.results.stats.spearman_by_layer."""
    rng = np.random.default_rng(1)
    n = 30
    seq, pos = np.arange(n, dtype=np.int32) // 5, np.arange(n, dtype=np.int32) % 5
    layers, rel, kl = [], [], []
    for layer in (0, 1):
        r = rng.random(n)
        k = r + rng.normal(scale=0.3, size=n)
        partition = {"model": "m", "layer": layer, "fn": "lowrank"}
        for dataset, table in (("fits", {"sample": ["real"] * n, "rel_err": r}), ("perturb", {"kl": k})):
            with ShardWriter(tmp_path / dataset, f"m/{layer}", KEY) as writer:
                writer.write(partition, pa.table({"seq_id": seq, "pos": pos, **table}))
        layers.append(np.full(n, layer))
        rel.append(r)
        kl.append(k)
    with warnings.catch_warnings():  # no patch of a random direction here: its statistic is not computed on nothing
        warnings.simplefilter("error", RuntimeWarning)
        tables = build_tables(sources(tmp_path), CFG)
    assert "outweighs_random" not in tables["paper_values"].column("statistic").to_pylist()
    assert "spearman" in tables["paper_values"].column("statistic").to_pylist()
    got = tables["correlations"].to_pylist()
    want = spearman_by_layer(
        np.concatenate(layers), np.concatenate(rel), np.concatenate(kl), n_boot=CFG.bootstrap, ci=CFG.ci, seed=CFG.seed
    )
    for row in got:
        c = want["stratified" if row["scope"] == "stratified" else row["layer"]]
        assert (row["n"], row["spearman"], row["ci_low"], row["ci_high"]) == pytest.approx((c.n, c.rho, c.low, c.high))
    assert [(r["scope"], r["layer"]) for r in got] == [("stratified", None), ("layer", 0), ("layer", 1)]
    assert got[0]["spearman"] == pytest.approx((got[1]["spearman"] + got[2]["spearman"]) / 2)
    assert 0 < got[0]["ci_low"] < got[0]["spearman"] < got[0]["ci_high"] < 1


# -------------------------------------------------------------------------------------------- claims
@pytest.fixture(scope="module")
def null_study(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pa.Table]:
    """Study A only: gpt2 at its final checkpoint on two seeds, two layers, real and null fits of enough
    anchors to be tested (the tiny study's strata have fewer than MIN_ANCHORS), patches without null patches."""
    data = tmp_path_factory.mktemp("nulls")
    rng = np.random.default_rng(1)
    for seed in (0, 1):
        for layer in (0, 1):
            for fn in ("lowrank", "identity"):
                write_random_stratum(data, f"gpt2-muon-s{seed}.final", layer, fn, rng, null_patches=False)
    return build_tables(sources(data), CFG)


def test_claim_tests_state_each_seed_claim_per_subject_against_its_nulls(null_study: dict[str, pa.Table]) -> None:
    tests = null_study["claim_tests"]
    assert tests.num_rows > 0  # every check below also holds for an empty table
    geometric = [c.name for c in CLAIMS if set(c.tests) == {"shuffled", "gaussian"}]
    want = {(claim, null) for claim in geometric for null in ("shuffled", "gaussian")}

    for scope, layers, n_layers in (("layer", {0, 1}, 1), ("stratified", {None}, 2)):
        found = rows(tests, subject="gpt2@final", fn="lowrank", scope=scope)
        assert {(r["claim"], r["null"]) for r in found} == want
        assert len(found) == len(want) * len(layers) and {r["layer"] for r in found} == layers
        assert {(r["n_models"], r["n_layers"]) for r in found} == {(2, n_layers)}  # both seeds in every test
    spearman = rows(tests, subject="gpt2@final", fn="lowrank", claim="spearman_rel_err_kl", scope="stratified")
    assert spearman == []  # no null patch in this study: nothing to test the correlation against
    assert not rows(tests, claim="residual_outweighs_null")  # nor the residual against a null patch
    assert not rows(tests, claim="partial_spearman_rel_err_kl")  # nor the partial correlation
    assert not rows(tests, fn="identity")  # Δ_tok = 0: the alignment claims are undefined
    assert {r["scope"] for r in tests.to_pylist()} <= {"layer", "stratified"}


def test_a_layer_that_is_not_well_posed_is_left_out_of_every_claim(tmp_path: Path) -> None:
    """Layer 1's pool has 900 distinct inputs, fewer than 10·k = 960: no claim reads it (no per-layer row, and the
    stratified rows rest on layer 0 alone), while its fits stay in the descriptive tables."""
    rng = np.random.default_rng(2)
    for seed in (0, 1):
        for layer, distinct in ((0, 4000), (1, 900)):
            for fn in ("lowrank", "mlp"):
                write_random_stratum(tmp_path, f"gpt2-muon-s{seed}.final", layer, fn, rng, distinct=distinct)
    tables = build_tables(sources(tmp_path), CFG)
    tests = tables["claim_tests"].to_pylist()
    assert tests and {t["layer"] for t in tests if t["scope"] == "layer"} == {0}
    assert {t["n_layers"] for t in tests if t["scope"] == "stratified"} == {1}
    assert {(g["layer"], g["fn"]) for g in tables["geometry"].to_pylist()} >= {(1, "lowrank"), (1, "mlp")}
    assert {v["n_layers"] for v in tables["paper_values"].to_pylist()} == {1}


def test_study_b_claims(tables: dict[str, pa.Table]) -> None:
    claims = {(r["fn"], r["claim"]): r for r in rows(tables["claims"], study="B", subject="gpt2")}
    bound = claims[("all", "bound_holds")]
    assert bound["holds"] is True and bound["value"] == pytest.approx(0.5)
    assert claims[("hilbert", "beats_muon")]["holds"] is True
    assert claims[("adamw", "beats_muon")]["holds"] is None  # one seed: not tested
    spread = claims[("hilbert_equi", "equi_spreads_rows")]
    assert spread["value"] == pytest.approx(EQUI_RATIO["hilbert_equi"] - EQUI_RATIO_RANDOM)
    assert spread["holds"] is None  # one seed: no interval, no verdict


def test_the_control_is_a_recipe_of_the_tables_and_hilbert_equi_is_read_against_it(tmp_path: Path) -> None:
    """`hilbert_ctl` (issue #55) has its row in the recipes table like every recipe, and `beats_control` is
    `hilbert_equi` minus it on the same seeds (paired t-test)."""
    losses = {"muon": [3.0, 3.1, 3.2], "hilbert_equi": [2.9, 3.02, 3.1], "hilbert_ctl": [2.95, 3.04, 3.16]}
    for recipe, values in losses.items():
        for seed, loss in enumerate(values):
            write_run(tmp_path, f"neox-{recipe}-s{seed}", loss)
    tables = build_tables(sources(tmp_path), CFG)
    assert {r["recipe"] for r in rows(tables["recipes"], arch="neox")} == set(losses)
    assert rows(tables["recipes"], recipe="hilbert_ctl")[0]["n_paired"] == 3
    claim = rows(tables["claims"], claim="beats_control")[0]
    assert (claim["subject"], claim["fn"]) == ("neox", "hilbert_equi")
    diff = np.subtract(losses["hilbert_equi"], losses["hilbert_ctl"])
    assert claim["value"] == pytest.approx(diff.mean())
    p = sps.ttest_rel(losses["hilbert_equi"], losses["hilbert_ctl"]).pvalue
    assert claim["holds"] is bool(p < 0.05) and f"p {p:.3g}" in claim["detail"] and "hilbert_ctl" in claim["detail"]


@pytest.mark.parametrize(("excess", "holds"), [((0.05, 0.06, 0.04), True), ((0.01, -0.012, 0.0), False)])
def test_the_spread_claim_is_an_interval_against_random_rows(tmp_path: Path, excess: tuple, holds: bool) -> None:
    """Planted: hilbert_equi's rows spread `excess` above random unit rows per seed (the random draw varies
    from step to step); measurably more equidistant only when the interval over seeds lies above 0."""
    rng = np.random.default_rng(0)
    for seed, gain in enumerate(excess):
        run = f"gpt2-hilbert_equi-s{seed}"
        table = steps_table(run)
        logged = np.isfinite(np.asarray(table["head_diam"].to_numpy(zero_copy_only=False), dtype=float))
        draws = EQUI_RATIO_RANDOM + rng.normal(0, 0.01, len(table))
        draws = draws - draws[logged].mean() + EQUI_RATIO_RANDOM  # each run's random rows average 0.55
        table = table.set_column(
            table.schema.get_field_index("equi_ratio"),
            "equi_ratio",
            pa.array(np.where(logged, draws + gain, np.nan), mask=~logged),
        )
        table = table.set_column(
            table.schema.get_field_index("equi_ratio_random"),
            "equi_ratio_random",
            pa.array(np.where(logged, draws, np.nan), mask=~logged),
        )
        write_steps(tmp_path, run, table)
    claim = rows(build_tables(sources(tmp_path), CFG)["claims"], claim="equi_spreads_rows")[0]
    assert claim["value"] == pytest.approx(np.mean(excess)) and claim["holds"] is holds
    planted = mean_interval(list(excess), CFG.ci)
    assert f"[{planted.low:.3g}, {planted.high:.3g}]" in claim["detail"]


# ------------------------------------------------------------------------------------------ outputs
def test_aggregate_outputs_are_byte_identical_across_runs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_tiny_study(data)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        aggregate(sources(data), out, CFG, KEY)
    a, b = ((o / "metrics.json").read_bytes() for o in outs)
    assert a == b
    m = json.loads(a)
    # The headline only, flat, muon first: Study B's paired differences to muon (hilbert: 2.55, 2.65, 2.70
    # against 3.05, 3.15, 3.35; sign diverged), and the widest half-width of their intervals (hilbert's, the
    # only one over more than one seed); no Study A name: the tiny study has no null samples, no claim is tested.
    hilbert = np.array([2.5, 2.6, 2.65]) - np.array([3.0, 3.1, 3.3])
    half = sps.t.ppf(0.5 + CFG.ci / 2, df=2) * hilbert.std(ddof=1) / math.sqrt(3)
    assert list(m) == ["muon_loss", "d_adamw", "d_hilbert", "d_hilbert_equi", "ci"]
    assert m == pytest.approx(
        {"muon_loss": 3.1833, "d_adamw": 0.4, "d_hilbert": -0.55, "d_hilbert_equi": -0.45, "ci": half}, abs=5e-5
    )
    for name in TABLES:
        first, second = (pq.read_table(o / "tables" / f"{name}.parquet") for o in outs)
        assert first.equals(second)
    assert sorted(p.name for p in outs[0].iterdir()) == ["metrics.json", "tables"]


def test_missing_studies_give_empty_tables_not_a_crash(tmp_path: Path) -> None:
    aggregate(sources(tmp_path / "nothing"), tmp_path / "out", CFG, KEY)
    for name in TABLES:
        assert pq.read_table(tmp_path / "out" / "tables" / f"{name}.parquet").num_rows == 0
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == {}


def test_study_a_without_perturb_leaves_spearman_unmeasured(tmp_path: Path) -> None:
    write_study_a(tmp_path, with_perturb=False)
    tables = build_tables(sources(tmp_path), CFG)
    assert tables["correlations"].num_rows == 0
    assert not rows(tables["claim_tests"], claim="spearman_rel_err_kl")
    measured = metrics({name: tables[name].to_pylist() for name in ("recipes", "envelope", "claim_tests")})
    assert tables["geometry_pooled"].num_rows and not set(measured) & set(HEADLINE.values())


def test_the_cos_bound_is_a_median_over_cos_full_toks_own_anchors() -> None:
    """cos_full_tok ≥ √(1 − rel_err²) at every anchor (a theorem; 0 where rel_err ≥ 1), so over the same anchors
    the medians keep the order. Half the anchors here have rel_err ≥ 1: a bound over the others only would
    exceed the cos median."""
    import duckdb

    from lmgeo.core.contracts import PERTURB_METRICS
    from lmgeo.results.study_a.tables import geometry_table

    rng = np.random.default_rng(3)
    n = 40
    rel = np.concatenate([rng.uniform(0.05, 0.3, n // 2), rng.uniform(1.0, 2.0, n // 2)])
    cos = np.sqrt(np.clip(1 - rel**2, 0, None)) + rng.uniform(0, 0.05, n) * (rel < 1)
    columns = {c: rng.uniform(0.1, 1.0, n) for c in FIT_METRICS + PERTURB_METRICS}
    columns |= {"rel_err": rel, "cos_full_tok": cos}
    locality = rng.uniform(0.2, 0.9, n)
    anchors = pa.table(
        {
            "model": ["m"] * n,
            "layer": [0] * n,
            "fn": ["lowrank"] * n,
            "sample": ["real"] * n,
            "k": [96] * n,
            "locality": locality,
            "n_nonfinite": [0] * n,
            "n_distinct": [4000] * n,
            "has_nonfinite": [False] * n,
            "subspace_tied": [False] * n,
            "converged": [None] * n,
            **columns,
        }
    )
    con = duckdb.connect()
    con.register("anchors", anchors)
    (row,) = geometry_table(con).to_pylist()
    expected = np.median(np.sqrt(np.clip(1 - rel**2, 0, None)))
    assert row["median_cos_bound"] == pytest.approx(expected)
    assert row["median_locality"] == pytest.approx(np.median(locality))  # how local the neighbourhoods are
    assert row["median_cos_full_tok"] >= row["median_cos_bound"]
    assert row["n_value_kept"] == row["n_operator_kept"] == n


# ------------------------------------------------------------------------------ the expressivity trade-off
TRADEOFF_CLASSES = ("diag_psd", "lowrank", "similarity", "mlp")
WIDTH = 5  # the `patched` vectors' width: the models' d


def write_tradeoff_study(data_dir: Path, rng: np.random.Generator) -> dict[tuple[str, int, str], tuple]:
    """Two seeds, two layers, three local classes with `patched` vectors of width WIDTH; one anchor of a
    layer unidentified for one class (left out of every class's values there). Returns each stratum's
    (rel_err, kl)."""
    planted = {}
    n = 24
    seq = np.arange(n, dtype=np.int32)
    for seed in (0, 1):
        model = f"gpt2-muon-s{seed}.final"
        for layer in (0, 1):
            for i, fn in enumerate(TRADEOFF_CLASSES):
                rel = rng.uniform(0.1, 0.9, n) / (1 + i)
                if fn == "lowrank":
                    rel[layer] = np.nan  # not identified
                kl = rel + rng.normal(0, 0.05 * (1 + i), n)
                planted[(model, layer, fn)] = (rel, kl)
                partition = {"model": model, "layer": layer, "fn": fn}
                patched = vectors_to_arrow(np.ones((n, WIDTH)))
                with ShardWriter(data_dir / "fits", f"{model}/{layer}/{fn}", KEY) as writer:
                    writer.write(
                        partition,
                        pa.table(
                            {
                                "sample": ["real"] * n,
                                "seq_id": seq,
                                "pos": seq,
                                "locality": np.full(n, 0.25 + 0.5 * layer + 0.1 * seed),
                                "rel_err": pa.array(rel, mask=np.isnan(rel)),
                                "patched": patched,
                            }
                        ),
                    )
                with ShardWriter(data_dir / "perturb", f"{model}/{layer}/{fn}", KEY) as writer:
                    writer.write(partition, pa.table({"seq_id": seq, "pos": seq, "kl": kl}))
    return planted


def test_the_expressivity_table_ranks_each_class_by_its_capacity_at_the_models_width(tmp_path: Path) -> None:
    """Per class: its parameters at the fits' vector width; its median rel_err and Spearman(rel_err, kl) on
    the anchors every class keeps, averaged over layers, then seeds (numpy/scipy by hand), inside its interval.
    The trade-off's rows: each linear class against the MLP, paired per anchor, with the t-interval over the
    seeds. Without the analysis section the classes have no capacity (`parameters` null)."""
    planted = write_tradeoff_study(tmp_path, np.random.default_rng(4))
    analysis = DEFAULT.analysis
    tables = build_tables(sources(tmp_path), CFG, analysis)
    got = tables["expressivity"].to_pylist()
    # d = 5, r = 4, h = 8: diag_psd d = 5, similarity d(d − 1)/2 + 1 = 11, lowrank r(2d − r) = 24, mlp 2hd + h + d =
    # 93 (at d = 64: 64, 2017, 496, 1096)
    assert [r["fn"] for r in got] == ["diag_psd", "similarity", "lowrank", "mlp"]
    for r in got:
        assert r["subject"] == "gpt2@final" and (r["n_models"], r["n_layers"], r["n"]) == (2, 2, 4 * 23)
        assert r["parameters"] == FIT_CLASSES[r["fn"]].parameters(WIDTH, analysis)
        per_model = {"rel_err": [], "spearman": []}
        for seed in (0, 1):
            layers = {"rel_err": [], "spearman": []}
            for layer in (0, 1):
                rel, kl = planted[(f"gpt2-muon-s{seed}.final", layer, r["fn"])]
                common = np.arange(len(rel)) != layer  # the anchor lowrank leaves out, left out for all
                layers["rel_err"].append(np.median(rel[common]))
                layers["spearman"].append(sps.spearmanr(rel[common], kl[common]).statistic)
            for part, values in layers.items():
                per_model[part].append(np.mean(values))
        for part, values in per_model.items():
            assert r[part] == pytest.approx(np.mean(values)), part
            assert r[f"{part}_low"] <= r[part] <= r[f"{part}_high"]
    tradeoff = rows(tables["claim_tests"], claim="expressivity_tradeoff", scope="stratified")
    pairs = {f"mlp vs {fn}" for fn in TRADEOFF_CLASSES if fn != "mlp"}
    assert {(t["fn"], t["null"]) for t in tradeoff} == {
        (pair, part) for pair in pairs for part in ("rel_err", "spearman")
    }
    for t in tradeoff:  # paired per anchor on the anchors both keep, each model's mean over layers, then seeds
        linear = t["fn"].split(" vs ")[1]
        per_model = []
        for seed in (0, 1):
            layers = []
            for layer in (0, 1):
                (rel, kl), (rel_mlp, kl_mlp) = (
                    planted[(f"gpt2-muon-s{seed}.final", layer, fn)] for fn in (linear, "mlp")
                )
                both = np.isfinite(rel) & np.isfinite(rel_mlp)
                layers.append(
                    np.median(rel[both] - rel_mlp[both])
                    if t["null"] == "rel_err"
                    else sps.spearmanr(rel[both], kl[both]).statistic
                    - sps.spearmanr(rel_mlp[both], kl_mlp[both]).statistic
                )
            per_model.append(np.mean(layers))
        low, high = sps.t.interval(CFG.ci, 1, loc=np.mean(per_model), scale=sps.sem(per_model))
        assert (t["effect"], t["ci_low"], t["ci_high"]) == pytest.approx((np.mean(per_model), low, high))
        assert (t["unit"], t["n_units"]) == ("seed", 2)
    without = build_tables(sources(tmp_path), CFG)
    assert [r["parameters"] for r in without["expressivity"].to_pylist()] == [None] * 4


def test_the_report_shows_the_classes_in_capacity_order_the_tradeoff_pairs_and_the_locality(tmp_path: Path) -> None:
    from lmgeo.results.study_a import report

    write_tradeoff_study(tmp_path, np.random.default_rng(4))
    tables = {name: t.to_pylist() for name, t in build_tables(sources(tmp_path), CFG, DEFAULT.analysis).items()}
    text = report._expressivity(tables["expressivity"], tables["claim_tests"])
    assert text.index("| `diag_psd` | 5 |") < text.index("| `similarity` | 11 |") < text.index("| `lowrank` | 24 |")
    assert text.index("| `lowrank` | 24 |") < text.index("| `mlp` | 93 |")
    pairs = [line for line in text.splitlines() if line.startswith("| **mlp vs ")]
    assert [re.match(r"\| \*\*mlp vs (\w+)\*\*", line)[1] for line in pairs] == ["diag_psd", "lowrank", "similarity"]
    reading = r"\*\*(supported|not supported|contradicted|inconclusive)\*\* · rel_err -?[\d.]+ \[.*\], spearman -?[\d.]"
    assert all(re.search(reading, line) for line in pairs), pairs
    kept = report._kept_table(tables["geometry"])
    assert "| locality |" in kept and "0.3·0.8 |" in kept  # per layer: the median over seeds 0.25/0.35, 0.75/0.85
    assert "ranges from 0.3 to 0.8." in kept  # its range over subjects and layers, from the same table
    assert report._expressivity([], []) == ""
