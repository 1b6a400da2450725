"""A straightforward per-anchor reference for the tokenwise fits of `pipeline.study_a.fits` (SPEC §4.2).

It works one anchor at a time in NumPy float64: its own neighbour search by fully sorting the
distances, each class's own per-anchor fit (`FitClass.reference`: least squares by `np.linalg.lstsq` on
ridge-augmented systems, the full `d × d` Jacobian of the fitted map, by autograd for the MLP) and its
full SVD. It shares nothing with the batched fits except the MLP's initial weights, which are part of
that fit's definition.

Two users: `tests/test_fits.py` checks every column of `fit_layer` against it, and `lmgeo bench`
times `fit_layer` against it (SPEC §7: "fits vs a straightforward per-anchor reference").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from pipeline.core.contracts import FIT_METRICS
from pipeline.study_a.config import AnalysisConfig

if TYPE_CHECKING:  # the classes import this module's solvers: no import of them at import time
    from pipeline.study_a.classes.base import FitClass

Row = dict[str, Any]  # metric name -> float or None (undefined), and "patched" -> T_i(x_a)


class RefContext(NamedTuple):
    """Where the reference is in the layer: anchor `anchor` (the MLP's initial weights depend on it)."""

    anchor: int


def ref_distances(x: np.ndarray, a: int, distance: str, seq: np.ndarray | None = None) -> np.ndarray:
    """Distances from `x[a]` to every row, `inf` for `a` itself (and its sequence with `seq`)."""
    if distance == "euclidean":
        dist = np.sqrt(((x - x[a]) ** 2).sum(axis=1))
    else:
        norms = np.linalg.norm(x, axis=1)
        directed = (norms > 0) & (norms[a] > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            cos = x @ x[a] / (norms * norms[a])
        # a zero row: cosine 0 to every other row, 1 to another zero row
        dist = 1 - np.where(directed, cos, (norms == 0) & (norms[a] == 0))
    dist[a] = np.inf
    if seq is not None:
        dist[seq == seq[a]] = np.inf
    return dist


def ref_neighbours(
    x: np.ndarray, a: int, k: int, distance: str, seq: np.ndarray | None = None
) -> np.ndarray:
    """The `k` nearest rows of `x[a]`, never `a` itself (nor its sequence with `seq`); ties to the lower index."""
    dist = ref_distances(x, a, distance, seq)
    return np.argsort(dist, kind="stable")[:k]


def ridge_lstsq(
    inputs: np.ndarray, targets: np.ndarray, ridge: float, intercept: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """argmin ‖targets − [inputs, 1] W‖² + ridge ‖W_inputs‖², via lstsq on the augmented system."""
    n, d = inputs.shape
    design = np.hstack([inputs, np.ones((n, 1))]) if intercept else inputs
    penalty = np.sqrt(ridge) * np.eye(d, design.shape[1])
    aug_design = np.vstack([design, penalty])
    aug_targets = np.vstack([targets, np.zeros((d, targets.shape[1]))])
    return np.linalg.lstsq(aug_design, aug_targets, rcond=None)[0], aug_design


def top_subspace(u: np.ndarray, s: np.ndarray, p: int) -> np.ndarray | None:
    """Columns of `u` for the `p` largest singular values, zeros never."""
    if s[0] <= 0:
        return None
    return u[:, : len(s)][:, :p][:, s[:p] > 1e-12 * s[0]]


def is_degenerate(inputs: np.ndarray, x_a: np.ndarray, needs: int) -> bool:
    """Too few independent neighbour inputs for the class (rank by NumPy's SVD, relative tolerance 1e-6),
    or every neighbour's input an exact copy of the anchor's."""
    s = np.linalg.svd(inputs, compute_uv=False)
    return int((s > 1e-6 * s[0]).sum()) < needs or bool((inputs == x_a).all())


def energy(v: np.ndarray, basis: np.ndarray | None) -> float | None:
    if basis is None or np.linalg.norm(v) == 0:
        return None
    return float(np.sum((basis.T @ v) ** 2) / np.sum(v**2))


def ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


def reference_rows(
    x: np.ndarray, y: np.ndarray, seq: np.ndarray, anchors: np.ndarray, fit_class: FitClass, cfg: AnalysisConfig
) -> list[Row]:
    """One anchor at a time: T_i(x_a) and J_i − I from the class's reference (None where the class's own
    solve is not unique), then every metric column (None where undefined or degenerate)."""
    patched, ops, degenerate = [], [], []
    for i, a in enumerate(anchors):
        context = RefContext(i)
        if fit_class.local:
            nb = ref_neighbours(x, a, cfg.k, cfg.distance, seq if cfg.exclude_same_sequence else None)
            result = fit_class.reference(x[nb], y[nb], x[a], cfg, context)
            bad = is_degenerate(x[nb], x[a], fit_class.needs_rank(x.shape[1]))
        else:
            result, bad = fit_class.reference(x, y, a, cfg, context), False
        degenerate.append(bad or result is None)
        patched.append(None if result is None else result[0])
        ops.append(None if result is None else result[1])
    kept = [t - x[a] for t, a, bad in zip(patched, anchors, degenerate) if not bad]
    _, s, vt = np.linalg.svd(np.array(kept).reshape(len(kept), x.shape[1]))
    global_basis = top_subspace(vt.T, s, cfg.p) if kept else None
    return [
        {"degenerate": True, "subspace_tied": None, "patched": None, **dict.fromkeys(FIT_METRICS)} if bad else
        _row(x[a], y[a], t_val, op, global_basis, cfg.p)
        for a, t_val, op, bad in zip(anchors, patched, ops, degenerate)
    ]  # fmt: skip


def _row(
    x_a: np.ndarray, y_a: np.ndarray, t_val: np.ndarray, op: np.ndarray, global_basis: np.ndarray | None, p: int
) -> Row:
    full, tok, res = y_a - x_a, t_val - x_a, y_a - t_val
    nf, nt, nr = (np.linalg.norm(v) for v in (full, tok, res))
    u, s, _ = np.linalg.svd(op)
    local = top_subspace(u, s, p)
    cos_rt = ratio(res @ tok, nr * nt)
    return {
        "rel_err": ratio(nr, nf),
        "rel_err_state": ratio(nr, np.linalg.norm(y_a)),
        "cos_full_tok": ratio(abs(full @ tok), nf * nt),
        "cos_full_res": ratio(abs(full @ res), nf * nr),
        "angle_res_tok": None if cos_rt is None else math.degrees(math.acos(np.clip(cos_rt, -1, 1))),
        "proj_full": energy(full, local),
        "proj_res": energy(res, local),
        "proj_full_global": energy(full, global_basis),
        "proj_res_global": energy(res, global_basis),
        "norm_full": nf,
        "norm_res": nr,
        "degenerate": False,
        "subspace_tied": bool(len(s) > p and s[p - 1] > 1e-12 * s[0] and s[p] >= s[p - 1] * (1 - 1e-8)),
        "patched": t_val,
    }
