"""The report's figures, one per question, from the rows of the result tables (SPEC §2).

Each function returns a matplotlib ``Figure`` (the Agg canvas through ``Figure``: no display, no global
pyplot state) or None when it has nothing to draw. Panels are small multiples by architecture (or subject),
lines by recipe: a figure stays readable whatever the number of seeds. Every axis is labelled from the
quantity it draws (``Axis``), never from a loop variable, and ``axis_labels`` reads the labels back from the
drawn figure so that a test can compare them with what each panel plots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.text import Text

from pipeline.results.claims import CLAIM_NAMES, VERDICT_SCORE, combined_verdict
from pipeline.study_b.baseline import baseline
from pipeline.study_b.recipes import RECIPES

Row = dict[str, Any]
# One colour per recipe, in registry order (a qualitative palette: ten distinct colours).
PALETTE = ("tab:gray", "tab:blue", "tab:purple", "tab:olive", "tab:brown", "tab:red", "tab:orange", "tab:green",
           "tab:pink", "tab:cyan")  # fmt: skip


@dataclass(frozen=True)
class Axis:
    """A plotted quantity: the column it reads and the label its axis carries."""

    column: str
    label: str
    log: bool = False


VAL_LOSS = Axis("val_loss", "validation loss (nats)")
HEAD_STEP = (
    Axis("hilbert_bound", "hilbert_bound: worst-case nats per step", log=True),
    Axis("tightness", "hilbert_realized / hilbert_bound"),
    Axis("equi_ratio", "equi_ratio (min / max row distance)"),
)
STEP = "training step"


def axis_labels(fig: Figure) -> list[dict[str, Any]]:
    """Title, x and y label of every panel that has data (colour bars excluded), as drawn, and whether all
    three lie inside the figure (a long label is cut off at the edge, unreadable)."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    box = fig.bbox

    def inside(text: Text) -> bool:
        extent = text.get_window_extent(renderer)
        return not text.get_text() or (extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1 and
                                       extent.y0 >= box.y0 - 1 and extent.y1 <= box.y1 + 1)  # fmt: skip

    return [{"title": ax.get_title(), "x": ax.get_xlabel(), "y": ax.get_ylabel(),
             "inside": all(inside(t) for t in (ax.title, ax.xaxis.label, ax.yaxis.label))}
            for ax in fig.axes if ax.has_data() and not hasattr(ax, "_colorbar")]  # fmt: skip


def _grid(rows: int, cols: int, width: float = 4.0, height: float = 3.0) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = np.array([[fig.add_subplot(rows, cols, r * cols + c + 1) for c in range(cols)] for r in range(rows)])
    return fig, axes


def _recipe_color(recipe: str) -> str:
    return PALETTE[RECIPES.order(recipe)[0] % len(PALETTE)] if recipe in RECIPES else "black"


def _archs(rows: Sequence[Row]) -> list[str]:
    return sorted({r["arch"] for r in rows if r["arch"]})


def _recipes(rows: Sequence[Row]) -> list[str]:
    return sorted({r["recipe"] for r in rows if r["recipe"]}, key=RECIPES.order)


# ------------------------------------------------------------------------------------------ Study B
def vs_muon(recipes: Sequence[Row], runs: Sequence[Row]) -> Figure | None:
    """Does any head recipe beat `muon`? Per arch: each recipe's paired difference of the final test loss to
    `muon` on the same seed (dots), its mean and t-interval (bar)."""
    reference = baseline().name
    archs = [a for a in _archs(recipes) if any(r["arch"] == a and r["diff_vs_muon"] is not None for r in recipes)]
    if not archs:
        return None
    fig, axes = _grid(1, len(archs), width=4.6, height=0.45 * len(_recipes(recipes)) + 1.4)
    for ax, arch in zip(axes[0], archs, strict=True):
        base = _test_loss_by_seed(runs, arch, reference)
        rows = [r for r in recipes if r["arch"] == arch and r["recipe"] != reference]
        for y, r in enumerate(rows):
            mine = _test_loss_by_seed(runs, arch, r["recipe"])
            diffs = [mine[s] - base[s] for s in sorted(mine.keys() & base.keys())]
            ax.scatter(diffs, np.full(len(diffs), y), s=12, color=_recipe_color(r["recipe"]), alpha=0.7, zorder=3)
            if r["diff_vs_muon"] is not None and r["diff_ci_low"] is not None:
                spread = [[r["diff_vs_muon"] - r["diff_ci_low"]], [r["diff_ci_high"] - r["diff_vs_muon"]]]
                ax.errorbar(r["diff_vs_muon"], y, xerr=spread, fmt="o", color="black", capsize=4, zorder=4)
        ax.axvline(0, color="gray", linewidth=1)
        ax.set_yticks(range(len(rows)), [r["recipe"] for r in rows])
        ax.invert_yaxis()
        ax.set_title(arch)
        ax.set_xlabel(f"final test loss − {reference}'s, same seed (nats)")
        ax.set_ylabel("head recipe")
        ax.grid(axis="x", alpha=0.3)
    return fig


def _test_loss_by_seed(runs: Sequence[Row], arch: str, recipe: str) -> dict[int, float]:
    mine = [r for r in runs if r["arch"] == arch and r["recipe"] == recipe and not r["diverged"]]
    return {r["seed"]: r["final_test_loss"] for r in mine if r["final_test_loss"] is not None}


def val_loss(curves: Sequence[Row], runs: Sequence[Row]) -> Figure | None:
    """How does training progress? Per arch, the validation loss per recipe (mean over seeds)."""
    return _curves_by_recipe(curves, runs, [VAL_LOSS])


def head_step(curves: Sequence[Row], runs: Sequence[Row]) -> Figure | None:
    """How large are the head steps in Hilbert units, how tight is the bound, how evenly are the update's
    rows spread? Columns: those quantities; rows: archs; lines: recipes (median over seeds). The dotted line
    of the equi_ratio panel is random unit rows of the same shape."""
    return _curves_by_recipe(curves, runs, list(HEAD_STEP), reference={"equi_ratio": "equi_ratio_random"})


def _curves_by_recipe(curves: Sequence[Row], runs: Sequence[Row], quantities: list[Axis],
                      reference: dict[str, str] | None = None) -> Figure | None:  # fmt: skip
    run_of = {r["run"]: r for r in runs}
    archs = _archs(runs)
    if not archs or not any(c[q.column] is not None for c in curves for q in quantities):
        return None
    fig, axes = _grid(len(archs), len(quantities))
    for row, arch in zip(axes, archs, strict=True):
        for ax, quantity in zip(row, quantities, strict=True):
            here = [c for c in curves if c["run"] in run_of and run_of[c["run"]]["arch"] == arch]
            for recipe in _recipes([run_of[c["run"]] for c in here]):
                steps, values = _median_curve([c for c in here if run_of[c["run"]]["recipe"] == recipe], quantity)
                if steps:
                    ax.plot(steps, values, color=_recipe_color(recipe), label=recipe, linewidth=1.3,
                            marker="." if len(steps) < 30 else None)  # fmt: skip
            level_of = (reference or {}).get(quantity.column)
            level = _median([c[level_of] for c in here]) if level_of else None
            if level is not None:
                ax.axhline(level, color="gray", linestyle=":", linewidth=1.2, label="random unit rows")
            _label(ax, arch, STEP, quantity)
    return fig


def _median_curve(curves: Sequence[Row], quantity: Axis) -> tuple[list[int], list[float]]:
    """Per step, the median over runs of the finite (positive on a log axis) values."""
    by_step: dict[int, list[float]] = {}
    for c in curves:
        v = c[quantity.column]
        if v is not None and math.isfinite(v) and (v > 0 or not quantity.log):
            by_step.setdefault(c["step"], []).append(v)
    steps = sorted(by_step)
    return steps, [float(np.median(by_step[s])) for s in steps]


def _label(ax: Axes, title: str, x: str, quantity: Axis) -> None:
    ax.set_title(title)
    ax.set_xlabel(x)
    ax.set_ylabel(quantity.label)
    if quantity.log and ax.has_data():
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)


def _median(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(finite)) if finite else None


# ------------------------------------------------------------------------------------------ Study A
# Not supported, inconclusive, supported: a diverging scale, the mixed cells (classes disagree) in between.
VERDICT_COLORS = ListedColormap(["#c0392b", "#e8a598", "#f2f2f2", "#9ec5e8", "#2471a3"])
LAYER = "layer"


def claims_by_layer(tests: Sequence[Row]) -> Figure | None:
    """Where does each claim hold? One heat map per subject (rows: architectures or models; columns: `final`
    and `init`): claims × layers, coloured by the verdict averaged over classes (+1 supported, −1 not
    supported; each class's verdict combined over the claim's nulls)."""
    per_layer = [t for t in tests if t["scope"] == "layer"]
    if not per_layer:
        return None
    subjects = sorted({t["subject"] for t in per_layer})
    bases = sorted({s.rsplit("@", 1)[0] for s in subjects})
    checkpoints = [c for c in ("final", "init") if any(s.endswith(f"@{c}") for s in subjects)] or [""]
    layers = sorted({t["layer"] for t in per_layer})
    claims = [c for c in CLAIM_NAMES if any(t["claim"] == c for t in per_layer)]
    fig, axes = _grid(len(bases), len(checkpoints), width=0.5 * len(layers) + 3.6, height=0.3 * len(claims) + 1.2)
    for row, base in zip(axes, bases, strict=True):
        for ax, checkpoint in zip(row, checkpoints, strict=True):
            # An external model has no checkpoint: it takes the first column.
            subject = f"{base}@{checkpoint}"
            if subject not in subjects and checkpoint == checkpoints[0]:
                subject = base
            grid = _verdict_grid([t for t in per_layer if t["subject"] == subject], claims, layers)
            if np.isnan(grid).all():
                ax.axis("off")
                continue
            image = ax.imshow(np.ma.masked_invalid(grid), cmap=VERDICT_COLORS, vmin=-1, vmax=1, aspect="auto")
            ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
            ax.set_yticks(range(len(claims)), claims if ax is row[0] else [""] * len(claims), fontsize=8)
            ax.set_title(subject, fontsize=9)
            ax.set_xlabel(LAYER)
            ax.set_ylabel("claim" if ax is row[0] else "")
    # One tick per colour band (the map has five bands of width 0.4 over [-1, 1]).
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), ticks=[-0.8, -0.4, 0, 0.4, 0.8], shrink=0.6)
    bar.ax.set_yticklabels(["not supported", "leaning not supported", "inconclusive", "leaning supported", "supported"])
    return fig


def _verdict_grid(tests: Sequence[Row], claims: list[str], layers: list[int]) -> np.ndarray:
    verdicts: dict[tuple[str, int, str], list[str]] = {}
    for t in tests:
        verdicts.setdefault((t["claim"], t["layer"], t["fn"]), []).append(t["verdict"])
    scores: dict[tuple[str, int], list[float]] = {}
    for (claim, layer, _), vs in verdicts.items():
        scores.setdefault((claim, layer), []).append(VERDICT_SCORE[combined_verdict(vs)])
    grid = np.full((len(claims), len(layers)), np.nan)
    for (claim, layer), values in scores.items():
        grid[claims.index(claim), layers.index(layer)] = np.mean(values)
    return grid


SPEARMAN_CLAIM = "spearman_rel_err_kl"
SPEARMAN_EFFECT = Axis("effect", "ρ(rel_err, kl) − random patch's ρ")


def spearman_vs_null(tests: Sequence[Row]) -> Figure | None:
    """Does the residual's size predict the output change better than a random patch of the same norm
    does? Per trained subject: the per-layer effect with its bootstrap CI, one line per class; dotted: the
    claim's margin."""
    rows = [t for t in tests if t["scope"] == "layer" and t["claim"] == SPEARMAN_CLAIM and t["null"] == "random"
            and not t["subject"].endswith("@init")]  # fmt: skip
    if not rows:
        return None
    subjects = sorted({t["subject"] for t in rows})
    fig, axes = _grid(1, len(subjects))
    for ax, subject in zip(axes[0], subjects, strict=True):
        here = [t for t in rows if t["subject"] == subject]
        fns = sorted({t["fn"] for t in here})
        for i, fn in enumerate(fns):
            pts = sorted((t for t in here if t["fn"] == fn and t["effect"] is not None), key=lambda t: t["layer"])
            # Classes are dodged sideways so that equal values and their CIs stay visible.
            x = np.array([t["layer"] for t in pts]) + 0.1 * (i - (len(fns) - 1) / 2)
            y = np.array([t["effect"] for t in pts])
            low = np.array([t["ci_low"] if t["ci_low"] is not None else t["effect"] for t in pts])
            high = np.array([t["ci_high"] if t["ci_high"] is not None else t["effect"] for t in pts])
            ax.errorbar(x, y, yerr=[y - low, high - y], marker="o", markersize=3, capsize=3, label=fn)
        ax.axhline(0, color="gray", linewidth=1)
        ax.axhline(here[0]["margin"], color="gray", linestyle=":", linewidth=1)
        ax.xaxis.get_major_locator().set_params(integer=True)
        _label(ax, subject, LAYER, SPEARMAN_EFFECT)
    return fig
