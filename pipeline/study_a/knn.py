"""Exact k-nearest neighbours of anchor rows within a pool, in bounded memory (SPEC §4.2).

Two passes. A float32 pass over the pool keeps each anchor's `k + slack` best candidates, `chunk` anchors
at a time. On the CPU that pass is FAISS's exact search (`knn_L2sqr`, the kernel behind `IndexFlatL2`,
run on the float32 copy in place; cosine: on the L2-normalised rows, whose squared distance `2 − 2 cos`
ranks the same), asked for as many more rows as the exclusions can remove. On an accelerator, or where
FAISS is not installed (the CUDA check machines), it is the Gram form in torch, `chunk` pool rows at a
time merged with `topk`. Float32 rounding can misorder rows whose distances differ by less than a bound
`ε` on its error, so every row within `2ε` of the k-th candidate must be among those kept; an anchor for
which that is not so (many rows tied at its k-th distance, e.g. copies of one token) is searched again
exactly over the whole pool. The candidates within `2ε` of the k-th (the only ones that can be among the
k nearest) are then ranked by their exact float64 distances, computed from the differences themselves
(never through a matmul, whose rounding depends on where a row sits in a block): bit-identical rows get
bit-identical distances, and ties are broken by the lower pool index. The result is a function of the
data alone, the same bit for bit from either backend.

Speed: the float32 pass is FAISS's own; the float32 copy and the exact re-rank come on top (`lmgeo bench`
compares the whole call with FAISS's `IndexFlatL2` alone).

Memory: the float32 copy and the row norms, O(pool); per block of anchors, FAISS's candidates
O(chunk × (k + slack + excluded rows)) and its 4096 × 1024 float32 distance tile, or torch's
O(chunk × (chunk + k)); the exact distances gather at most 4 MiB of rows at a time on the CPU.
An anchor is excluded from its own neighbourhood by pool index, not by distance: an exact duplicate of the
anchor elsewhere in the pool is a legitimate neighbour at distance 0.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Literal, NamedTuple

import torch
from torch import Tensor

Distance = Literal["euclidean", "cosine"]

# Norms below this count as zero for the cosine distance: such a row has cosine 0 (distance 1) to
# every other row instead of a division by zero.
_TINY_NORM = 1e-300
_U32 = 2.0**-24  # float32 unit roundoff
_CACHED_VALUES = 2**19  # candidate values gathered at once for the exact distances on the CPU (4 MiB in float64)


@functools.cache
def _faiss() -> ModuleType | None:
    """FAISS, where it is installed (every CPU install; the CUDA check machines go without it)."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


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
    Distances are exact in the dtype of `pool` (float64 for the fits). Raises `ValueError` when an anchor
    has fewer than `k` eligible neighbours.
    """
    n_pool = pool.shape[0]
    anchor_idx = anchor_idx.to(device=pool.device, dtype=torch.long)
    if pool.ndim != 2 or anchor_idx.ndim != 1:
        shapes = f"{tuple(pool.shape)} and {tuple(anchor_idx.shape)}"
        raise ValueError(f"pool must be (n, d) and anchor_idx 1-D, got {shapes}")
    if k < 1 or chunk < 1:
        raise ValueError(f"k ({k}) and chunk ({chunk}) must be positive")
    if distance not in ("euclidean", "cosine"):
        raise ValueError(f"unknown distance {distance!r}; expected 'euclidean' or 'cosine'")
    if anchor_idx.numel() and (int(anchor_idx.min()) < 0 or int(anchor_idx.max()) >= n_pool):
        raise ValueError(f"anchor indices must lie in [0, {n_pool})")
    if seq_id is not None:
        seq_id = seq_id.to(pool.device)
    search = _Search(pool, distance, seq_id, k, chunk)
    blocks = [search.block(anchor_idx[a0 : a0 + chunk]) for a0 in range(0, anchor_idx.numel(), chunk)]
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
    return Neighbours(index, dist)


class _Search:
    """The pool prepared once (float32 copy, norms, the rounding bound) for every anchor block."""

    def __init__(self, pool: Tensor, distance: Distance, seq_id: Tensor | None, k: int, chunk: int) -> None:
        self.pool, self.distance, self.seq_id, self.k, self.chunk = pool, distance, seq_id, k, chunk
        self.keep = min(pool.shape[0], k + max(8, k // 4))  # candidates kept per anchor
        norms = pool.norm(dim=1)
        if distance == "cosine":  # unit rows: the squared Euclidean distance is 2 − 2 cos, the same ranking
            self.approx = (pool / norms.clamp_min(_TINY_NORM)[:, None]).float().contiguous()
            scale = torch.full_like(norms, 4.0)  # unit vectors: (‖a‖ + ‖p‖)² = 4
        else:
            self.approx = pool.float().contiguous()  # C order: FAISS reads it in place
            scale = (norms + norms.max()).square()
        # |float32 distance − exact| ≤ (d + 8)·u·(‖a‖ + ‖p‖)², rounding of the inputs included; doubled. Both
        # backends compute a squared distance as ‖a‖² + ‖p‖² − 2 a·p (torch leaves out the constant ‖a‖²):
        # each of the three float32 dot products of length d is off by at most d·u times its factors' norms,
        # which sum to (‖a‖ + ‖p‖)²; the two additions and the float64 → float32 inputs add at most 4u of it,
        # and FAISS's clamp of negative sums to 0 only moves a value towards the true one (≥ 0). (For small
        # searches FAISS sums (a − p)² row by row instead, whose error is smaller still.)
        self.error = 2 * (pool.shape[1] + 8) * _U32 * scale
        # At most this many of an anchor's nearest rows are excluded: itself, or every row of its sequence.
        self.skipped = 1 if seq_id is None else int(torch.unique(seq_id, return_counts=True)[1].max())
        self.faiss = _faiss() if pool.device.type == "cpu" else None

    def block(self, anchors: Tensor) -> Neighbours:
        cand_d, cand_i = self._faiss_candidates(anchors) if self.faiss else self._gram_candidates(anchors)
        kth = cand_d[:, self.k - 1 : self.k]
        # A row farther than this (in float32) has k rows exactly closer, so it is not among the k nearest.
        reach = kth + 2 * self.error[anchors, None]
        covered = (cand_d[:, -1:] > reach) | torch.isinf(kth)
        if self.keep == self.pool.shape[0]:
            covered[:] = True
        index = torch.empty((anchors.numel(), self.k), dtype=torch.long, device=self.pool.device)
        dist = torch.empty((anchors.numel(), self.k), dtype=self.pool.dtype, device=self.pool.device)
        ok = covered[:, 0]
        within = (cand_d[ok] <= reach[ok]).sum(dim=1)  # the sorted candidates' prefix that can be among them
        band = int(within.max()) if within.numel() else self.k
        index[ok], dist[ok] = self._exact_top_k(anchors[ok], cand_i[ok, :band])
        for a in (~ok).nonzero()[:, 0].tolist():  # rows tied beyond the slack: rank the whole pool exactly
            everything = torch.arange(self.pool.shape[0], device=self.pool.device)[None]
            index[a], dist[a] = (t[0] for t in self._exact_top_k(anchors[a : a + 1], everything))
        return Neighbours(index, dist)

    def _faiss_candidates(self, anchors: Tensor) -> tuple[Tensor, Tensor]:
        """`_gram_candidates` by FAISS's exact float32 search (`knn_L2sqr`, the kernel of `IndexFlatL2`
        without copying the pool into an index): enough rows that, the anchor and its own sequence
        dropped, `keep` eligible ones remain."""
        searched = min(self.pool.shape[0], self.keep + self.skipped)
        self.faiss.omp_set_num_threads(torch.get_num_threads())  # the task's share of the cores
        dist, index = self.faiss.knn(self.approx[anchors].numpy(), self.approx.numpy(), searched)
        dist, index = torch.from_numpy(dist), torch.from_numpy(index)
        excluded = self._excluded_rows(anchors, index)
        # A stable sort on the flag moves the eligible rows first, still nearest first.
        order = excluded.to(torch.uint8).argsort(dim=1, stable=True)[:, : self.keep]
        short = excluded.gather(1, order)  # only when the search took the whole pool
        return dist.gather(1, order).masked_fill(short, torch.inf), index.gather(1, order).masked_fill(short, -1)

    def _gram_candidates(self, anchors: Tensor) -> tuple[Tensor, Tensor]:
        """Each anchor's `keep` smallest float32 distances (sorted) and their pool rows, excluded rows at
        `inf`: the Gram form in blocks of `chunk` pool rows, merged with `topk` (any device)."""
        n = anchors.numel()
        a_vec = self.approx[anchors]
        best_d = torch.full((n, 0), torch.inf, dtype=torch.float32, device=self.pool.device)
        best_i = torch.full((n, 0), -1, dtype=torch.long, device=self.pool.device)
        for p0 in range(0, self.pool.shape[0], self.chunk):
            rows = torch.arange(p0, min(p0 + self.chunk, self.pool.shape[0]), device=self.pool.device)
            p_vec = self.approx[rows]
            # ‖p‖² − 2 a·p: the distance less ‖a‖², a constant per anchor (ranks and gaps are unchanged)
            block = torch.addmm((p_vec * p_vec).sum(dim=1)[None, :], a_vec, p_vec.T, alpha=-2)
            block = block.masked_fill(self._excluded(anchors, rows), torch.inf)
            cand_d = torch.cat([best_d, block], dim=1)
            cand_i = torch.cat([best_i, rows.expand(n, -1)], dim=1)
            top = cand_d.topk(min(self.keep, cand_d.shape[1]), dim=1, largest=False, sorted=True)
            best_d, best_i = top.values, cand_i.gather(1, top.indices)
        return best_d, best_i

    def _excluded(self, anchors: Tensor, rows: Tensor) -> Tensor:
        excluded = anchors[:, None] == rows[None, :]
        if self.seq_id is not None:
            excluded |= self.seq_id[anchors][:, None] == self.seq_id[rows][None, :]
        return excluded

    def _exact_top_k(self, anchors: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
        """The `k` candidates nearest by exact distance, ties to the lower pool index."""
        candidates = candidates.sort(dim=1).values  # index order, so the stable sort breaks ties by index
        exact = self._exact(anchors, candidates).masked_fill(candidates < 0, torch.inf)
        exact = torch.where(self._excluded_rows(anchors, candidates), torch.inf, exact)
        order = torch.sort(exact, dim=1, stable=True).indices[:, : self.k]
        return candidates.gather(1, order), exact.gather(1, order)

    def _excluded_rows(self, anchors: Tensor, candidates: Tensor) -> Tensor:
        excluded = candidates == anchors[:, None]
        if self.seq_id is not None:
            excluded |= self.seq_id[candidates.clamp_min(0)] == self.seq_id[anchors][:, None]
        return excluded

    def _exact(self, anchors: Tensor, candidates: Tensor) -> Tensor:
        """Exact distances from the differences (Euclidean) or the dot products (cosine), row by row. On the
        CPU a few anchors at a time, so that their gathered candidate rows stay in cache (twice as fast at
        d = 256 as gathering the whole block); on an accelerator the whole block in one go."""
        if self.pool.device.type != "cpu":
            return self._exact_rows(anchors, candidates)
        step = max(1, _CACHED_VALUES // max(1, candidates.shape[1] * self.pool.shape[1]))
        parts = zip(anchors.split(step), candidates.split(step), strict=True)
        return torch.cat([self._exact_rows(a, c) for a, c in parts])

    def _exact_rows(self, anchors: Tensor, candidates: Tensor) -> Tensor:
        a = self.pool[anchors][:, None, :]
        p = self.pool[candidates.clamp_min(0)]
        if self.distance == "euclidean":  # pair by pair from the differences (no matmul), in C++
            return torch.cdist(a, p, compute_mode="donot_use_mm_for_euclid_dist")[:, 0]
        norms = a.norm(dim=2).clamp_min(_TINY_NORM) * p.norm(dim=2).clamp_min(_TINY_NORM)
        return 1 - (p * a).sum(dim=2) / norms
