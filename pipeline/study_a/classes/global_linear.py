"""`global_linear`: one affine map `T(x) = A x + b` for the whole layer, ridge on `A` (not on `b`), fitted
on the whole finite pool. The baseline without locality."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.study_a.classes.base import FitClass, RefContext
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import Update, ridge_inverse, top_left_singular
from pipeline.study_a.reference import ridge_lstsq


class GlobalLinearFit(NamedTuple):
    a: Tensor  # (d, d)
    b: Tensor  # (d,)

    def update(self, x_a: Tensor, p: int) -> Update:
        eye = torch.eye(self.a.shape[0], dtype=self.a.dtype, device=self.a.device)
        basis = top_left_singular(eye[None], (self.a - eye)[None], p)
        return Update(x_a @ self.a.T + self.b - x_a, basis)


def fit_global_linear(x: Tensor, y: Tensor, ridge: float) -> GlobalLinearFit:
    x_mean, y_mean = x.mean(dim=0), y.mean(dim=0)
    xc, yc = x - x_mean, y - y_mean
    w, _, inv = ridge_inverse(xc.T @ xc, ridge)
    a = (w @ (inv[:, None] * (w.T @ (xc.T @ yc)))).T  # Aᵀ = (XᵀX + λI)⁻¹ XᵀY on centred data
    return GlobalLinearFit(a, y_mean - a @ x_mean)


# -------------------------------------------------------------------------------------- geometry


def fit(x: Tensor, y: Tensor, x_a: Tensor, cfg: AnalysisConfig) -> Update:
    return fit_global_linear(x, y, cfg.ridge).update(x_a, cfg.p)


def reference(x: np.ndarray, y: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext) -> tuple[np.ndarray, np.ndarray]:
    """Least squares with an intercept on the whole pool: (T(x_a), J − I)."""
    coef = ridge_lstsq(x, y, cfg.ridge, intercept=True)[0]
    a_mat, b_vec = coef[:-1].T, coef[-1]
    return a_mat @ xa + b_vec, a_mat - np.eye(len(xa))


CLASS = FitClass("global_linear", local=False, fit=fit, reference=reference, summary="one affine map for the whole layer")
