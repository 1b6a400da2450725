"""`lowrank`: `T(x) = x + U Vᵀ x`, rank `r` (`analysis.rank`): identity plus low rank, so the residual
stream is representable.

The rank-`r` `B = UVᵀ` minimises `Σ ‖(y_j − x_j) − B x_j‖² + λ‖B‖²_F`. That is reduced-rank regression
on the ridge-augmented data `[X, √λI] → [E, 0]`: `B̂ = E Xᵀ(XXᵀ + λI)⁻¹`, `U` = top-`r` left singular
vectors of the augmented fitted values `B̂[X, √λI]`, `V = B̂ᵀU` (exact for `λ > 0`). Computed through the
eigendecomposition of the smaller of the Gram matrices `XᵀX` (`k × k`) and `XXᵀ` (`d × d`), whose
eigenvalues identification computed for the neighbourhood already (`lmgeo.study_a.identification`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmgeo.study_a.classes.base import FitClass, FitContext, RefContext
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import Update, ridge_reciprocal, top_left_singular
from lmgeo.study_a.identification import GramEigen, NeighbourhoodGram
from lmgeo.study_a.reference import ridge_lstsq


class LowRankFit(NamedTuple):
    u: Tensor  # (A, d, r), orthonormal columns
    v: Tensor  # (A, d, r); the update is B = U Vᵀ

    def update(self, x_a: Tensor, p: int) -> Update:
        delta = self.u @ (self.v.transpose(1, 2) @ x_a[..., None])
        return Update(delta[..., 0], top_left_singular(self.u, self.v.transpose(1, 2), p))


def fit_lowrank(xn: Tensor, yn: Tensor, rank: int, ridge: float, eigen: GramEigen | None = None) -> LowRankFit:
    """Ridge reduced-rank regression, through the smaller of the two Gram matrices (`k × k` or `d × d`),
    whose eigendecomposition `eigen` (`NeighbourhoodGram(xn).eigen()`) is computed here when not given.

    `fitted` is any matrix with the left singular vectors of `B̂[X, √λI]`, i.e. a square root of
    `B̂(XXᵀ + λI)B̂ᵀ`; `U` is its top `rank`, and `V = B̂ᵀU`.
    """
    eigen = NeighbourhoodGram(xn).eigen() if eigen is None else eigen
    e = (yn - xn).transpose(1, 2)  # (A, d, k): updates as columns
    x_cols = xn.transpose(1, 2)  # (A, d, k): inputs as columns
    inv = ridge_reciprocal(eigen.values, ridge)
    if not eigen.primal:  # k ≤ d: kernel form, G = XᵀX = W diag(g) Wᵀ
        w, g = eigen.vectors, eigen.values
        u = _left_singular(e @ w * (g * inv).sqrt()[:, None, :], rank)
        v = x_cols @ (w @ (inv[..., None] * (w.transpose(1, 2) @ (e.transpose(1, 2) @ u))))
    else:  # primal form, C = XXᵀ = Z diag(c) Zᵀ, B̂ = E Xᵀ (C + λI)⁻¹
        z = eigen.vectors
        cross = e @ xn  # E Xᵀ
        u = _left_singular(cross @ z * inv.sqrt()[:, None, :], rank)
        v = z @ (inv[..., None] * (z.transpose(1, 2) @ (cross.transpose(1, 2) @ u)))
    return LowRankFit(u, v)


def _left_singular(m: Tensor, rank: int) -> Tensor:
    """An orthonormal basis of the span of the top-`rank` left singular vectors of `m` (A, d, n), from
    the `eigh` of the smaller Gram matrix instead of an SVD. Only the span matters: `B = UUᵀB̂`.

    `n < d`: with `mᵀm = V diag(s²) Vᵀ`, the span is that of `m V_top`, orthonormalised by QR (not
    divided by `s`, which may be zero). Otherwise the top eigenvectors of `m mᵀ` are the vectors."""
    if m.shape[-1] < m.shape[-2]:
        top = torch.linalg.eigh(m.transpose(1, 2) @ m).eigenvectors[..., -rank:]
        return torch.linalg.qr(m @ top).Q
    return torch.linalg.eigh(m @ m.transpose(1, 2)).eigenvectors[..., -rank:]


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    return fit_lowrank(xn, yn, cfg.rank, cfg.ridge, context.gram.eigen()).update(x_a, cfg.p)


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray]:
    """Reduced-rank ridge regression of the updates: (T(x_a), J − I)."""
    b_t, aug_design = ridge_lstsq(xn, yn - xn, cfg.ridge)  # (d, d) = B̂ᵀ
    fitted = aug_design @ b_t  # rows: B̂ applied to [X, √λI]
    top = np.linalg.svd(fitted)[2][: cfg.rank].T  # left singular vectors of B̂[X, √λI]
    b = top @ top.T @ b_t.T
    return xa + b @ xa, b


def needs_rank(d: int) -> int:
    return d  # below it B̂ is the minimum-norm choice on the neighbours' span, not a fact of the data


def parameters(d: int, cfg: AnalysisConfig) -> int:
    """A rank-r d × d matrix has r(2d − r) degrees of freedom (U Vᵀ = U G G⁻¹ Vᵀ for any invertible G)."""
    r = min(cfg.rank, d)
    return r * (2 * d - r)


CLASS = FitClass(
    "lowrank",
    local=True,
    fit=fit,
    reference=reference,
    summary="T(x) = x + U Vᵀ x, rank r",
    parameters=parameters,
    needs_rank=needs_rank,
)
