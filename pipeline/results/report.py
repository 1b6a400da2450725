"""The Markdown report and its figures, from the result tables of pipeline/aggregate.py (SPEC §2, §3.3, §4.4).

``render_report(tables_dir, out_md, figures_dir, provenance, tuning)`` writes ``out_md`` with the sections
Setup & provenance, Study B, Study A and Claims, and PNG figures into ``figures_dir`` (matplotlib's Agg
canvas through ``Figure``, so it needs no display and touches no global pyplot state). A study whose
tables are empty is reported as not run. The provenance (git revision, params hash, seeds, package
versions, hardware, data checksums) is gathered by the caller (`pipeline.core.provenance`), and so is the
record of the head step-size tuning (`docs/tuning.json`, written by `lmgeo tune`) that Study B's protocol
states.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from pipeline.core.contracts import RESULT_TABLES, read_result_tables
from pipeline.core.store import atomic_write
from pipeline.results.aggregate import CLAIM_TEXT, POWER, RESOLVE_NATS, SIGNIFICANCE
from pipeline.results.claims import CLAIMS, combined_verdict
from pipeline.study_b.recipes import RECIPES

Row = dict[str, Any]
# One colour per recipe, in registry order (a qualitative palette: ten distinct colours).
PALETTE = ("tab:gray", "tab:blue", "tab:purple", "tab:olive", "tab:brown", "tab:red", "tab:orange", "tab:green", "tab:pink", "tab:cyan")
SEED_STYLES = ("-", "--", ":", "-.")


# ------------------------------------------------------------------------------------------- report
def render_report(
    tables_dir: Path, out_md: Path, figures_dir: Path, provenance: dict[str, Any], tuning: dict[str, Any] | None = None
) -> None:
    """Write the report (module docstring); figures that have no data are not drawn."""
    found = read_result_tables(tables_dir) if tables_dir.is_dir() else {}
    tables = {name: found[name].to_pylist() if name in found else [] for name in RESULT_TABLES}
    figures_dir.mkdir(parents=True, exist_ok=True)
    for stale in figures_dir.glob("*.png"):
        stale.unlink()
    figures = _Figures(figures_dir, Path(os.path.relpath(figures_dir, out_md.parent)))
    parts = [
        "# lmgeo report\n",
        _setup_section(provenance),
        _study_b_section(tables, figures, tuning),
        _study_a_section(tables, figures),
        _claims_section(tables),
    ]
    atomic_write(out_md, "\n".join(parts))


class _Figures:
    """Saves figures and returns the Markdown that shows them."""

    def __init__(self, directory: Path, link_prefix: Path) -> None:
        self.directory = directory
        self.link_prefix = link_prefix

    def save(self, fig: Figure, name: str, caption: str) -> str:
        fig.savefig(self.directory / f"{name}.png", dpi=110, metadata={"Software": None})
        return f"![{caption}]({(self.link_prefix / f'{name}.png').as_posix()})\n\n*{caption}*\n"


def _grid(n_panels: int, width: float = 4.2, height: float = 3.2) -> tuple[Figure, list[Axes]]:
    cols = min(3, n_panels)
    rows = math.ceil(n_panels / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n_panels)]
    return fig, axes


# ---------------------------------------------------------------------------------------- markdown
def _num(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_num(v) if not isinstance(v, str) else v for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _bullets(mapping: dict[str, Any], indent: int = 0) -> list[str]:
    lines = []
    for key, value in mapping.items():
        pad = "  " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}- **{key}**:")
            lines += _bullets(value, indent + 1)
        elif isinstance(value, list):
            lines.append(f"{pad}- **{key}**: {', '.join(map(str, value)) if value else 'none'}")
        else:
            lines.append(f"{pad}- **{key}**: `{value}`")
    return lines


def _setup_section(provenance: dict[str, Any]) -> str:
    body = "\n".join(_bullets(provenance)) if provenance else "No provenance was recorded."
    return f"## Setup & provenance\n\n{body}\n"


# ----------------------------------------------------------------------------------------- Study B
def _study_b_section(tables: dict[str, list[Row]], figures: _Figures, tuning: dict[str, Any] | None) -> str:
    out = ["## Study B — LM-head update geometry\n"]
    runs, curves, recipes = tables["runs"], tables["curves"], tables["recipes"]
    if not runs:
        out.append("Study B was not run: there are no training logs.\n")
        return "\n".join(out)
    archs = sorted({r["arch"] for r in runs if r["arch"]})
    out.append(_protocol(runs, recipes, tuning))
    out.append("### Test loss, and the paired difference to `muon`\n")
    out.append(_comparison_table(recipes))
    out.append(figures.save(_final_loss_figure(recipes, runs, archs), "final_test_loss",
                            "Final test loss per recipe: each seed (dots), mean and its 95% t-interval (bars)."))  # fmt: skip
    out.append("### Head step geometry\n")
    out.append(_geometry_table(runs))
    out.append(_equidistance_statement(runs))
    if curves:
        out.append("### Curves\n")
        out.append(figures.save(_curve_figure(curves, runs, archs, "val_loss", "validation loss", log=False),
                                "loss_curves", "Validation loss over training steps (colour: recipe, line style: seed)."))  # fmt: skip
        out.append(
            "`hilbert_bound` = max‖h‖ · diam(ΔW) on a fixed probe batch: the worst-case change, in nats, of any "
            "token's log-probability caused by the head step alone (SPEC §3.1), measured for every recipe. "
            "`hilbert_realized` is the largest change actually seen on the probe batch.\n"
        )
        out.append(figures.save(_curve_figure(curves, runs, archs, "hilbert_bound", "hilbert_bound (nats)", log=True),
                                "hilbert_bound", "Head step in Hilbert units (hilbert_bound) over training."))  # fmt: skip
        out.append(figures.save(_curve_figure(curves, runs, archs, "tightness", "hilbert_realized / hilbert_bound", log=False),
                                "tightness", "Tightness of the bound on exact-diameter steps (≤ 1 by SPEC §3.1)."))  # fmt: skip
        out.append(figures.save(_curve_figure(curves, runs, archs, "equi_ratio", "equi_ratio (min/max row distance)",
                                              log=False, reference="equi_ratio_random"),
                                "equi_ratio", "Spread of the head update's rows: min/max pairwise distance on a fixed "
                                "row sample (1 = equidistant); dotted: random unit rows of the same shape."))  # fmt: skip
    out.append("### Per run\n")
    out.append(_table(
        ["run", "head step", "final test loss", "final val loss", "median step time (s)", "median hilbert_bound",
         "max tightness", "median equi_ratio", "diameter"],
        [[f"`{r['run']}`", r["head_step"] or "–", _num(r["final_test_loss"], 4), _num(r["final_val_loss"], 4),
          _num(r["median_step_time_s"]), _num(r["median_hilbert_bound"]), _num(r["max_tightness"]),
          _num(r["median_equi_ratio"]),
          "row sample on some steps (lower bound)" if r["head_diam_sampled"] else "exact"] for r in runs],
    ))  # fmt: skip
    out.append(_problem_runs(runs))
    return "\n".join(out)


def _protocol(runs: list[Row], recipes: list[Row], tuning: dict[str, Any] | None) -> str:
    """What an optimizer researcher needs to trust the comparison (SPEC §3.2): splits, seeds and what they
    resolve, the tuning budget, and whether step sizes were matched."""
    seeds = sorted({r["seed"] for r in runs if r["seed"] is not None})
    lines = [
        "### Protocol\n",
        "- **Splits.** The corpus is split by document into train, val and test. Tuning and every early decision "
        "(the loss curves) use val; the test split is read once per run, after its last step, and is what recipes "
        "are compared on here. No tuning run evaluates test.",
        f"- **Seeds.** {len(seeds)} seeds ({', '.join(map(str, seeds))}) for every recipe; a seed fixes the "
        "initialisation and the order of the training batches, so recipes are compared *paired* on the same seeds "
        "(the seed's own effect cancels). Only the LM head's optimizer differs between recipes other than `adamw`; "
        "all run the same steps and tokens.",
        _power_statement(recipes),
        _tuning_statement(tuning, runs),
        _budget_statement(runs),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _power_statement(recipes: list[Row]) -> str:
    """The measured seed SD and paired SD, what the seeds resolve, and what RESOLVE_NATS would need."""
    parts = []
    for arch in sorted({r["arch"] for r in recipes}):
        rows = [r for r in recipes if r["arch"] == arch]
        sd = _pooled([r["test_loss_sd"] for r in rows])
        paired = [r for r in rows if r["diff_sd"] is not None]
        if sd is None or not paired:
            continue
        needed = [r["seeds_to_resolve"] for r in paired if r["seeds_to_resolve"] is not None]
        parts.append(
            f"{arch}: seed-to-seed SD of the test loss {_num(sd, 2)} nats (pooled over recipes), SD of the paired "
            f"difference to `muon` {_num(_pooled([r['diff_sd'] for r in paired]), 2)}; with "
            f"{min(r['n_paired'] for r in paired)} paired seeds a difference of "
            f"{_num(_median([r['detectable_diff'] for r in paired]), 2)} nats is detected with power {POWER:g} "
            f"(paired t-test, α = {SIGNIFICANCE:g}; median over recipes); resolving {RESOLVE_NATS:g} nats needs "
            f"{max(needed) if needed else 'more than 10,000'} seeds for the noisiest comparison (per recipe below)"
        )
    if not parts:
        return "- **Power.** Not measured: fewer than two paired seeds."
    return "- **Power.** " + "; ".join(parts) + "."


def _tuning_statement(tuning: dict[str, Any] | None, runs: list[Row]) -> str:
    if not tuning:
        return "- **Tuning.** No record of the head step-size sweep (`docs/tuning.json`) was found."
    p = tuning["protocol"]
    per_recipe = {}
    for t in tuning["trials"]:
        if t["arch"] == p["arch"]:
            per_recipe.setdefault(t["recipe"], set()).add((t["knob"], t["value"]))
    budgets = sorted({len(v) for v in per_recipe.values()})
    chosen = {recipe: f"{c['knob']}={c['value']:g}" for recipe, c in tuning["chosen"].items() if c}
    used = {r["recipe"]: r["head_step"] for r in runs if r["head_step"]}
    differing = sorted(r for r, step in used.items() if r in chosen and chosen[r] != step)
    steps = sorted({r["steps"] for r in runs if r["steps"]})
    horizon = f"{p['steps']} steps, as here" if steps == [p["steps"]] else f"{p['steps']} steps (here: {steps})"
    transfer = f" Transfer to other architectures: {p['transfer']}." if p.get("transfer") else ""
    used_note = ("Every recipe ran at its tuned step." if not differing else "Not at the tuned step here: "
                 + ", ".join(f"`{r}` ({used[r]}, tuned {chosen[r]})" for r in differing) + ".")  # fmt: skip
    return (
        f"- **Tuning** (`lmgeo tune`, `docs/tuning.md`). Every recipe's head step size, the baselines' included, "
        f"was chosen on `{p['arch']}` with the same budget: {' or '.join(map(str, budgets))} step sizes per recipe "
        f"({p['grid']}), each trained with seeds {', '.join(map(str, p['seeds']))} (not the study's) for {horizon}, "
        f"selected on the final **val** loss (mean over seeds; a divergence counts as +∞).{transfer} {used_note}"
    )


def _budget_statement(runs: list[Row]) -> str:
    budgets = {r["head_budget_tau"] for r in runs if r["finished"]} - {None}
    if budgets:
        taus = ", ".join(map(_num, sorted(budgets)))
        return (
            "- **Step size vs direction.** This study is the **matched-budget ablation**: every recipe's realised "
            f"head step was scaled down where needed to diam(ΔW) ≤ tau_t / r_t with tau = {taus} nats on the run's "
            "schedule (r_t = max ‖h‖ of the batch), so recipes compare at equal worst-case nats per step; the "
            "geometry table gives the fraction of steps the cap bound."
        )
    return (
        "- **Step size vs direction.** Recipes take their own tuned step sizes, so their steps differ in size as well "
        "as direction (`hilbert_bound` below). The matched-budget ablation caps every head step at the same "
        "worst-case Hilbert budget: `dvc exp run $(lmgeo preset presets/matched_budget.yaml)`."
    )


def _equidistance_statement(runs: list[Row]) -> str:
    """The seed's proposal in two numbers per arch: how evenly `hilbert_equi` spreads the rows against random
    unit rows, and how much of `hilbert`'s descent per unit of diameter it keeps."""
    parts = []
    for arch in sorted({r["arch"] for r in runs if r["arch"]}):
        equi, plain = (_medians([r for r in runs if r["arch"] == arch and r["recipe"] == name])
                       for name in ("hilbert_equi", "hilbert"))  # fmt: skip
        if equi["median_equi_ratio"] is None or equi["median_equi_ratio_random"] is None:
            continue
        part = (f"{arch}: `hilbert_equi`'s equi_ratio {_num(equi['median_equi_ratio'])} against "
                f"{_num(equi['median_equi_ratio_random'])} for random unit rows (`hilbert` {_num(plain['median_equi_ratio'])})")
        kept = _ratio(equi["median_head_alignment_hilbert"], plain["median_head_alignment_hilbert"])
        parts.append(part + (f"; it keeps {_num(kept, 2)} of `hilbert`'s descent per unit diameter" if kept else ""))
    if not parts:
        return ""
    return ("**The equidistance LMO.** " + "; ".join(parts) + ". By construction every row keeps at least "
            "`equi_alignment` of its alignment with the momentum, so ⟨M, ΔW⟩ ≥ c·⟨M, ΔW_hilbert⟩ (SPEC §3.2).\n")


def _medians(runs: list[Row]) -> dict[str, float | None]:
    """Per geometry column, the median over runs of each run's median."""
    return {c: _median([r[c] for r in runs]) for c in GEOMETRY_COLUMNS}


def _median(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(finite)) if finite else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _pooled(sds: Sequence[float | None]) -> float | None:
    finite = [s for s in sds if s is not None and math.isfinite(s)]
    return float(np.sqrt(np.mean(np.square(finite)))) if finite else None


def _comparison_table(recipes: list[Row]) -> str:
    rows = [[r["arch"], f"`{r['recipe']}`", r["head_step"] or "–", r["n_seeds"],
             f"{_num(r['test_loss_mean'], 4)} [{_num(r['test_loss_ci_low'], 4)}, {_num(r['test_loss_ci_high'], 4)}]",
             _difference(r), _p_value(r, "p_vs_muon"), _p_value(r, "p_vs_muon_holm"), _num(r["detectable_diff"], 2),
             _num(r["seeds_to_resolve"]), r["n_diverged"]] for r in recipes]  # fmt: skip
    header = ["arch", "recipe", "head step", "seeds", "test loss [95% CI]", "Δ vs muon, paired [95% CI]",
              "p (paired t)", "Holm p", f"detectable Δ (power {POWER:g})", f"seeds for {RESOLVE_NATS:g} nats",
              "diverged"]  # fmt: skip
    note = (f"Δ < 0: lower test loss than `muon` on the same seeds. Holm adjusts each arch's comparisons together. "
            f"*Detectable Δ*: the difference these seeds detect with power {POWER:g} at the measured SD of the paired "
            f"differences; *seeds for {RESOLVE_NATS:g} nats*: how many seeds that would take.\n")  # fmt: skip
    return _table(header, rows) + "\n" + note


def _difference(r: Row) -> str:
    if r["diff_vs_muon"] is None:
        return "(baseline)" if r["recipe"] == "muon" else "–"
    return f"{_num(r['diff_vs_muon'], 3)} [{_num(r['diff_ci_low'], 3)}, {_num(r['diff_ci_high'], 3)}]"


def _p_value(recipe_row: Row, column: str) -> str:
    if recipe_row["recipe"] == "muon":
        return "(baseline)"
    if recipe_row[column] is None:
        return "not tested (< 3 paired seeds)"
    return _num(recipe_row[column], 2)


GEOMETRY_COLUMNS = ("median_hilbert_bound", "median_hilbert_realized_train", "median_head_alignment",
                    "median_head_alignment_hilbert", "median_equi_ratio", "median_equi_ratio_random",
                    "frac_steps_capped")  # fmt: skip


def _geometry_table(runs: list[Row]) -> str:
    """Per arch × recipe, medians over runs of each run's median over logged steps."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in runs:
        if r["arch"] and r["recipe"]:
            groups.setdefault((r["arch"], r["recipe"]), []).append(r)
    ordered = sorted(groups.items(), key=lambda g: (g[0][0], RECIPES.order(g[0][1])))
    rows = [[arch, f"`{recipe}`", *(_median([r[c] for r in rs]) for c in GEOMETRY_COLUMNS)]
            for (arch, recipe), rs in ordered]  # fmt: skip
    header = ["arch", "recipe", "hilbert_bound (nats)", "d_H on its training batch", "cos(ΔW, −G)",
              "descent per unit diam / hilbert's", "equi_ratio", "random unit rows", "steps capped"]  # fmt: skip
    note = ("Medians over logged steps, then over seeds. *d_H on its training batch*: the largest change of a token's "
            "log-probability the head step made on the batch it was computed from (at most tau_t for the tau recipes, "
            "weight decay included). *cos(ΔW, −G)*: alignment with that "
            "batch's head gradient G; *descent per unit diam*: −⟨G, ΔW⟩ / (½·diam(ΔW)·Σ‖g̃_i‖), about 1 for the "
            "`hilbert` step of G itself and at most √(2d/(d+1)) for any step (SPEC §3.3). *equi_ratio*: min/max row "
            "distance of ΔW on a fixed row sample, against random unit rows of the same shape; no configuration of "
            f"that shape exceeds {_num(_median([r['median_equi_ratio_bound'] for r in runs]))} (SPEC §3.1).\n")  # fmt: skip
    return _table(header, rows) + "\n" + note


def _problem_runs(runs: list[Row]) -> str:
    diverged = [f"`{r['run']}` (non-finite loss at step {_num(r['diverged_at_step'])})" for r in runs if r["diverged"]]
    unfinished = [f"`{r['run']}`" for r in runs if not r["finished"]]
    lines = [f"**Diverged runs**: {', '.join(diverged) if diverged else 'none'}."]
    if unfinished:
        lines.append(f"**Runs without a final `run.json`** (stopped early; logged steps only): {', '.join(unfinished)}.")
    return "\n\n".join(lines) + "\n"


def _by_arch(runs: list[Row], archs: list[str]) -> dict[str, list[Row]]:
    return {a: sorted((r for r in runs if r["arch"] == a), key=lambda r: (RECIPES.order(r["recipe"]), r["seed"] or 0)) for a in archs}


def _recipe_color(recipe: str) -> str:
    order = RECIPES.order(recipe)[0]
    return PALETTE[order % len(PALETTE)] if recipe in RECIPES else "black"


def _curve_figure(curves: list[Row], runs: list[Row], archs: list[str], column: str, label: str, log: bool,
                  reference: str | None = None) -> Figure:  # fmt: skip
    """One panel per arch, one line per run (colour: recipe, line style: seed); null points skipped. A
    `reference` column (one level per run) is drawn as a dotted grey line at its median."""
    series = _series(curves, column, positive=log)
    fig, axes = _grid(len(archs))
    seeds = sorted({r["seed"] for r in runs if r["seed"] is not None})
    for ax, (arch, arch_runs) in zip(axes, _by_arch(runs, archs).items(), strict=True):
        labelled: set[str] = set()
        for r in arch_runs:
            if r["run"] in series:
                xs, ys = series[r["run"]]
                style = SEED_STYLES[seeds.index(r["seed"]) % len(SEED_STYLES)] if r["seed"] in seeds else "-"
                # One legend entry per recipe (colour); seeds are told apart by line style.
                legend = None if r["recipe"] in labelled else r["recipe"]
                labelled.add(r["recipe"])
                ax.plot(xs, ys, style, color=_recipe_color(r["recipe"]), label=legend, linewidth=1.2,
                        marker="." if len(xs) < 30 else None)  # fmt: skip
        if reference is not None:
            runs_here = {r["run"] for r in arch_runs}
            level = _median([c[reference] for c in curves if c["run"] in runs_here])
            if level is not None:
                ax.axhline(level, color="gray", linestyle=":", linewidth=1.2, label="random unit rows")
        ax.set_title(arch)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    return fig


def _series(curves: list[Row], column: str, positive: bool) -> dict[str, tuple[list[int], list[float]]]:
    """run → (steps, values) of `column`, skipping nulls, non-finite values and (for log axes) values ≤ 0."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for c in curves:
        value = c[column]
        if value is not None and math.isfinite(value) and (not positive or value > 0):
            xs, ys = series.setdefault(c["run"], ([], []))
            xs.append(c["step"])
            ys.append(value)
    return series


def _final_loss_figure(recipes: list[Row], runs: list[Row], archs: list[str]) -> Figure:
    fig, axes = _grid(len(archs))
    for ax, arch in zip(axes, archs, strict=True):
        rows = [r for r in recipes if r["arch"] == arch]
        names = [r["recipe"] for r in rows]
        for i, r in enumerate(rows):
            vals = [x["final_test_loss"] for x in runs if x["arch"] == arch and x["recipe"] == r["recipe"]
                    and not x["diverged"] and x["final_test_loss"] is not None]  # fmt: skip
            ax.scatter(np.full(len(vals), i) + np.linspace(-0.1, 0.1, len(vals)), vals, s=14,
                       color=_recipe_color(r["recipe"]), zorder=3)  # fmt: skip
            mean, low, high = r["test_loss_mean"], r["test_loss_ci_low"], r["test_loss_ci_high"]
            if mean is not None:
                spread = [[mean - low], [high - mean]] if low is not None else None
                ax.errorbar(i, mean, yerr=spread, fmt="_", markersize=18, color="black", capsize=4, zorder=2)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(arch)
        ax.set_ylabel("final test loss")
        ax.grid(axis="y", alpha=0.3)
    return fig


# ----------------------------------------------------------------------------------------- Study A
_NULL_TEXT = {
    "shuffled": "shuffled pairs", "gaussian": "Gaussian pool", "random": "random-direction patch",
    "other": "other anchor's residual", "zero": "zero",
}  # fmt: skip


def _study_a_section(tables: dict[str, list[Row]], figures: _Figures) -> str:
    out = ["## Study A — layer-update geometry\n"]
    tests, geometry, corr = tables["claim_tests"], tables["geometry"], tables["correlations"]
    if not geometry:
        out.append("Study A was not run: there are no fits.\n")
        return "\n".join(out)
    out.append(
        "For each model and layer a tokenwise map T is fitted on each anchor's nearest neighbours; the update "
        "Δ_full = h_{l+1} − h_l splits into Δ_tok = T(h_l) − h_l and a residual r (SPEC §4.2). Every claim of the "
        "seed is tested against a null (SPEC §4.5): the geometric ones against the same fits on *shuffled pairs* "
        "(h_{l+1} permuted across the pool) and on a *Gaussian pool* with the same mean and covariance; the "
        "functional ones against patches of the same norm ‖r‖ in a random direction or along another anchor's "
        "residual. The effect is statistic − null (positive = the claim's direction), averaged over layers and "
        "over the seeds of an architecture (each (model, layer) resampled on its own, never pooled), with a 95% "
        "bootstrap interval. **Supported**: the interval is above 0; **not supported**: it lies below the "
        "claim's margin (the smallest effect worth the name); **inconclusive**: otherwise.\n"
    )
    stratified = [t for t in tests if t["scope"] == "stratified"]
    if stratified:
        out.append("### What was found\n")
        out.append(_findings(stratified))
        out.append("### Each claim against its nulls\n")
        out.append("Per architecture at `final` (trained) and `init` (random weights, distinct initialisations "
                   "only); `n` anchors over layers and seeds.\n")  # fmt: skip
        for claim in CLAIMS:
            rows = [t for t in stratified if t["claim"] == claim.name]
            if rows:
                out.append(f"**`{claim.name}`** — {claim.text}. Seed: {claim.seed_value}; margin {_num(claim.margin)}.\n")
                out.append(_claim_table(rows))
    out.append(_well_posed(geometry))
    if any(c["scope"] == "layer" for c in corr):
        models = sorted({c["model"] for c in corr})
        out.append("### Spearman per layer\n")
        out.append(figures.save(_spearman_figure(corr, models), "spearman_layers",
                                "Spearman(rel_err, kl) per layer with bootstrap CI, per model and class."))  # fmt: skip
    if tables["angles"]:
        models = sorted({a["model"] for a in tables["angles"]})
        out.append(figures.save(_angle_figure(tables["angles"], models), "angles",
                                "Distribution of angle_res_tok per model (one line per class), real pairs."))  # fmt: skip
    return "\n".join(out)


def _subject_parts(subject: str) -> tuple[str, str]:
    arch, _, checkpoint = subject.partition("@")
    return arch, checkpoint or "–"


def _findings(stratified: list[Row]) -> str:
    """One plain sentence per claim: where it is supported, not supported, inconclusive (all nulls combined)."""
    lines = []
    for claim in CLAIMS:
        verdicts: dict[tuple[str, str], list[str]] = {}
        for t in stratified:
            if t["claim"] == claim.name:
                verdicts.setdefault((t["subject"], t["fn"]), []).append(t["verdict"])
        if not verdicts:
            continue
        by_verdict: dict[str, list[str]] = {}
        for (subject, fn), vs in sorted(verdicts.items()):
            by_verdict.setdefault(combined_verdict(vs), []).append(f"{subject} {fn}")
        parts = [f"{verdict} for {', '.join(where)}" for verdict, where in sorted(by_verdict.items())]
        lines.append(f"- **{claim.name}** ({claim.text}): " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n\nA claim counts as supported for a model and class only when it is supported against every null.\n"


def _claim_table(rows: list[Row]) -> str:
    nulls = list(dict.fromkeys(r["null"] for r in rows))
    at = {(r["subject"], r["fn"], r["null"]): r for r in rows}
    keys = sorted({(_subject_parts(r["subject"])[0], r["fn"]) for r in rows})
    header = ["arch", "class", "statistic (final)", "n"]
    for null in nulls:
        header += [f"vs {_NULL_TEXT.get(null, null)}: effect [95% CI]", "final", "init"]
    body = []
    for arch, fn in keys:
        final = [at.get((f"{arch}@final", fn, null)) or at.get((arch, fn, null)) for null in nulls]
        init = [at.get((f"{arch}@init", fn, null)) for null in nulls]
        first = next((r for r in final if r), None)
        row = [f"`{arch}`", fn, _num(first["statistic"]) if first else "–", first["n"] if first else "–"]
        for f, i in zip(final, init, strict=True):
            row += [_effect(f), f["verdict"] if f else "–", i["verdict"] if i else "–"]
        body.append(row)
    return _table(header, body)


def _effect(r: Row | None) -> str:
    if not r:
        return "–"
    return f"{_num(r['effect'])} [{_num(r['ci_low'])}, {_num(r['ci_high'])}] (null {_num(r['null_statistic'])})"


def _well_posed(geometry: list[Row]) -> str:
    """Per layer, real pairs: distinct inputs in the pool against 10·k, degenerate neighbourhoods and tied
    subspaces per class, and cos_full_tok beside the bound √(1 − rel_err²) that rel_err alone implies."""
    out = ["### Are the fits well posed?\n",
           "Per model and layer (real pairs): `distinct` = distinct h_l in the pool (SPEC asks ≥ 10·k); per class, "
           "the share of anchors whose neighbourhood cannot identify the map (`degenerate`: too few independent "
           "neighbour inputs, or all copies of the anchor's; their values are null and left out) and whose top-p "
           "subspace splits a tie. `cos_full_tok ≥ √(1 − rel_err²)` always holds, so the alignment claim is "
           "shown beside that bound (median over anchors): it is no evidence beyond a small residual.\n"]  # fmt: skip
    real = [g for g in geometry if g["sample"] == "real"]
    fns = list(dict.fromkeys(g["fn"] for g in real))
    at = {(g["model"], g["layer"], g["fn"]): g for g in real}
    rows = []
    for model, layer in sorted({(g["model"], g["layer"]) for g in real}):
        first = next(at[(model, layer, fn)] for fn in fns if (model, layer, fn) in at)
        row = [f"`{model}`", layer, f"{first['n_distinct']} (10·k = {10 * first['k']})"]
        for fn in fns:
            g = at.get((model, layer, fn))
            row.append("–" if g is None else
                       f"{g['n_degenerate'] / g['n']:.0%} / {g['n_subspace_tied'] / g['n']:.0%} / "
                       f"{_num(g['median_cos_full_tok'])} ≥ {_num(g['median_cos_bound'])}")  # fmt: skip
        rows.append(row)
    out.append(_table(["model", "layer", "distinct inputs"] + [f"{fn}: degenerate / tied / cos ≥ bound" for fn in fns], rows))
    return "\n".join(out)


def _angle_figure(angles: list[Row], models: list[str]) -> Figure:
    fig, axes = _grid(len(models))
    for ax, model in zip(axes, models, strict=True):
        rows = [a for a in angles if a["model"] == model]
        for fn in sorted({a["fn"] for a in rows}):
            bins = [a for a in rows if a["fn"] == fn]
            ax.step([b["bin_lo"] for b in bins] + [bins[-1]["bin_hi"]], [b["fraction"] for b in bins] + [bins[-1]["fraction"]],
                    where="post", label=fn)  # fmt: skip
        ax.axvline(60, color="gray", linestyle=":", linewidth=1)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("angle_res_tok (degrees)")
        ax.set_ylabel("fraction of anchors")
        ax.set_xlim(0, 180)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    return fig


def _spearman_figure(corr: list[Row], models: list[str]) -> Figure:
    fig, axes = _grid(len(models))
    for ax, model in zip(axes, models, strict=True):
        rows = [c for c in corr if c["model"] == model and c["scope"] == "layer" and c["spearman"] is not None]
        fns = sorted({c["fn"] for c in rows})
        for i, fn in enumerate(fns):
            pts = sorted((c for c in rows if c["fn"] == fn), key=lambda c: c["layer"])
            # Classes are dodged sideways so that equal values and their CIs stay visible.
            x = np.array([c["layer"] for c in pts]) + 0.08 * (i - (len(fns) - 1) / 2)
            y = np.array([c["spearman"] for c in pts])
            lo = np.array([c["ci_low"] if c["ci_low"] is not None else c["spearman"] for c in pts])
            hi = np.array([c["ci_high"] if c["ci_high"] is not None else c["spearman"] for c in pts])
            ax.errorbar(x, y, yerr=[y - lo, hi - y], marker="o", markersize=3, capsize=3, label=fn)
        ax.axhline(0.7, color="gray", linestyle=":", linewidth=1)
        ax.set_ylim(-1.05, 1.05)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("Spearman(rel_err, kl)")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.legend(fontsize=7)
    return fig


# -------------------------------------------------------------------------------------------- claims
_VERDICT: dict[bool | None, str] = {True: "holds", False: "does not hold", None: "not measured"}


def _claims_section(tables: dict[str, list[Row]]) -> str:
    claims = tables["claims"]
    out = ["## Claims as measured here\n"]
    out.append("Study A's claims are tested against their nulls in the Study A section above.\n")
    out.append("Study B:\n")
    b_rows = [c for c in claims if c["study"] == "B"]
    if b_rows:
        out.append(_table(["arch", "recipe", "claim", "measured", "verdict", "detail"],
                          [[c["subject"], c["fn"], c["claim"], _num(c["value"]), _VERDICT[c["holds"]], c["detail"]]
                           for c in b_rows]))  # fmt: skip
    else:
        out.append("Not measured: Study B was not run.\n")
    out.append("Claims:\n\n" + "\n".join(f"- `{name}`: {text}" for name, text in CLAIM_TEXT.items()) + "\n")
    return "\n".join(out)

