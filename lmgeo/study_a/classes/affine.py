"""`affine`: `T(x) = A x + b` on each anchor's neighbours, `A` a general `d × d` matrix and `b` a `d`-vector,
ridge on `A` (not on `b`): `global_linear`'s objective, fitted per neighbourhood instead of once for the layer,
so that locality is tested against one affine map with an affine map.

Closed form on the centred neighbours `X̃ = X − μ_x`, `Ỹ = Y − μ_y`: `Aᵀ = (X̃ᵀX̃ + λI)⁻¹ X̃ᵀỸ` (the
minimum-norm solution where `λ = 0` and `X̃` lacks rank), `b = μ_y − A μ_x`, through the eigendecomposition of
the smaller of the two Gram forms of `X̃` (`X̃ᵀX̃`, d × d, or `X̃X̃ᵀ`, k × k). `J − I = A − I`.

Identification (SPEC §4.5) is the one rule on the inputs the map sees, `x_j − μ` (`centres_inputs`): the value at
`x_a` is a fact of the data where `x_a − μ` lies in the span of the centred inputs (the neighbours' affine
span), the map itself where the centred inputs have rank `d` (so `k ≥ d + 1`: `d + 1` unknowns per output)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmgeo.study_a.classes.base import FitClass, FitContext, RefContext
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import Update, ridge_inverse, top_left_singular
from lmgeo.study_a.reference import ridge_lstsq


class AffineFit(NamedTuple):
    a_t: Tensor  # (A, d, d) Aᵀ
    x_mean: Tensor  # (A, d) μ_x
    y_mean: Tensor  # (A, d) μ_y

    def update(self, x_a: Tensor, p: int) -> Update:
        """At the anchors' inputs `x_a` (A, d); a layer-wide fit (one map, A = 1) broadcasts over them."""
        value = self.y_mean + ((x_a - self.x_mean)[:, None, :] @ self.a_t)[:, 0]
        eye = torch.eye(self.a_t.shape[-1], dtype=self.a_t.dtype, device=self.a_t.device)
        return Update(value - x_a, top_left_singular(eye[None], self.a_t.transpose(1, 2) - eye, p))


def fit_affine(xn: Tensor, yn: Tensor, ridge: float) -> AffineFit:
    """Ridge regression with an intercept of each neighbourhood's outputs `yn` on its inputs `xn` (A, k, d)."""
    x_mean, y_mean = xn.mean(dim=1), yn.mean(dim=1)
    xc, yc = xn - x_mean[:, None], yn - y_mean[:, None]
    if xn.shape[1] > xn.shape[2]:  # primal: Aᵀ = (X̃ᵀX̃ + λI)⁻¹ X̃ᵀỸ
        w, _, inv = ridge_inverse(xc.mT @ xc, ridge)
        a_t = w @ (inv[..., None] * (w.mT @ (xc.mT @ yc)))
    else:  # kernel: Aᵀ = X̃ᵀ (X̃X̃ᵀ + λI)⁻¹ Ỹ
        w, _, inv = ridge_inverse(xc @ xc.mT, ridge)
        a_t = xc.mT @ (w @ (inv[..., None] * (w.mT @ yc)))
    return AffineFit(a_t, x_mean, y_mean)


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    del context  # fitted on the centred inputs, not on the raw Gram the context holds
    return fit_affine(xn, yn, cfg.ridge).update(x_a, cfg.p)


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray]:
    """Least squares with an intercept column on the neighbours, ridge on `A` only: (T(x_a), J − I)."""
    coef = ridge_lstsq(xn, yn, cfg.ridge, intercept=True)[0]  # (d + 1, d): [Aᵀ; bᵀ]
    return coef[:-1].T @ xa + coef[-1], coef[:-1].T - np.eye(len(xa))


def needs_rank(d: int) -> int:
    return d  # of the centred inputs (k ≥ d + 1): below it A is the minimum-norm choice, not a fact of the data


def parameters(d: int, cfg: AnalysisConfig) -> int:
    del cfg
    return d * d + d


CLASS = FitClass(
    "affine",
    local=True,
    fit=fit,
    reference=reference,
    summary="T(x) = A x + b, A general, b a vector",
    parameters=parameters,
    needs_rank=needs_rank,
    centres_inputs=True,
)
