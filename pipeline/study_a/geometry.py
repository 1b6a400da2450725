"""The geometry of a tokenwise fit at its anchors (SPEC §4.2): the update `Δ_tok` and the dominant
subspace of the local update operator `J_i − I`, and every metric column built from them.

Dominant subspace: the left singular vectors of exactly the `p` largest singular values of `J_i − I` (strict
top-`p`, in the order the decomposition returns them), never including a zero singular value (below 1e-12
of the largest): when the operator has rank below `p`, the subspace is its range. When the `p`-th singular
value is tied with the next (within 1e-8 relative) the top-`p` subspace is not unique: the anchor is then
reported as `subspace_tied` (ties happen: `sQ − I` pairs its singular values per rotation plane, and every
clamped `d_c = 0` of `diag_psd` has `|d_c − 1| = 1`). The global subspace is the same construction on the
stacked `Δ_tok` of a layer's anchors (right singular vectors). A column is null where it is undefined: a
zero vector in a ratio or an angle, or no non-zero singular value (e.g. `identity`, where `Δ_tok = 0`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.study_a.solvers import solver_for

F64 = torch.float64
# Singular values (and eigenvalues of Gram matrices) below this fraction of the largest are zero.
_RCOND = 1e-12
# Singular values within this relative distance of each other are tied.
_TIE = 1e-8


class Columns(NamedTuple):
    """A subspace per anchor as columns `(A or 1, d, q)` that are orthonormal or zero (all zero: none);
    `tied` (A or 1,): the top-`p` cut splits a tie, so another choice was as good."""

    columns: Tensor
    tied: Tensor

    def energy(self, v: Tensor) -> Tensor:
        """`‖P v‖²` per row of `v` (A, d), `P` the projector on the subspace."""
        return (self.columns.transpose(-1, -2) @ v[..., None]).square().sum(dim=(1, 2))

    def is_defined(self) -> Tensor:
        return self.columns.square().sum(dim=(1, 2)) > 0


class CoordinateAxes(NamedTuple):
    """A subspace per anchor spanned by coordinate axes: `mask` (A, d) marks them. Equal to `Columns`
    of the selected unit vectors, in O(A·d) instead of a dense `(A, d, d)` basis."""

    mask: Tensor
    tied: Tensor

    def energy(self, v: Tensor) -> Tensor:
        return v.square().where(self.mask, 0.0).sum(dim=1)

    def is_defined(self) -> Tensor:
        return self.mask.any(dim=1)


Subspace = Columns | CoordinateAxes


class Update(NamedTuple):
    """`delta_tok = T_i(x_i) − x_i` per anchor, and `basis`: the dominant subspace of `J_i − I`;
    `unidentified` (A,): anchors where the class's own solve is not unique (None: everywhere unique);
    `converged` (A,): whether an iterative fit met its convergence criterion (None: a closed form)."""

    delta_tok: Tensor
    basis: Subspace
    unidentified: Tensor | None = None
    converged: Tensor | None = None


# ------------------------------------------------------------------------------------ public API


def global_basis(delta_tok: Tensor, p: int) -> Columns:
    """`(1, d, p)`: the top-`p` right singular vectors of the stacked `Δ_tok` (anchors × d)."""
    eye = torch.eye(delta_tok.shape[1], dtype=delta_tok.dtype, device=delta_tok.device)
    return top_left_singular(eye[None], delta_tok.T[None], p)


def update_metrics(
    x: Tensor, y: Tensor, delta_tok: Tensor, local: Subspace, global_: Subspace
) -> dict[str, Tensor]:
    """Every metric column per anchor, NaN where undefined (`global_` is one subspace for every anchor)."""
    full = y - x
    res = full - delta_tok
    n_full, n_tok, n_res, n_y = (v.norm(dim=1) for v in (full, delta_tok, res, y))
    has_local, has_global = local.is_defined(), global_.is_defined()
    return {
        "rel_err": _ratio(n_res, n_full),
        "rel_err_state": _ratio(n_res, n_y),
        "cos_full_tok": _ratio((full * delta_tok).sum(dim=1).abs(), n_full * n_tok),
        "cos_full_res": _ratio((full * res).sum(dim=1).abs(), n_full * n_res),
        "angle_res_tok": _angle_degrees(res, n_res, delta_tok, n_tok),
        "proj_full": _energy_fraction(full, n_full, local, has_local),
        "proj_res": _energy_fraction(res, n_res, local, has_local),
        "proj_full_global": _energy_fraction(full, n_full, global_, has_global),
        "proj_res_global": _energy_fraction(res, n_res, global_, has_global),
        "norm_full": n_full,
        "norm_res": n_res,
    }


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den > 0, num / den.where(den > 0, 1.0), torch.nan)


def _angle_degrees(u: Tensor, n_u: Tensor, v: Tensor, n_v: Tensor) -> Tensor:
    """Angle between `u` and `v` as `2 atan2(‖û − v̂‖, ‖û + v̂‖)`, accurate near 0° and 180°."""
    defined = (n_u > 0) & (n_v > 0)
    u_hat = u / n_u.where(defined, 1.0)[:, None]
    v_hat = v / n_v.where(defined, 1.0)[:, None]
    angle = torch.rad2deg(2 * torch.atan2((u_hat - v_hat).norm(dim=1), (u_hat + v_hat).norm(dim=1)))
    return torch.where(defined, angle, torch.nan)


def _energy_fraction(v: Tensor, n_v: Tensor, basis: Subspace, has_basis: Tensor) -> Tensor:
    """`‖P v‖² / ‖v‖²` with `P` the projector on the subspace."""
    return torch.where(has_basis, _ratio(basis.energy(v), n_v.square()), torch.nan)


def top_left_singular(left: Tensor, core: Tensor, p: int) -> Columns:
    """Top-`p` left singular vectors of `left @ core` when `left` has orthonormal columns, as the
    columns of `left @ U` kept by `dominant` (the others zeroed); the SVD from the device's solver."""
    u, singular = solver_for(core.device).left_singular(core)
    return Columns(left @ (u * dominant(singular, p)[..., None, :]), tied(singular, p))


def coordinate_basis(diag: Tensor, p: int) -> CoordinateAxes:
    """`top_left_singular` for a diagonal operator: the coordinate axes of the largest `|diag|` (ties in
    index order)."""
    values, index = diag.abs().sort(dim=1, descending=True, stable=True)
    mask = torch.zeros_like(index, dtype=torch.bool).scatter_(1, index, dominant(values, p))
    return CoordinateAxes(mask, tied(values, p))


def dominant(singular: Tensor, p: int) -> Tensor:
    """Which of the descending singular values span the dominant subspace: the first `p`, never a zero one."""
    first = torch.arange(singular.shape[-1], device=singular.device) < p
    return first & (singular > _RCOND * singular[..., :1])


def leading_values_read(p: int) -> int:
    """How many of the leading singular values `dominant` and `tied` read (the largest, the first `p` and the
    next): a solver that finds only the leading ones (`pipeline.study_a.solvers`) finds at least these."""
    return p + 1


def tied(singular: Tensor, p: int) -> Tensor:
    """Whether the `p`-th (non-zero) descending singular value equals the next within `_TIE`: the strict
    top-`p` subspace is then one choice among several."""
    if singular.shape[-1] <= p:
        return torch.zeros(singular.shape[:-1], dtype=torch.bool, device=singular.device)
    p_th, after = singular[..., p - 1], singular[..., p]
    return (p_th > _RCOND * singular[..., 0]) & (after >= p_th * (1 - _TIE))


def ridge_inverse(gram: Tensor, ridge: float) -> tuple[Tensor, Tensor, Tensor]:
    """`gram = W diag(g) Wᵀ`; returns `W`, `g` and `1/(g + λ)`, zero where `g + λ` is numerically
    zero (the minimum-norm solution when `λ = 0` and the data are rank-deficient)."""
    g, w = torch.linalg.eigh(gram)
    g = g.clamp_min(0)
    return w, g, ridge_reciprocal(g, ridge)


def ridge_reciprocal(g: Tensor, ridge: float) -> Tensor:
    """`1/(g + λ)` for eigenvalues `g ≥ 0` of a Gram matrix, zero where `g + λ` is numerically zero."""
    total = g + ridge
    cutoff = _RCOND * total.amax(dim=-1, keepdim=True)
    return torch.where(total > cutoff, 1 / total.where(total > cutoff, 1.0), 0.0)


def as_float64(a: np.ndarray | Tensor, device: str | torch.device) -> Tensor:
    if isinstance(a, Tensor):
        return a.to(device=device, dtype=F64)
    return torch.from_numpy(np.array(a, dtype=np.float64)).to(device)
