"""`orthogonal`: `T(x) = Q x`, `Q` orthogonal (Procrustes); with its least-squares scale, `similarity`.

`Q = argmax_Q ⟨C, Q⟩ = polar(C)`, `C = Σ_j y_j x_jᵀ`: the plain Procrustes solution, without a ridge, so its
value never depends on `analysis.ridge`. It is unique exactly when `C = YᵀX` is invertible. Whether the
inputs `X` have rank `d` is the shared identification's business (SPEC §4.5); with them, `C` is singular
exactly when the outputs `Y` are. `σ_d(C) ≥ σ_d(Y) σ_d(X)`, so `σ_d(C) ≤ u‖Y‖_F σ_d(X)` (`u = 2⁻²⁴`) proves
`σ_d(Y) ≤ u‖Y‖_F`: outputs without rank `d` at the float32 resolution of the stored values. Those anchors'
operator is unidentified (a cut-off on the data's own condition, not on `C`'s, which is about its square).
Its value at `x_a` is identified wherever the inputs' span holds `x_a`.

`similarity` fits `T(x) = s Q x` with `s > 0` jointly: for any `s > 0` the best `Q` is the same polar factor,
and then `s = ⟨C, Q⟩ / Σ_j ‖x_j‖² = tr(Σ_C) / ‖X‖_F²` (the trace of `C`'s singular values over the inputs'
energy), positive whenever `C ≠ 0`."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.study_a.classes.base import FitClass, FitContext, RefContext
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import F64, Columns, Update, dominant, leading_values_read, tied
from pipeline.study_a.identification import U32, NeighbourhoodGram, smallest_singular
from pipeline.study_a.solvers import solver_for


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
        vectors = solver_for(core.device).normal_singular_vectors(core, symmetric, leading_values_read(p))
        singular, order = (core @ vectors).norm(dim=1).sort(dim=1, descending=True, stable=True)
        vectors = vectors.gather(2, order[:, None, :].expand_as(vectors))
        return Columns(vectors * dominant(singular, p)[:, None, :], tied(singular, p))


def fit_orthogonal(xn: Tensor, yn: Tensor, with_scale: bool, gram: NeighbourhoodGram | None = None) -> OrthogonalFit:
    """The (scaled) Procrustes maps; `gram` is `NeighbourhoodGram(xn)`, made here when not given."""
    gram = NeighbourhoodGram(xn) if gram is None else gram
    cross = yn.transpose(1, 2) @ xn  # Σ y_j x_jᵀ
    energy = (xn * xn).sum(dim=(1, 2))  # ‖X‖_F²
    smallest = smallest_singular(gram, xn.shape[2])  # σ_d(X), 0 with fewer than d neighbours
    threshold = U32 * (yn * yn).sum(dim=(1, 2)).sqrt() * smallest  # σ_d(C) at most this: not identified
    floor = threshold / torch.linalg.matrix_norm(cross).clamp_min(torch.finfo(F64).tiny)
    polar = solver_for(xn.device).polar(cross, floor)  # the polar factor, Σ σ(C) and σ_d(C)
    unidentified = (smallest == 0) | (polar.smallest <= threshold)
    if not with_scale:
        return OrthogonalFit(polar.rotation, xn.new_ones(xn.shape[0]), unidentified)
    scale = polar.singular_sum / energy.clamp_min(torch.finfo(F64).tiny)  # ⟨C, Q⟩ = tr(Σ_C)
    return OrthogonalFit(polar.rotation, scale, unidentified)


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    return fit_orthogonal(xn, yn, False, context.gram).update(x_a, cfg.p)


def procrustes_reference(xn: np.ndarray, yn: np.ndarray, with_scale: bool) -> tuple[np.ndarray, bool]:
    """`s Q` from NumPy's SVD of `C`, and whether `Q` is unique at the data's float32 resolution."""
    cross = yn.T @ xn
    u, singular, vt = np.linalg.svd(cross)
    s = singular.sum() / (xn * xn).sum() if with_scale else 1.0
    inputs = np.linalg.svd(xn, compute_uv=False)
    smallest = inputs[-1] if len(inputs) == xn.shape[1] else 0.0
    return s * (u @ vt), bool(smallest > 0 and singular[-1] > 2.0**-24 * np.linalg.norm(yn) * smallest)


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


CLASS = FitClass(
    "orthogonal", local=True, fit=fit, reference=reference, summary="T(x) = Q x, Q orthogonal (Procrustes)",
    parameters=parameters, needs_rank=needs_rank,
)
