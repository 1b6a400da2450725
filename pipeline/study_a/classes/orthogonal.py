"""`orthogonal`: `T(x) = s Q x`, `Q` orthogonal (Procrustes pulled towards the identity).

`Q = argmin Σ‖y_j − Q x_j‖² + λ‖Q − I‖²_F = polar(Σ y_j x_jᵀ + λI)`. With `S` the span of the neighbours'
inputs and outputs, this `Q` is exactly the identity on `S⊥`, as SPEC asks; the `λ` term also makes `Q`
unique inside `S`, where the plain Procrustes optimum is not unique once `k < dim S`: it is the optimum
closest to the identity (the `λ → 0⁺` limit). `λ > 0` is needed for uniqueness. `Q` is stored as
`I + B (Q_S − I) Bᵀ`, `B` an orthonormal basis of `S` (of R^d once `2k ≥ d`). With `orthogonal_scale`,
`s = ⟨Σ y_j x_jᵀ, Q⟩ / Σ‖x_j‖²` (the least-squares scale given `Q`), else `s = 1`. For `sQ − I` the
singular value `|s − 1|` on `S⊥` is the smallest it can have, so the dominant subspace lies inside `S`."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.study_a.classes.base import FitClass, RefContext
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import F64, Columns, Update, dominant


class OrthogonalFit(NamedTuple):
    basis: Tensor  # (A, d, m): orthonormal basis B of the span S of the neighbours' x and y (or of R^d)
    rotation: Tensor  # (A, m, m): Q_S, so Q = I + B (Q_S − I) Bᵀ
    scale: Tensor  # (A,)

    def update(self, x_a: Tensor, p: int) -> Update:
        coords = (self.basis.transpose(1, 2) @ x_a[..., None])[..., 0]
        qx = x_a + (self.basis @ ((self.rotation @ coords[..., None])[..., 0] - coords)[..., None])[..., 0]
        return Update(self.scale[:, None] * qx - x_a, self._dominant_subspace(p))

    def _dominant_subspace(self, p: int) -> Columns:
        """`top_left_singular(B, sQ_S − I)` by one `eigh` instead of an SVD: `N = sQ_S − I` is normal,
        `NNᵀ = (s² + 1)I − s(Q_S + Q_Sᵀ)`, so the eigenvectors of `(Q_S + Q_Sᵀ)/2` are its left singular
        vectors. Their singular values are measured as `‖N v‖`, accurate where `√(s² − 2sμ + 1)` of
        an eigenvalue `μ` near 1 would cancel, and sorted (the order of `μ` flips with the sign of `s`)."""
        eye = torch.eye(self.rotation.shape[-1], dtype=self.rotation.dtype, device=self.rotation.device)
        core = self.scale[:, None, None] * self.rotation - eye
        vectors = torch.linalg.eigh((self.rotation + self.rotation.transpose(1, 2)) / 2).eigenvectors
        singular, order = (core @ vectors).norm(dim=1).sort(dim=1, descending=True, stable=True)
        vectors = vectors.gather(2, order[:, None, :].expand_as(vectors))
        return Columns(self.basis @ (vectors * dominant(singular, p)[:, None, :]))


def fit_orthogonal(xn: Tensor, yn: Tensor, ridge: float, with_scale: bool) -> OrthogonalFit:
    basis = _span_basis(xn, yn)
    cross = (yn @ basis).transpose(1, 2) @ (xn @ basis)  # Σ y_j x_jᵀ in the coordinates of S
    eye = torch.eye(basis.shape[-1], dtype=xn.dtype, device=xn.device)
    svd = torch.linalg.svd(cross + ridge * eye)
    rotation = svd.U @ svd.Vh  # polar factor
    if not with_scale:
        return OrthogonalFit(basis, rotation, xn.new_ones(xn.shape[0]))
    energy = (xn * xn).sum(dim=(1, 2)).clamp_min(torch.finfo(F64).tiny)
    return OrthogonalFit(basis, rotation, (cross * rotation).sum(dim=(1, 2)) / energy)


def _span_basis(xn: Tensor, yn: Tensor) -> Tensor:
    """`(A, d, min(d, 2k))` orthonormal columns spanning the neighbours' inputs and outputs. Once
    `2k ≥ d` a QR returns a basis of all of R^d, and `Q` does not depend on which: the identity."""
    n_anchors, k, d = xn.shape
    if 2 * k >= d:
        return torch.eye(d, dtype=xn.dtype, device=xn.device).expand(n_anchors, d, d)
    return torch.linalg.qr(torch.cat([xn, yn], dim=1).transpose(1, 2)).Q


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig) -> Update:
    return fit_orthogonal(xn, yn, cfg.ridge, cfg.orthogonal_scale).update(x_a, cfg.p)


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray]:
    """Procrustes pulled towards the identity, the full `d × d` polar factor: (T(x_a), J − I)."""
    cross = yn.T @ xn
    u, _, vt = np.linalg.svd(cross + cfg.ridge * np.eye(xn.shape[1]))
    q = u @ vt
    s = (cross * q).sum() / (xn * xn).sum() if cfg.orthogonal_scale else 1.0
    return s * q @ xa, s * q - np.eye(len(xa))


def check_config(cfg: AnalysisConfig) -> str | None:
    return "ridge must be > 0 (it picks the map closest to I)" if cfg.ridge <= 0 else None


CLASS = FitClass(
    "orthogonal", local=True, fit=fit, reference=reference, summary="T(x) = s Q x, Q orthogonal (Procrustes)",
    check_config=check_config,
)
