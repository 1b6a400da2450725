"""Study A's figures (SPEC §2): where each claim holds, layer by layer, and the functional claim's effect
against a random patch of the same norm. As for Study B's (``lmgeo.results.study_b.figures``): a
``Figure`` or None, axes labelled from the quantity they draw."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from lmgeo.results.common import Axis, Row, figure_legend, label_axes, panel_grid
from lmgeo.results.study_a.claims import (
    CLAIMS,
    CONTRADICTED,
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    VERDICT_SCORE,
    combined_verdict,
    votes,
)

# ------------------------------------------------------------------------------------------ Study A
# A cell's reading (a claim at one layer, over the fit classes): each its own colour, on a diverging scale from
# contradicted to supported; where the classes disagree, pale, leaning the way their mean verdict score leans.
LEANING_AGAINST, LEANING_SUPPORTED = "mixed, leaning not supported", "mixed, leaning supported"
CELL_COLORS = {
    CONTRADICTED: "#7b241c",
    NOT_SUPPORTED: "#e67e22",
    LEANING_AGAINST: "#f5cba7",
    INCONCLUSIVE: "#aab7b8",
    LEANING_SUPPORTED: "#aed6f1",
    SUPPORTED: "#2471a3",
}
# Cells that are no evidence either way: a layer whose pool is not well posed (left out of every claim) is hatched,
# a layer where the claim was not tested is left blank.
ILL_POSED_HATCH, ILL_POSED = "///", "not well posed (left out)"
NOT_TESTED = "not tested"
LAYER = "layer"


def claims_by_layer(tests: Sequence[Row], ill_posed: Collection[tuple[str, int]] = ()) -> Figure | None:
    """Where does each claim hold? One heat map per subject (rows: architectures or models; columns: `final`
    and `init`): claims × layers, each cell coloured by its reading (`cell_reading`); the layers of
    `ill_posed` ((subject, layer) whose pool is not well posed in some model of the subject) hatched."""
    per_layer = [t for t in tests if t["scope"] == "layer"]
    if not per_layer:
        return None
    subjects = sorted({t["subject"] for t in per_layer})
    bases = sorted({s.rsplit("@", 1)[0] for s in subjects})
    checkpoints = [c for c in ("final", "init") if any(s.endswith(f"@{c}") for s in subjects)] or [""]
    layers = sorted({t["layer"] for t in per_layer} | {layer for s, layer in ill_posed if s in subjects})
    claims = [c for c in CLAIMS if any(t["claim"] == c.name for t in per_layer)]
    fig, axes = panel_grid(len(bases), len(checkpoints), width=0.4 * len(layers) + 2.6, height=0.3 * len(claims) + 1.2)
    colors = ListedColormap(list(CELL_COLORS.values()))
    for row, base in zip(axes, bases, strict=True):
        for ax, checkpoint in zip(row, checkpoints, strict=True):
            # An external model has no checkpoint: it takes the first column.
            subject = f"{base}@{checkpoint}"
            if subject not in subjects and checkpoint == checkpoints[0]:
                subject = base
            grid = _reading_grid([t for t in per_layer if t["subject"] == subject], [c.name for c in claims], layers)
            hatched = [i for i, layer in enumerate(layers) if (subject, layer) in ill_posed]
            if np.isnan(grid).all() and not hatched:
                ax.axis("off")
                continue
            ax.imshow(np.ma.masked_invalid(grid), cmap=colors, vmin=-0.5, vmax=len(CELL_COLORS) - 0.5, aspect="auto")
            for i in hatched:
                ax.add_patch(
                    Rectangle(
                        (i - 0.5, -0.5),
                        1,
                        len(claims),
                        facecolor="white",
                        edgecolor="gray",
                        hatch=ILL_POSED_HATCH,
                        linewidth=0,
                    )
                )
            ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
            labels = [c.label for c in claims] if ax is row[0] else [""] * len(claims)
            ax.set_yticks(range(len(claims)), labels, fontsize=8)
            ax.set_title(subject, fontsize=9)
            ax.set_xlabel(LAYER)
            ax.set_ylabel("claim" if ax is row[0] else "")
    figure_legend(
        fig,
        {
            **{reading: Patch(facecolor=color) for reading, color in CELL_COLORS.items()},
            ILL_POSED: Patch(facecolor="white", edgecolor="gray", hatch=ILL_POSED_HATCH),
            NOT_TESTED: Patch(facecolor="white", edgecolor="gray"),
        },
        columns=2,
    )
    return fig


def cell_reading(verdicts: Sequence[str]) -> str:
    """A claim's reading at one layer from its classes' verdicts (each combined over the claim's nulls): the
    verdict where they agree, else the way their mean verdict score (+1 supported … −1 contradicted) leans."""
    if len(set(verdicts)) == 1:
        return verdicts[0]
    lean = float(np.mean([VERDICT_SCORE[v] for v in verdicts]))
    return LEANING_SUPPORTED if lean > 0 else LEANING_AGAINST if lean < 0 else INCONCLUSIVE


def _reading_grid(tests: Sequence[Row], claims: list[str], layers: list[int]) -> np.ndarray:
    """Claims × layers: the index of each cell's reading in `CELL_COLORS`, NaN where it was not tested."""
    verdicts: dict[tuple[str, int, str], list[str]] = {}
    for t in (t for t in tests if votes(t["fn"])):  # the baselines' rows are no class's verdict
        verdicts.setdefault((t["claim"], t["layer"], t["fn"]), []).append(t["verdict"])
    per_class: dict[tuple[str, int], list[str]] = {}
    for (claim, layer, _), vs in verdicts.items():
        per_class.setdefault((claim, layer), []).append(combined_verdict(vs))
    readings = list(CELL_COLORS)
    grid = np.full((len(claims), len(layers)), np.nan)
    for (claim, layer), vs in per_class.items():
        grid[claims.index(claim), layers.index(layer)] = readings.index(cell_reading(vs))
    return grid


SPEARMAN_CLAIM = "spearman_rel_err_kl"
SPEARMAN_EFFECT = Axis("effect", "ρ(rel_err, kl) − random patch's ρ")


def spearman_vs_null(tests: Sequence[Row]) -> Figure | None:
    """Does the residual's size predict the output change better than a random patch of the same norm
    does? Per trained subject: the per-layer effect with its bootstrap CI, one line per class; dotted: the
    claim's margin."""
    rows = [
        t
        for t in tests
        if t["scope"] == "layer"
        and t["claim"] == SPEARMAN_CLAIM
        and t["null"] == "random"
        and not t["subject"].endswith("@init")
    ]
    if not rows:
        return None
    subjects = sorted({t["subject"] for t in rows})
    fig, axes = panel_grid(1, len(subjects))
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
        label_axes(ax, subject, LAYER, SPEARMAN_EFFECT)
    figure_legend(fig)
    return fig
