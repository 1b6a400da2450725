"""Building blocks of the head LMOs: unit rows, and the pieces of the equidistance spreading of
`hilbert_equi`: nearest-row candidates and the projection of unit rows into alignment cones. (The spectral
LMO, Newton–Schulz, is Muon's: `pipeline.study_b.muon`.)"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Rows of a distance block held at once: memory O(CHUNK_ROWS · bucket size).
CHUNK_ROWS = 512


def _row_norms(m: Tensor) -> Tensor:
    return m.norm(dim=1, keepdim=True).clamp_min_(torch.finfo(m.dtype).tiny)


def unit_rows(m: Tensor) -> Tensor:
    """Rows scaled to norm 1; zero rows stay zero (still feasible: inside every ball)."""
    return m / _row_norms(m)


def unit_rows_(m: Tensor) -> Tensor:
    """`unit_rows` in place. At the head's size (V × d) a fresh temporary costs ~10× an in-place pass over
    it (page faults of a new mapping), so the LMOs reuse their own temporaries."""
    return m.div_(_row_norms(m))


def row_dots(a: Tensor, b: Tensor) -> Tensor:
    """(n, 1) inner products of the rows of `a` and `b`, without an (n, d) temporary (a batched matmul)."""
    return torch.bmm(a[:, None, :], b[:, :, None])[:, 0]


def tangent_rows(u: Tensor, axes: Tensor, dots: Tensor | None = None) -> Tensor:
    """Each row of `u` with its component along the same row of the unit `axes` removed, normalised;
    `dots` is `row_dots(u, axes)` where the caller has it."""
    along = row_dots(u, axes) if dots is None else dots
    return unit_rows_(torch.addcmul(u, along, axes, value=-1.0))


def on_cone_(tangents: Tensor, axes: Tensor, cos_min: float) -> Tensor:
    """In place on the unit `tangents`: the points of the cones' boundaries `⟨u_i, a_i⟩ = cos_min` in
    their directions. Returns `tangents`."""
    return tangents.mul_(math.sqrt(1 - cos_min * cos_min)).add_(axes, alpha=cos_min)


def into_cones_(u: Tensor, axes: Tensor, cos_min: float) -> Tensor:
    """In place: unit rows `u` moved, where needed, onto the boundary of the cone `⟨u_i, a_i⟩ ≥ cos_min`
    around their axis, along the great circle through the axis (the nearest point of the cone on the
    sphere). Returns `u`."""
    dots = row_dots(u, axes)
    outside = torch.nonzero(dots[:, 0] < cos_min).flatten()
    axes_out = axes[outside]
    u[outside] = on_cone_(tangent_rows(u[outside], axes_out, dots[outside]), axes_out, cos_min)
    return u


# Above this width, distances between rows are measured on a fixed random projection (Johnson–Lindenstrauss):
# close rows stay close, and the search costs V·(buckets + bucket size)·SKETCH_WIDTH instead of V²·d.
SKETCH_WIDTH = 64
# The candidate search is exact within buckets of about this many rows (one bucket, exact, up to it): an
# inverted-file index assigns each row to the nearest of V / BUCKET_ROWS random rows, so nothing is V × V.
BUCKET_ROWS = 2048


def sketch_projection(width: int, like: Tensor, seed: int = 0) -> Tensor | None:
    """None up to `SKETCH_WIDTH` columns (rows are compared as they are), else a seeded Gaussian
    (width, SKETCH_WIDTH) projection: distances between unit rows survive it to about 1/√SKETCH_WIDTH."""
    if width <= SKETCH_WIDTH:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(width, SKETCH_WIDTH, generator=gen).to(like.device, like.dtype)


def sketch(u: Tensor, projection: Tensor | None) -> Tensor:
    """The rows as compared by the candidate search: themselves, or projected and renormalised."""
    return u if projection is None else unit_rows_(u @ projection)


def nearest_candidates(s: Tensor, k: int, seed: int = 0, bucket_rows: int = BUCKET_ROWS) -> Tensor:
    """(V, k) indices of each unit row's `k` nearest other rows of its bucket (largest inner products);
    a row whose bucket has fewer than k + 1 rows lists itself in the spare places (`nearest_among` skips
    them). Exact for V ≤ `bucket_rows`."""
    n_rows = s.shape[0]
    n_buckets = max(1, n_rows // bucket_rows)
    if n_buckets == 1:
        bucket = torch.zeros(n_rows, dtype=torch.long, device=s.device)
    else:
        gen = torch.Generator().manual_seed(seed)
        centres = s[torch.randperm(n_rows, generator=gen)[:n_buckets].to(s.device)]
        bucket = torch.cat([(s[i : i + CHUNK_ROWS] @ centres.T).argmax(dim=1) for i in range(0, n_rows, CHUNK_ROWS)])
    found = torch.arange(n_rows, device=s.device)[:, None].repeat(1, k)
    for b in range(n_buckets):
        members = torch.nonzero(bucket == b).flatten()
        take = min(k, len(members) - 1)
        for start in range(0, len(members), CHUNK_ROWS) if take > 0 else ():
            block = members[start : start + CHUNK_ROWS]
            similarity = s[block] @ s[members].T
            similarity[torch.arange(len(block)), torch.arange(start, start + len(block))] = -math.inf  # not itself
            found[block, :take] = members[similarity.topk(take, dim=1).indices]
    return found


def nearest_among(s: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """For each row, the nearest of its candidate rows (itself excluded): (index, distance), in chunks."""
    index = torch.empty(s.shape[0], dtype=torch.long, device=s.device)
    distance = torch.empty(s.shape[0], dtype=s.dtype, device=s.device)
    rows = torch.arange(s.shape[0], device=s.device)
    for start in range(0, s.shape[0], CHUNK_ROWS):
        block = slice(start, min(start + CHUNK_ROWS, s.shape[0]))
        gaps = (s[block, None, :] - s[candidates[block]]).norm(dim=2)
        gaps[candidates[block] == rows[block, None]] = math.inf
        distance[block], best = gaps.min(dim=1)
        index[block] = candidates[block][torch.arange(len(best), device=s.device), best]
    return index, distance
