"""Study A's figures (SPEC §2): where each claim holds, layer by layer, and the functional claim's effect
against a random patch of the same norm. As for Study B's (``pipeline.results.study_b.figures``): a
``Figure`` or None, axes labelled from the quantity they draw."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from pipeline.results.common import Axis, Row, figure_legend, label_axes, panel_grid
from pipeline.results.study_a.claims import CLAIMS, VERDICT_SCORE, combined_verdict, votes

# ------------------------------------------------------------------------------------------ Study A
# Not supported, inconclusive, supported: a diverging scale, the mixed cells (classes disagree) in between.
VERDICT_COLORS = ListedColormap(["#c0392b", "#e8a598", "#f2f2f2", "#9ec5e8", "#2471a3"])
LAYER = "layer"


def claims_by_layer(tests: Sequence[Row]) -> Figure | None:
    """Where does each claim hold? One heat map per subject (rows: architectures or models; columns: `final`
    and `init`): claims × layers, coloured by the verdict averaged over classes (+1 supported, −½ not
    supported, −1 contradicted; each class's verdict combined over the claim's nulls)."""
    per_layer = [t for t in tests if t["scope"] == "layer"]
    if not per_layer:
        return None
    subjects = sorted({t["subject"] for t in per_layer})
    bases = sorted({s.rsplit("@", 1)[0] for s in subjects})
    checkpoints = [c for c in ("final", "init") if any(s.endswith(f"@{c}") for s in subjects)] or [""]
    layers = sorted({t["layer"] for t in per_layer})
    claims = [c for c in CLAIMS if any(t["claim"] == c.name for t in per_layer)]
    fig, axes = panel_grid(len(bases), len(checkpoints), width=0.5 * len(layers) + 3.6, height=0.3 * len(claims) + 1.2)
    for row, base in zip(axes, bases, strict=True):
        for ax, checkpoint in zip(row, checkpoints, strict=True):
            # An external model has no checkpoint: it takes the first column.
            subject = f"{base}@{checkpoint}"
            if subject not in subjects and checkpoint == checkpoints[0]:
                subject = base
            grid = _verdict_grid([t for t in per_layer if t["subject"] == subject], [c.name for c in claims], layers)
            if np.isnan(grid).all():
                ax.axis("off")
                continue
            image = ax.imshow(np.ma.masked_invalid(grid), cmap=VERDICT_COLORS, vmin=-1, vmax=1, aspect="auto")
            ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
            labels = [c.label for c in claims] if ax is row[0] else [""] * len(claims)
            ax.set_yticks(range(len(claims)), labels, fontsize=8)
            ax.set_title(subject, fontsize=9)
            ax.set_xlabel(LAYER)
            ax.set_ylabel("claim" if ax is row[0] else "")
    # One tick per colour band (the map has five bands of width 0.4 over [-1, 1]).
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), ticks=[-0.8, -0.4, 0, 0.4, 0.8], shrink=0.6)
    bar.ax.set_yticklabels(["not supported", "leaning not supported", "inconclusive", "leaning supported", "supported"])
    return fig


def _verdict_grid(tests: Sequence[Row], claims: list[str], layers: list[int]) -> np.ndarray:
    verdicts: dict[tuple[str, int, str], list[str]] = {}
    for t in (t for t in tests if votes(t["fn"])):  # the baselines' rows are no class's verdict
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
