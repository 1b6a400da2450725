"""Exact k-nearest neighbours of anchor rows within a pool, in bounded memory (SPEC §4.2).

Two passes. A float32 pass over the pool keeps each anchor's `k + slack` best candidates, `chunk` anchors
at a time. On the CPU that pass is FAISS's exact search (`knn_L2sqr`, the kernel behind `IndexFlatL2`,
run on the float32 copy in place; cosine: on the L2-normalised rows, whose squared distance `2 − 2 cos`
ranks the same), asked for as many more rows as the exclusions can remove. On an accelerator, or where
FAISS is not installed (the CUDA check machines), it is the Gram form in torch, `chunk` pool rows at a
time merged with `topk`.

The second pass makes the float32 selection exact without redoing it. A float32 squared distance is
within `c·(‖a‖ + ‖p‖)² + η` of the exact one (the bound below), so each candidate's true distance lies in
an interval around its float32 value. Sorted by float32 distance, the candidates fall into *chains*:
runs that no split separates, a split being a place where every interval before lies below every
interval after. Whole chains before the k-th candidate's chain are certainly among the k nearest, whole
chains after it certainly not, so only the members of the k-th candidate's chain (usually a handful) are
ranked by exact float64 distances, computed from the differences themselves (never through a matmul,
whose rounding depends on where a row sits in a block), ties to the lower pool index. A row the float32
pass did not keep is certainly farther than the k-th when its float32 distance exceeds what any row that
close could show; an anchor for which that is not so (many rows tied at its k-th distance, e.g. copies
of one token) is ranked exactly over the whole pool. The bound uses each row's own norm, not the pool's
largest, so a few rows of huge norm (attention sinks) do not widen every interval. The result is the set
of the k nearest in ascending pool index, a function of the data alone, the same from either backend.

Speed: the float32 pass is FAISS's own; on top come the float32 copy (of a float64 pool) and the exact
distances of the k-th candidate's chain (`lmgeo bench` compares the whole call with FAISS's
`IndexFlatL2` alone). Distances and ranks are not part of the result: the fits need the set, and
`neighbour_distances` gives the exact distances of any neighbours found.

Memory: the float32 copy and the row norms, O(pool); per block of anchors, FAISS's candidates
O(chunk × (k + slack + excluded rows)) and its 4096 × 1024 float32 distance tile, or torch's
O(chunk × (chunk + k)); the exact distances gather at most 4 MiB of rows at a time.
An anchor is excluded from its own neighbourhood by pool index, not by distance: an exact duplicate of the
anchor elsewhere in the pool is a legitimate neighbour at distance 0. For the cosine distance a zero row has
no direction: cosine 0 to every other row, 1 to another zero row. "Exact" means the float64 value computed
pair by pair (Euclidean: the sum of squared differences); two distances that differ only in their last bit
are told apart by it. Rows must be finite with norm below 1e18 (the float32 pass squares them); at the other
end, values near float32's underflow are handled by an absolute term in the bound.
"""

from __future__ import annotations

import functools
import operator
from types import ModuleType
from typing import Literal

import numpy as np
import torch
from torch import Tensor

Distance = Literal["euclidean", "cosine"]

_U32 = 2.0**-24  # float32 unit roundoff
_F32_TINY = 2.0**-126  # float32's smallest normal number
_LARGEST_NORM = 1e18  # squared distances of rows below this norm stay finite in float32 (< 3.4e38)
_CACHED_VALUES = 2**19  # candidate values gathered at once for the exact distances on the CPU (4 MiB in float64)


@functools.cache
def _faiss() -> ModuleType | None:
    """FAISS, where it is installed (every CPU install; the CUDA check machines go without it)."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def nearest_neighbours(
    pool: Tensor,
    anchor_idx: Tensor,
    k: int,
    *,
    distance: Distance = "euclidean",
    seq_id: Tensor | None = None,
    chunk: int = 4096,
) -> Tensor:
    """Pool indices of the `k` nearest rows of each anchor `pool[anchor_idx[a]]` (at equal distance the lower
    index), never the anchor itself, in ascending pool index: shape (anchors, k).

    `seq_id` (one per pool row), when given, also excludes every row of the anchor's own sequence.
    Nearness is exact in the dtype of `pool` (float64 for the fits). Raises `ValueError` when an anchor
    has fewer than `k` eligible neighbours.
    """
    n_pool, k, chunk = pool.shape[0], operator.index(k), operator.index(chunk)
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
    index = torch.cat(blocks) if blocks else torch.empty((0, k), dtype=torch.long, device=pool.device)
    if bool((index < 0).any()):
        short = int((index < 0).any(dim=1).nonzero()[0])
        raise ValueError(
            f"anchor at pool row {int(anchor_idx[short])} has fewer than k={k} eligible neighbours "
            f"(pool of {n_pool}, excluding itself{' and its own sequence' if seq_id is not None else ''})"
        )
    return index


def neighbour_distances(pool: Tensor, anchor_idx: Tensor, index: Tensor, distance: Distance = "euclidean") -> Tensor:
    """The exact distances (Euclidean, or `1 − cos` for cosine; float64) from each anchor to its neighbours
    `index[a]`, computed as the search ranks them: shape of `index`."""
    anchors = anchor_idx.to(device=pool.device, dtype=torch.long)[:, None].expand_as(index)
    squared = _exact(pool, distance, anchors.reshape(-1), index.reshape(-1)).view(index.shape)
    return squared.sqrt() if distance == "euclidean" else squared / 2


# The median pair distance (`median_pair_distance`) is exact over every pair of distinct rows up to this many
# pairs; above it, the median of `SAMPLED_PAIRS` seeded random pairs, whose sampling error is far below the
# precision the radius is read at, at a fraction of the exact median's cost on a study-sized pool.
EXACT_PAIRS = 2**20
SAMPLED_PAIRS = 2**20


def median_pair_distance(pool: Tensor, distance: Distance = "euclidean", *, seed: int = 0) -> float:
    """The median exact distance (as `neighbour_distances` gives it) over the pairs of distinct pool rows: over
    all of them where there are at most `EXACT_PAIRS`, else over `SAMPLED_PAIRS` pairs drawn uniformly (with
    replacement) with `seed`. Deterministic; NaN for a pool of fewer than two rows."""
    n = pool.shape[0]
    if n < 2:
        return float("nan")
    if n * (n - 1) // 2 <= EXACT_PAIRS:
        first, second = torch.triu_indices(n, n, 1)
    else:  # a uniform ordered pair of distinct rows: the second row an offset of 1 … n − 1 from the first
        generator = torch.Generator().manual_seed(seed)
        first = torch.randint(n, (SAMPLED_PAIRS,), generator=generator)
        second = (first + torch.randint(1, n, (SAMPLED_PAIRS,), generator=generator)) % n
    distances = neighbour_distances(pool, first.to(pool.device), second.to(pool.device)[:, None], distance)
    return float(distances.view(-1).quantile(0.5))  # of an even count, the mean of the middle two


class _Search:
    """The pool prepared once (float32 copy, norms, the rounding bound) for every anchor block."""

    def __init__(self, pool: Tensor, distance: Distance, seq_id: Tensor | None, k: int, chunk: int) -> None:
        self.pool, self.distance, self.seq_id, self.k, self.chunk = pool, distance, seq_id, k, chunk
        self.keep = min(pool.shape[0], k + max(8, k // 4))  # candidates kept per anchor
        d = pool.shape[1]
        if distance == "cosine":  # unit rows: the squared Euclidean distance is 2 − 2 cos, the same ranking
            pool64 = pool.double()
            norms = pool64.norm(dim=1, keepdim=True)
            zero = norms == 0
            unit = pool64 / norms.masked_fill(zero, 1.0)
            # A zero row has no direction: cosine 0 to every other row, 1 to another zero row (a copy). One
            # more coordinate, 1 for the zero rows, gives the float32 pass exactly those distances (2 and 0).
            self.approx = torch.cat([unit, zero.double()], dim=1).float().contiguous()
        else:  # C order: FAISS reads it in place (a float32 pool is not copied)
            self.approx = pool.contiguous() if pool.dtype == torch.float32 else pool.float().contiguous()
        # An upper bound on each searched row's norm: the float32 norm is within (d/2 + 1)·u of the norm of
        # the float32 row, which is within u of the row's (unit rows about 1).
        self.radius = self.approx.norm(dim=1).double() * (1 + (d + 5) * _U32)
        if not bool((self.radius < _LARGEST_NORM).all()):
            raise ValueError(
                f"pool rows must be finite with norm below {_LARGEST_NORM:g} (the float32 pass "
                "squares them); rescale the pool"
            )
        # |float32 squared distance − exact| ≤ c·(‖a‖ + ‖p‖)² + eta, c = (d + 8)·u, doubled. Both backends
        # compute it as ‖a‖² + ‖p‖² − 2 a·p: each of the three float32 dot products of length d is off by at
        # most d·u times its factors' norms, which sum to (‖a‖ + ‖p‖)²; the additions and the float64 →
        # float32 inputs add at most 8u of it, and FAISS's clamp of negative sums to 0 only moves a value
        # towards the true one (≥ 0). (For small searches FAISS sums (a − p)² row by row, smaller still.)
        # Values near float32's underflow lose absolute precision instead: eta allows every one of the
        # (4d + 16) operations to lose up to the smallest normal number (as if flushed to zero), doubled.
        self.c = 2 * (d + 8) * _U32
        self.eta = 2 * (4 * d + 16) * _F32_TINY
        # At most this many of an anchor's nearest rows are excluded: itself, or every row of its sequence.
        self.skipped = 1 if seq_id is None else int(torch.unique(seq_id, return_counts=True)[1].max())
        self.faiss = _faiss() if pool.device.type == "cpu" else None

    def block(self, anchors: Tensor) -> Tensor:
        cand_d, cand_i = self._faiss_candidates(anchors) if self.faiss else self._gram_candidates(anchors)
        centre = cand_d.double()
        r_anchor = self.radius.index_select(0, anchors)
        r_cand = self.radius.index_select(0, cand_i.clamp_min(0).view(-1)).view(cand_i.shape)
        err = r_cand.add_(r_anchor[:, None]).square_().mul_(self.c).add_(self.eta)
        lower, upper = centre - err, centre + err
        # The k-th nearest distance is at most `bound`. A row not kept that came within it would have norm
        # ≤ ‖a‖ + √bound, so a float32 distance ≤ bound + c·(2‖a‖ + √bound)²: past that, none was missed.
        bound = upper[:, : self.k].amax(dim=1)
        missed = (2 * r_anchor + bound.clamp_min(0).sqrt()).square_().mul_(self.c).add_(bound + self.eta)
        covered = (centre[:, -1] > missed) | torch.isinf(bound) | (self.keep == self.pool.shape[0])
        if bool(covered.all()):
            return self._settle(anchors, cand_i, centre, lower, upper, bound)
        index = torch.full((anchors.numel(), self.k), -1, dtype=torch.long, device=self.pool.device)
        ok = covered.nonzero()[:, 0]
        if ok.numel():
            index[ok] = self._settle(anchors[ok], cand_i[ok], centre[ok], lower[ok], upper[ok], bound[ok])
        for a in (~covered).nonzero()[:, 0].tolist():  # rows tied beyond the slack: rank the whole pool exactly
            index[a] = self._whole_pool(anchors[a])
        return index

    def _settle(
        self, anchors: Tensor, cand_i: Tensor, centre: Tensor, lower: Tensor, upper: Tensor, bound: Tensor
    ) -> Tensor:
        """The k nearest candidates, in ascending pool index. Only the chain holding the k-th candidate (in
        float32 order) is split by the k-th place: its members that can be among the k nearest (lower end ≤
        `bound`) get exact distances; every other candidate is in or out with its whole chain."""
        # Excluded rows (at inf) are never eligible, also for an anchor whose bound is inf (fewer than k rows).
        eligible = lower <= bound.clamp(max=torch.finfo(bound.dtype).max)[:, None]
        # A chain ends where every interval before lies below every interval after (each candidate's width
        # depends on its own norm, so the lower ends are not sorted: both sides are needed).
        starts = torch.ones_like(eligible)
        below = lower.flip(1).cummin(dim=1).values.flip(1)
        torch.lt(upper.cummax(dim=1).values[:, :-1], below[:, 1:], out=starts[:, 1:])
        chain = starts.cumsum(dim=1)
        kth = min(self.k, cand_i.shape[1]) - 1
        member = chain < chain[:, kth : kth + 1]  # whole chains before the k-th candidate's: in
        contested = (chain == chain[:, kth : kth + 1]) & eligible
        in_contest = contested.sum(dim=1) > 1
        member |= contested & ~in_contest[:, None]  # a k-th candidate alone in its chain: in
        rows = in_contest.nonzero()[:, 0]
        if rows.numel():
            places = self.k - member[rows].sum(dim=1)
            member[rows] |= self._contest(anchors[rows], cand_i[rows], contested[rows], places)
        # In ascending pool index; an anchor with fewer than k eligible rows gets -1 for the rest.
        n_pool = self.pool.shape[0]
        found = _sorted_rows(cand_i.masked_fill(~member, n_pool))[:, : self.k]
        if found.shape[1] < self.k:  # a pool of fewer than k + 1 rows
            found = torch.nn.functional.pad(found, (0, self.k - found.shape[1]), value=n_pool)
        return found.masked_fill_(found == n_pool, -1)

    def _contest(self, anchors: Tensor, cand_i: Tensor, contested: Tensor, places: Tensor) -> Tensor:
        """The `places[a]` contested candidates of each anchor nearest by exact distance (at equal distance
        the lower pool index), as a mask."""
        key = torch.full(cand_i.shape, torch.inf, dtype=torch.float64, device=cand_i.device)
        flat = contested.view(-1).nonzero()[:, 0]
        rows = anchors.index_select(0, flat // cand_i.shape[1])
        distances = _exact(self.pool, self.distance, rows, cand_i.reshape(-1).index_select(0, flat))
        key.view(-1).index_copy_(0, flat, distances)
        by_index = cand_i.masked_fill(~contested, self.pool.shape[0]).argsort(dim=1)
        order = by_index.gather(1, key.gather(1, by_index).argsort(dim=1, stable=True))
        won = torch.arange(cand_i.shape[1], device=cand_i.device)[None, :] < places[:, None]
        return torch.zeros_like(contested).scatter_(1, order, won) & contested

    def _whole_pool(self, anchor: Tensor) -> Tensor:
        """One anchor's k nearest by exact distance over the whole pool, ties to the lower pool index."""
        rows = torch.arange(self.pool.shape[0], device=self.pool.device)
        exact = _exact(self.pool, self.distance, anchor.expand_as(rows), rows)
        exact = torch.where(self._excluded_rows(anchor[None], rows[None])[0], torch.inf, exact)
        order = torch.sort(exact, stable=True).indices[: self.k]
        return _sorted_rows(rows[order].masked_fill(torch.isinf(exact[order]), -1)[None])[0]

    def _faiss_candidates(self, anchors: Tensor) -> tuple[Tensor, Tensor]:
        """`_gram_candidates` by FAISS's exact float32 search (`knn_L2sqr`, the kernel of `IndexFlatL2`
        without copying the pool into an index): enough rows that, the anchor and its own sequence
        dropped, `keep` eligible ones remain."""
        searched = min(self.pool.shape[0], self.keep + self.skipped)
        assert self.faiss is not None  # called only when FAISS imported
        self.faiss.omp_set_num_threads(torch.get_num_threads())  # the task's share of the cores
        dist, index = self.faiss.knn(self.approx[anchors].numpy(), self.approx.numpy(), searched)
        dist, index = torch.from_numpy(dist), torch.from_numpy(index)
        excluded = self._excluded_rows(anchors, index)
        if searched == self.keep + 1 and self.seq_id is None and bool(excluded[:, 0].all()):
            return dist[:, 1:], index[:, 1:]  # the usual case: each anchor itself came first
        # Each row's eligible candidates moved to its front, still nearest first (the excluded ones and those
        # past `keep` to a spare last column); a row left short (the search took the whole pool) ends in inf.
        eligible = ~excluded
        slot = (eligible.cumsum(dim=1) - 1).masked_fill_(~eligible, self.keep).clamp_(max=self.keep)
        kept_d = torch.full((len(anchors), self.keep + 1), torch.inf).scatter_(1, slot, dist)
        kept_i = torch.full((len(anchors), self.keep + 1), -1).scatter_(1, slot, index)
        return kept_d[:, : self.keep], kept_i[:, : self.keep]

    def _gram_candidates(self, anchors: Tensor) -> tuple[Tensor, Tensor]:
        """Each anchor's `keep` smallest float32 squared distances (sorted) and their pool rows, excluded
        rows at `inf`: the Gram form in blocks of `chunk` pool rows, merged with `topk` (any device)."""
        n = anchors.numel()
        a_vec = self.approx[anchors]
        best_d = torch.full((n, 0), torch.inf, dtype=torch.float32, device=self.pool.device)
        best_i = torch.full((n, 0), -1, dtype=torch.long, device=self.pool.device)
        for p0 in range(0, self.pool.shape[0], self.chunk):
            rows = torch.arange(p0, min(p0 + self.chunk, self.pool.shape[0]), device=self.pool.device)
            p_vec = self.approx[rows]
            # ‖p‖² − 2 a·p: the distance less ‖a‖², a constant per anchor added at the end
            block = torch.addmm((p_vec * p_vec).sum(dim=1)[None, :], a_vec, p_vec.T, alpha=-2)
            block = block.masked_fill(self._excluded(anchors, rows), torch.inf)
            cand_d = torch.cat([best_d, block], dim=1)
            cand_i = torch.cat([best_i, rows.expand(n, -1)], dim=1)
            top = cand_d.topk(min(self.keep, cand_d.shape[1]), dim=1, largest=False, sorted=True)
            best_d, best_i = top.values, cand_i.gather(1, top.indices)
        return best_d + (a_vec * a_vec).sum(dim=1)[:, None], best_i

    def _excluded(self, anchors: Tensor, rows: Tensor) -> Tensor:
        excluded = anchors[:, None] == rows[None, :]
        if self.seq_id is not None:
            excluded |= self.seq_id[anchors][:, None] == self.seq_id[rows][None, :]
        return excluded

    def _excluded_rows(self, anchors: Tensor, candidates: Tensor) -> Tensor:
        excluded = candidates == anchors[:, None]
        if self.seq_id is not None:
            excluded |= self.seq_id[candidates.clamp_min(0)] == self.seq_id[anchors][:, None]
        return excluded


def _sorted_rows(index: Tensor) -> Tensor:
    """Each row in ascending order (NumPy's sort of many short rows is about 3× torch's on the CPU)."""
    if index.device.type == "cpu":
        return torch.from_numpy(np.sort(index.numpy(), axis=1))
    return index.sort(dim=1).values


def _exact(pool: Tensor, distance: Distance, anchors: Tensor, rows: Tensor) -> Tensor:
    """The squared distance of each pair (pool[anchors[i]], pool[rows[i]]) in float64, on the scale the
    float32 pass ranks by (cosine: 2 − 2 cos, of unit rows): pair by pair from the differences (Euclidean)
    or the dot products (cosine), a few MiB of gathered rows at a time so that they stay in cache."""
    step = max(1, _CACHED_VALUES // pool.shape[1])
    if len(rows) <= step:
        return _exact_pairs(pool, distance, anchors, rows)
    chunks = zip(anchors.split(step), rows.split(step), strict=True)
    return torch.cat([_exact_pairs(pool, distance, a, r) for a, r in chunks])


def _exact_pairs(pool: Tensor, distance: Distance, anchors: Tensor, rows: Tensor) -> Tensor:
    a, p = pool.index_select(0, anchors).double(), pool.index_select(0, rows).double()  # float32 rows: exact
    if distance == "euclidean":
        p = p.sub_(a)
        return torch.linalg.vecdot(p, p)
    norm_a, norm_p = a.norm(dim=1), p.norm(dim=1)
    directed = (norm_a > 0) & (norm_p > 0)
    cos = torch.linalg.vecdot(a, p) / norm_a.masked_fill(~directed, 1.0) / norm_p.masked_fill(~directed, 1.0)
    # A zero row: cosine 0 to every other row, 1 to another zero row (as the float32 pass sees them).
    cos = torch.where(directed, cos, ((norm_a == 0) & (norm_p == 0)).double())
    return 2 * (1 - cos)
