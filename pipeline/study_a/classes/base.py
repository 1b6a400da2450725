"""What a function class of Study A is (SPEC §4.2): a fit, batched over anchors, and an independent
per-anchor reference of the same map, which the tests and the bench compare it with.

A class is one module of `pipeline/study_a/classes/` defining `CLASS = FitClass(...)`, plus one line in
`pipeline/study_a/classes/__init__.py`. Everything is float64: neighbour order, rank cut-offs and the
1e-4 agreement with the reference depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import Update
from pipeline.study_a.reference import RefContext

# (inputs, outputs, at, cfg, first) -> Update. A local class gets its (A, k, d) neighbours and `at` = the
# anchors' inputs x_a (A, d), never an anchor's own output; anchors come in chunks (memory stays bounded by
# the chunk, `pipeline.study_a.fits`) and `first` is the chunk's first anchor in the layer, so that per-anchor
# randomness (the MLP's start) does not depend on the chunking. A layer-wide class gets the (n, d) pool and
# `at` = the anchors' pool rows (A,), so that it can leave each anchor's own pair out, and `first` = 0.
BatchedFit = Callable[[Tensor, Tensor, Tensor, AnalysisConfig, int], Update]
# (inputs, outputs, at, cfg, context) -> (T(x_a), J − I) for one anchor, in NumPy; `at` as for the batched fit
# (x_a for a local class, the anchor's pool row for a layer-wide one); None where the class's solve is not unique.
ReferenceFit = Callable[[np.ndarray, np.ndarray, Any, AnalysisConfig, RefContext], tuple[np.ndarray, np.ndarray] | None]


def _no_constraint(cfg: AnalysisConfig) -> str | None:
    del cfg
    return None


def _any_rank(d: int) -> int:
    del d
    return 1


@dataclass(frozen=True)
class FitClass:
    name: str
    local: bool  # fitted per anchor on its k nearest neighbours; otherwise one map for the whole layer
    fit: BatchedFit
    reference: ReferenceFit
    summary: str  # the map, in one line (the report and `lmgeo --help` show it)
    tokenwise: bool = True  # False when Δ_tok ≡ 0 (`identity`): the alignment claims are undefined
    iterative: bool = False  # fitted by an optimiser (not in closed form): agreement is to its tolerance
    # A reason the analysis params cannot be used with this class, or None.
    check_config: Callable[[AnalysisConfig], str | None] = _no_constraint
    # The rank the neighbours' inputs need, in width d, for the local map's value at the anchor to be
    # determined by the data alone (not by the ridge or a starting point); below it the anchor is degenerate.
    needs_rank: Callable[[int], int] = _any_rank
