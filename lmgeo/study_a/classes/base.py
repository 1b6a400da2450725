"""What a function class of Study A is (SPEC §4.2): a fit, batched over anchors, and an independent
per-anchor reference of the same map, which the tests and the bench compare it with.

A class is one module of `lmgeo/study_a/classes/` defining `CLASS = FitClass(...)`, plus one line in
`lmgeo/study_a/classes/__init__.py`. Everything is float64: neighbour order, rank cut-offs and the
1e-4 agreement with the reference depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from torch import Tensor

from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import Update
from lmgeo.study_a.identification import NeighbourhoodGram
from lmgeo.study_a.reference import RefContext


class FitContext(NamedTuple):
    """Where a batched fit is in the layer, and what was computed for it already: `first`, the chunk's first
    anchor in the layer (per-anchor randomness, the MLP's start, does not depend on the chunking; 0 for a
    layer-wide fit); `gram`, the smaller Gram form of the inputs
    (`lmgeo.study_a.identification`), whose eigenvalues identification computed once per neighbourhood."""

    first: int
    gram: NeighbourhoodGram


# (inputs, outputs, at, cfg, context) -> Update. A local class gets its (A, k, d) neighbours and `at` = the
# anchors' inputs x_a (A, d), never an anchor's own output; anchors come in chunks (memory stays bounded by
# the chunk, `lmgeo.study_a.fits`). A local class is also fitted once on the whole layer (one
# neighbourhood of every pool row, `A = 1`, evaluated at every anchor: `at` (A, d)). A layer-wide class gets
# the (n, d) pool and `at` = the anchors' pool rows (A,), so that it can leave each anchor's own pair out, and
# a context whose `gram` is that of the pool.
BatchedFit = Callable[[Tensor, Tensor, Tensor, AnalysisConfig, FitContext], Update]
# (inputs, outputs, at, cfg, context) -> (T(x_a), J − I) for one anchor, in NumPy; `at` as for the batched fit
# (x_a for a local class, the anchor's pool row for a layer-wide one); J − I is None where the class's own solve
# leaves the operator undetermined (its value may still be: the span test decides, SPEC §4.5).
ReferenceFit = Callable[[np.ndarray, np.ndarray, Any, AnalysisConfig, RefContext], tuple[np.ndarray, np.ndarray | None]]


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
    # Free parameters of one map in width d (its capacity: the claims order classes by it).
    parameters: Callable[[int, AnalysisConfig], int]
    tokenwise: bool = True  # False when Δ_tok ≡ 0 (`identity`): the alignment claims are undefined
    # Fitted by an optimiser (not in closed form): agreement with its reference is to its tolerance.
    iterative: bool = False
    # A linear map of x (every class but the MLP): the expressivity trade-off compares each local class that is
    # not with each that is (the paper: "small MLPs instead of linear maps").
    linear: bool = True
    # Tested and reported beside the paper's classes, but never deciding a claim's verdict (SPEC §4.5).
    diagnostic: bool = False
    # A reason the analysis params cannot be used with this class, or None.
    check_config: Callable[[AnalysisConfig], str | None] = _no_constraint
    # The rank the neighbours' inputs need, in width d, for the local map itself to be determined by the data
    # alone (not by the ridge or a starting point): below it the anchor's operator is not identified.
    needs_rank: Callable[[int], int] = _any_rank
    # Whether the map sees its inputs centred on the neighbours' mean (`mlp`): its identification (SPEC §4.5) is
    # then decided on the centred inputs, `x_j − μ` and `x_a − μ` (the affine span, and its rank), by the same
    # rule as every other class's on the raw inputs (the linear span).
    centres_inputs: bool = False
