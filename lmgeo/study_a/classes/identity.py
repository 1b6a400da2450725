"""`identity`: `T(x) = x`, the baseline in which the whole update is residual (`Δ_tok = 0`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lmgeo.study_a.classes.base import FitClass, FitContext, RefContext
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import Columns, Update


def fit(x: Tensor, y: Tensor, anchors: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    del y, context  # nothing fitted
    none = torch.zeros(1, dtype=torch.bool, device=x.device)
    return Update(torch.zeros_like(x[anchors]), Columns(x.new_zeros((1, x.shape[1], cfg.p)), none))


def reference(
    x: np.ndarray, y: np.ndarray, a: int, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray]:
    del y, cfg
    return x[a].copy(), np.zeros((x.shape[1], x.shape[1]))


def parameters(d: int, cfg: AnalysisConfig) -> int:
    del d, cfg
    return 0


CLASS = FitClass(
    "identity", local=False, fit=fit, reference=reference, summary="T(x) = x", parameters=parameters, tokenwise=False
)
