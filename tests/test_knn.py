"""Exact kNN against a brute-force reference: full distance vectors, fully sorted (stable, so ties
go to the lower pool index), the anchor's own row removed by index. Every test runs on both candidate
backends: FAISS (CPU) and the torch Gram form (CUDA, or wherever FAISS is not installed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmgeo.study_a import knn
from lmgeo.study_a.knn import median_pair_distance, nearest_neighbours, neighbour_distances
from lmgeo.study_a.reference import ref_distances


@pytest.fixture(params=["faiss", "torch"])
def backend(request, monkeypatch):
    """Each test that asks for it runs on both candidate backends."""
    if request.param == "torch":  # as on a machine without FAISS
        monkeypatch.setattr(knn, "_faiss", lambda: None)
    else:
        assert knn._faiss() is not None, "faiss-cpu is a dependency: the CPU search must use it"


def brute_force(pool: np.ndarray, anchors: np.ndarray, k: int, distance: str, seq_id=None):
    """Each anchor's k nearest (a stable sort: at equal distance the lower index), in ascending index."""
    index, dist = [], []
    for a in anchors:
        d = ref_distances(pool, a, distance, seq_id)
        nearest = np.sort(np.argsort(d, kind="stable")[:k])
        index.append(nearest)
        dist.append(d[nearest])
    return np.array(index), np.array(dist)


def run(pool, anchors, k, **kw):
    seq = kw.pop("seq_id", None)
    pool, anchors = torch.as_tensor(pool), torch.as_tensor(anchors)
    index = nearest_neighbours(pool, anchors, k, seq_id=None if seq is None else torch.as_tensor(seq), **kw)
    return index.numpy(), neighbour_distances(pool, anchors, index, kw.get("distance", "euclidean")).numpy()


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
    assert 40 in index[0] and 5 in index[1]
    np.testing.assert_allclose(dist.min(axis=1), 0, atol=1e-6)


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
    rank_whole_pool = knn._Search._whole_pool

    def spy(self, anchor):
        whole_pool.append(int(anchor))
        return rank_whole_pool(self, anchor)

    monkeypatch.setattr(knn._Search, "_whole_pool", spy)
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


@pytest.mark.slow
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
    np.testing.assert_array_equal(found.numpy(), gram.numpy())
    some = rng.choice(4000, size=50, replace=False)
    ref_index, _ = brute_force(pool.numpy(), anchors.numpy()[some], 32, distance, seq.numpy())
    np.testing.assert_array_equal(found.numpy()[some], ref_index)


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_near_ties_below_float32_resolution_are_ranked_exactly(distance, backend):
    # Rows whose distances to the anchor differ by ~1e-12 relative (far below float32's 6e-8): the float32
    # pass cannot order them, so they form one chain and are ranked by their float64 distances.
    rng = np.random.default_rng(10)
    d = 16
    directions = rng.normal(size=(200, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    radii = 3.0 * (1 + 1e-12 * rng.permutation(200))
    pool = np.vstack([np.full((1, d), 5.0), 5.0 + radii[:, None] * directions, rng.normal(size=(300, d)) * 40])
    index, dist = run(pool, np.array([0]), 50, distance=distance)
    ref_index, ref_dist = brute_force(pool, np.array([0]), 50, distance)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(dist, ref_dist, rtol=1e-12)


def test_rows_of_huge_norm_do_not_widen_every_anchors_interval(monkeypatch, backend):
    # A few rows 10⁴ times the others' norm (attention sinks): a bound on the pool's largest norm would put
    # every candidate of every anchor within the float32 error of the k-th and rank all of them over the
    # whole pool; each row's own norm keeps the ordinary anchors on the candidates.
    rng = np.random.default_rng(11)
    pool = rng.normal(size=(3000, 24))
    pool[::500] *= 1e4
    anchors = rng.choice(np.setdiff1d(np.arange(3000), np.arange(0, 3000, 500)), size=64, replace=False)
    whole_pool = []
    rank_whole_pool = knn._Search._whole_pool
    monkeypatch.setattr(knn._Search, "_whole_pool", lambda self, a: whole_pool.append(a) or rank_whole_pool(self, a))
    index, _ = run(pool, anchors, 20)
    np.testing.assert_array_equal(index, brute_force(pool, anchors, 20, "euclidean")[0])
    assert not whole_pool


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_a_float32_pool_is_searched_in_place_and_ranked_in_float64(distance, backend):
    # The float32 values themselves, ranked exactly: the same neighbours as the float64 pool of those values.
    rng = np.random.default_rng(12)
    pool32 = rng.normal(size=(400, 12)).astype(np.float32)
    anchors = rng.choice(400, size=40, replace=False)
    index32, _ = run(pool32, anchors, 15, distance=distance)
    index64, _ = run(pool32.astype(np.float64), anchors, 15, distance=distance)
    np.testing.assert_array_equal(index32, index64)
    np.testing.assert_array_equal(index32, brute_force(pool32.astype(np.float64), anchors, 15, distance)[0])


def test_zero_rows_under_cosine_have_cosine_zero_to_others_and_one_to_each_other(backend):
    # A zero row has no direction. The float32 pass sees it through one extra coordinate, the exact pass by
    # definition; both must agree, for a zero anchor too, and for a float32 pool of the same values.
    rng = np.random.default_rng(13)
    angles = np.linspace(1.0, 1.3, 6)  # cos 0.27..0.54: some rows nearer than a zero row (1 − cos = 1)
    pool = np.vstack([[1.0, 0.0], np.zeros((3, 2)), np.c_[np.cos(angles), np.sin(angles)], rng.normal(size=(30, 2))])
    anchors = np.array([0, 1, 5])
    index, dist = run(pool, anchors, 8, distance="cosine")
    ref_index, ref_dist = brute_force(pool, anchors, 8, "cosine")
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(dist, ref_dist, atol=1e-12)
    assert {2, 3} <= set(index[1])  # the zero anchor's nearest: the other zero rows, at distance 0
    np.testing.assert_array_equal(run(pool.astype(np.float32), anchors, 8, distance="cosine")[0], index)


@pytest.mark.parametrize("d", [1, 3, 16])
def test_rows_near_float32_underflow_are_ranked_exactly(d, backend):
    # Rows around 1e-21: float32 squared distances are subnormal, so their error is absolute, not relative.
    rng = np.random.default_rng(14)
    for scale in (1e-19, 1e-21, 1e-22):
        pool = rng.normal(size=(40, d)) * scale
        index, _ = run(pool, np.arange(40), 5)
        np.testing.assert_array_equal(index, brute_force(pool, np.arange(40), 5, "euclidean")[0])


def test_a_wider_interval_behind_a_candidate_joins_its_chain(monkeypatch):
    # White box: float32 values within half the bound, sorted i, j, m, where m (norm 2, so a wide interval)
    # is truly the nearest. A chain that only looked back would leave i alone, certainly first, and return i
    # as the nearest; a split must have every interval before it below every interval after it.
    d, c = 2, 2 * (2 + 8) * 2.0**-24
    pool = np.zeros((24, d))
    pool[0], pool[2] = [1, 0], [0, np.sqrt(2.5 * c)]  # pool[1]: the origin, at distance 1
    pool[3] = [1 + np.sqrt(1 - 0.2 * c), 0]  # at squared distance 1 − 0.2c: the nearest
    pool[4:] = 10 * np.random.default_rng(0).normal(size=(20, d)) + 30
    pool_t = torch.as_tensor(pool)
    fake = ((pool_t - pool_t[0]) ** 2).sum(dim=1).float()
    fake[1], fake[3] = 1 + 0.45 * c, 1 + 2.6 * c

    def candidates(self, anchors):
        f = fake.clone()
        f[0] = torch.inf
        order = torch.sort(f, stable=True).indices[: self.keep]
        return f[order][None], order[None]

    monkeypatch.setattr(knn, "_faiss", lambda: None)
    monkeypatch.setattr(knn._Search, "_gram_candidates", candidates)
    search = knn._Search(pool_t, "euclidean", None, 1, 4096)
    err = search.c * (search.radius[0] + search.radius[[1, 3]]).square()
    assert ((fake[[1, 3]].double() - ((pool_t[[1, 3]] - pool_t[0]) ** 2).sum(dim=1)).abs() < err / 2).all()
    assert nearest_neighbours(pool_t, torch.tensor([0]), 1)[0].tolist() == [3]


def test_rows_too_large_for_float32_are_refused():
    pool = torch.randn(20, 3, dtype=torch.float64)
    pool[4] *= 1e19
    with pytest.raises(ValueError, match="norm below 1e"):
        nearest_neighbours(pool, torch.tensor([0]), 3)
    pool[4] = torch.nan
    with pytest.raises(ValueError, match="must be finite"):
        nearest_neighbours(pool, torch.tensor([0]), 3)


def test_k_may_be_any_integer_type():
    pool = torch.randn(10, 3, dtype=torch.float64)
    assert nearest_neighbours(pool, torch.tensor([0, 1]), np.int64(9)).shape == (2, 9)


# ------------------------------------------------------------------------------- median pair distance
@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
@pytest.mark.parametrize("n", [2, 7, 50])
def test_median_pair_distance_is_exact_over_every_pair_of_distinct_rows(distance, n):
    """Against NumPy: the median over the n(n − 1)/2 pairs i < j of the brute-force distances (an even count:
    the mean of the middle two), the same for a float32 pool read in float64."""
    rng = np.random.default_rng(n)
    pool = rng.normal(size=(n, 5))
    expected = np.median(np.concatenate([ref_distances(pool, i, distance)[i + 1 :] for i in range(n)]))
    assert median_pair_distance(torch.from_numpy(pool), distance) == pytest.approx(expected, rel=1e-12)
    assert np.isnan(median_pair_distance(torch.from_numpy(pool[:1]), distance))


def test_median_pair_distance_samples_seeded_pairs_of_a_large_pool(monkeypatch):
    """Above `EXACT_PAIRS`, the median of `SAMPLED_PAIRS` uniform pairs of distinct rows: deterministic for
    a seed, close to the exact median, and never a row paired with itself (two rows 1 apart: every pair is at 1)."""
    rng = np.random.default_rng(21)
    pool = torch.from_numpy(rng.normal(size=(300, 4)))
    exact = median_pair_distance(pool)
    monkeypatch.setattr(knn, "EXACT_PAIRS", 1000)
    monkeypatch.setattr(knn, "SAMPLED_PAIRS", 20000)
    sampled = median_pair_distance(pool, seed=4)
    assert sampled == median_pair_distance(pool, seed=4) != median_pair_distance(pool, seed=5)
    assert sampled == pytest.approx(exact, rel=0.03)
    monkeypatch.setattr(knn, "EXACT_PAIRS", 0)
    assert median_pair_distance(torch.tensor([[0.0, 0.0], [0.6, 0.8]], dtype=torch.float64), seed=1) == 1.0
