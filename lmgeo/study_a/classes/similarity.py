"""`similarity`: `T(x) = s Q x`, `Q` orthogonal and `s > 0` (scaled Procrustes), both in closed form: `Q` is
`orthogonal`'s polar factor, `s = tr(Σ_C) / ‖X‖_F²` (`lmgeo.study_a.classes.orthogonal`). `J − I = sQ − I`."""

from __future__ import annotations

import numpy as np
from torch import Tensor

from lmgeo.study_a.classes.base import FitClass, FitContext, RefContext
from lmgeo.study_a.classes.orthogonal import fit_orthogonal, needs_rank, procrustes_reference
from lmgeo.study_a.classes.orthogonal import parameters as rotation_parameters
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import Update


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    return fit_orthogonal(xn, yn, True, context.gram).update(x_a, cfg.p)


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, _: RefContext
) -> tuple[np.ndarray, np.ndarray | None]:
    """Scaled Procrustes from NumPy's SVD: (T(x_a), J − I, None where Q is not unique)."""
    sq, unique = procrustes_reference(xn, yn, with_scale=True)
    return sq @ xa, sq - np.eye(len(xa)) if unique else None


def parameters(d: int, cfg: AnalysisConfig) -> int:
    return rotation_parameters(d, cfg) + 1  # and the scale


CLASS = FitClass(
    "similarity",
    local=True,
    fit=fit,
    reference=reference,
    summary="T(x) = s Q x, Q orthogonal, s > 0",
    parameters=parameters,
    needs_rank=needs_rank,
)
