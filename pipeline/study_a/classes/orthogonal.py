"""`orthogonal`: `T(x) = s Q x`, `Q` orthogonal (Procrustes).

`Q = argmax_Q ⟨C, Q⟩ = polar(C)`, `C = Σ_j y_j x_jᵀ`: the plain Procrustes solution, without a ridge. It is
unique exactly when `C` has full rank `d`; where it has not (fewer than `d` independent neighbour inputs, or
outputs), every orthogonal map that agrees on the range of `C` is optimal and the data cannot choose one:
the anchor is then degenerate (`C`'s smallest singular value below `RANK_TOL` of its largest). So the class
needs `k ≥ d` neighbours, and its value never depends on `analysis.ridge`. With `orthogonal_scale`,
`s = ⟨C, Q⟩ / Σ‖x_j‖²` (the least-squares scale given `Q`), else `s = 1`."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.study_a.classes.base import FitClass, RefContext
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import F64, RANK_TOL, Columns, Update, dominant, tied


class OrthogonalFit(NamedTuple):
    rotation: Tensor  # (A, d, d): Q
    scale: Tensor  # (A,)
    unidentified: Tensor  # (A,): C rank-deficient, Q not unique

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
        vectors = torch.linalg.eigh((self.rotation + self.rotation.transpose(1, 2)) / 2).eigenvectors
        singular, order = (core @ vectors).norm(dim=1).sort(dim=1, descending=True, stable=True)
        vectors = vectors.gather(2, order[:, None, :].expand_as(vectors))
        return Columns(vectors * dominant(singular, p)[:, None, :], tied(singular, p))


def fit_orthogonal(xn: Tensor, yn: Tensor, with_scale: bool) -> OrthogonalFit:
    cross = yn.transpose(1, 2) @ xn  # Σ y_j x_jᵀ
    svd = torch.linalg.svd(cross)
    rotation = svd.U @ svd.Vh  # polar factor
    unidentified = svd.S[:, -1] <= RANK_TOL * svd.S[:, 0]
    if not with_scale:
        return OrthogonalFit(rotation, xn.new_ones(xn.shape[0]), unidentified)
    energy = (xn * xn).sum(dim=(1, 2)).clamp_min(torch.finfo(F64).tiny)
    return OrthogonalFit(rotation, (cross * rotation).sum(dim=(1, 2)) / energy, unidentified)


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig, first: int) -> Update:
    del first  # a closed form: nothing drawn per anchor
    return fit_orthogonal(xn, yn, cfg.orthogonal_scale).update(x_a, cfg.p)


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray] | None:
    """Procrustes: the orthogonal `Q` maximising `tr(Qᵀ C)`, from NumPy's SVD: (T(x_a), J − I)."""
    cross = yn.T @ xn
    u, singular, vt = np.linalg.svd(cross)
    if singular[-1] <= 1e-6 * singular[0]:
        return None  # C rank-deficient: many orthogonal maps are optimal
    q = u @ vt
    s = (cross * q).sum() / (xn * xn).sum() if cfg.orthogonal_scale else 1.0
    return s * q @ xa, s * q - np.eye(len(xa))


def needs_rank(d: int) -> int:
    return d


CLASS = FitClass(
    "orthogonal", local=True, fit=fit, reference=reference, summary="T(x) = s Q x, Q orthogonal (Procrustes)",
    needs_rank=needs_rank,
)
