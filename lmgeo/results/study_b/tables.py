"""Study B's result tables (SPEC §3.2, §3.3): per run, per step (thinned), per arch × recipe with the paired
comparison with `muon`, and Study B's claims; and its part of the DVC metrics (`lmgeo.results.aggregate`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from lmgeo.core.contracts import RUN_ID_PATTERN
from lmgeo.results.common import finite, none_if_nan
from lmgeo.results.config import ReportConfig
from lmgeo.results.stats import detectable_difference, holm, mean_interval, paired_difference, seeds_needed
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.ngram import NgramLoss
from lmgeo.study_b.recipes import RECIPES

# ------------------------------------------------------------------------------ claims (SPEC §3.3)
SIGNIFICANCE = 0.05
MIN_SEEDS_FOR_TEST = 3
# Study B resolves differences of this size (issue 12): seeds are planned for it at this power.
RESOLVE_NATS = 0.02
POWER = 0.8
# A trained model beats the bigram of its own training data by at least this much on test (issue 37): below it,
# an optimizer comparison says little about trained models.
REGIME_MARGIN = 0.3
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
                   avg(equi_ratio - equi_ratio_random) AS mean_equi_ratio_excess,
                   median(equi_ratio_bound) AS median_equi_ratio_bound,
                   median(head_alignment) AS median_head_alignment,
                   median(head_alignment_hilbert) AS median_head_alignment_hilbert,
                   median(hilbert_realized_train) AS median_hilbert_realized_train,
                   max(hilbert_realized_train) AS max_hilbert_realized_train,
                   median(head_step_scale) AS median_head_step_scale,
                   avg(CASE WHEN head_step_scale > 1 THEN 1.0 ELSE 0.0 END)
                       FILTER (WHERE head_step_scale IS NOT NULL) AS frac_steps_enlarged
            FROM steps GROUP BY run
        )
        SELECT coalesce(j.run, l.run) AS run,
               coalesce(j.arch, regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 1)) AS arch,
               coalesce(j.recipe, regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 2)) AS recipe,
               coalesce(
                   j.seed, TRY_CAST(regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 3) AS BIGINT)
               ) AS seed,
               regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 4) <> '' AS matched,
               coalesce(
                   j.head_budget_tau,
                   TRY_CAST(nullif(regexp_extract(coalesce(j.run, l.run), '{RUN_ID_PATTERN}', 5), '') AS DOUBLE)
               ) AS head_budget_tau,
               j.run IS NOT NULL AS finished,
               j.diverged, j.diverged_at_step, j.steps, j.steps_done, j.tokens,
               j.final_train_loss, j.final_val_loss, j.final_test_loss, j.head_step,
               j.n_params, j.params_hash,
               l.* EXCLUDE (run)
        FROM run_json j FULL OUTER JOIN logged l ON j.run = l.run
        ORDER BY matched, arch, recipe, seed, head_budget_tau NULLS FIRST, run
    """).to_arrow_table()


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
    """).to_arrow_table()


RECIPES_SCHEMA = pa.schema(
    [
        ("arch", pa.string()),
        ("recipe", pa.string()),
        ("matched", pa.bool_()),
        ("head_budget_tau", pa.float64()),
        ("n_runs", pa.int64()),
        ("n_seeds", pa.int64()),
        ("n_diverged", pa.int64()),
        ("test_loss_mean", pa.float64()),
        ("test_loss_sd", pa.float64()),
        ("test_loss_ci_low", pa.float64()),
        ("test_loss_ci_high", pa.float64()),
        ("val_loss_mean", pa.float64()),
        ("steps", pa.int64()),
        ("tokens", pa.int64()),
        ("head_step", pa.string()),
        ("median_hilbert_bound", pa.float64()),
        ("median_step_scale", pa.float64()),
        ("n_paired", pa.int64()),
        ("diff_vs_muon", pa.float64()),
        ("diff_sd", pa.float64()),
        ("diff_ci_low", pa.float64()),
        ("diff_ci_high", pa.float64()),
        ("p_vs_muon", pa.float64()),
        ("p_vs_muon_holm", pa.float64()),
        ("detectable_diff", pa.float64()),
        ("seeds_to_resolve", pa.int64()),
        ("seeds_for_observed", pa.int64()),
        ("budget_effect", pa.float64()),
        ("budget_effect_ci_low", pa.float64()),
        ("budget_effect_ci_high", pa.float64()),
    ]
)

# (matched, head_budget_tau, arch, recipe): the default runs (False, None, ...) and each budget of the
# matched-budget sweep (True, tau, ...).
GroupKey = tuple[bool, float | None, str, str]


def _group_key(row: dict[str, Any]) -> GroupKey:
    return row["matched"], row["head_budget_tau"], row["arch"], row["recipe"]


def _display_order(key: GroupKey) -> tuple[Any, ...]:
    matched, tau, arch, recipe = key
    return arch, matched, tau or 0.0, RECIPES.order(recipe)


def recipes_table(runs: pa.Table, cfg: ReportConfig) -> pa.Table:
    """Per arch × recipe, for the default runs and apart for each budget of the matched-budget sweep: final
    test loss over seeds with its t-interval (diverged runs counted, not averaged), and the paired comparison
    with `muon` of the same kind and budget on the same seeds (same init, same data order): the mean
    difference with its t-interval, the paired t-test p-value and its Holm adjustment — over the arch's
    recipes for the default runs, over *every* comparison of the arch's sweep (all budgets) for the sweep's —,
    the difference these seeds detect with POWER, and the seeds RESOLVE_NATS and the observed difference would
    need. A sweep row also carries how much the budget rescaled the recipe's own step (the median factor; > 1:
    enlarged) and the budget's effect (its test loss minus the same recipe's default run, same seed: the
    same horizon and data, the recipe's own step size)."""
    by_group: dict[GroupKey, list[dict[str, Any]]] = {}
    for row in runs.to_pylist():
        if row["arch"] and row["recipe"]:
            by_group.setdefault(_group_key(row), []).append(row)
    test = {key: _by_seed(rows, "final_test_loss") for key, rows in by_group.items()}
    reference = baseline().name
    out = []
    for key in sorted(by_group, key=_display_order):
        rows = by_group[key]
        matched, tau, arch, recipe = key
        loss = mean_interval(list(test[key].values()), cfg.ci)
        muon = (matched, tau, arch, reference)
        compared = recipe != reference and muon in test
        paired = paired_difference(test[key], test[muon], cfg.ci) if compared else None
        diff = paired.diff if paired else None
        out.append(
            {
                "arch": arch,
                "recipe": recipe,
                "matched": matched,
                "head_budget_tau": tau,
                "n_runs": len(rows),
                "n_seeds": loss.n,
                "n_diverged": sum(bool(r["diverged"]) for r in rows),
                "test_loss_mean": none_if_nan(loss.mean),
                "test_loss_sd": none_if_nan(loss.sd),
                "test_loss_ci_low": none_if_nan(loss.low),
                "test_loss_ci_high": none_if_nan(loss.high),
                "val_loss_mean": none_if_nan(mean_interval(list(_by_seed(rows, "final_val_loss").values())).mean),
                "steps": _single([r["steps_done"] for r in rows]),
                "tokens": _single([r["tokens"] for r in rows]),
                "head_step": _single([r["head_step"] for r in rows]),
                "median_hilbert_bound": _median([r["median_hilbert_bound"] for r in rows]),
                "median_step_scale": _median([r["median_head_step_scale"] for r in rows]) if matched else None,
                "n_paired": diff.n if diff else None,
                "diff_vs_muon": none_if_nan(diff.mean) if diff else None,
                "diff_sd": none_if_nan(diff.sd) if diff else None,
                "diff_ci_low": none_if_nan(diff.low) if diff else None,
                "diff_ci_high": none_if_nan(diff.high) if diff else None,
                "p_vs_muon": _testable(paired),
                **_planning(diff),
                **_budget_effect(test, key, cfg.ci),
            }
        )
    _holm(out, ("arch", "matched"), "p_vs_muon", "p_vs_muon_holm")
    return pa.Table.from_pylist(out, schema=RECIPES_SCHEMA)


ENVELOPE_SCHEMA = pa.schema(
    [
        ("arch", pa.string()),
        ("recipe", pa.string()),
        ("best_tau", pa.float64()),
        ("n_budgets", pa.int64()),
        ("best_interior", pa.bool_()),
        ("val_loss_mean", pa.float64()),
        ("n_seeds", pa.int64()),
        ("test_loss_mean", pa.float64()),
        ("test_loss_ci_low", pa.float64()),
        ("test_loss_ci_high", pa.float64()),
        ("own_step_test_loss", pa.float64()),
        ("muon_best_tau", pa.float64()),
        ("n_paired", pa.int64()),
        ("diff_vs_muon", pa.float64()),
        ("diff_ci_low", pa.float64()),
        ("diff_ci_high", pa.float64()),
        ("p_vs_muon", pa.float64()),
        ("p_vs_muon_holm", pa.float64()),
    ]
)


def envelope_table(runs: pa.Table, recipes: pa.Table, cfg: ReportConfig) -> pa.Table:
    """The matched-budget sweep's fair overall comparison: per arch × recipe, its best budget, chosen on the
    mean final *val* loss (the protocol's tuning split; ties: the smaller budget) and whether it is interior
    (a budget below and one above it were swept: else the grid may clip the best), its test loss there, its
    own-step test loss (the default runs of the sweep's seeds), and the paired difference to `muon` at muon's
    own best budget on the same seeds (Holm over the arch's recipes)."""
    per_run = [r for r in runs.to_pylist() if r["matched"]]
    swept = [r for r in recipes.to_pylist() if r["matched"] and r["val_loss_mean"] is not None]
    best: dict[tuple[str, str], dict[str, Any]] = {}
    budgets: dict[tuple[str, str], list[float]] = {}
    for r in swept:
        budgets.setdefault((r["arch"], r["recipe"]), []).append(r["head_budget_tau"])
        here = best.get((r["arch"], r["recipe"]))
        ranked = (r["val_loss_mean"], r["head_budget_tau"])
        if here is None or ranked < (here["val_loss_mean"], here["head_budget_tau"]):
            best[(r["arch"], r["recipe"])] = r
    sweep_seeds = {r["seed"] for r in per_run}
    own = {
        key: _by_seed(
            [r for r in runs.to_pylist() if _group_key(r) == key and r["seed"] in sweep_seeds], "final_test_loss"
        )
        for key in {(False, None, a, rc) for a, rc in best}
    }

    def losses(arch: str, recipe: str) -> dict[int, float]:
        tau = best[(arch, recipe)]["head_budget_tau"]
        return _by_seed([r for r in per_run if _group_key(r) == (True, tau, arch, recipe)], "final_test_loss")

    out = []
    for (arch, recipe), row in sorted(best.items(), key=lambda item: (item[0][0], RECIPES.order(item[0][1]))):
        muon = (arch, baseline().name)
        compared = recipe != muon[1] and muon in best
        paired = paired_difference(losses(arch, recipe), losses(*muon), cfg.ci) if compared else None
        diff = paired.diff if paired else None
        swept_here = budgets[(arch, recipe)]
        own_losses = list(own[(False, None, arch, recipe)].values())
        out.append(
            {
                "arch": arch,
                "recipe": recipe,
                "best_tau": row["head_budget_tau"],
                "n_budgets": len(swept_here),
                "best_interior": min(swept_here) < row["head_budget_tau"] < max(swept_here),
                "val_loss_mean": row["val_loss_mean"],
                "n_seeds": row["n_seeds"],
                "test_loss_mean": row["test_loss_mean"],
                "test_loss_ci_low": row["test_loss_ci_low"],
                "test_loss_ci_high": row["test_loss_ci_high"],
                "own_step_test_loss": float(np.mean(own_losses)) if own_losses else None,
                "muon_best_tau": best[muon]["head_budget_tau"] if muon in best else None,
                "n_paired": diff.n if diff else None,
                "diff_vs_muon": none_if_nan(diff.mean) if diff else None,
                "diff_ci_low": none_if_nan(diff.low) if diff else None,
                "diff_ci_high": none_if_nan(diff.high) if diff else None,
                "p_vs_muon": _testable(paired),
            }
        )
    _holm(out, ("arch",), "p_vs_muon", "p_vs_muon_holm")
    return pa.Table.from_pylist(out, schema=ENVELOPE_SCHEMA)


def _by_seed(runs: list[dict[str, Any]], column: str) -> dict[int, float]:
    """seed → value of the finished, non-diverged runs with a finite value."""
    return {
        r["seed"]: r[column]
        for r in runs
        if not r["diverged"] and r[column] is not None and math.isfinite(r[column]) and r["seed"] is not None
    }


def _budget_effect(test: dict[GroupKey, dict[int, float]], key: GroupKey, ci: float) -> dict[str, Any]:
    """For sweep rows: what matching the budget did, their test loss minus the same recipe's default runs
    (its own step, same horizon) on the same seeds (paired t-interval); None for any other row."""
    matched, _tau, arch, recipe = key
    own = test.get((False, None, arch, recipe))
    if not matched or not own:
        return {"budget_effect": None, "budget_effect_ci_low": None, "budget_effect_ci_high": None}
    diff = paired_difference(test[key], own, ci).diff
    return {
        "budget_effect": none_if_nan(diff.mean),
        "budget_effect_ci_low": none_if_nan(diff.low),
        "budget_effect_ci_high": none_if_nan(diff.high),
    }


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


def _holm(rows: list[dict[str, Any]], family: tuple[str, ...], p: str, adjusted: str) -> None:
    """`adjusted`: the p-values `p` of the rows that agree on the `family` columns, Holm-adjusted together
    (for the recipes table: the arch's default comparisons with `muon`, or all of its sweep's)."""
    for family_key in {tuple(r[c] for c in family) for r in rows}:
        members = [r for r in rows if tuple(r[c] for c in family) == family_key]
        for r, value in zip(members, holm([math.nan if r[p] is None else r[p] for r in members]), strict=True):
            r[adjusted] = none_if_nan(value)


def _median(values: Sequence[float | None]) -> float | None:
    vals = finite(values)
    return float(np.median(vals)) if vals.size else None


def _single(values: Sequence[Any]) -> Any:
    """The common value (runs compared at equal steps/tokens), or None when they differ or are unknown."""
    distinct = {v for v in values if v is not None}
    return distinct.pop() if len(distinct) == 1 else None


BASELINES_SCHEMA = pa.schema(
    [("model", pa.string()), ("smoothing", pa.string()), ("val_loss", pa.float64()), ("test_loss", pa.float64())]
)


def baselines_table(baselines: Sequence[NgramLoss]) -> pa.Table:
    """The n-gram baselines (`lmgeo.study_b.ngram`) on the models' val and test windows."""
    return pa.Table.from_pylist([dataclasses.asdict(b) for b in baselines], schema=BASELINES_SCHEMA)


# ------------------------------------------------------------------------------------------- claims
CLAIMS_SCHEMA = pa.schema(
    [
        ("study", pa.string()),
        ("subject", pa.string()),
        ("fn", pa.string()),
        ("claim", pa.string()),
        ("value", pa.float64()),
        ("threshold", pa.float64()),
        ("holds", pa.bool_()),
        ("holds_at_init", pa.bool_()),
        ("detail", pa.string()),
    ]
)


def _claim(
    study: str,
    subject: str,
    fn: str,
    claim: str,
    value: float | None,
    threshold: float,
    holds: bool | None,
    detail: str,
) -> dict[str, Any]:
    measured = value is not None and math.isfinite(value)
    return {
        "study": study,
        "subject": subject,
        "fn": fn,
        "claim": claim,
        "value": value if measured else None,
        "threshold": threshold,
        "holds": holds if measured else None,
        "holds_at_init": None,
        "detail": detail,
    }


def claims_table(runs: pa.Table, recipes: pa.Table, cfg: ReportConfig) -> pa.Table:
    """Study B's claims (the bound, the spread of `hilbert_equi`'s rows, beating `muon`), one row per subject."""
    return pa.Table.from_pylist(_claims(runs, recipes, cfg.ci), schema=CLAIMS_SCHEMA)


def _claims(runs: pa.Table, recipes: pa.Table, ci: float) -> list[dict[str, Any]]:
    rows = []
    by_arch: dict[str, list[dict[str, Any]]] = {}
    for r in runs.to_pylist():
        if r["arch"] and not r["matched"]:  # the geometry claims are about the recipes as tuned
            by_arch.setdefault(r["arch"], []).append(r)
    for arch, arch_runs in sorted(by_arch.items()):
        ratios = [r["max_tightness"] for r in arch_runs if r["max_tightness"] is not None]
        worst = max(ratios) if ratios else None
        rows.append(
            _claim(
                "B",
                arch,
                "all",
                "bound_holds",
                worst,
                1.0,
                worst is not None and worst <= 1 + BOUND_TOLERANCE,
                f"max realized/bound {_fmt(worst)} over {len(ratios)} runs with exact diameters",
            )
        )
        spread = _spread_claim(arch, arch_runs, ci)
        if spread:
            rows.append(spread)
        rows.extend(_control_claims(arch, arch_runs, ci))
    for r in recipes.to_pylist():
        if r["recipe"] == baseline().name or r["diff_vs_muon"] is None or r["matched"]:
            continue
        p = r["p_vs_muon_holm"]
        detail = f"paired Δ {_fmt(r['diff_vs_muon'])} nats [{_fmt(r['diff_ci_low'])}, {_fmt(r['diff_ci_high'])}], " + (
            f"p {_fmt(r['p_vs_muon'])}, Holm {_fmt(p)}"
            if p is not None
            else f"n={r['n_paired']}: too few seeds to test"
        )
        row = _claim(
            "B",
            r["arch"],
            r["recipe"],
            "beats_muon",
            r["diff_vs_muon"],
            0.0,
            p is not None and r["diff_vs_muon"] < 0 and p < SIGNIFICANCE,
            detail,
        )
        if p is None:
            row["holds"] = None
        rows.append(row)
    return rows


def _spread_claim(arch: str, runs: list[dict[str, Any]], ci: float) -> dict[str, Any] | None:
    """`equi_spreads_rows` as an interval: per `hilbert_equi` run, its rows' equi_ratio minus that of random
    unit rows drawn afresh at each logged step (same shape), averaged over the steps; the t-interval of that
    excess over seeds must lie above 0 (`hilbert`'s, as a reference, in the detail)."""
    excess = mean_interval(finite([r["mean_equi_ratio_excess"] for r in runs if r["recipe"] == "hilbert_equi"]), ci)
    if excess.n == 0:
        return None
    plain = mean_interval(finite([r["mean_equi_ratio_excess"] for r in runs if r["recipe"] == "hilbert"]), ci)
    equi = _median_of(runs, "hilbert_equi", "median_equi_ratio")
    random_rows = _median_of(runs, "hilbert_equi", "median_equi_ratio_random")
    holds = None if not math.isfinite(excess.low) else excess.low > 0
    return _claim(
        "B",
        arch,
        "hilbert_equi",
        "equi_spreads_rows",
        none_if_nan(excess.mean),
        0.0,
        holds,
        f"equi_ratio − random unit rows' {_fmt(excess.mean)} [{_fmt(excess.low)}, {_fmt(excess.high)}] "
        f"over {excess.n} seeds (medians {_fmt(equi)} vs {_fmt(random_rows)}; hilbert "
        f"{_fmt(plain.mean)} [{_fmt(plain.low)}, {_fmt(plain.high)}])",
    )


def _control_claims(arch: str, runs: list[dict[str, Any]], ci: float) -> list[dict[str, Any]]:
    """`beats_control`, per recipe with a control in the runs (`HeadRecipe.control_of`; issue #55): the
    recipe's final test loss minus its control's on the same seeds (paired t-interval and p-value; one
    planned comparison per recipe, outside `beats_muon`'s Holm family), holding where the recipe is lower at
    SIGNIFICANCE; not tested below MIN_SEEDS_FOR_TEST pairs."""
    by_recipe: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_recipe.setdefault(r["recipe"], []).append(r)
    rows = []
    for control in [name for name in by_recipe if name in RECIPES and RECIPES[name].control_of in by_recipe]:
        subject = RECIPES[control].control_of
        assert subject is not None
        paired = paired_difference(
            _by_seed(by_recipe[subject], "final_test_loss"), _by_seed(by_recipe[control], "final_test_loss"), ci
        )
        diff, p = paired.diff, _testable(paired)
        tested = f"p {_fmt(p)}" if p is not None else f"n={diff.n}: too few seeds to test"
        rows.append(
            _claim(
                "B",
                arch,
                subject,
                "beats_control",
                none_if_nan(diff.mean),
                0.0,
                None if p is None else bool(diff.mean < 0 and p < SIGNIFICANCE),
                f"paired Δ test loss {subject} − its control {control} (same knobs: only the direction differs) "
                f"{_fmt(diff.mean)} nats [{_fmt(diff.low)}, {_fmt(diff.high)}] over {diff.n} seeds, {tested}",
            )
        )
    return rows


def _median_of(runs: list[dict[str, Any]], recipe: str, column: str) -> float | None:
    vals = finite([r[column] for r in runs if r["recipe"] == recipe])
    return float(np.median(vals)) if vals.size else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"
