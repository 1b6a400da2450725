"""A straightforward per-anchor reference for the tokenwise fits of `lmgeo.study_a.fits` (SPEC §4.2).

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

from lmgeo.core.contracts import FIT_METRICS
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import TIE  # the definition of a tie, not code under test

if TYPE_CHECKING:  # the classes import this module's solvers: no import of them at import time
    from lmgeo.study_a.classes.base import FitClass

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


def ref_neighbours(x: np.ndarray, a: int, k: int, distance: str, seq: np.ndarray | None = None) -> np.ndarray:
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
    """Columns of `u` for the dominant singular values, walked one by one: the first `p`, then on while the
    next is tied (closer than `TIE` of the largest), never a zero one (SPEC §4.2)."""
    if s[0] <= 0:
        return None
    nonzero = s > 1e-12 * s[0]
    kept = min(p, len(s))
    while kept < len(s) and nonzero[kept] and s[kept - 1] - s[kept] <= TIE * s[0]:
        kept += 1
    return u[:, : len(s)][:, :kept][:, nonzero[:kept]]


def identification(inputs: np.ndarray, x_a: np.ndarray) -> tuple[int, bool]:
    """The numerical rank of the neighbours' inputs and whether `x_a` lies in their span, by NumPy's SVD and an
    explicit projection, at the float32 resolution of the stored values (SPEC §4.5)."""
    _, s, vt = np.linalg.svd(inputs)
    frobenius = np.linalg.norm(inputs)
    rank = int((s > 2.0**-24 * frobenius).sum())
    outside = x_a - vt[:rank].T @ (vt[:rank] @ x_a)
    allowed = 2.0**-24 * (1 + (frobenius / s[rank - 1] if rank else 0.0))
    return rank, bool(np.linalg.norm(outside) <= allowed * np.linalg.norm(x_a))


def energy(v: np.ndarray, basis: np.ndarray | None) -> float | None:
    if basis is None or np.linalg.norm(v) == 0:
        return None
    return float(np.sum((basis.T @ v) ** 2) / np.sum(v**2))


def ratio(num: float | np.floating, den: float | np.floating) -> float | np.floating | None:
    return None if den == 0 else num / den


def reference_rows(
    x: np.ndarray,
    y: np.ndarray,
    seq: np.ndarray,
    anchors: np.ndarray,
    fit_class: FitClass,
    cfg: AnalysisConfig,
    layer_wide: bool = False,
) -> list[Row]:
    """One anchor at a time: T_i(x_a) and J_i − I from the class's reference, what of it the data identify,
    then every metric column (None where undefined or not identified). `layer_wide`: a local class fitted on
    the whole pool instead of each anchor's neighbours (its `.layer` partition)."""
    patched, ops, value, operator = [], [], [], []
    for i, a in enumerate(anchors):
        context = RefContext(0 if layer_wide else i)  # one layer-wide map: the first anchor's start
        if fit_class.local:
            nb = (
                np.arange(len(x))
                if layer_wide
                else ref_neighbours(x, a, cfg.k, cfg.distance, seq if cfg.exclude_same_sequence else None)
            )
            t_val, op = fit_class.reference(x[nb], y[nb], x[a], cfg, context)
            centre = x[nb].mean(axis=0) if fit_class.centres_inputs else 0.0  # what the class sees
            rank, in_span = identification(x[nb] - centre, x[a] - centre)
            determined = op is not None and rank >= fit_class.needs_rank(x.shape[1])
            value.append(in_span)
        else:
            (t_val, op), determined = fit_class.reference(x, y, a, cfg, context), True
            value.append(True)
        operator.append(determined)
        patched.append(t_val)
        ops.append(op)
    kept = [t - x[a] for t, a, known in zip(patched, anchors, value) if known]
    _, s, vt = np.linalg.svd(np.array(kept).reshape(len(kept), x.shape[1]))
    global_basis = top_subspace(vt.T, s, cfg.p) if kept else None
    rows = []
    for a, t_val, op, known, determined in zip(anchors, patched, ops, value, operator):
        row = (
            _row(x[a], y[a], t_val, op, global_basis, cfg.p)
            if known
            else {"subspace_tied": None, "subspace_dim": None, "patched": None, **dict.fromkeys(FIT_METRICS)}
        )
        if not determined:
            row |= {"proj_full": None, "proj_res": None, "subspace_tied": None, "subspace_dim": None}
        rows.append(row | {"value_identified": known, "operator_identified": determined})
    return rows


def _row(
    x_a: np.ndarray,
    y_a: np.ndarray,
    t_val: np.ndarray,
    op: np.ndarray | None,
    global_basis: np.ndarray | None,
    p: int,
) -> Row:
    full, tok, res = y_a - x_a, t_val - x_a, y_a - t_val
    nf, nt, nr = (np.linalg.norm(v) for v in (full, tok, res))
    u, s, _ = np.linalg.svd(np.zeros((len(x_a), len(x_a))) if op is None else op)  # None: nulled by the caller
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
        "subspace_tied": local is not None and local.shape[1] > p,
        "subspace_dim": 0 if local is None else local.shape[1],
        "patched": t_val,
    }
