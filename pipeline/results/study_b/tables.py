"""Study B's result tables (SPEC §3.2, §3.3): per run, per step (thinned), per arch × recipe with the paired
comparison with `muon`, and Study B's claims; and its part of the DVC metrics (`pipeline.results.aggregate`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from pipeline.core.contracts import RUN_ID_PATTERN
from pipeline.results.common import measured, none_if_nan
from pipeline.results.config import ReportConfig
from pipeline.results.stats import detectable_difference, holm, mean_interval, paired_difference, seeds_needed
from pipeline.study_b.baseline import baseline
from pipeline.study_b.recipes import RECIPES

# ------------------------------------------------------------------------------ claims (SPEC §3.3)
SIGNIFICANCE = 0.05
MIN_SEEDS_FOR_TEST = 3
# Study B resolves differences of this size (issue 12): seeds are planned for it at this power.
RESOLVE_NATS = 0.02
POWER = 0.8
BOUND_TOLERANCE = 1e-5  # hilbert_realized / hilbert_bound may exceed 1 by float rounding only
MAX_CURVE_POINTS = 1000

_TIGHTNESS = "hilbert_realized / hilbert_bound"
# The bound is tested on exact diameters only: a sampled diameter is a lower bound (SPEC §3.3).
_EXACT = "NOT coalesce(head_diam_sampled, false) AND hilbert_bound > 0"


def runs_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    return con.sql(f"""
        WITH logged AS (
            SELECT run,
                   count(*) AS steps_logged,
                   max(step) AS last_step,
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
               coalesce(
                   j.seed, TRY_CAST(regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 3) AS BIGINT)
               ) AS seed,
               regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 4) <> '' AS matched,
               j.run IS NOT NULL AS finished,
               j.diverged, j.diverged_at_step, j.steps, j.steps_done, j.tokens,
               j.final_train_loss, j.final_val_loss, j.final_test_loss, j.head_step, j.head_budget_tau,
               j.n_params, j.params_hash,
               l.* EXCLUDE (run)
        FROM run_json j FULL OUTER JOIN logged l ON j.run = l.run
        ORDER BY matched, arch, recipe, seed, run
    """).to_arrow_table()  # fmt: skip


def curves_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
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
        SELECT run, step, tokens, lr, train_loss, val_loss, head_diam, head_diam_sampled,
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
    [("arch", pa.string()), ("recipe", pa.string()), ("matched", pa.bool_()), ("n_runs", pa.int64()),
     ("n_seeds", pa.int64()), ("n_diverged", pa.int64()),
     ("test_loss_mean", pa.float64()), ("test_loss_sd", pa.float64()),
     ("test_loss_ci_low", pa.float64()), ("test_loss_ci_high", pa.float64()), ("val_loss_mean", pa.float64()),
     ("steps", pa.int64()), ("tokens", pa.int64()), ("head_step", pa.string()), ("head_budget_tau", pa.float64()),
     ("n_paired", pa.int64()),
     ("diff_vs_muon", pa.float64()), ("diff_sd", pa.float64()), ("diff_ci_low", pa.float64()),
     ("diff_ci_high", pa.float64()), ("p_vs_muon", pa.float64()), ("p_vs_muon_holm", pa.float64()),
     ("detectable_diff", pa.float64()), ("seeds_to_resolve", pa.int64()), ("seeds_for_observed", pa.int64()),
     ("cap_effect", pa.float64()), ("cap_effect_ci_low", pa.float64()), ("cap_effect_ci_high", pa.float64())]
)  # fmt: skip


def recipes_table(runs: pa.Table, cfg: ReportConfig) -> pa.Table:
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
    groups = sorted(by_group.items(), key=lambda item: (*item[0][:2], RECIPES.order(item[0][2])))
    for (matched, arch, recipe), rows in groups:
        loss = mean_interval(list(test[(matched, arch, recipe)].values()), cfg.ci)
        muon = (matched, arch, reference)
        compared = recipe != reference and muon in test
        paired = paired_difference(test[(matched, arch, recipe)], test[muon], cfg.ci) if compared else None
        diff = paired.diff if paired else None
        out.append({
            "arch": arch, "recipe": recipe, "matched": matched, "n_runs": len(rows), "n_seeds": loss.n,
            "n_diverged": sum(bool(r["diverged"]) for r in rows),
            "test_loss_mean": none_if_nan(loss.mean), "test_loss_sd": none_if_nan(loss.sd),
            "test_loss_ci_low": none_if_nan(loss.low), "test_loss_ci_high": none_if_nan(loss.high),
            "val_loss_mean": none_if_nan(mean_interval(list(_by_seed(rows, "final_val_loss").values())).mean),
            "steps": _single([r["steps_done"] for r in rows]), "tokens": _single([r["tokens"] for r in rows]),
            "head_step": _single([r["head_step"] for r in rows]),
            "head_budget_tau": _single([r["head_budget_tau"] for r in rows]),
            "n_paired": diff.n if diff else None,
            "diff_vs_muon": none_if_nan(diff.mean) if diff else None,
            "diff_sd": none_if_nan(diff.sd) if diff else None,
            "diff_ci_low": none_if_nan(diff.low) if diff else None,
            "diff_ci_high": none_if_nan(diff.high) if diff else None,
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


def _cap_effect(
    test: dict[tuple[bool, str, str], dict[int, float]], key: tuple[bool, str, str], ci: float
) -> dict[str, Any]:
    """For matched-budget runs: what the cap did, their test loss minus the same recipe's default runs' on
    the same seeds (paired t-interval); None for default runs."""
    matched, arch, recipe = key
    default = test.get((False, arch, recipe))
    if not matched or not default:
        return {"cap_effect": None, "cap_effect_ci_low": None, "cap_effect_ci_high": None}
    diff = paired_difference(test[key], default, ci).diff
    return {"cap_effect": none_if_nan(diff.mean), "cap_effect_ci_low": none_if_nan(diff.low),
            "cap_effect_ci_high": none_if_nan(diff.high)}  # fmt: skip


def _planning(diff: Any) -> dict[str, Any]:
    """What the paired SD says about seeds: the difference these seeds detect with POWER, and the seeds
    RESOLVE_NATS and the observed difference would need."""
    if diff is None:
        return {"detectable_diff": None, "seeds_to_resolve": None, "seeds_for_observed": None}
    return {
        "detectable_diff": none_if_nan(detectable_difference(diff.sd, diff.n, SIGNIFICANCE, POWER)),
        "seeds_to_resolve": seeds_needed(RESOLVE_NATS, diff.sd, SIGNIFICANCE, POWER),
        "seeds_for_observed": (
            seeds_needed(diff.mean, diff.sd, SIGNIFICANCE, POWER) if math.isfinite(diff.mean) else None
        ),
    }


def _testable(paired: Any) -> float | None:
    """The paired p-value where there are MIN_SEEDS_FOR_TEST pairs, else None (not tested)."""
    if paired is None or paired.diff.n < MIN_SEEDS_FOR_TEST:
        return None
    return none_if_nan(paired.p)


def _holm_per_arch(rows: list[dict[str, Any]]) -> None:
    """`p_vs_muon_holm`: the arch's family of comparisons with `muon` (default or matched runs), adjusted
    together."""
    for family_key in {(r["arch"], r["matched"]) for r in rows}:
        family = [r for r in rows if (r["arch"], r["matched"]) == family_key]
        adjusted = holm([math.nan if r["p_vs_muon"] is None else r["p_vs_muon"] for r in family])
        for r, p in zip(family, adjusted, strict=True):
            r["p_vs_muon_holm"] = none_if_nan(p)


def _finite(values: Sequence[float | None]) -> np.ndarray:
    arr = np.array([v for v in values if v is not None], dtype=float)
    return arr[np.isfinite(arr)]


def _single(values: Sequence[Any]) -> Any:
    """The common value (runs compared at equal steps/tokens), or None when they differ or are unknown."""
    distinct = {v for v in values if v is not None}
    return distinct.pop() if len(distinct) == 1 else None


# ------------------------------------------------------------------------------------------- claims
CLAIMS_SCHEMA = pa.schema(
    [("study", pa.string()), ("subject", pa.string()), ("fn", pa.string()), ("claim", pa.string()),
     ("value", pa.float64()), ("threshold", pa.float64()), ("holds", pa.bool_()),
     ("holds_at_init", pa.bool_()), ("detail", pa.string())]
)  # fmt: skip

# Study B's claims (Study A's are tests against nulls: `pipeline.results.study_a.claims`, the `claim_tests` table).
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


def claims_table(runs: pa.Table, recipes: pa.Table) -> pa.Table:
    """Study B's claims (the bound, the spread of `hilbert_equi`'s rows, beating `muon`), one row per subject."""
    return pa.Table.from_pylist(_claims(runs, recipes), schema=CLAIMS_SCHEMA)


def _claims(runs: pa.Table, recipes: pa.Table) -> list[dict[str, Any]]:
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
                           f"max realized/bound {_fmt(worst)} over {len(ratios)} runs with exact "
                           "diameters"))  # fmt: skip
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
                  + (f"p {_fmt(r['p_vs_muon'])}, Holm {_fmt(p)}" if p is not None
                     else f"n={r['n_paired']}: too few seeds to test"))  # fmt: skip
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


def metrics(tables: dict[str, pa.Table]) -> dict[str, Any]:
    """Study B's part of the DVC metrics (`pipeline.results.aggregate`): per compared arch, `muon`'s test loss
    and each recipe's paired difference to it, default and matched-budget runs apart."""
    study_b: dict[str, dict[str, Any]] = {}
    rows = tables["recipes"].to_pylist()
    compared = {r["arch"] for r in rows if r["recipe"] != baseline().name}  # not Study A's muon-only archs
    for r in (r for r in rows if r["arch"] in compared):
        arch = study_b.setdefault(r["arch"], {"diff_vs_muon": {}})
        if r["recipe"] == baseline().name:
            arch |= measured({"muon_test_loss" + ("_matched" if r["matched"] else ""): r["test_loss_mean"]})
        else:
            key = "diff_vs_muon_matched" if r["matched"] else "diff_vs_muon"
            arch[key] = arch.get(key, {}) | measured({r["recipe"]: r["diff_vs_muon"]})
    return study_b
