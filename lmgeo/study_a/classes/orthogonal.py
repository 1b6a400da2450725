"""`orthogonal`: `T(x) = Q x`, `Q` orthogonal (Procrustes); with its least-squares scale, `similarity`.

`Q = argmax_Q ⟨C, Q⟩ = polar(C)`, `C = Σ_j y_j x_jᵀ = YᵀX`: the plain Procrustes solution, without a ridge, so
its value never depends on `analysis.ridge`. It is unique exactly when `C` is invertible. Whether the inputs `X`
(k × d) have rank `d` is the shared identification's business (SPEC §4.5); but inputs and outputs of full rank
do not make `C` invertible when `k > d`: with `X = Q_X R_X`, `Y = Q_Y R_Y` (orthonormal `k × d` bases of their
column spaces), `C = R_Yᵀ (Q_Yᵀ Q_X) R_X`, singular exactly when the two column spaces meet at a right angle
(their largest principal angle θ_d, `cos θ_d = σ_d(Q_Yᵀ Q_X)`, is 90°), which two `d`-dimensional subspaces of
`R^k` can do for `k > d`. The stored values are float32: the data stand for `X + E`, `Y + F` with
`‖E‖₂ ≤ u‖X‖_F`, `‖F‖₂ ≤ u‖Y‖_F` (`u = 2⁻²⁴`), which tilt the column spaces by at most `τ_X = u‖X‖_F / σ_d(X)`,
`τ_Y = u‖Y‖_F / σ_d(Y)` (Wedin). So `Q` is determined by the data only where no such tilt can make `C`
singular: an anchor's operator is unidentified where `σ_d(Y) ≤ u‖Y‖_F` (outputs without rank `d` at float32
resolution) or `cos θ_d ≤ τ_X + τ_Y` (a cut-off on the data's own geometry, not on `C`'s condition, which also
carries `X`'s and `Y`'s). Its value at `x_a` is identified wherever the inputs' span holds `x_a`.

`similarity` fits `T(x) = s Q x` with `s > 0` jointly: for any `s > 0` the best `Q` is the same polar factor,
and then `s = ⟨C, Q⟩ / Σ_j ‖x_j‖² = tr(Σ_C) / ‖X‖_F²` (the trace of `C`'s singular values over the inputs'
energy), positive whenever `C ≠ 0`."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmgeo.study_a.classes.base import FitClass, FitContext, RefContext
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import F64, Columns, Update, dominant, leading_values_read, tied
from lmgeo.study_a.identification import U32, NeighbourhoodGram, smallest_singular
from lmgeo.study_a.solvers import Lapack, solver_for


class OrthogonalFit(NamedTuple):
    rotation: Tensor  # (A, d, d): Q
    scale: Tensor  # (A,)
    unidentified: Tensor  # (A,): Q not determined at the data's float32 resolution

    def update(self, x_a: Tensor, p: int) -> Update:
        qx = (self.rotation @ x_a[..., None])[..., 0]
        return Update(self.scale[:, None] * qx - x_a, self._dominant_subspace(p), self.unidentified)

    def _dominant_subspace(self, p: int) -> Columns:
        """`top_left_singular(I, sQ − I)` by one `eigh` instead of an SVD: `N = sQ − I` is normal,
        `NNᵀ = (s² + 1)I − s(Q + Qᵀ)`, so the eigenvectors of `(Q + Qᵀ)/2` are its left singular
        vectors. Their singular values are measured as `‖N v‖`, accurate where `√(s² − 2sμ + 1)` of
        an eigenvalue `μ` near 1 would cancel, and sorted (the order of `μ` flips with the sign of `s`)."""
        eye = torch.eye(self.rotation.shape[-1], dtype=self.rotation.dtype, device=self.rotation.device)
        core = self.scale[:, None, None] * self.rotation - eye
        symmetric = (self.rotation + self.rotation.transpose(1, 2)) / 2
        vectors, singular = _ranked(
            core, solver_for(core.device).normal_singular_vectors(core, symmetric, leading_values_read(p))
        )
        if vectors.shape[-1] < core.shape[-1] and bool(dominant(singular, p).all(dim=-1).any()):
            # every leading vector found is kept: a tie may run past them, which only the whole spectrum shows
            vectors, singular = _ranked(core, Lapack().normal_singular_vectors(core, symmetric, core.shape[-1]))
        return Columns(vectors * dominant(singular, p)[:, None, :], tied(singular, p))


def _ranked(core: Tensor, vectors: Tensor) -> tuple[Tensor, Tensor]:
    """Candidate singular vectors of `core`, sorted by their singular values `‖core v‖` (descending)."""
    singular, order = (core @ vectors).norm(dim=1).sort(dim=1, descending=True, stable=True)
    return vectors.gather(2, order[:, None, :].expand_as(vectors)), singular


def fit_orthogonal(xn: Tensor, yn: Tensor, with_scale: bool, gram: NeighbourhoodGram | None = None) -> OrthogonalFit:
    """The (scaled) Procrustes maps; `gram` is `NeighbourhoodGram(xn)`, made here when not given."""
    gram = NeighbourhoodGram(xn) if gram is None else gram
    cross = yn.transpose(1, 2) @ xn  # Σ y_j x_jᵀ
    energy = (xn * xn).sum(dim=(1, 2))  # ‖X‖_F²
    smallest = smallest_singular(gram, xn.shape[2])  # σ_d(X), 0 with fewer than d neighbours
    threshold = U32 * (yn * yn).sum(dim=(1, 2)).sqrt() * smallest  # σ_d(C) at most this: not identified
    floor = threshold / torch.linalg.matrix_norm(cross).clamp_min(torch.finfo(F64).tiny)
    polar = solver_for(xn.device).polar(cross, floor)  # the polar factor, Σ σ(C) and σ_d(C)
    unidentified = procrustes_undetermined(xn, yn, smallest)
    if not with_scale:
        return OrthogonalFit(polar.rotation, xn.new_ones(xn.shape[0]), unidentified)
    scale = polar.singular_sum / energy.clamp_min(torch.finfo(F64).tiny)  # ⟨C, Q⟩ = tr(Σ_C)
    return OrthogonalFit(polar.rotation, scale, unidentified)


def procrustes_undetermined(xn: Tensor, yn: Tensor, smallest_input: Tensor) -> Tensor:
    """(A,): where float32 rounding of the stored inputs `xn` and outputs `yn` (A, k, d) can make `C = YᵀX`
    singular (module docstring): fewer than `d` rows, `σ_d(X)` (`smallest_input`) or `σ_d(Y)` within rounding
    of 0, or the column spaces within `τ_X + τ_Y` of a right angle."""
    k, d = xn.shape[1:]
    if k < d:
        return torch.ones(xn.shape[0], dtype=torch.bool, device=xn.device)
    q_x, _ = torch.linalg.qr(xn)
    q_y, r_y = torch.linalg.qr(yn)
    smallest_output = torch.linalg.svdvals(r_y)[:, -1]  # R_Y has Y's singular values
    cosine = torch.linalg.svdvals(q_y.transpose(1, 2) @ q_x)[:, -1]  # cos θ_d
    reach = [U32 * (v * v).sum(dim=(1, 2)).sqrt() for v in (xn, yn)]  # u‖X‖_F, u‖Y‖_F
    flat = (smallest_input <= reach[0]) | (smallest_output <= reach[1])
    tilt = reach[0] / smallest_input.where(~flat, 1.0) + reach[1] / smallest_output.where(~flat, 1.0)
    return flat | (cosine <= tilt)


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    return fit_orthogonal(xn, yn, False, context.gram).update(x_a, cfg.p)


def procrustes_reference(xn: np.ndarray, yn: np.ndarray, with_scale: bool) -> tuple[np.ndarray, bool]:
    """`s Q` from NumPy's SVD of `C`, and whether `Q` is unique at the data's float32 resolution: SciPy's
    principal angles between the inputs' and outputs' column spaces against the tilt rounding can give them."""
    from scipy.linalg import subspace_angles

    cross = yn.T @ xn
    u, singular, vt = np.linalg.svd(cross)
    s = singular.sum() / (xn * xn).sum() if with_scale else 1.0
    k, d = xn.shape
    if k < d:
        return s * (u @ vt), False
    smallest = [np.linalg.svd(v, compute_uv=False)[-1] for v in (xn, yn)]
    reach = [2.0**-24 * np.linalg.norm(v) for v in (xn, yn)]
    if any(m <= r for m, r in zip(smallest, reach, strict=True)):
        return s * (u @ vt), False
    cosine = np.cos(subspace_angles(xn, yn).max())
    return s * (u @ vt), bool(cosine > reach[0] / smallest[0] + reach[1] / smallest[1])


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray | None]:
    """Procrustes: the orthogonal `Q` maximising `tr(Qᵀ C)`: (T(x_a), J − I, None where Q is not unique)."""
    sq, unique = procrustes_reference(xn, yn, with_scale=False)
    return sq @ xa, sq - np.eye(len(xa)) if unique else None


def needs_rank(d: int) -> int:
    return d


def parameters(d: int, cfg: AnalysisConfig) -> int:
    del cfg
    return d * (d - 1) // 2  # the orthogonal group's dimension


# A diagnostic, not one of the paper's classes: without a scale it cannot follow the residual stream's growth in
# norm (rel_err 0.8 where `similarity` leaves 0.2), so it would decide claims by its misfit alone.
CLASS = FitClass(
    "orthogonal",
    local=True,
    fit=fit,
    reference=reference,
    summary="T(x) = Q x, Q orthogonal (Procrustes)",
    parameters=parameters,
    needs_rank=needs_rank,
    diagnostic=True,
)
