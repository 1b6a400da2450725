"""Aggregation of training logs and per-token fits into small result tables (SPEC §2, §3.3, §4.4).

``aggregate(sources, out_dir, cfg)`` reads ``Sources``: the verified files of the steps, fits and perturb
datasets (``pipeline.core.contracts``) and the records of the finished runs, and writes:

- ``out_dir/tables/<name>.parquet`` for every name in ``RESULT_TABLES`` (always all of them; a study that was not
  run gives empty tables with the documented columns):
  ``runs``, ``curves``, ``recipes``, ``geometry`` (per model, layer, class and sample: real or null),
  ``geometry_pooled`` (descriptive, real sample), ``angles``, ``correlations`` (per layer, and stratified over
  layers), ``claims`` (Study B), ``claim_tests`` (Study A's claims against their nulls,
  ``pipeline.results.claims``). Models are labelled ``<run>@init`` / ``<run>@final`` or by their hub id (``/``).
- ``out_dir/metrics.json`` (DVC metrics): the headline numbers a person compares across experiments, tens of
  entries for the default study so ``dvc exp show`` and ``dvc metrics diff`` fit a screen (the detail stays in
  the tables, for ``lmgeo query``). Layout, stable; a key whose value is not measured is left out::

      {"study_b": {<arch>: {"muon_test_loss": mean over seeds,
                            "diff_vs_muon": {<recipe>: paired mean difference of the final test loss},
                            "muon_test_loss_matched", "diff_vs_muon_matched": the same for the
                                                     matched-budget runs, when the study has them}},
       "study_a": {<subject>: {<claim>: {"effect": the deciding test's stratified effect against its null,
                                         "verdict": +1 supported, 0 inconclusive, -1 not supported,
                                                    averaged over classes}}}}

  Study A's subjects are the trained architectures (``<arch>@final``) and external models; the ``@init``
  checkpoints and the claims in ``HEADLINE_EXCLUDED`` are in the tables and the report only.
  Floats are rounded to 6 significant digits and keys sorted, so equal inputs give identical bytes.

Non-finite values in fits are excluded from every statistic and counted (``n_nonfinite_values``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from pipeline.core.contracts import (
    FIT_METRICS,
    FITS,
    PERTURB,
    PERTURB_METRICS,
    RUN_ID_PATTERN,
    STEPS,
    RunRecord,
    parse_run_id,
    scan,
    table_id_sql,
)
from pipeline.core.store import ManifestKey, ShardWriter, atomic_write, verified_files
from pipeline.models.registry import FAMILIES
from pipeline.results.claims import Stratum, claim_tests, summarise
from pipeline.results.config import ReportConfig
from pipeline.results.stats import (
    detectable_difference,
    holm,
    mean_interval,
    paired_difference,
    seeds_needed,
    spearman_by_layer,
)
from pipeline.study_b.baseline import baseline
from pipeline.study_b.recipes import RECIPES

# ------------------------------------------------------------------------------ claims (SPEC §3.3)
SIGNIFICANCE = 0.05
MIN_SEEDS_FOR_TEST = 3
# Study B resolves differences of this size (issue 12): seeds are planned for it at this power.
RESOLVE_NATS = 0.02
POWER = 0.8
BOUND_TOLERANCE = 1e-5  # hilbert_realized / hilbert_bound may exceed 1 by float rounding only
ANGLE_BIN_DEG = 10
MAX_CURVE_POINTS = 1000


# ------------------------------------------------------------------------------------ reading data
Files = tuple[Path, Sequence[Path]]  # a dataset's root and its verified files


@dataclass(frozen=True)
class Sources:
    """What aggregation reads: the verified files of each per-token dataset, and the finished runs."""

    steps: Files
    fits: Files
    perturb: Files
    runs: Sequence[RunRecord]


def load_sources(
    steps: Path, fits: Path, perturb: Path, models: Path, expected: Mapping[str, Mapping[str, ManifestKey]] | None = None
) -> Sources:
    """The verified files under each dataset folder (none where a stage has not run) and the records of
    the finished runs (`run.json` of each final checkpoint, as its manifest lists it).

    `expected` (dataset → shard → key, from the writing stages' current plans: `train` for the steps and
    the models, `fit`, `perturb`) makes every read take exactly the planned shards, and refuse a missing,
    stale or mixed one; without it a dataset is read as written (one params hash, one code version)."""
    planned = dict(expected or {})

    def files(root: Path, name: str, stage: str) -> Files:
        if name not in planned and not root.is_dir():
            return root, []
        return root, verified_files(root, planned.get(name), rebuild=f"`lmgeo {stage}`")

    _, checkpoints = files(models, "models", "train")
    records = [RunRecord.from_json(json.loads(p.read_text())) for p in checkpoints if p.match("*/final/run.json")]
    return Sources(files(steps, "steps", "train"), files(fits, "fits", "fit"), files(perturb, "perturb", "perturb"),
                   sorted(records, key=lambda r: r.run))  # fmt: skip


def _register_sources(con: duckdb.DuckDBPyConnection, sources: Sources) -> None:
    for name, dataset, (root, files) in (("steps_raw", STEPS, sources.steps), ("fits", FITS, sources.fits),
                                         ("perturb", PERTURB, sources.perturb)):  # fmt: skip
        con.register(name, scan(root, dataset, files))
    records = [dataclasses.asdict(r) for r in sources.runs]
    con.register("run_json", pa.Table.from_pylist(records, schema=RunRecord.arrow_schema()))
    # A diverging run logs NaN/Inf on its last steps: those values are missing, never summarised or drawn.
    finite = ", ".join(f"CASE WHEN isfinite({f.name}) THEN {f.name} END AS {f.name}"
                       for f in STEPS.scalar_schema if f.type == pa.float64())  # fmt: skip
    con.execute(f"CREATE TEMP VIEW steps AS SELECT * REPLACE ({finite}) FROM steps_raw")


# ------------------------------------------------------------------------------------ Study B tables
_TIGHTNESS = "hilbert_realized / hilbert_bound"
# The bound is tested on exact diameters only: a sampled diameter is a lower bound (SPEC §3.3).
_EXACT = "NOT coalesce(head_diam_sampled, false) AND hilbert_bound > 0"


def _runs_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    return con.sql(f"""
        WITH logged AS (
            SELECT run,
                   count(*) AS steps_logged,
                   max(step) AS last_step,
                   median(step_time_s) AS median_step_time_s,
                   median(hilbert_bound) AS median_hilbert_bound,
                   median(hilbert_realized) AS median_hilbert_realized,
                   median({_TIGHTNESS}) FILTER (WHERE {_EXACT}) AS median_tightness,
                   max({_TIGHTNESS}) FILTER (WHERE {_EXACT}) AS max_tightness,
                   count(*) FILTER (WHERE {_EXACT} AND hilbert_realized IS NOT NULL) AS n_exact_geometry_steps,
                   coalesce(bool_or(head_diam_sampled), false) AS head_diam_sampled,
                   median(head_diam) AS median_head_diam,
                   median(equi_ratio) AS median_equi_ratio,
                   median(equi_ratio_random) AS median_equi_ratio_random,
                   median(equi_ratio_bound) AS median_equi_ratio_bound,
                   median(head_alignment) AS median_head_alignment,
                   median(head_alignment_hilbert) AS median_head_alignment_hilbert,
                   median(hilbert_realized_train) AS median_hilbert_realized_train,
                   max(hilbert_realized_train) AS max_hilbert_realized_train,
                   median(head_step_scale) AS median_head_step_scale,
                   avg(CASE WHEN head_step_scale < 1 THEN 1.0 ELSE 0.0 END)
                       FILTER (WHERE head_step_scale IS NOT NULL) AS frac_steps_capped
            FROM steps GROUP BY run
        )
        SELECT coalesce(j.run, l.run) AS run,
               coalesce(j.arch, regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 1)) AS arch,
               coalesce(j.recipe, regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 2)) AS recipe,
               coalesce(j.seed, TRY_CAST(regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 3) AS BIGINT)) AS seed,
               regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 4) <> '' AS matched,
               j.run IS NOT NULL AS finished,
               j.diverged, j.diverged_at_step, j.steps, j.steps_done, j.tokens,
               j.final_train_loss, j.final_val_loss, j.final_test_loss, j.head_step, j.head_budget_tau,
               j.wall_time_s, j.n_params, j.params_hash,
               l.* EXCLUDE (run)
        FROM run_json j FULL OUTER JOIN logged l ON j.run = l.run
        ORDER BY matched, arch, recipe, seed, run
    """).to_arrow_table()  # fmt: skip


def _curves_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Per run and step; long runs are thinned to about MAX_CURVE_POINTS plain and geometry rows each,
    always keeping evaluation steps and the last step."""
    return con.sql(f"""
        WITH numbered AS (
            SELECT *,
                   row_number() OVER (PARTITION BY run ORDER BY step) - 1 AS i,
                   count(*) OVER (PARTITION BY run) AS n,
                   count(hilbert_bound) OVER (PARTITION BY run ORDER BY step) - 1 AS gi,
                   count(hilbert_bound) OVER (PARTITION BY run) AS gn
            FROM steps
        )
        SELECT run, step, tokens, lr, train_loss, val_loss, step_time_s, head_diam, head_diam_sampled,
               hilbert_bound, hilbert_realized,
               CASE WHEN {_EXACT} THEN {_TIGHTNESS} END AS tightness,
               equi_ratio, equi_ratio_random, head_update_rms, head_update_spectral, head_alignment,
               head_alignment_hilbert, hilbert_realized_train, head_step_scale
        FROM numbered
        WHERE i % greatest(1, ceil(n / {MAX_CURVE_POINTS}))::BIGINT = 0
           OR val_loss IS NOT NULL
           OR i = n - 1
           OR (hilbert_bound IS NOT NULL AND gi % greatest(1, ceil(gn / {MAX_CURVE_POINTS}))::BIGINT = 0)
        ORDER BY run, step
    """).to_arrow_table()  # fmt: skip


RECIPES_SCHEMA = pa.schema(
    [("arch", pa.string()), ("recipe", pa.string()), ("matched", pa.bool_()), ("n_runs", pa.int64()), ("n_seeds", pa.int64()),
     ("n_diverged", pa.int64()), ("test_loss_mean", pa.float64()), ("test_loss_sd", pa.float64()),
     ("test_loss_ci_low", pa.float64()), ("test_loss_ci_high", pa.float64()), ("val_loss_mean", pa.float64()),
     ("steps", pa.int64()), ("tokens", pa.int64()), ("head_step", pa.string()), ("head_budget_tau", pa.float64()),
     ("n_paired", pa.int64()),
     ("diff_vs_muon", pa.float64()), ("diff_sd", pa.float64()), ("diff_ci_low", pa.float64()),
     ("diff_ci_high", pa.float64()), ("p_vs_muon", pa.float64()), ("p_vs_muon_holm", pa.float64()),
     ("detectable_diff", pa.float64()), ("seeds_to_resolve", pa.int64()), ("seeds_for_observed", pa.int64()),
     ("cap_effect", pa.float64()), ("cap_effect_ci_low", pa.float64()), ("cap_effect_ci_high", pa.float64())]
)  # fmt: skip


def _recipes_table(runs: pa.Table, cfg: ReportConfig) -> pa.Table:
    """Per arch × recipe, for the default runs and apart for the matched-budget runs: final test loss over
    seeds with its t-interval (diverged runs counted, not averaged), and the paired comparison with `muon`
    of the same kind on the same seeds (same init, same data order): the mean difference with its
    t-interval, the paired t-test p-value and its Holm adjustment over the arch's recipes, the difference
    these seeds detect with POWER, and the seeds RESOLVE_NATS and the observed difference would need."""
    by_group: dict[tuple[bool, str, str], list[dict[str, Any]]] = {}
    for row in runs.to_pylist():
        if row["arch"] and row["recipe"]:
            by_group.setdefault((row["matched"], row["arch"], row["recipe"]), []).append(row)
    test = {key: _by_seed(rows, "final_test_loss") for key, rows in by_group.items()}
    reference = baseline().name
    out = []
    for (matched, arch, recipe), rows in sorted(by_group.items(), key=lambda item: (*item[0][:2], RECIPES.order(item[0][2]))):
        loss = mean_interval(list(test[(matched, arch, recipe)].values()), cfg.ci)
        muon = (matched, arch, reference)
        compared = recipe != reference and muon in test
        paired = paired_difference(test[(matched, arch, recipe)], test[muon], cfg.ci) if compared else None
        diff = paired.diff if paired else None
        out.append({
            "arch": arch, "recipe": recipe, "matched": matched, "n_runs": len(rows), "n_seeds": loss.n,
            "n_diverged": sum(bool(r["diverged"]) for r in rows),
            "test_loss_mean": _none_if_nan(loss.mean), "test_loss_sd": _none_if_nan(loss.sd),
            "test_loss_ci_low": _none_if_nan(loss.low), "test_loss_ci_high": _none_if_nan(loss.high),
            "val_loss_mean": _none_if_nan(mean_interval(list(_by_seed(rows, "final_val_loss").values())).mean),
            "steps": _single([r["steps_done"] for r in rows]), "tokens": _single([r["tokens"] for r in rows]),
            "head_step": _single([r["head_step"] for r in rows]),
            "head_budget_tau": _single([r["head_budget_tau"] for r in rows]),
            "n_paired": diff.n if diff else None,
            "diff_vs_muon": _none_if_nan(diff.mean) if diff else None,
            "diff_sd": _none_if_nan(diff.sd) if diff else None,
            "diff_ci_low": _none_if_nan(diff.low) if diff else None,
            "diff_ci_high": _none_if_nan(diff.high) if diff else None,
            "p_vs_muon": _testable(paired),
            **_planning(diff),
            **_cap_effect(test, (matched, arch, recipe), cfg.ci),
        })  # fmt: skip
    _holm_per_arch(out)
    return pa.Table.from_pylist(out, schema=RECIPES_SCHEMA)


def _by_seed(runs: list[dict[str, Any]], column: str) -> dict[int, float]:
    """seed → value of the finished, non-diverged runs with a finite value."""
    return {
        r["seed"]: r[column] for r in runs
        if not r["diverged"] and r[column] is not None and math.isfinite(r[column]) and r["seed"] is not None
    }  # fmt: skip


def _cap_effect(test: dict[tuple[bool, str, str], dict[int, float]], key: tuple[bool, str, str], ci: float) -> dict[str, Any]:
    """For matched-budget runs: what the cap did, their test loss minus the same recipe's default runs' on
    the same seeds (paired t-interval); None for default runs."""
    matched, arch, recipe = key
    default = test.get((False, arch, recipe))
    if not matched or not default:
        return {"cap_effect": None, "cap_effect_ci_low": None, "cap_effect_ci_high": None}
    diff = paired_difference(test[key], default, ci).diff
    return {"cap_effect": _none_if_nan(diff.mean), "cap_effect_ci_low": _none_if_nan(diff.low),
            "cap_effect_ci_high": _none_if_nan(diff.high)}  # fmt: skip


def _planning(diff: Any) -> dict[str, Any]:
    """What the paired SD says about seeds: the difference these seeds detect with POWER, and the seeds
    RESOLVE_NATS and the observed difference would need."""
    if diff is None:
        return {"detectable_diff": None, "seeds_to_resolve": None, "seeds_for_observed": None}
    return {
        "detectable_diff": _none_if_nan(detectable_difference(diff.sd, diff.n, SIGNIFICANCE, POWER)),
        "seeds_to_resolve": seeds_needed(RESOLVE_NATS, diff.sd, SIGNIFICANCE, POWER),
        "seeds_for_observed": seeds_needed(diff.mean, diff.sd, SIGNIFICANCE, POWER) if math.isfinite(diff.mean) else None,
    }


def _testable(paired: Any) -> float | None:
    """The paired p-value where there are MIN_SEEDS_FOR_TEST pairs, else None (not tested)."""
    if paired is None or paired.diff.n < MIN_SEEDS_FOR_TEST:
        return None
    return _none_if_nan(paired.p)


def _holm_per_arch(rows: list[dict[str, Any]]) -> None:
    """`p_vs_muon_holm`: the arch's family of comparisons with `muon` (default or matched runs), adjusted
    together."""
    for family_key in {(r["arch"], r["matched"]) for r in rows}:
        family = [r for r in rows if (r["arch"], r["matched"]) == family_key]
        adjusted = holm([math.nan if r["p_vs_muon"] is None else r["p_vs_muon"] for r in family])
        for r, p in zip(family, adjusted, strict=True):
            r["p_vs_muon_holm"] = _none_if_nan(p)


def _finite(values: Sequence[float | None]) -> np.ndarray:
    arr = np.array([v for v in values if v is not None], dtype=float)
    return arr[np.isfinite(arr)]


def _single(values: Sequence[Any]) -> Any:
    """The common value (runs compared at equal steps/tokens), or None when they differ or are unknown."""
    distinct = {v for v in values if v is not None}
    return distinct.pop() if len(distinct) == 1 else None


def _none_if_nan(x: float) -> float | None:
    return None if math.isnan(x) else x


# ------------------------------------------------------------------------------------ Study A tables
def _create_anchor_view(con: duckdb.DuckDBPyConnection) -> None:
    """Every fit row (all samples) with its perturbation values (real sample only)."""
    finite = ", ".join(f"CASE WHEN isfinite(f.{c}) THEN f.{c} END AS {c}" for c in FIT_METRICS)
    any_nonfinite = " OR ".join(f"NOT isfinite(f.{c})" for c in FIT_METRICS)
    kl = ", ".join(f"CASE WHEN isfinite(p.{c}) THEN p.{c} END AS {c}" for c in PERTURB_METRICS)
    con.execute(f"""
        CREATE TEMP VIEW anchors AS
        SELECT {table_id_sql('f.model')} AS model, f.layer, f.fn, f.sample, f.seq_id, f.pos, f.k, {finite},
               coalesce({any_nonfinite}, false) AS has_nonfinite, f.n_nonfinite, f.n_distinct,
               f.degenerate, f.subspace_tied, f.converged, {kl}
        FROM fits f LEFT JOIN perturb p
          ON f.sample = 'real' AND f.model = p.model AND f.layer = p.layer AND f.fn = p.fn
             AND f.seq_id = p.seq_id AND f.pos = p.pos
    """)  # fmt: skip


def _model_facts() -> str:
    """SQL columns run, checkpoint, arch and family (the registered family's kind; for an external model,
    the kind of the registered family whose model type its id names, else transformer)."""
    kinds = " ".join(
        f"WHEN split_part(model, '-', 1) = '{f.name}' OR lower(model) LIKE '%{f.model_type}%' THEN '{f.kind}'"
        for f in FAMILIES if f.kind != "transformer"
    )
    return f"""
    nullif(regexp_extract(model, '^(.*)@(init|final)$', 1), '') AS run,
    nullif(regexp_extract(model, '^(.*)@(init|final)$', 2), '') AS checkpoint,
    CASE WHEN regexp_matches(model, '@(init|final)$') THEN split_part(model, '-', 1) END AS arch,
    CASE {kinds} ELSE 'transformer' END AS family
"""
_ALL_METRICS = FIT_METRICS + PERTURB_METRICS


def _summaries() -> str:
    return ", ".join(f"avg({c}) AS mean_{c}, median({c}) AS median_{c}" for c in _ALL_METRICS)


def _geometry_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Per (model, layer, class, sample): summaries, and what SPEC §4.5 asks to count per layer."""
    return con.sql(f"""
        SELECT model, layer, fn, sample, count(*) AS n, max(n_nonfinite) AS n_nonfinite,
               max(n_distinct) AS n_distinct, max(k) AS k,
               count(*) FILTER (WHERE degenerate) AS n_degenerate,
               count(*) FILTER (WHERE subspace_tied) AS n_subspace_tied,
               count(*) FILTER (WHERE NOT converged) AS n_not_converged,
               count(*) FILTER (WHERE has_nonfinite) AS n_nonfinite_values, {_summaries()},
               median(CASE WHEN rel_err < 1 THEN sqrt(1 - rel_err * rel_err) END) AS median_cos_bound
        FROM anchors GROUP BY model, layer, fn, sample ORDER BY model, layer, fn, sample
    """).to_arrow_table()  # fmt: skip


def _geometry_pooled_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Descriptive medians of the real sample over every anchor of every layer (the claims never use them:
    they are tested per layer, `claim_tests`)."""
    over_layers = ", ".join(f"median(median_{c}) AS layer_median_{c}" for c in _ALL_METRICS)
    return con.sql(f"""
        WITH pooled AS (
            SELECT model, fn, count(*) AS n, count(DISTINCT layer) AS n_layers,
                   count(*) FILTER (WHERE degenerate) AS n_degenerate,
                   count(*) FILTER (WHERE has_nonfinite) AS n_nonfinite_values, {_summaries()}
            FROM anchors WHERE sample = 'real' GROUP BY model, fn
        ), per_layer AS (
            SELECT model, fn, sum(n_nonfinite) AS n_nonfinite, {over_layers}
            FROM geometry WHERE sample = 'real' GROUP BY model, fn
        )
        SELECT model, fn, {_model_facts()}, p.n, p.n_layers, l.n_nonfinite,
               p.* EXCLUDE (model, fn, n, n_layers), l.* EXCLUDE (model, fn, n_nonfinite)
        FROM pooled p JOIN per_layer l USING (model, fn)
        ORDER BY model, fn
    """).to_arrow_table()  # fmt: skip


def _angles_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    bins = 180 // ANGLE_BIN_DEG
    return con.sql(f"""
        WITH real AS (SELECT * FROM anchors WHERE sample = 'real'),
        groups AS (SELECT DISTINCT model, fn FROM real WHERE angle_res_tok IS NOT NULL),
        grid AS (SELECT model, fn, b FROM groups, range({bins}) t(b)),
        counts AS (
            SELECT model, fn, least(floor(angle_res_tok / {ANGLE_BIN_DEG}), {bins - 1})::BIGINT AS b, count(*) AS c
            FROM real WHERE angle_res_tok IS NOT NULL GROUP BY ALL
        )
        SELECT g.model, g.fn, (g.b * {ANGLE_BIN_DEG})::DOUBLE AS bin_lo, ((g.b + 1) * {ANGLE_BIN_DEG})::DOUBLE AS bin_hi,
               coalesce(c.c, 0) AS count,
               coalesce(c.c, 0) / sum(coalesce(c.c, 0)) OVER (PARTITION BY g.model, g.fn) AS fraction
        FROM grid g LEFT JOIN counts c USING (model, fn, b)
        ORDER BY g.model, g.fn, g.b
    """).to_arrow_table()  # fmt: skip


CORRELATIONS_SCHEMA = pa.schema(
    [("model", pa.string()), ("fn", pa.string()), ("scope", pa.string()), ("layer", pa.int32()),
     ("n", pa.int64()), ("spearman", pa.float64()), ("ci_low", pa.float64()), ("ci_high", pa.float64())]
)  # fmt: skip


def _correlations_table(con: duckdb.DuckDBPyConnection, cfg: ReportConfig) -> pa.Table:
    """Spearman(rel_err, kl) per (model, fn, layer), and `stratified` over layers (the mean of the layers'
    rhos, never rows of different layers ranked together; layer null)."""
    pairs = con.sql("""
        SELECT model, fn, layer, rel_err, kl FROM anchors
        WHERE sample = 'real' AND rel_err IS NOT NULL AND kl IS NOT NULL ORDER BY model, fn, layer, seq_id, pos
    """).fetchnumpy()  # fmt: skip
    rows = []
    for model, fn in dict.fromkeys(zip(pairs["model"].tolist(), pairs["fn"].tolist(), strict=True)):
        g = (pairs["model"] == model) & (pairs["fn"] == fn)
        by_layer = spearman_by_layer(pairs["layer"][g], pairs["rel_err"][g], pairs["kl"][g],
                                     n_boot=cfg.bootstrap, ci=cfg.ci, seed=cfg.seed)  # fmt: skip
        stratified = by_layer.pop("stratified", None)
        for layer, c in ([(None, stratified)] if stratified else []) + sorted(by_layer.items()):
            rows.append({
                "model": model, "fn": fn, "scope": "stratified" if layer is None else "layer", "layer": layer, "n": c.n,
                "spearman": _none_if_nan(c.rho), "ci_low": _none_if_nan(c.low), "ci_high": _none_if_nan(c.high),
            })  # fmt: skip
    return pa.Table.from_pylist(rows, schema=CORRELATIONS_SCHEMA)


def _strata(con: duckdb.DuckDBPyConnection) -> list[Stratum]:
    """Per (model, layer, class): the real anchors' columns, each null sample's values at the same anchors
    (`<sample>.<column>`), the null patches' KLs, and `global_linear`'s left-out rel_err (`global.rel_err`)."""
    columns = ("rel_err", "rel_err_state", "cos_full_tok", "angle_res_tok", "proj_full", "proj_res",
               "proj_full_global", "proj_res_global", "kl", "kl_random", "kl_other")  # fmt: skip
    table = con.sql(f"""
        SELECT model, layer, fn, sample, seq_id, pos, {", ".join(columns)} FROM anchors
        ORDER BY model, layer, fn, sample, seq_id, pos
    """).fetchnumpy()  # fmt: skip
    groups: dict[tuple[str, int, str, str], dict[str, np.ndarray]] = {}
    keys = list(zip(table["model"].tolist(), table["layer"].tolist(), table["fn"].tolist(), table["sample"].tolist(), strict=True))
    anchor = table["seq_id"].astype(np.int64) * 2**32 + table["pos"]
    for key, (start, stop) in _runs(keys).items():
        groups[key] = {"anchor": anchor[start:stop], **{c: _floats(table[c][start:stop]) for c in columns}}
    strata = []
    for (model, layer, fn, sample), real in groups.items():
        if sample != "real":
            continue
        cols = {c: real[c] for c in columns}
        for other, values in ((s, groups.get((model, layer, fn, s))) for s in ("shuffled", "gaussian")):
            if values is not None:
                cols |= {f"{other}.{c}": _aligned(real["anchor"], values["anchor"], values[c]) for c in columns}
        glob = groups.get((model, layer, "global_linear", "real"))
        if glob is not None:
            cols["global.rel_err"] = _aligned(real["anchor"], glob["anchor"], glob["rel_err"])
        strata.append(Stratum(model, _subject(model), int(layer), fn, cols))
    return strata


def _runs(keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], tuple[int, int]]:
    """Start and stop of each run of equal keys in a sorted list."""
    bounds: dict[tuple[Any, ...], tuple[int, int]] = {}
    for i, key in enumerate(keys):
        start = bounds.get(key, (i, i))[0]
        bounds[key] = (start, i + 1)
    return bounds


def _floats(values: Any) -> np.ndarray:
    return np.ma.filled(np.ma.asarray(values, dtype=float), np.nan)


def _aligned(anchors: np.ndarray, other: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`values` (keyed by the sorted `other` anchors) at `anchors`; NaN where an anchor is missing."""
    where = np.searchsorted(other, anchors).clip(0, max(len(other) - 1, 0))
    found = len(other) > 0 and other[where] == anchors
    return np.where(found, values[where] if len(other) else np.nan, np.nan)


def _subject(model: str) -> str:
    """What the claims are stated for: `<arch>@<checkpoint>` for a trained checkpoint (its seeds are
    combined), the model id for an external model."""
    match = re.match(r"^(.*)@(init|final)$", model)
    return f"{parse_run_id(match[1]).arch}@{match[2]}" if match else model


# ------------------------------------------------------------------------------------------- claims
CLAIMS_SCHEMA = pa.schema(
    [("study", pa.string()), ("subject", pa.string()), ("fn", pa.string()), ("claim", pa.string()),
     ("value", pa.float64()), ("threshold", pa.float64()), ("holds", pa.bool_()),
     ("holds_at_init", pa.bool_()), ("detail", pa.string())]
)  # fmt: skip

# Study B's claims (Study A's are tests against nulls: `pipeline.results.claims`, the `claim_tests` table).
CLAIM_TEXT = {
    "bound_holds": "hilbert_realized ≤ hilbert_bound on every exact-diameter step (max ratio ≤ 1)",
    "beats_muon": f"final test loss below muon's on the same seeds: paired t-test, Holm-adjusted over the arch's "
    f"recipes, p < {SIGNIFICANCE} (needs ≥ {MIN_SEEDS_FOR_TEST} paired seeds)",
    "equi_spreads_rows": "hilbert_equi spreads head-update rows at least as evenly as random unit rows on the same "
    "row sample (median equi_ratio / median equi_ratio_random ≥ 1)",
}  # fmt: skip


def _claim(study: str, subject: str, fn: str, claim: str, value: float | None, threshold: float,
           holds: bool | None, detail: str) -> dict[str, Any]:  # fmt: skip
    measured = value is not None and math.isfinite(value)
    return {
        "study": study, "subject": subject, "fn": fn, "claim": claim,
        "value": value if measured else None, "threshold": threshold,
        "holds": holds if measured else None, "holds_at_init": None, "detail": detail,
    }  # fmt: skip


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _study_b_claims(runs: pa.Table, recipes: pa.Table) -> list[dict[str, Any]]:
    rows = []
    by_arch: dict[str, list[dict[str, Any]]] = {}
    for r in runs.to_pylist():
        if r["arch"] and not r["matched"]:  # the geometry claims are about the recipes as tuned
            by_arch.setdefault(r["arch"], []).append(r)
    for arch, arch_runs in sorted(by_arch.items()):
        ratios = [r["max_tightness"] for r in arch_runs if r["max_tightness"] is not None]
        worst = max(ratios) if ratios else None
        rows.append(_claim("B", arch, "all", "bound_holds", worst, 1.0,
                           worst is not None and worst <= 1 + BOUND_TOLERANCE,
                           f"max realized/bound {_fmt(worst)} over {len(ratios)} runs with exact diameters"))  # fmt: skip
        equi = _median_of(arch_runs, "hilbert_equi", "median_equi_ratio")
        random_rows = _median_of(arch_runs, "hilbert_equi", "median_equi_ratio_random")
        if equi is not None and random_rows is not None:
            spread = _ratio(equi, random_rows)
            plain = _median_of(arch_runs, "hilbert", "median_equi_ratio")
            rows.append(_claim("B", arch, "hilbert_equi", "equi_spreads_rows", spread, 1.0,
                               spread is not None and spread >= 1,
                               f"median equi_ratio hilbert_equi {_fmt(equi)} vs random unit rows {_fmt(random_rows)}"
                               f" (hilbert {_fmt(plain)})"))  # fmt: skip
    for r in recipes.to_pylist():
        if r["recipe"] == baseline().name or r["diff_vs_muon"] is None or r["matched"]:
            continue
        p = r["p_vs_muon_holm"]
        detail = (f"paired Δ {_fmt(r['diff_vs_muon'])} nats [{_fmt(r['diff_ci_low'])}, {_fmt(r['diff_ci_high'])}], "
                  + (f"p {_fmt(r['p_vs_muon'])}, Holm {_fmt(p)}" if p is not None else f"n={r['n_paired']}: too few seeds to test"))  # fmt: skip
        row = _claim("B", r["arch"], r["recipe"], "beats_muon", r["diff_vs_muon"], 0.0,
                     p is not None and r["diff_vs_muon"] < 0 and p < SIGNIFICANCE, detail)  # fmt: skip
        if p is None:
            row["holds"] = None
        rows.append(row)
    return rows


def _median_of(runs: list[dict[str, Any]], recipe: str, column: str) -> float | None:
    vals = _finite([r[column] for r in runs if r["recipe"] == recipe])
    return float(np.median(vals)) if vals.size else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"


# ------------------------------------------------------------------------------------------ outputs
def build_tables(sources: Sources, cfg: ReportConfig) -> dict[str, pa.Table]:
    """Every result table from ``sources`` (see the module docstring)."""
    # One thread: float sums then run in a fixed order, so equal inputs give byte-identical tables.
    con = duckdb.connect(":memory:", config={"threads": 1})
    _register_sources(con, sources)
    runs = _runs_table(con)
    recipes = _recipes_table(runs, cfg)
    _create_anchor_view(con)
    geometry = _geometry_table(con)
    con.register("geometry", geometry)
    pooled = _geometry_pooled_table(con)
    return {
        "runs": runs, "curves": _curves_table(con), "recipes": recipes, "geometry": geometry,
        "geometry_pooled": pooled, "angles": _angles_table(con), "correlations": _correlations_table(con, cfg),
        "claims": pa.Table.from_pylist(_study_b_claims(runs, recipes), schema=CLAIMS_SCHEMA),
        "claim_tests": claim_tests(_strata(con), n_boot=cfg.bootstrap, ci=cfg.ci, seed=cfg.seed),
    }  # fmt: skip


def aggregate(sources: Sources, out_dir: Path, cfg: ReportConfig, key: ManifestKey) -> None:
    """Write ``out_dir/tables/*.parquet`` and ``out_dir/metrics.json`` (module docstring).

    The tables are one shard of the store under ``key``, so their readers (the report, ``lmgeo query``)
    verify every file against the manifest, as for any dataset."""
    tables = build_tables(sources, cfg)
    with ShardWriter(out_dir / "tables", "tables", key) as writer:
        for name, table in tables.items():
            writer.write({}, table, name=f"{name}.parquet")
    atomic_write(out_dir / "metrics.json", json.dumps(metrics(tables), sort_keys=True, indent=2) + "\n")


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.6g}")
    return x


def _measured(record: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _round(v) for k, v in record.items()
        if v is not None and not (isinstance(v, float) and not math.isfinite(v))
    }  # fmt: skip


# `cos_full_tok` is implied by `rel_err` (cos_full_tok ≥ √(1 − rel_err²), SPEC §4.5): no headline of its own.
HEADLINE_EXCLUDED = ("cos_full_tok_near_1",)


def metrics(tables: dict[str, pa.Table]) -> dict[str, Any]:
    """The DVC metrics dictionary (layout in the module docstring)."""
    study_b: dict[str, dict[str, Any]] = {}
    rows = tables["recipes"].to_pylist()
    compared = {r["arch"] for r in rows if r["recipe"] != baseline().name}  # not Study A's muon-only archs
    for r in (r for r in rows if r["arch"] in compared):
        arch = study_b.setdefault(r["arch"], {"diff_vs_muon": {}})
        if r["recipe"] == baseline().name:
            arch |= _measured({"muon_test_loss" + ("_matched" if r["matched"] else ""): r["test_loss_mean"]})
        else:
            key = "diff_vs_muon_matched" if r["matched"] else "diff_vs_muon"
            arch[key] = arch.get(key, {}) | _measured({r["recipe"]: r["diff_vs_muon"]})
    study_a: dict[str, dict[str, Any]] = {}
    for s in summarise(tables["claim_tests"].to_pylist()):
        if not s.subject.endswith("@init") and s.claim not in HEADLINE_EXCLUDED:
            study_a.setdefault(s.subject.removesuffix("@final"), {})[s.claim] = _measured(
                {"effect": s.weakest["effect"], "verdict": s.score}
            )
    return {"study_b": study_b, "study_a": study_a}
