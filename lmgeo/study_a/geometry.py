"""The geometry of a tokenwise fit at its anchors (SPEC §4.2): the update `Δ_tok` and the dominant
subspace of the local update operator `J_i − I`, and every metric column built from them.

Dominant subspace (`dominant`, the one definition of the cut): the left singular vectors of the largest
singular values of `J_i − I`, at least `p` of them and cut at a gap, so that a group of tied singular values is
kept whole: the subspace is then unique, and no value written from it depends on rounding. Ties happen:
`sQ − I` pairs its singular values per rotation plane (and puts an unpaired `s + 1` on top where `det Q = −1`),
and every clamped `d_c = 0` of `diag_psd` has `|d_c − 1| = 1`. A zero singular value (below 1e-12 of the
largest) is never kept: when the operator has rank below `p`, the subspace is its range. `subspace_tied` marks
an anchor whose cut went past `p` to keep a tie whole, `subspace_dim` the dimension kept. The global subspace is
the same construction on the stacked `Δ_tok` of a layer's anchors (right singular vectors). A column is null
where it is undefined: a zero vector in a ratio or an angle, or no non-zero singular value (e.g. `identity`,
where `Δ_tok = 0`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmgeo.study_a.solvers import solver_for

F64 = torch.float64
# Singular values (and eigenvalues of Gram matrices) below this fraction of the largest are zero.
RCOND = 1e-12
# Consecutive singular values closer than this fraction of the largest are tied: the dominant subspace never
# separates them. Exact ties (a rotation plane's pair, clamped diagonal entries) differ by float64 rounding,
# ~1e-15 of the largest; distinct singular values of a d × d operator lie ~1/d of the largest apart. A cut at a
# gap of at least 1e-6 moves the subspace by at most ~1e-10 of the operator's rounding-level change (Wedin).
TIE = 1e-6


class Columns(NamedTuple):
    """A subspace per anchor as columns `(A or 1, d, q)` that are orthonormal or zero (all zero: none);
    `tied` (A or 1,): the cut went past `p` to keep a tie whole (`dominant`)."""

    columns: Tensor
    tied: Tensor

    def energy(self, v: Tensor) -> Tensor:
        """`‖P v‖²` per row of `v` (A, d), `P` the projector on the subspace."""
        return (self.columns.transpose(-1, -2) @ v[..., None]).square().sum(dim=(1, 2))

    def is_defined(self) -> Tensor:
        return self.columns.square().sum(dim=(1, 2)) > 0

    def dim(self) -> Tensor:
        """The dimension of each subspace (its non-zero columns)."""
        return (self.columns.square().sum(dim=1) > 0).sum(dim=1)


class CoordinateAxes(NamedTuple):
    """A subspace per anchor spanned by coordinate axes: `mask` (A, d) marks them. Equal to `Columns`
    of the selected unit vectors, in O(A·d) instead of a dense `(A, d, d)` basis."""

    mask: Tensor
    tied: Tensor

    def energy(self, v: Tensor) -> Tensor:
        return v.square().where(self.mask, 0.0).sum(dim=1)

    def is_defined(self) -> Tensor:
        return self.mask.any(dim=1)

    def dim(self) -> Tensor:
        return self.mask.sum(dim=1)


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


def update_metrics(x: Tensor, y: Tensor, delta_tok: Tensor, local: Subspace, global_: Subspace) -> dict[str, Tensor]:
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
    """The dominant left singular vectors of `left @ core` (`dominant`) when `left` has orthonormal columns,
    as the columns of `left @ U` it keeps (the others zeroed); the SVD from the device's solver."""
    u, singular = solver_for(core.device).left_singular(core)
    return Columns(left @ (u * dominant(singular, p)[..., None, :]), tied(singular, p))


def coordinate_basis(diag: Tensor, p: int) -> CoordinateAxes:
    """`top_left_singular` for a diagonal operator: the coordinate axes of the largest `|diag|`, cut as
    `dominant` cuts (a tied group of axes kept whole)."""
    values, index = diag.abs().sort(dim=1, descending=True, stable=True)
    mask = torch.zeros_like(index, dtype=torch.bool).scatter_(1, index, dominant(values, p))
    return CoordinateAxes(mask, tied(values, p))


def dominant(singular: Tensor, p: int) -> Tensor:
    """The cut of the dominant subspace, its one definition (every class, the layer's global subspace, and
    any other implementation of the fits, such as a GPU solver, must reproduce it).

    `singular` (..., n): singular values in descending order. Returns a mask (..., n) of those kept: the
    first `q`, for the smallest `q ≥ p` at which the spectrum has a gap, `σ_q − σ_{q+1} > TIE · σ_1`
    (`σ_{n+1} = 0`), so that a tied group is kept whole or not at all; and of those, only the non-zero ones
    (`σ > 1e-12 · σ_1`; a value at or below it counts as 0 in the gap test too). With fewer than `p` non-zero
    values the subspace is the operator's range; with `σ_1 = 0`, empty."""
    if singular.shape[-1] == 0:  # no values (e.g. a layer's global subspace with no identified anchor): empty
        return torch.zeros_like(singular, dtype=torch.bool)
    top = singular[..., :1]
    values = singular.where(singular > RCOND * top, 0.0)
    after = torch.cat([values[..., 1:], torch.zeros_like(values[..., :1])], dim=-1)
    index = torch.arange(values.shape[-1], device=values.device)
    cuttable = ((values - after > TIE * top) | (after == 0)) & (index >= p - 1)  # a cut after index j keeps j + 1
    count = torch.where(cuttable, index, values.shape[-1] - 1).amin(dim=-1, keepdim=True) + 1
    return (index < count) & (values > 0)


def leading_values_read(p: int) -> int:
    """How many leading singular values a solver that finds only the leading ones (`lmgeo.study_a.solvers`)
    finds: the first `p` and the next, which decide `dominant`'s cut unless a tie runs past them (every value
    found then kept); its caller then reads the whole spectrum."""
    return p + 1


def tied(singular: Tensor, p: int) -> Tensor:
    """Whether `dominant`'s cut went past `p` to keep a tie whole (the strict top `p` would have split it)."""
    return dominant(singular, p).sum(dim=-1) > p


def ridge_inverse(gram: Tensor, ridge: float) -> tuple[Tensor, Tensor, Tensor]:
    """`gram = W diag(g) Wᵀ`; returns `W`, `g` and `1/(g + λ)`, zero where `g + λ` is numerically
    zero (the minimum-norm solution when `λ = 0` and the data are rank-deficient)."""
    g, w = torch.linalg.eigh(gram)
    g = g.clamp_min(0)
    return w, g, ridge_reciprocal(g, ridge)


def ridge_reciprocal(g: Tensor, ridge: float) -> Tensor:
    """`1/(g + λ)` for eigenvalues `g ≥ 0` of a Gram matrix, zero where `g + λ` is numerically zero."""
    total = g + ridge
    cutoff = RCOND * total.amax(dim=-1, keepdim=True)
    return torch.where(total > cutoff, 1 / total.where(total > cutoff, 1.0), 0.0)


def as_float64(a: np.ndarray | Tensor, device: str | torch.device) -> Tensor:
    if isinstance(a, Tensor):
        return a.to(device=device, dtype=F64)
    return torch.from_numpy(np.array(a, dtype=np.float64)).to(device)
