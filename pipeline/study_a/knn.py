"""Exact k-nearest neighbours of anchor rows within a pool, in bounded memory (SPEC §4.2).

Both sides are chunked: `chunk` anchors at a time are compared with `chunk` pool rows at a time, and
each block is merged into a running top-k. Extra memory is therefore O(chunk × (chunk + k)) whatever
the pool size (plus O(pool) for the row norms); the pool itself is only read.

Ties are broken by the lower pool index, so the result is a function of the data alone. An anchor is
excluded from its own neighbourhood by pool index, not by distance: an exact duplicate of the anchor
elsewhere in the pool is a legitimate neighbour at distance 0.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

Distance = Literal["euclidean", "cosine"]

# Norms below this count as zero for the cosine distance: such a row has cosine 0 (distance 1) to
# every other row instead of a division by zero.
_TINY_NORM = 1e-300


class Neighbours(NamedTuple):
    """`index[a]`: pool indices of anchor `a`'s neighbours, nearest first (ties: lower index first);
    `distance[a]`: their distances (Euclidean, or `1 − cos` for cosine)."""

    index: Tensor
    distance: Tensor


def nearest_neighbours(
    pool: Tensor,
    anchor_idx: Tensor,
    k: int,
    *,
    distance: Distance = "euclidean",
    seq_id: Tensor | None = None,
    chunk: int = 4096,
) -> Neighbours:
    """The `k` nearest pool rows of each anchor `pool[anchor_idx[a]]`, never the anchor itself.

    `seq_id` (one per pool row), when given, also excludes every row of the anchor's own sequence.
    Runs on the device of `pool` and in its dtype (use float64 when neighbour order must be exact).
    Raises `ValueError` when an anchor has fewer than `k` eligible neighbours.
    """
    n_pool = pool.shape[0]
    anchor_idx = anchor_idx.to(device=pool.device, dtype=torch.long)
    if pool.ndim != 2 or anchor_idx.ndim != 1:
        shapes = f"{tuple(pool.shape)} and {tuple(anchor_idx.shape)}"
        raise ValueError(f"pool must be (n, d) and anchor_idx 1-D, got {shapes}")
    if k < 1 or chunk < 1:
        raise ValueError(f"k ({k}) and chunk ({chunk}) must be positive")
    if anchor_idx.numel() and (int(anchor_idx.min()) < 0 or int(anchor_idx.max()) >= n_pool):
        raise ValueError(f"anchor indices must lie in [0, {n_pool})")
    if seq_id is not None:
        seq_id = seq_id.to(pool.device)
    row_norm = _row_norms(pool, distance)

    blocks = [
        _anchor_block(pool, row_norm, anchor_idx[a0 : a0 + chunk], k, distance, seq_id, chunk)
        for a0 in range(0, anchor_idx.numel(), chunk)
    ]
    if not blocks:
        empty = torch.empty((0, k), device=pool.device)
        return Neighbours(empty.long(), empty.to(pool.dtype))
    index = torch.cat([b.index for b in blocks])
    dist = torch.cat([b.distance for b in blocks])
    if bool(torch.isinf(dist).any()):
        short = int(torch.isinf(dist).any(dim=1).nonzero()[0])
        raise ValueError(
            f"anchor at pool row {int(anchor_idx[short])} has fewer than k={k} eligible neighbours "
            f"(pool of {n_pool}, excluding itself{' and its own sequence' if seq_id is not None else ''})"
        )
    if distance == "euclidean":
        dist = dist.sqrt()  # the merge ran on squared distances, which order the same way
    return Neighbours(index, dist)


def _row_norms(pool: Tensor, distance: Distance) -> Tensor:
    """Per-row quantity the block distance needs: ‖p‖² for Euclidean, ‖p‖ for cosine."""
    if distance == "euclidean":
        return (pool * pool).sum(dim=1)
    if distance == "cosine":
        return pool.norm(dim=1).clamp_min(_TINY_NORM)
    raise ValueError(f"unknown distance {distance!r}; expected 'euclidean' or 'cosine'")


def _anchor_block(
    pool: Tensor,
    row_norm: Tensor,
    anchors: Tensor,
    k: int,
    distance: Distance,
    seq_id: Tensor | None,
    chunk: int,
) -> Neighbours:
    """Running top-k of one block of anchors over the pool, one pool chunk at a time.

    The merge keeps the invariant "best is sorted by (distance, index)": every kept candidate comes
    from an earlier chunk, so has a lower index than the new chunk's rows, and a *stable* sort of
    [best, chunk survivors] by distance therefore orders equal distances by index.
    """
    n_anchors = anchors.numel()
    a_vec = pool[anchors]
    a_norm = row_norm[anchors]
    a_seq = seq_id[anchors] if seq_id is not None else None
    best_d = torch.full((n_anchors, k), torch.inf, dtype=pool.dtype, device=pool.device)
    best_i = torch.full((n_anchors, k), -1, dtype=torch.long, device=pool.device)
    for p0 in range(0, pool.shape[0], chunk):
        rows = torch.arange(p0, min(p0 + chunk, pool.shape[0]), device=pool.device)
        block = _block_distance(a_vec, a_norm, pool[rows], row_norm[rows], distance)
        excluded = anchors[:, None] == rows[None, :]
        if a_seq is not None:
            excluded |= a_seq[:, None] == seq_id[rows][None, :]
        block = block.masked_fill(excluded, torch.inf)
        block_d, block_i = _chunk_top_k(block, rows, k)
        cand_d = torch.cat([best_d, block_d], dim=1)
        cand_i = torch.cat([best_i, block_i], dim=1)
        order = torch.sort(cand_d, dim=1, stable=True).indices[:, :k]
        best_d = cand_d.gather(1, order)
        best_i = cand_i.gather(1, order)
    return Neighbours(best_i, best_d)


def _chunk_top_k(block: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The `k` smallest entries of each row of `block` by (distance, index), in index order.

    Only these can survive the merge, so the stable sort then runs on `2k` candidates instead of
    `k + chunk`. `topk` finds the k-th smallest distance `t` but breaks ties arbitrarily, so the
    survivors are chosen here: every entry `< t`, then the lowest-index entries `== t` up to `k`.
    """
    n_anchors, n_rows = block.shape
    if n_rows <= k:
        return block, rows.expand(n_anchors, -1)
    kth = block.topk(k, dim=1, largest=False, sorted=False).values.amax(dim=1, keepdim=True)
    below = block < kth
    tied = block == kth
    room = k - below.sum(dim=1, keepdim=True)  # how many entries at the k-th distance still fit
    keep = below | (tied & (tied.cumsum(dim=1) <= room))
    if not bool((keep.sum(dim=1) == k).all()):  # unordered values (NaN): no k-th distance to cut at
        order = torch.sort(block, dim=1, stable=True).indices[:, :k].sort(dim=1).values
        return block.gather(1, order), rows[order]
    cols = keep.nonzero()[:, 1].view(n_anchors, k)  # row-major: each row's survivors in index order
    return block.gather(1, cols), rows[cols]


def _block_distance(a: Tensor, a_norm: Tensor, p: Tensor, p_norm: Tensor, distance: Distance) -> Tensor:
    """Squared Euclidean distances (Gram form, clamped at 0) or cosine distances, anchors × rows."""
    dots = a @ p.T
    if distance == "euclidean":
        return (a_norm[:, None] + p_norm[None, :] - 2 * dots).clamp_min(0)
    return 1 - dots / (a_norm[:, None] * p_norm[None, :])
