"""Study B's figures, one per question, from the rows of the result tables (SPEC §2): the comparison with
`muon`, the validation loss, the head step's geometry.

Each function returns a matplotlib ``Figure`` (the Agg canvas through ``Figure``: no display, no global
pyplot state) or None when it has nothing to draw. Panels are small multiples by architecture, lines by
recipe: a figure stays readable whatever the number of seeds. Every axis is labelled from the quantity it
draws (``Axis``), never from a loop variable, and ``axis_labels`` (``lmgeo.results.common``) reads the
labels back from the drawn figure so that a test can compare them with what each panel plots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from matplotlib.figure import Figure

from lmgeo.results.common import Axis, Row, figure_legend, label_axes, median, panel_grid
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.recipes import RECIPES

# One colour per recipe, in registry order (a qualitative palette: ten distinct colours).
PALETTE = (
    "tab:gray",
    "tab:blue",
    "tab:purple",
    "tab:olive",
    "tab:brown",
    "tab:red",
    "tab:orange",
    "tab:green",
    "tab:pink",
    "tab:cyan",
)


VAL_LOSS = Axis("val_loss", "validation loss (nats)")
HEAD_STEP = (
    Axis("hilbert_bound", "worst-case step (nats)", log=True),
    Axis("tightness", "realised / worst case"),
    Axis("equi_ratio", "row spread (min / max distance)"),
)
STEP = "training step"


# Beside its colour, a line style and a marker per recipe: two recipes whose curves coincide (`hilbert` and
# `rownorm` often do) stay distinguishable, the dashed line over the solid one.
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def _recipe_color(recipe: str) -> str:
    return PALETTE[_recipe_index(recipe) % len(PALETTE)]


def _recipe_style(recipe: str) -> dict[str, str]:
    i = _recipe_index(recipe)
    return {
        "color": _recipe_color(recipe),
        "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
        "marker": MARKERS[i % len(MARKERS)],
    }


def _recipe_index(recipe: str) -> int:
    return RECIPES.order(recipe)[0] if recipe in RECIPES else len(PALETTE) - 1


def _archs(rows: Sequence[Row]) -> list[str]:
    """The architectures where recipes are compared: those with at least two recipes (Study A's architectures
    hold its `muon` runs only, nothing to compare)."""
    recipes: dict[str, set[str]] = {}
    for r in rows:
        if r["arch"] and r["recipe"]:
            recipes.setdefault(r["arch"], set()).add(r["recipe"])
    return sorted(arch for arch, names in recipes.items() if len(names) > 1)


def _recipes(rows: Sequence[Row]) -> list[str]:
    return sorted({r["recipe"] for r in rows if r["recipe"]}, key=RECIPES.order)


def vs_muon(recipes: Sequence[Row], runs: Sequence[Row], resolved: Callable[[Row], bool]) -> Figure | None:
    """Does any head recipe beat `muon`? Per arch: each recipe's paired difference of the final test loss to
    `muon` on the same seed (dots), its mean and t-interval (bar), the mean filled where `resolved` (the
    table's reading: Holm-adjusted) and hollow where it is not, whatever the unadjusted interval."""
    reference = baseline().name
    archs = [a for a in _archs(recipes) if any(r["arch"] == a and r["diff_vs_muon"] is not None for r in recipes)]
    if not archs:
        return None
    fig, axes = panel_grid(1, len(archs), width=4.6, height=0.45 * len(_recipes(recipes)) + 1.4)
    for ax, arch in zip(axes[0], archs, strict=True):
        base = _test_loss_by_seed(runs, arch, reference)
        rows = [r for r in recipes if r["arch"] == arch and r["recipe"] != reference]
        for y, r in enumerate(rows):
            mine = _test_loss_by_seed(runs, arch, r["recipe"])
            diffs = [mine[s] - base[s] for s in sorted(mine.keys() & base.keys())]
            # Seeds spread under the mean's bar, in seed order (a fixed jitter: the figure stays reproducible).
            ax.scatter(
                diffs,
                y + np.linspace(0.12, 0.36, len(diffs)),
                s=28,
                color=_recipe_color(r["recipe"]),
                edgecolors="black",
                linewidths=0.6,
                zorder=3,
            )
            if r["diff_vs_muon"] is not None and r["diff_ci_low"] is not None:
                spread = [[r["diff_vs_muon"] - r["diff_ci_low"]], [r["diff_ci_high"] - r["diff_vs_muon"]]]
                ax.errorbar(
                    r["diff_vs_muon"],
                    y,
                    xerr=spread,
                    fmt="o",
                    color="black",
                    capsize=4,
                    zorder=4,
                    markerfacecolor="black" if resolved(r) else "white",
                    markersize=7,
                )
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


def _curves_by_recipe(
    curves: Sequence[Row], runs: Sequence[Row], quantities: list[Axis], reference: dict[str, str] | None = None
) -> Figure | None:
    run_of = {r["run"]: r for r in runs}
    archs = _archs(runs)
    if not archs or not any(c[q.column] is not None for c in curves for q in quantities):
        return None
    fig, axes = panel_grid(len(archs), len(quantities))
    for row, arch in zip(axes, archs, strict=True):
        for ax, quantity in zip(row, quantities, strict=True):
            here = [c for c in curves if c["run"] in run_of and run_of[c["run"]]["arch"] == arch]
            for recipe in _recipes([run_of[c["run"]] for c in here]):
                steps, values = _median_curve([c for c in here if run_of[c["run"]]["recipe"] == recipe], quantity)
                if steps:
                    ax.plot(
                        steps,
                        values,
                        label=recipe,
                        linewidth=1.3,
                        markersize=4,
                        markevery=max(1, len(steps) // 8),
                        **_recipe_style(recipe),
                    )
            level_of = (reference or {}).get(quantity.column)
            level = median([c[level_of] for c in here]) if level_of else None
            if level is not None:
                ax.axhline(level, color="gray", linestyle=":", linewidth=1.2, label="random unit rows")
            label_axes(ax, arch, STEP, quantity)
    figure_legend(fig)
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


BUDGET = "head budget tau (worst-case nats per step)"
TEST_LOSS = Axis("test_loss_mean", "final test loss (nats)")


# Above the bigram the loss axis stops this far (a share of the span from the lowest interval to the bigram): a
# budget that ruins a recipe would otherwise squash the differences that matter, between trained models, to a few
# pixels. Only where some model is below the bigram: otherwise there is nothing to zoom on.
ABOVE_BIGRAM = 0.25
MARGIN = 0.05  # below the lowest interval, a share of the shown span


def loss_vs_budget(swept: Sequence[Row], own_step: Sequence[Row], bigram: float | None = None) -> Figure | None:
    """Does the verdict depend on the budget? Per arch, the matched-budget sweep's test loss against the
    budget (log axis): a line per recipe with its mean and t-interval over seeds, and the recipe at its own
    tuned step (`own_step`: the default runs of the sweep's seeds) as a square to the right of the largest
    budget. With the smoothed bigram's test loss (`bigram`), a dashed line marks it, the axis stops
    `ABOVE_BIGRAM` above it, and a mean beyond the axis is a triangle on its top edge, labelled with its value."""
    swept = [r for r in swept if r["matched"] and r["test_loss_mean"] is not None]
    budgets = sorted({r["head_budget_tau"] for r in swept})
    archs = _archs(swept)
    if not budgets or not archs:
        return None
    own_x = budgets[-1] * 2  # beyond every budget, one octave to the right
    fig, axes = panel_grid(1, len(archs), width=5.2, height=3.8)
    for ax, arch in zip(axes[0], archs, strict=True):
        drawn: list[tuple[float, Row]] = []  # (x, row) of every mean the panel shows
        for recipe in _recipes([r for r in swept if r["arch"] == arch]):
            mine = [r for r in swept if (r["arch"], r["recipe"]) == (arch, recipe)]
            line = sorted(mine, key=lambda r: r["head_budget_tau"])
            ax.errorbar(
                [r["head_budget_tau"] for r in line],
                [r["test_loss_mean"] for r in line],
                yerr=_interval_arms(line),
                label=recipe,
                markersize=4,
                linewidth=1.3,
                capsize=2,
                **_recipe_style(recipe),
            )
            drawn += [(r["head_budget_tau"], r) for r in line]
            for r in (r for r in own_step if (r["arch"], r["recipe"]) == (arch, recipe) and r["test_loss_mean"]):
                ax.plot([own_x], [r["test_loss_mean"]], marker="s", color=_recipe_color(recipe), linestyle="none")
                drawn.append((own_x, r))
        ax.axvline(math.sqrt(budgets[-1] * own_x), color="gray", linewidth=0.8, linestyle=":")
        if bigram is not None:
            _clip_above_bigram(ax, drawn, bigram)
        ax.set_xscale("log")
        ax.set_xticks([*budgets, own_x], [*(f"{b:g}" for b in budgets), "own step"])
        ax.minorticks_off()
        label_axes(ax, arch, BUDGET, TEST_LOSS)
    figure_legend(fig)
    return fig


def _clip_above_bigram(ax, means: Sequence[tuple[float, Row]], bigram: float) -> None:
    """The bigram's line; the loss axis stopped `ABOVE_BIGRAM` of the span above it, and each mean (x, row)
    beyond the axis drawn as a triangle on the top edge with its value."""
    ax.axhline(bigram, color="black", linewidth=0.9, linestyle="--")
    ax.annotate(
        "smoothed bigram",
        (0.01, bigram),
        xycoords=("axes fraction", "data"),
        xytext=(0, 2),
        textcoords="offset points",
        fontsize=7,
        va="bottom",
    )
    lowest = min(r["test_loss_mean"] if r["test_loss_ci_low"] is None else r["test_loss_ci_low"] for _, r in means)
    top = bigram + ABOVE_BIGRAM * (bigram - lowest)
    if lowest >= bigram or ax.get_ylim()[1] <= top:
        return
    ax.set_ylim(lowest - MARGIN * (top - lowest), top)
    stacked: dict[float, int] = {}  # labels already at this x: the next goes below them
    for x, r in sorted(((x, r) for x, r in means if r["test_loss_mean"] > top), key=lambda m: -m[1]["test_loss_mean"]):
        colour = _recipe_color(r["recipe"])
        ax.plot([x], [top], marker="^", color=colour, linestyle="none", clip_on=False)
        below = stacked[x] = stacked.get(x, -1) + 1
        ax.annotate(
            f"{r['test_loss_mean']:.2f}",
            (x, top),
            xytext=(5, -3 - 9 * below),
            textcoords="offset points",
            fontsize=7,
            ha="left",
            va="top",
            color=colour,
        )


def _interval_arms(rows: Sequence[Row]) -> list[list[float]]:
    """Error-bar arms of the test loss's t-interval (none where a single seed gives no interval)."""
    low = [r["test_loss_mean"] - r["test_loss_ci_low"] if r["test_loss_ci_low"] is not None else 0.0 for r in rows]
    high = [r["test_loss_ci_high"] - r["test_loss_mean"] if r["test_loss_ci_high"] is not None else 0.0 for r in rows]
    return [low, high]
