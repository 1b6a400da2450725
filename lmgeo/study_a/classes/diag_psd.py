"""`diag_psd`: `T(x) = D x`, `D` diagonal and `D ≥ 0`.

`d_c = max(0, Σ x_c y_c / (Σ x_c² + λ))`, the per-coordinate ridge solution projected on `D ≥ 0` (exact,
since the coordinates decouple). `J − I = D − I` is diagonal, so its dominant subspace is spanned by
coordinate axes (`CoordinateAxes`, O(A·d) instead of a dense basis)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmgeo.study_a.classes.base import FitClass, FitContext, RefContext
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import Update, coordinate_basis
from lmgeo.study_a.reference import ridge_lstsq


class DiagFit(NamedTuple):
    diag: Tensor  # (A, d), non-negative

    def update(self, x_a: Tensor, p: int) -> Update:
        return Update((self.diag - 1) * x_a, coordinate_basis(self.diag - 1, p))


def fit_diag_psd(xn: Tensor, yn: Tensor, ridge: float) -> DiagFit:
    num = (xn * yn).sum(dim=1)
    den = (xn * xn).sum(dim=1) + ridge
    ratio = torch.where(den > 0, num / den.where(den > 0, 1.0), 0.0)  # an all-zero coordinate gets 0
    return DiagFit(ratio.clamp_min(0))


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    del context  # a closed form per coordinate: nothing drawn, no Gram needed
    return fit_diag_psd(xn, yn, cfg.ridge).update(x_a, cfg.p)


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray]:
    """One ridge regression per coordinate, clamped at 0: (T(x_a), J − I)."""
    coords = range(xn.shape[1])
    diag = np.array([max(0.0, ridge_lstsq(xn[:, [c]], yn[:, [c]], cfg.ridge)[0][0, 0]) for c in coords])
    return diag * xa, np.diag(diag) - np.eye(len(xa))


def parameters(d: int, cfg: AnalysisConfig) -> int:
    del cfg
    return d


CLASS = FitClass(
    "diag_psd",
    local=True,
    fit=fit,
    reference=reference,
    summary="T(x) = D x, D diagonal, D ≥ 0",
    parameters=parameters,
)
