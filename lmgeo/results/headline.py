"""The DVC metrics (`reports/metrics.json`, SPEC §2): the headline a person compares across experiments, one
flat object of short names, Study B's then Study A's, so that `dvc metrics show` (one row, a column per name)
and `dvc exp show --only-changed` fit a 200-column terminal; `metric_meaning` says what each name is, and the
report prints it beside the value. A name whose value is not measured is left out; rounded, equal inputs give
identical bytes. Computed from the result tables' rows, so the aggregate (which writes the file) and the
report (which explains it) share one definition without the report depending on the aggregation's code."""

from __future__ import annotations

import numpy as np

from lmgeo.results.common import Tables, finite, measured
from lmgeo.results.study_a.claims import CLAIMS, summarise
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.recipes import RECIPES

STUDY_B_DECIMALS = 4  # 1e-4 nats: far below the differences Study B resolves (RESOLVE_NATS)
STUDY_A_DECIMALS = 2  # verdict scores are multiples of 1/8 averaged over a few models: more only widens the column
# The paper's claims, each under a short name, so that `dvc metrics show` fits a 200-column terminal (with the
# sweep's `envelope` too). `cos_full_tok_near_1` has none: it is implied by `rel_err` (cos_full_tok ≥
# √(1 − rel_err²), SPEC §4.5); nor has `expressivity_tradeoff`, one verdict over class pairs, nor the project's
# own checks (`partial_spearman_rel_err_kl`, `local_beats_layer`): the tables and the report have them.
HEADLINE = {
    "angle_res_tok_near_90": "ortho",
    "proj_res_below_full": "proj_loc",
    "proj_res_global_below_full": "proj_glob",
    "spearman_rel_err_kl": "rho_kl",
    "residual_outweighs_null": "kl_null",
}


def metrics(tables: Tables) -> dict[str, float]:
    """The headline from the `recipes`, `envelope` and `claim_tests` rows, in a stable order: the columns of
    `dvc metrics show`."""
    return study_b_metrics(tables) | study_a_metrics(tables)


def study_b_metrics(tables: Tables) -> dict[str, float]:
    """Over the archs that compare recipes (not Study A's muon-only ones): `muon_loss` and `d_<recipe>` per
    other recipe (means over those archs), `ci` (a maximum) and, when the study has the sweep, `envelope` (a
    minimum; `metric_meaning`). In nats."""
    muon = baseline().name
    rows = [r for r in tables["recipes"] if not r["matched"]]
    compared = {r["arch"] for r in rows if r["recipe"] != muon}
    rows = [r for r in rows if r["arch"] in compared]
    by_name: dict[str, list[float | None]] = {}
    for r in sorted(rows, key=lambda r: (r["recipe"] != muon, RECIPES.order(r["recipe"]))):  # muon first
        loss = r["recipe"] == muon
        by_name.setdefault(f"{muon}_loss" if loss else f"d_{r['recipe']}", []).append(
            r["test_loss_mean" if loss else "diff_vs_muon"]
        )
    half_widths = [(r["diff_ci_high"] - r["diff_ci_low"]) / 2 for r in rows if r["diff_ci_low"] is not None]
    matched = [r["diff_vs_muon"] for r in tables["envelope"] if r["arch"] in compared]
    return measured(
        {
            **{name: _mean(values) for name, values in by_name.items()},
            "ci": max(half_widths, default=None),
            "envelope": min(finite(matched), default=None),
        },
        decimals=STUDY_B_DECIMALS,
    )


def study_a_metrics(tables: Tables) -> dict[str, float]:
    """Per claim of `HEADLINE`, under its short name, the verdict score (`metric_meaning`) averaged over the
    trained architectures (`@final`) and external models."""
    scores: dict[str, list[float]] = {}
    for s in summarise(tables["claim_tests"]):
        if not s.subject.endswith("@init") and s.claim in HEADLINE:
            scores.setdefault(HEADLINE[s.claim], []).append(s.score)
    return measured({name: float(np.mean(values)) for name, values in scores.items()}, decimals=STUDY_A_DECIMALS)


def metric_meaning(name: str) -> str:
    """What the metric `name` is, in words (the report's table of them)."""
    muon = baseline().name
    if name in HEADLINE.values():
        (claim,) = (c for c in CLAIMS if HEADLINE.get(c.name) == name)
        return (
            f"“{claim.label}” (`{claim.name}`): its verdict score, +1 supported … −1 contradicted, averaged "
            "over classes and models"
        )
    if name == f"{muon}_loss":
        return f"`{muon}`'s final test loss (nats, mean over seeds and the archs that compare recipes)"
    if name == "ci":
        return (
            "the widest half-width of the `d_` differences' confidence intervals (nats): a change of a "
            "difference smaller than it is noise"
        )
    if name == "envelope":
        return (
            f"the matched-budget sweep's lowest difference to `{muon}`, each recipe and `{muon}` at its best "
            "budget (nats; negative: lower loss)"
        )
    recipe = name.removeprefix("d_")
    return f"`{recipe}`'s test loss minus `{muon}`'s, paired by seed (nats; negative: lower loss than `{muon}`'s)"


def _mean(values: list[float | None]) -> float | None:
    vals = finite(values)
    return float(vals.mean()) if vals.size else None
