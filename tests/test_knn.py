"""Exact kNN against a brute-force reference: full distance vectors, fully sorted (stable, so ties
go to the lower pool index), the anchor's own row removed by index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.study_a.knn import nearest_neighbours
from pipeline.study_a.reference import ref_distances


def brute_force(pool: np.ndarray, anchors: np.ndarray, k: int, distance: str, seq_id=None):
    index, dist = [], []
    for a in anchors:
        d = ref_distances(pool, a, distance, seq_id)
        order = np.argsort(d, kind="stable")[:k]
        index.append(order)
        dist.append(d[order])
    return np.array(index), np.array(dist)


def run(pool, anchors, k, **kw):
    seq = kw.pop("seq_id", None)
    nb = nearest_neighbours(
        torch.as_tensor(pool),
        torch.as_tensor(anchors),
        k,
        seq_id=None if seq is None else torch.as_tensor(seq),
        **kw,
    )
    return nb.index.numpy(), nb.distance.numpy()


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
@pytest.mark.parametrize("chunk", [1, 7, 13, 100, 4096])
def test_matches_brute_force(distance, chunk):
    rng = np.random.default_rng(1)
    pool = rng.normal(size=(100, 5))
    anchors = rng.choice(100, size=23, replace=False)
    index, dist = run(pool, anchors, 9, distance=distance, chunk=chunk)
    ref_index, ref_dist = brute_force(pool, anchors, 9, distance)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(dist, ref_dist, rtol=1e-9, atol=1e-9)
    assert not (index == anchors[:, None]).any()


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_excludes_the_anchors_own_sequence(distance):
    rng = np.random.default_rng(2)
    pool = rng.normal(size=(90, 4))
    seq = np.repeat(np.arange(9), 10)
    anchors = np.arange(0, 90, 7)
    index, dist = run(pool, anchors, 6, distance=distance, seq_id=seq, chunk=11)
    ref_index, ref_dist = brute_force(pool, anchors, 6, distance, seq)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(dist, ref_dist, atol=1e-9)
    assert not (seq[index] == seq[anchors][:, None]).any()


@pytest.mark.parametrize("chunk", [1, 7, 60, 1000])
def test_ties_go_to_the_lower_index(chunk):
    # Small integers: every dot product is exact in float64, so the ties are exact.
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 3, size=(60, 3)).astype(np.float64)
    anchors = np.arange(0, 60, 5)
    index, _ = run(pool, anchors, 10, chunk=chunk)
    ref_index, _ = brute_force(pool, anchors, 10, "euclidean")
    np.testing.assert_array_equal(index, ref_index)


def test_duplicates_of_the_anchor_are_neighbours():
    rng = np.random.default_rng(4)
    pool = rng.normal(size=(50, 6))
    pool[40] = pool[5]
    index, dist = run(pool, np.array([5, 40]), 3, chunk=8)
    assert index[0, 0] == 40 and index[1, 0] == 5
    np.testing.assert_allclose(dist[:, 0], 0, atol=1e-6)


def test_too_few_eligible_neighbours_is_an_error():
    pool = np.random.default_rng(5).normal(size=(12, 3))
    seq = np.repeat(np.arange(2), 6)
    with pytest.raises(ValueError, match="fewer than k=7"):
        run(pool, np.array([0]), 7, seq_id=seq)
    with pytest.raises(ValueError, match="fewer than k=12"):
        run(pool, np.array([0]), 12)
