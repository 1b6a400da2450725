"""`global_linear`: one affine map `T(x) = A x + b` for the whole layer, ridge on `A` (not on `b`), fitted
on the finite pool. The baseline without locality.

It is evaluated out of sample, like the local classes (whose neighbourhoods never hold the anchor's own
pair): `T_{−i}(x_i)` is the map fitted on the pool without anchor `i`, by the exact leave-one-out identity
of a linear smoother, `y_i − T_{−i}(x_i) = (y_i − T(x_i)) / (1 − H_ii)` with the leverage
`H_ii = 1/n + x̃_iᵀ(X̃ᵀX̃ + λI)⁻¹x̃_i` (X̃ centred). The dominant subspace is that of the full fit's `A − I`."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmgeo.study_a.classes.base import FitClass, FitContext, RefContext
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import Update, ridge_inverse, top_left_singular
from lmgeo.study_a.reference import ridge_lstsq


class GlobalLinearFit(NamedTuple):
    a: Tensor  # (d, d)
    b: Tensor  # (d,)
    leverage: Tensor  # (n,) H_ii of every pool row

    def update(self, x: Tensor, y: Tensor, anchors: Tensor, p: int) -> Update:
        eye = torch.eye(self.a.shape[0], dtype=self.a.dtype, device=self.a.device)
        basis = top_left_singular(eye[None], (self.a - eye)[None], p)
        x_a, y_a = x[anchors], y[anchors]
        residual = (y_a - x_a @ self.a.T - self.b) / (1 - self.leverage[anchors])[:, None]  # left out
        return Update(y_a - residual - x_a, basis)


def fit_global_linear(x: Tensor, y: Tensor, ridge: float) -> GlobalLinearFit:
    x_mean, y_mean = x.mean(dim=0), y.mean(dim=0)
    xc, yc = x - x_mean, y - y_mean
    w, _, inv = ridge_inverse(xc.T @ xc, ridge)
    a = (w @ (inv[:, None] * (w.T @ (xc.T @ yc)))).T  # Aᵀ = (XᵀX + λI)⁻¹ XᵀY on centred data
    leverage = 1 / len(x) + ((xc @ w).square() * inv).sum(dim=1)
    return GlobalLinearFit(a, y_mean - a @ x_mean, leverage)


def fit(x: Tensor, y: Tensor, anchors: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    del context  # one map for the layer, fitted on the centred pool (not the Gram the context holds)
    return fit_global_linear(x, y, cfg.ridge).update(x, y, anchors, cfg.p)


def reference(
    x: np.ndarray, y: np.ndarray, a: int, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray]:
    """Least squares with an intercept on the pool without row `a`: (T_{−a}(x_a), J − I of the full fit)."""
    others = np.arange(len(x)) != a
    coef = ridge_lstsq(x[others], y[others], cfg.ridge, intercept=True)[0]
    full = ridge_lstsq(x, y, cfg.ridge, intercept=True)[0]
    return coef[:-1].T @ x[a] + coef[-1], full[:-1].T - np.eye(x.shape[1])


def parameters(d: int, cfg: AnalysisConfig) -> int:
    del cfg
    return d * d + d


CLASS = FitClass(
    "global_linear",
    local=False,
    fit=fit,
    reference=reference,
    summary="one affine map for the whole layer, left out at each anchor",
    parameters=parameters,
)
