"""The Markdown report and its figures, from the result tables of pipeline/aggregate.py (SPEC §2, §3.3, §4.4).

``render_report(tables_dir, out_md, figures_dir, provenance)`` writes ``out_md`` with the sections Setup &
provenance, Study B, Study A and Claims, and PNG figures into ``figures_dir`` (matplotlib's Agg canvas
through ``Figure``, so it needs no display and touches no global pyplot state). A study whose tables are
empty is reported as not run. The provenance (git revision, params hash, seeds, package versions,
hardware, data checksums) is gathered by the caller (`pipeline.core.provenance`).
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
from pipeline.results.aggregate import CLAIM_TEXT
from pipeline.results.claims import CLAIMS, combined_verdict
from pipeline.study_b.recipes import RECIPES

Row = dict[str, Any]
# One colour per recipe, in registry order (a qualitative palette: ten distinct colours).
PALETTE = ("tab:gray", "tab:blue", "tab:purple", "tab:olive", "tab:brown", "tab:red", "tab:orange", "tab:green", "tab:pink", "tab:cyan")
SEED_STYLES = ("-", "--", ":", "-.")


# ------------------------------------------------------------------------------------------- report
def render_report(tables_dir: Path, out_md: Path, figures_dir: Path, provenance: dict[str, Any]) -> None:
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
        _study_b_section(tables, figures),
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
def _study_b_section(tables: dict[str, list[Row]], figures: _Figures) -> str:
    out = ["## Study B — LM-head update geometry\n"]
    runs, curves, recipes = tables["runs"], tables["curves"], tables["recipes"]
    if not runs:
        out.append("Study B was not run: there are no training logs.\n")
        return "\n".join(out)
    archs = sorted({r["arch"] for r in runs if r["arch"]})
    out.append(
        "Recipes are compared at equal steps and tokens; only the LM head's optimizer differs between "
        "recipes other than `adamw`. Losses are in nats per token.\n"
    )
    out.append("### Final validation loss\n")
    out.append(_table(
        ["arch", "recipe", "seeds", "mean ± std", "min – max", "Δ vs muon", "Welch p vs muon", "diverged", "steps", "tokens"],
        [[r["arch"], f"`{r['recipe']}`", r["n_seeds"],
          f"{_num(r['val_loss_mean'], 4)} ± {_num(r['val_loss_std'], 2)}",
          f"{_num(r['val_loss_min'], 4)} – {_num(r['val_loss_max'], 4)}", _num(r["diff_vs_muon"]),
          _p_value(r), r["n_diverged"], r["steps"], r["tokens"]] for r in recipes],
    ))  # fmt: skip
    out.append("A significance test (Welch's t-test) needs at least 3 non-diverged seeds of both recipes.\n")
    out.append(figures.save(_final_loss_figure(recipes, runs, archs), "final_val_loss",
                            "Final validation loss per recipe: each seed (dots), mean ± std (bars)."))  # fmt: skip
    if curves:
        out.append("### Loss curves\n")
        out.append(figures.save(_curve_figure(curves, runs, archs, "val_loss", "validation loss", log=False),
                                "loss_curves", "Validation loss over training steps (colour: recipe, line style: seed)."))  # fmt: skip
        out.append("### Head step in Hilbert units\n")
        out.append(
            "`hilbert_bound` = max‖h‖ · diam(ΔW) on a fixed probe batch: the worst-case change, in nats, of any "
            "token's log-probability caused by the head step alone (SPEC §3.1), measured for every recipe. "
            "`hilbert_realized` is the largest change actually seen on the probe batch.\n"
        )
        out.append(figures.save(_curve_figure(curves, runs, archs, "hilbert_bound", "hilbert_bound (nats)", log=True),
                                "hilbert_bound", "Head step in Hilbert units (hilbert_bound) over training."))  # fmt: skip
        out.append(figures.save(_curve_figure(curves, runs, archs, "tightness", "hilbert_realized / hilbert_bound", log=False),
                                "tightness", "Tightness of the bound on exact-diameter steps (≤ 1 by SPEC §3.1)."))  # fmt: skip
        out.append(figures.save(_curve_figure(curves, runs, archs, "equi_ratio", "equi_ratio (min/max row distance)", log=False),
                                "equi_ratio", "Spread of the head update's rows: min/max pairwise distance (1 = equidistant)."))  # fmt: skip
    out.append("### Per run\n")
    out.append(_table(
        ["run", "final val loss", "median step time (s)", "median hilbert_bound", "median tightness", "max tightness",
         "median equi_ratio", "diameter"],
        [[f"`{r['run']}`", _num(r["final_val_loss"], 4), _num(r["median_step_time_s"]), _num(r["median_hilbert_bound"]),
          _num(r["median_tightness"]), _num(r["max_tightness"]), _num(r["median_equi_ratio"]),
          "row sample on some steps (lower bound)" if r["head_diam_sampled"] else "exact"] for r in runs],
    ))  # fmt: skip
    out.append(_problem_runs(runs))
    return "\n".join(out)


def _p_value(recipe_row: Row) -> str:
    if recipe_row["recipe"] == "muon":
        return "(baseline)"
    if recipe_row["p_vs_muon"] is None:
        return "not tested (< 3 seeds)"
    return _num(recipe_row["p_vs_muon"], 2)


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


def _curve_figure(curves: list[Row], runs: list[Row], archs: list[str], column: str, label: str, log: bool) -> Figure:
    """One panel per arch, one line per run (colour: recipe, line style: seed); null points skipped."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for c in curves:
        value = c[column]
        if value is not None and math.isfinite(value) and (not log or value > 0):
            xs, ys = series.setdefault(c["run"], ([], []))
            xs.append(c["step"])
            ys.append(value)
    fig, axes = _grid(len(archs))
    seeds = sorted({r["seed"] for r in runs if r["seed"] is not None})
    for ax, (arch, arch_runs) in zip(axes, _by_arch(runs, archs).items(), strict=True):
        labelled: set[str] = set()
        for r in arch_runs:
            if r["run"] in series:
                xs, ys = series[r["run"]]
                style = SEED_STYLES[seeds.index(r["seed"]) % len(SEED_STYLES)] if r["seed"] in seeds else "-"
                # One legend entry per recipe (colour); seeds are told apart by line style.
                label = None if r["recipe"] in labelled else r["recipe"]
                labelled.add(r["recipe"])
                ax.plot(xs, ys, style, color=_recipe_color(r["recipe"]), label=label, linewidth=1.2,
                        marker="." if len(xs) < 30 else None)  # fmt: skip
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


def _final_loss_figure(recipes: list[Row], runs: list[Row], archs: list[str]) -> Figure:
    fig, axes = _grid(len(archs))
    for ax, arch in zip(axes, archs, strict=True):
        rows = [r for r in recipes if r["arch"] == arch]
        names = [r["recipe"] for r in rows]
        for i, r in enumerate(rows):
            vals = [x["final_val_loss"] for x in runs if x["arch"] == arch and x["recipe"] == r["recipe"]
                    and not x["diverged"] and x["final_val_loss"] is not None]  # fmt: skip
            ax.scatter(np.full(len(vals), i) + np.linspace(-0.1, 0.1, len(vals)), vals, s=14,
                       color=_recipe_color(r["recipe"]), zorder=3)  # fmt: skip
            if r["val_loss_mean"] is not None:
                ax.errorbar(i, r["val_loss_mean"], yerr=r["val_loss_std"] or 0, fmt="_", markersize=18,
                            color="black", capsize=4, zorder=2)  # fmt: skip
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(arch)
        ax.set_ylabel("final validation loss")
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

