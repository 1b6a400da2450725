"""What a neighbourhood's data determine (SPEC §4.5): per anchor, whether the local map's value at the anchor
(`value_identified`) and the map itself (`operator_identified`) are facts of the data, not of a ridge, a
starting point or the float32 rounding of the stored activations.

Everything here comes from the eigenvalues of one Gram matrix per neighbourhood, that of the smaller Gram form
of its inputs `X` (k × d), `XᵀX` (d × d) when `k > d`, else `XXᵀ` (k × k), computed once and shared by every
class (`NeighbourhoodGram`). Eigenvectors cost about six times the eigenvalues, so they are computed only where
something needs them: the span test of an anchor whose neighbours' inputs lack full rank (or, with `k ≤ d`,
every anchor's), and the classes that factorise the same Gram anyway (`lowrank`, through `eigen()`), so that
identification costs what it guards.

Cut-offs (each is the float32 rounding of the stored values, nothing tuned):
- The stored inputs carry a relative rounding `u = 2⁻²⁴` per value, so the matrix the data stand for differs
  from the stored `X` by `E` with `‖E‖₂ ≤ ‖E‖_F ≤ u‖X‖_F`. A singular value `σᵢ ≤ u‖X‖_F` may be created or
  removed by that rounding (Weyl): the *input rank* `r` counts those above it.
- `x_a` lies in the span of its neighbours' inputs when its component outside the top-`r` right singular
  subspace is no larger than rounding can make it: `‖(I − P_r) x_a‖ ≤ u (1 + ‖X‖_F / σ_r) ‖x_a‖` (its own
  rounding, `u‖x_a‖`, plus the tilt of the span by `E`, at most `‖E‖₂ / σ_r`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lmgeo.study_a.solvers import LAPACK, U32, GramSpectrum, solver_for


class GramEigen(NamedTuple):
    """The eigendecomposition of the smaller Gram form of each neighbourhood's inputs (A, k, d):
    `primal`: of `XᵀX` (d × d, when k > d), else of `XXᵀ` (k × k); eigenvalues ascending, clamped at 0."""

    values: Tensor  # (A, m)
    vectors: Tensor  # (A, m, m)
    primal: bool


class Identification(NamedTuple):
    """Per anchor: the input rank `r` and whether `x_a` lies in the span of its neighbours' inputs."""

    input_rank: Tensor  # (A,) int64
    in_span: Tensor  # (A,) bool


class NeighbourhoodGram:
    """The smaller Gram form of the neighbourhoods' inputs `xn` (A, k, d): its eigenvalues (`values`, ascending,
    clamped at 0) and its eigendecomposition (`eigen()`), each computed on first use and kept."""

    def __init__(self, xn: Tensor) -> None:
        self.primal = xn.shape[1] > xn.shape[2]
        self.matrix = xn.mT @ xn if self.primal else xn @ xn.mT
        self._spectrum: GramSpectrum | None = None
        self._eigen: GramEigen | None = None

    def spectrum(self) -> GramSpectrum:
        """What identification reads of the eigenvalues (trace, which are kept, the smallest), from the device's
        solver (`lmgeo.study_a.solvers`: every eigenvalue on the CPU, a Cholesky test on CUDA)."""
        if self._spectrum is None:
            self._spectrum = solver_for(self.matrix.device).spectrum(self.matrix)
        return self._spectrum

    @property
    def values(self) -> Tensor:
        """Every eigenvalue (ascending, clamped at 0): the spectrum's where its solver computed them."""
        found = self.spectrum().values
        if found is None:
            found = LAPACK.eigenvalues(self.matrix)
            assert self._spectrum is not None  # set by self.spectrum() above
            self._spectrum = self._spectrum._replace(values=found)
        return found

    def eigen(self) -> GramEigen:
        if self._eigen is None:
            values, vectors = torch.linalg.eigh(self.matrix)
            self._eigen = GramEigen(values.clamp_min(0), vectors, self.primal)
        return self._eigen

    def vectors(self, which: Tensor) -> Tensor:
        """The eigenvectors of the neighbourhoods `which` (a mask), ascending as `values`; each matrix's
        decomposition is its own, so it does not depend on which others are decomposed with it."""
        if self._eigen is not None:
            return self._eigen.vectors[which]
        return torch.linalg.eigh(self.matrix[which]).eigenvectors


def identify(xn: Tensor, x_a: Tensor, gram: NeighbourhoodGram) -> Identification:
    """The input rank of each neighbourhood `xn` (A, k, d) and whether its anchor's input `x_a` (A, d) lies
    in the span of the neighbours' inputs, at the float32 resolution of the stored values."""
    spectrum = gram.spectrum()
    frobenius_sq = spectrum.trace[..., None]  # ‖X‖_F²
    kept = spectrum.kept
    rank = spectrum.rank
    smallest_kept = spectrum.smallest_kept  # σ_r² (inf when r = 0)
    x_sq = x_a.square().sum(dim=-1)
    if gram.primal:  # the component along the dropped right singular vectors: none where every one is kept
        outside_sq = x_sq.new_zeros(x_sq.shape)
        deficient = ~kept.all(dim=-1)  # per neighbourhood
        if deficient.any():
            per_anchor = deficient.shape == x_sq.shape  # else one neighbourhood (the layer's) for every anchor
            at, dropped = (x_a[deficient], ~kept[deficient]) if per_anchor else (x_a, ~kept)
            outside = (gram.vectors(deficient).mT @ at[..., None])[..., 0].square().where(dropped, 0.0).sum(dim=-1)
            if per_anchor:
                outside_sq[deficient] = outside
            else:
                outside_sq = outside
    else:  # ‖x_a‖² − ‖P_r x_a‖², P_r x_a's coordinates `uᵢᵀ X x_a / σᵢ` on the kept left singular vectors
        along = (gram.eigen().vectors.mT @ (xn @ x_a[..., None]))[..., 0].square()  # kept for `lowrank`
        inside_sq = (along / gram.values.where(kept, 1.0)).where(kept, 0.0).sum(dim=-1)
        outside_sq = (x_sq - inside_sq).clamp_min(0)
    ratio = (frobenius_sq[..., 0] / smallest_kept).sqrt()  # ‖X‖_F / σ_r (0 when r = 0)
    allowed = U32 * (1 + ratio)
    in_span = outside_sq <= allowed.square() * x_sq
    return Identification(rank, in_span)


def smallest_singular(gram: NeighbourhoodGram, d: int) -> Tensor:
    """`σ_d(X)` of each neighbourhood's inputs (A,): zero when it has fewer than `d` rows."""
    smallest = gram.spectrum().smallest
    if gram.matrix.shape[-1] < d:
        return smallest.new_zeros(smallest.shape)
    return smallest.sqrt()
