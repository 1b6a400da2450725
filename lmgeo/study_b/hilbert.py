"""Hilbert-projective geometry of LM-head updates (SPEC §3.1).

Head `z = W h`, `p = softmax(z)`. The Hilbert metric between output distributions equals the
oscillation of the logit change, and its worst case over `‖h‖ ≤ r` is `r · diam(ΔW)`, the largest
distance between two rows of the update. Everything here is shift-invariant in the rows, because
softmax is blind to common row shifts `1cᵀ`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

# Pairwise distances are computed in float64: the Gram form ‖a‖² + ‖b‖² − 2aᵀb then has a rounding
# error far below any distance we care about, and on GPUs float64 sidesteps TF32 matmuls silently
# rounding to 10 bits.
_EXACT = torch.float64


class Diameter(NamedTuple):
    """`value = ‖w_i − w_j‖₂`, the largest row distance found; `sampled` marks a row-sample estimate
    (a lower bound of the true diameter)."""

    value: float
    i: int
    j: int
    sampled: bool = False

    def __float__(self) -> float:
        return self.value


def osc(dz: Tensor) -> Tensor:
    """Oscillation `max_i dz_i − min_j dz_j` over the last dimension."""
    return dz.amax(dim=-1) - dz.amin(dim=-1)


def hilbert_distance(p: Tensor, q: Tensor) -> Tensor:
    """`d_H(p, q) = max_i log(p_i/q_i) − min_j log(p_j/q_j)` for distributions in the open simplex
    (strictly positive entries; the metric is infinite on its boundary)."""
    if bool((p <= 0).any()) or bool((q <= 0).any()):
        raise ValueError("hilbert_distance needs strictly positive probabilities (the open simplex)")
    return osc(torch.log(p) - torch.log(q))


def hilbert_distance_logits(z1: Tensor, z2: Tensor) -> Tensor:
    """`d_H(softmax z1, softmax z2)` from logits, through log-probabilities so nothing underflows."""
    return osc(torch.log_softmax(z1, dim=-1) - torch.log_softmax(z2, dim=-1))


def center_rows(m: Tensor) -> Tensor:
    """Subtract the mean row: the orthogonal projection `(I − 11ᵀ/V) M` that removes common row
    shifts `1cᵀ`, the kernel of `diam` and the directions softmax cannot see."""
    return m - m.mean(dim=0, keepdim=True)


def _centred_exact(w: Tensor) -> Tensor:
    """Rows in float64, centred: distances are unchanged, and afterwards every row norm is at most the
    diameter (the mean lies in the rows' convex hull), so the Gram form cannot cancel
    catastrophically even when the rows share a large common offset."""
    return center_rows(w.detach().to(_EXACT))


def _gram_sq_distances(a: Tensor, sq_a: Tensor, b: Tensor, sq_b: Tensor) -> Tensor:
    return (sq_a[:, None] + sq_b[None, :] - 2.0 * (a @ b.T)).clamp_min_(0.0)


@torch.no_grad()
def diam(w: Tensor, chunk_rows: int = 1024) -> Diameter:
    """Exact `max_{i,j} ‖w_i − w_j‖₂` and a maximising pair, in memory `O(chunk_rows · V)`.

    The chunked Gram form finds every pair within its rounding bound of the largest squared distance;
    those candidates are then re-evaluated in difference form, so the result is the exact maximum
    (to float64 rounding of one difference norm), not an estimate.
    """
    if w.ndim != 2:
        raise ValueError(f"diam needs a 2-D matrix of rows, got shape {tuple(w.shape)}")
    n_rows, width = w.shape
    if n_rows < 2:
        return Diameter(0.0, 0, 0)
    x = _centred_exact(w)
    sq = (x * x).sum(dim=1)
    # A pair's Gram estimate is off by at most 4γ·max‖x‖² (γ = (width+2)·eps, the dot-product bound),
    # so the true maximiser's estimate lies within twice that of the largest estimate.
    tolerance = 8.0 * (width + 4) * torch.finfo(_EXACT).eps * float(sq.max())
    best = -1.0
    rows = cols = torch.empty(0, dtype=torch.long, device=x.device)
    kept = torch.empty(0, dtype=_EXACT, device=x.device)
    for start in range(0, n_rows, chunk_rows):
        stop = min(start + chunk_rows, n_rows)
        # Upper triangle only: pairs (i, j) with j ≥ start cover every unordered pair once.
        d2 = _gram_sq_distances(x[start:stop], sq[start:stop], x[start:], sq[start:])
        best = max(best, float(d2.max()))
        new_rows, new_cols = _near_maximum(d2, best - tolerance)
        rows = torch.cat([rows, new_rows + start])
        cols = torch.cat([cols, new_cols + start])
        kept = torch.cat([kept, d2[new_rows, new_cols]])
        rows, cols, kept = _prune(rows, cols, kept, best - tolerance)
    return _exact_max_pair(w, rows, cols)


@torch.no_grad()
def diam_upper(w: Tensor, chunk_rows: int = 1024) -> float:
    """An upper bound of `diam(w)`, tight to the rounding of one float32 Gram form (relative ~(d+4)·eps,
    1e-5 at d = 64): the largest squared distance of the rows, centred in float64, in the Gram form plus
    that form's rounding bound. Cheap enough to cap a step every training step, where `diam`'s float64
    search would cost more than the step."""
    x = _centred_exact(w).float()
    sq = (x * x).sum(dim=1)
    best = 0.0
    for start in range(0, x.shape[0], chunk_rows):
        # Each pair once (a chunk against itself and the rows after it), and ‖a‖² added after the row
        # maximum: one fused matmul and one reduction per chunk, the cost of a cap every training step.
        a, rest = x[start : start + chunk_rows], x[start:]
        row_max = torch.addmm(sq[None, start:], a, rest.T, alpha=-2.0).amax(dim=1)
        best = max(best, float((row_max + sq[start : start + chunk_rows]).max()))
    # Centring and the Gram form each err by at most a few (width+4)·eps·max‖x‖² (see `diam`).
    tolerance = 16.0 * (x.shape[1] + 4) * torch.finfo(x.dtype).eps * float(sq.max())
    return math.sqrt(best + tolerance)


# Beyond this many near-maximal pairs (e.g. two antipodal clusters of rows), keeping only the largest
# estimates costs at most the Gram rounding bound, ~1e-12 relative, and keeps memory bounded.
_MAX_CANDIDATES = 16384


def _near_maximum(d2: Tensor, floor: float) -> tuple[Tensor, Tensor]:
    near = d2 >= floor
    if int(near.sum()) <= _MAX_CANDIDATES:
        rows, cols = torch.nonzero(near, as_tuple=True)  # d2 is a matrix: two index tensors
        return rows, cols
    flat = d2.flatten().topk(_MAX_CANDIDATES).indices
    return flat // d2.shape[1], flat % d2.shape[1]


def _prune(rows: Tensor, cols: Tensor, d2: Tensor, floor: float) -> tuple[Tensor, Tensor, Tensor]:
    """Drop candidates a later, larger maximum has overtaken; cap how many stay."""
    keep = d2 >= floor
    rows, cols, d2 = rows[keep], cols[keep], d2[keep]
    if len(d2) > _MAX_CANDIDATES:
        top = d2.topk(_MAX_CANDIDATES).indices
        rows, cols, d2 = rows[top], cols[top], d2[top]
    return rows, cols, d2


def _exact_max_pair(w: Tensor, rows: Tensor, cols: Tensor) -> Diameter:
    """The largest `‖w_i − w_j‖` over the candidate pairs, in difference form (no cancellation)."""
    dist = (w[rows].to(_EXACT) - w[cols].to(_EXACT)).norm(dim=1)
    k = int(dist.argmax())
    return Diameter(float(dist[k]), int(rows[k]), int(cols[k]))


@torch.no_grad()
def diam_sampled(w: Tensor, n_rows: int, seed: int = 0, chunk_rows: int = 1024) -> Diameter:
    """`diam` of a seeded sample of `n_rows` rows (a lower bound), with indices into `w`. The same
    seed and shape give the same rows, so estimates along a run are comparable."""
    sample = row_sample(w.shape[0], n_rows, seed).to(w.device)
    found = diam(w[sample], chunk_rows)
    return Diameter(found.value, int(sample[found.i]), int(sample[found.j]), sampled=len(sample) < w.shape[0])


def row_sample(n_total: int, n_rows: int, seed: int) -> Tensor:
    """A fixed random subset of `min(n_rows, n_total)` row indices (CPU generator: device-independent)."""
    order = torch.randperm(n_total, generator=torch.Generator().manual_seed(seed))
    return order[:n_rows]


@torch.no_grad()
def eccentricities(w: Tensor, chunk_rows: int = 1024) -> Tensor:
    """Per row, the largest distance to any other row (float64, chunked); its maximum is `diam(w)`."""
    x = _centred_exact(w)
    sq = (x * x).sum(dim=1)
    out = torch.empty(w.shape[0], dtype=_EXACT, device=x.device)
    for start in range(0, w.shape[0], chunk_rows):
        stop = min(start + chunk_rows, w.shape[0])
        out[start:stop] = _gram_sq_distances(x[start:stop], sq[start:stop], x, sq).amax(dim=1)
    return out.sqrt_()


@torch.no_grad()
def equi_ratio(w: Tensor, sample_rows: int = 1024, seed: int = 0) -> float:
    """Min/max pairwise distance among a fixed sample of at most `sample_rows` rows: 1 for
    equidistant rows, near 0 when some rows (almost) coincide. NaN when all sampled rows coincide."""
    x = _centred_exact(w[row_sample(w.shape[0], sample_rows, seed).to(w.device)])
    if x.shape[0] < 2:
        raise ValueError("equi_ratio needs at least two rows")
    sq = (x * x).sum(dim=1)
    dist = _gram_sq_distances(x, sq, x, sq).sqrt_()
    off_diagonal = ~torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
    largest = float(dist[off_diagonal].max())
    return float(dist[off_diagonal].min()) / largest if largest > 0 else float("nan")


def equi_ratio_random(n_rows: int, width: int, seed: int = 0) -> float:
    """`equi_ratio` of `n_rows` random unit rows in R^width (seeded): the baseline a spreading step is
    measured against, on a sample of the same shape."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n_rows, width, generator=gen, dtype=_EXACT)
    return equi_ratio(rows / rows.norm(dim=1, keepdim=True), sample_rows=n_rows)


def equi_ratio_bound(n_rows: int, width: int) -> float:
    """The largest `equi_ratio` any `n_rows` points of R^width can have (a Welch-type bound, SPEC §3.1):
    `(1 + √((n − d − 1)/(d·n)))^(−1/2)`, 1 when n ≤ d + 1 (a regular simplex is equidistant)."""
    excess = n_rows - width - 1
    return 1.0 if excess <= 0 else (1.0 + math.sqrt(excess / (width * n_rows))) ** -0.5
