"""`identity`: `T(x) = x`, the baseline in which the whole update is residual (`Δ_tok = 0`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pipeline.study_a.classes.base import FitClass, RefContext
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import Columns, Update


def fit(x: Tensor, y: Tensor, x_a: Tensor, cfg: AnalysisConfig) -> Update:
    del y
    return Update(torch.zeros_like(x_a), Columns(x_a.new_zeros((1, x.shape[1], cfg.p))))


def reference(x: np.ndarray, y: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext) -> tuple[np.ndarray, np.ndarray]:
    del x, y, cfg
    return xa.copy(), np.zeros((len(xa), len(xa)))


CLASS = FitClass("identity", local=False, fit=fit, reference=reference, summary="T(x) = x", tokenwise=False)
