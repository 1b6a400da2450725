"""Building blocks of the head LMOs: unit rows, torch's own Newton–Schulz orthogonalisation (the kernel
torch.optim.Muon runs, so the spectral step is the same code in every recipe; it is private in torch, hence
pinned in constraints.txt), and the pieces of the equidistance spreading of `hilbert_equi`: nearest-row
candidates and the projection of unit rows into alignment cones."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _zeropower_via_newtonschulz,
)


def unit_rows(m: Tensor) -> Tensor:
    """Rows scaled to norm 1; zero rows stay zero (still feasible: inside every ball)."""
    return m / m.norm(dim=1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)


def orthogonalise(m: Tensor) -> Tensor:
    ortho = _zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS)
    return ortho.to(m.dtype)


def tangent_rows(u: Tensor, axes: Tensor) -> Tensor:
    """Each row of `u` with its component along the same row of the unit `axes` removed, normalised."""
    return unit_rows(u - (u * axes).sum(dim=1, keepdim=True) * axes)


def into_cones(u: Tensor, axes: Tensor, cos_min: float) -> Tensor:
    """Unit rows `u` moved, where needed, onto the boundary of the cone `⟨u_i, a_i⟩ ≥ cos_min` around
    their axis, along the great circle through the axis (the nearest point of the cone on the sphere)."""
    cosine = (u * axes).sum(dim=1, keepdim=True)
    boundary = cos_min * axes + math.sqrt(1 - cos_min * cos_min) * tangent_rows(u, axes)
    return torch.where(cosine < cos_min, boundary, u)


# Above this width the candidate search runs on a fixed random projection (Johnson–Lindenstrauss): its
# cost is V²·SKETCH_WIDTH instead of V²·d, and a pair that is close in R^d stays close in the sketch.
SKETCH_WIDTH = 64
# Rows of the V × V distance block held at once: memory O(CHUNK_ROWS · V).
CHUNK_ROWS = 512


def nearest_candidates(u: Tensor, k: int, seed: int = 0) -> Tensor:
    """(V, k) indices of each unit row's `k` nearest other rows (largest inner products): exact when the
    width is at most `SKETCH_WIDTH`, otherwise found on a seeded Gaussian sketch of the rows, renormalised
    (the caller measures the true distances to these candidates)."""
    n_rows, width = u.shape
    k = min(k, n_rows - 1)
    if width > SKETCH_WIDTH:
        gen = torch.Generator().manual_seed(seed)
        u = unit_rows(u @ torch.randn(width, SKETCH_WIDTH, generator=gen).to(u.device, u.dtype))
    found = torch.empty(n_rows, k, dtype=torch.long, device=u.device)
    for start in range(0, n_rows, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, n_rows)
        similarity = u[start:stop] @ u.T
        similarity[torch.arange(stop - start), torch.arange(start, stop)] = -math.inf  # not its own candidate
        found[start:stop] = similarity.topk(k, dim=1).indices
    return found


def nearest_among(u: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """For each row, the nearest of its candidate rows: (index, distance), computed in chunks."""
    index = torch.empty(u.shape[0], dtype=torch.long, device=u.device)
    distance = torch.empty(u.shape[0], dtype=u.dtype, device=u.device)
    rows = torch.arange(u.shape[0], device=u.device)
    for start in range(0, u.shape[0], CHUNK_ROWS):
        block = slice(start, min(start + CHUNK_ROWS, u.shape[0]))
        gaps = (u[block, None, :] - u[candidates[block]]).norm(dim=2)
        distance[block], best = gaps.min(dim=1)
        index[block] = candidates[block][rows[: len(best)], best]
    return index, distance
