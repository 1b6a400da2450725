"""Exact kNN against a brute-force reference: full distance vectors, fully sorted (stable, so ties
go to the lower pool index), the anchor's own row removed by index. Every test runs on both candidate
backends: FAISS (CPU) and the torch Gram form (CUDA, or wherever FAISS is not installed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.study_a import knn
from pipeline.study_a.knn import nearest_neighbours
from pipeline.study_a.reference import ref_distances


@pytest.fixture(params=["faiss", "torch"])
def backend(request, monkeypatch):
    """Each test that asks for it runs on both candidate backends."""
    if request.param == "torch":  # as on a machine without FAISS
        monkeypatch.setattr(knn, "_faiss", lambda: None)
    else:
        assert knn._faiss() is not None, "faiss-cpu is a dependency: the CPU search must use it"


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
def test_matches_brute_force(distance, chunk, backend):
    rng = np.random.default_rng(1)
    pool = rng.normal(size=(100, 5))
    anchors = rng.choice(100, size=23, replace=False)
    index, dist = run(pool, anchors, 9, distance=distance, chunk=chunk)
    ref_index, ref_dist = brute_force(pool, anchors, 9, distance)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(dist, ref_dist, rtol=1e-9, atol=1e-9)
    assert not (index == anchors[:, None]).any()


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_excludes_the_anchors_own_sequence(distance, backend):
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
def test_ties_go_to_the_lower_index(chunk, backend):
    # Small integers: every dot product is exact in float64, so the ties are exact.
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 3, size=(60, 3)).astype(np.float64)
    anchors = np.arange(0, 60, 5)
    index, _ = run(pool, anchors, 10, chunk=chunk)
    ref_index, _ = brute_force(pool, anchors, 10, "euclidean")
    np.testing.assert_array_equal(index, ref_index)


def test_duplicates_of_the_anchor_are_neighbours(backend):
    rng = np.random.default_rng(4)
    pool = rng.normal(size=(50, 6))
    pool[40] = pool[5]
    index, dist = run(pool, np.array([5, 40]), 3, chunk=8)
    assert index[0, 0] == 40 and index[1, 0] == 5
    np.testing.assert_allclose(dist[:, 0], 0, atol=1e-6)


def test_too_few_eligible_neighbours_is_an_error(backend):
    pool = np.random.default_rng(5).normal(size=(12, 3))
    seq = np.repeat(np.arange(2), 6)
    with pytest.raises(ValueError, match="fewer than k=7"):
        run(pool, np.array([0]), 7, seq_id=seq)
    with pytest.raises(ValueError, match="fewer than k=12"):
        run(pool, np.array([0]), 12)


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_copies_beyond_the_slack_fall_back_to_the_whole_pool(distance, monkeypatch, backend):
    # 40 copies of one row: the k-th candidate's ties run past the k + 8 kept, so the certificate fails and
    # those anchors are ranked exactly over the whole pool.
    rng = np.random.default_rng(6)
    pool = rng.normal(size=(120, 4))
    pool[10:50] = pool[10]
    anchors = np.array([3, 10, 25, 49, 60, 119])
    whole_pool = []
    exact_top_k = knn._Search._exact_top_k

    def spy(self, anchor_rows, candidates):
        whole_pool.append(candidates.shape[1] == len(pool))
        return exact_top_k(self, anchor_rows, candidates)

    monkeypatch.setattr(knn._Search, "_exact_top_k", spy)
    index, dist = run(pool, anchors, 5, distance=distance, chunk=32)
    ref_index, ref_dist = brute_force(pool, anchors, 5, distance)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(dist, ref_dist, atol=1e-9)
    assert any(whole_pool)


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_own_sequence_longer_than_the_candidates(distance, backend):
    # Sequences of 30 rows against k + 8 = 14 candidates: the search must reach past the anchor's sequence.
    rng = np.random.default_rng(7)
    pool = rng.normal(size=(150, 3)) + np.repeat(rng.normal(scale=5, size=(5, 3)), 30, axis=0)
    seq = np.repeat(np.arange(5), 30)
    anchors = np.arange(0, 150, 11)
    index, dist = run(pool, anchors, 6, distance=distance, seq_id=seq, chunk=16)
    ref_index, ref_dist = brute_force(pool, anchors, 6, distance, seq)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(dist, ref_dist, atol=1e-9)


def test_fewer_eligible_rows_than_candidates(backend):
    # 10 eligible rows per anchor against k + 8 = 13 candidates: the search takes the whole pool.
    pool = np.random.default_rng(8).normal(size=(20, 3))
    seq = np.repeat(np.arange(2), 10)
    anchors = np.array([0, 9, 10, 19])
    index, dist = run(pool, anchors, 5, seq_id=seq)
    ref_index, ref_dist = brute_force(pool, anchors, 5, "euclidean", seq)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(dist, ref_dist, atol=1e-9)


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_backends_agree_bit_for_bit(distance, monkeypatch):
    # 4000 anchors × d = 32 in one block: FAISS takes its BLAS path (‖a‖² + ‖p‖² − 2 a·p), not the
    # row-by-row one the small tests above take (nq·d below FAISS's 128000).
    rng = np.random.default_rng(9)
    # Small integers: many exact ties at the k-th distance, every distance exact in float64 as in the reference.
    pool = torch.as_tensor(rng.integers(-5, 6, size=(5000, 32)).astype(np.float64))
    pool[100:140] = pool[7]
    seq = torch.as_tensor(np.repeat(np.arange(250), 20))
    anchors = torch.as_tensor(rng.choice(5000, size=4000, replace=False))
    found = nearest_neighbours(pool, anchors, 32, distance=distance, seq_id=seq, chunk=4000)
    monkeypatch.setattr(knn, "_faiss", lambda: None)
    gram = nearest_neighbours(pool, anchors, 32, distance=distance, seq_id=seq, chunk=4000)
    np.testing.assert_array_equal(found.index.numpy(), gram.index.numpy())
    np.testing.assert_array_equal(found.distance.numpy(), gram.distance.numpy())
    some = rng.choice(4000, size=50, replace=False)
    ref_index, _ = brute_force(pool.numpy(), anchors.numpy()[some], 32, distance, seq.numpy())
    np.testing.assert_array_equal(found.index.numpy()[some], ref_index)
