"""What a neighbourhood's data determine (SPEC §4.5): per anchor, whether the local map's value at the anchor
(`value_identified`) and the map itself (`operator_identified`) are facts of the data, not of a ridge, a
starting point or the float32 rounding of the stored activations.

Everything here comes from one eigendecomposition per neighbourhood: that of the smaller Gram form of its
inputs `X` (k × d), `XᵀX` (d × d) when `k > d`, else `XXᵀ` (k × k). It is computed once, shared by every
class, and handed to the classes that factorise the same Gram anyway (`lowrank`), so that identification
costs what it guards.

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

U32 = 2.0**-24  # float32 unit roundoff: the relative rounding of every stored activation value


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


def gram_eigen(xn: Tensor) -> GramEigen:
    """`GramEigen` of the neighbourhoods' inputs `xn` (A, k, d)."""
    primal = xn.shape[1] > xn.shape[2]
    gram = xn.mT @ xn if primal else xn @ xn.mT
    values, vectors = torch.linalg.eigh(gram)
    return GramEigen(values.clamp_min(0), vectors, primal)


def identify(xn: Tensor, x_a: Tensor, eigen: GramEigen) -> Identification:
    """The input rank of each neighbourhood `xn` (A, k, d) and whether its anchor's input `x_a` (A, d) lies
    in the span of the neighbours' inputs, at the float32 resolution of the stored values."""
    frobenius_sq = eigen.values.sum(dim=-1, keepdim=True)  # ‖X‖_F²
    kept = eigen.values > U32**2 * frobenius_sq
    rank = kept.sum(dim=-1)
    smallest_kept = eigen.values.where(kept, torch.inf).amin(dim=-1)  # σ_r² (inf when r = 0)
    x_sq = x_a.square().sum(dim=-1)
    if eigen.primal:  # the component along the dropped right singular vectors, measured directly
        along = (eigen.vectors.mT @ x_a[..., None])[..., 0].square()
        outside_sq = along.where(~kept, 0.0).sum(dim=-1)
    else:  # ‖x_a‖² − ‖P_r x_a‖², P_r x_a's coordinates `uᵢᵀ X x_a / σᵢ` on the kept left singular vectors
        along = (eigen.vectors.mT @ (xn @ x_a[..., None]))[..., 0].square()
        inside_sq = (along / eigen.values.where(kept, 1.0)).where(kept, 0.0).sum(dim=-1)
        outside_sq = (x_sq - inside_sq).clamp_min(0)
    ratio = (frobenius_sq[..., 0] / smallest_kept).sqrt()  # ‖X‖_F / σ_r (0 when r = 0)
    allowed = U32 * (1 + ratio)
    in_span = outside_sq <= allowed.square() * x_sq
    return Identification(rank, in_span)



def smallest_singular(eigen: GramEigen, d: int) -> Tensor:
    """`σ_d(X)` of each neighbourhood's inputs (A,): zero when it has fewer than `d` rows."""
    if eigen.values.shape[-1] < d:
        return eigen.values.new_zeros(eigen.values.shape[:-1])
    return eigen.values[..., 0].sqrt()
