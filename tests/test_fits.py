"""Tokenwise fits against an independent per-anchor reference.

The reference (`lmgeo.study_a.reference` with each class's `FitClass.reference`, which `lmgeo bench`
also times) works one anchor at a time in NumPy float64: its own neighbour search by fully sorting the
distances, its own least squares (`np.linalg.lstsq` on ridge-augmented systems), the full `d × d`
Jacobian of each fitted map (by autograd for the MLP) and its full SVD. It shares nothing with the
batched fits except the MLP's initial weights, which are part of that fit's definition. Every test over
classes is parametrised over the registry, so a new class is tested by registering it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from lmgeo.core.contracts import FIT_METRICS as METRICS
from lmgeo.core.contracts import FITS, arrow_to_vectors, vector_type
from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_a.classes.diag_psd import fit_diag_psd
from lmgeo.study_a.classes.lowrank import fit_lowrank
from lmgeo.study_a.classes.orthogonal import fit_orthogonal
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.fits import choose_anchors, fit_layer, null_sample
from lmgeo.study_a.knn import nearest_neighbours
from lmgeo.study_a.reference import reference_rows

CLASSES = FIT_CLASSES.names()


def fit_one(x, y, seq, pos, tok, anchors, fn, cfg, samples=("real",)):
    tables, info = fit_layer(x, y, seq, pos, tok, anchors, [fn], cfg, samples=samples)
    return tables[fn], info


# ------------------------------------------------------------------------------------- reference
def assert_rows_match(table, rows, tol=1e-4):
    """Every column, the local projections of tied anchors included: the dominant subspace keeps a tie whole,
    so it is unique and two implementations agree on it."""
    assert table.num_rows == len(rows)
    for flag in ("value_identified", "operator_identified", "subspace_tied", "subspace_dim"):
        assert table.column(flag).to_pylist() == [r[flag] for r in rows], flag
    for name in METRICS:
        got, want = table.column(name).to_pylist(), [r[name] for r in rows]
        assert [g is None for g in got] == [w is None for w in want], name
        present = np.array([(g, w) for g, w in zip(got, want) if g is not None]).reshape(-1, 2)
        np.testing.assert_allclose(present[:, 0], present[:, 1], atol=tol, rtol=tol, err_msg=name)
    patched = table.column("patched")
    assert patched.is_null().to_pylist() == [r["patched"] is None for r in rows]
    got = arrow_to_vectors(patched.filter(patched.is_valid()))
    want = [r["patched"] for r in rows if r["patched"] is not None]
    np.testing.assert_allclose(got, np.array(want).reshape(got.shape), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------- data
def random_layer(rng, n_seq=12, seq_len=10, d=6):
    n = n_seq * seq_len
    x = rng.normal(size=(n, d)) + 0.5
    mix = np.eye(d) + 0.4 * rng.normal(size=(d, d))
    seq = np.repeat(np.arange(n_seq), seq_len)
    context = np.array([x[seq == s].mean(axis=0) for s in seq])
    y = np.tanh(x) @ mix.T + x + 0.3 * context  # nonlinear tokenwise part plus a cross-token part
    pos = np.tile(np.arange(seq_len), n_seq)
    return x, y, seq, pos, rng.integers(0, 500, size=n)


CONFIGS = {
    # k > d: the neighbours span the space (every class is identifiable).
    "euclid": dict(k=10, rank=2, p=3, ridge=1e-3, mlp_hidden=4, mlp_steps=25, anchors=9),
    # p > rank exercises the rank convention; cosine kNN excluding the anchor's own sequence.
    "cosine": dict(
        k=14,
        rank=2,
        p=5,
        ridge=1e-2,
        mlp_hidden=3,
        mlp_steps=25,
        anchors=9,
        distance="cosine",
        exclude_same_sequence=True,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("fn", CLASSES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_column_matches_the_per_anchor_reference(fn, config):
    rng = np.random.default_rng(10)
    d = 6 if config == "euclid" else 12
    x, y, seq, pos, tok = random_layer(rng, d=d)
    cfg = AnalysisConfig(**CONFIGS[config])
    anchors = choose_anchors(len(x), cfg.anchors, seed=3)
    tables, info = fit_layer(x.astype(np.float32), y.astype(np.float32), seq, pos, tok, anchors, [fn], cfg)
    table = tables[fn]
    # The reference sees the same float32-rounded inputs.
    x32, y32 = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    assert_rows_match(table, reference_rows(x32, y32, seq, anchors, FIT_CLASSES[fn], cfg))
    assert table.schema == FITS.file_schema(d)
    assert table.column("seq_id").to_pylist() == seq[anchors].tolist()
    assert table.column("pos").to_pylist() == pos[anchors].tolist()
    assert table.column("token_id").to_pylist() == tok[anchors].tolist()
    assert set(table.column("k").to_pylist()) == {cfg.k}
    assert info.n_nonfinite == 0 and info.n_anchors == len(anchors) and info.n_pool == len(x)


@pytest.mark.slow
@pytest.mark.parametrize("fn", CLASSES)
def test_anchors_fitted_in_chunks_equal_all_at_once(fn, monkeypatch):
    """Memory is bounded by the anchor chunk (`fits.CHUNK_VALUES`); the rows do not depend on it (the
    MLP's start is drawn per anchor, whatever its chunk)."""
    from lmgeo.study_a import fits

    rng = np.random.default_rng(4)
    x, y, seq, pos, tok = random_layer(rng, d=6)
    cfg = AnalysisConfig(**CONFIGS["euclid"])
    anchors = choose_anchors(len(x), cfg.anchors, seed=3)
    whole = fit_one(x, y, seq, pos, tok, anchors, fn, cfg)[0]
    monkeypatch.setattr(fits, "CHUNK_VALUES", 2 * cfg.k * 6)  # two anchors a chunk: 5 chunks, the last short
    assert len(fits.anchor_chunks(len(anchors), cfg.k, 6)) == 5
    chunked = fit_one(x, y, seq, pos, tok, anchors, fn, cfg)[0]
    for name in chunked.column_names:
        got, want = chunked.column(name).to_pylist(), whole.column(name).to_pylist()
        if name == "patched":  # stored vectors: compare the decoded values
            got, want = (_vectors_or_none(table.column(name)) for table in (chunked, whole))
        if name in (
            "sample",
            "value_identified",
            "operator_identified",
            "converged",
            "subspace_tied",
            "subspace_dim",
            "seq_id",
            "pos",
            "token_id",
            "k",
            "input_rank",
        ):
            assert got == want, name
        else:
            assert [g is None for g in got] == [w is None for w in want], name
            present = [(g, w) for g, w in zip(got, want, strict=True) if g is not None]
            for g, w in present:
                np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12, err_msg=name)


def _vectors_or_none(column):
    """A vector column as one array per row, None where the row is null."""
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    values = iter(arrow_to_vectors(column.filter(column.is_valid())))
    return [next(values) if known else None for known in valid]


def test_schema_is_the_contract():
    assert FITS.file_schema(3).names == [
        "sample",
        "seq_id",
        "pos",
        "token_id",
        "k",
        "locality",
        "rel_err",
        "rel_err_state",
        "cos_full_tok",
        "cos_full_res",
        "angle_res_tok",
        "proj_full",
        "proj_res",
        "proj_full_global",
        "proj_res_global",
        "norm_full",
        "norm_res",
        "input_rank",
        "value_identified",
        "operator_identified",
        "converged",
        "subspace_tied",
        "subspace_dim",
        "patched",
        "n_nonfinite",
        "n_distinct",
    ]
    assert FITS.file_schema(3).field("patched").type == vector_type(3)


# ---------------------------------------------------------------------------------- class checks
def neighbourhoods(rng, n_anchors=5, k=7, d=9):
    xn = torch.from_numpy(rng.normal(size=(n_anchors, k, d)))
    yn = torch.from_numpy(rng.normal(size=(n_anchors, k, d)))
    return xn, yn


def test_diag_psd_is_non_negative_and_closed_form():
    xn, yn = neighbourhoods(np.random.default_rng(20))
    diag = fit_diag_psd(xn, yn, 0.5).diag
    assert (diag >= 0).all() and (diag == 0).any()  # anti-correlated coordinates are clamped
    expected = ((xn * yn).sum(1) / ((xn * xn).sum(1) + 0.5)).clamp_min(0)
    torch.testing.assert_close(diag, expected)


@pytest.mark.parametrize("with_scale", [False, True])
def test_orthogonal_map_is_the_procrustes_optimum_and_unidentified_below_full_rank(with_scale):
    rng = np.random.default_rng(21)
    xn, yn = neighbourhoods(rng, k=20)
    fit = fit_orthogonal(xn, yn, with_scale)
    q = fit.rotation
    eye = torch.eye(9, dtype=torch.float64)
    torch.testing.assert_close(q.transpose(1, 2) @ q, eye.expand_as(q), atol=1e-10, rtol=0)
    # No orthogonal map does better on tr(Qᵀ C): compare with random rotations near Q.
    cross = yn.transpose(1, 2) @ xn
    best = (cross * q).sum(dim=(1, 2))
    for _ in range(20):
        skew = 1e-2 * torch.from_numpy(rng.normal(size=(5, 9, 9)))
        nearby = q @ torch.linalg.matrix_exp(skew - skew.transpose(1, 2))
        assert ((cross * nearby).sum(dim=(1, 2)) <= best + 1e-9).all()
    assert not fit.unidentified.any()
    assert (fit.scale != 1).all() if with_scale else (fit.scale == 1).all()
    few = fit_orthogonal(*neighbourhoods(rng, k=5), with_scale)  # k < d: C has rank 5 < 9
    assert few.unidentified.all()


def test_noise_free_maps_are_recovered_exactly():
    rng = np.random.default_rng(22)
    xn = torch.from_numpy(rng.normal(size=(4, 30, 6)))
    diag = torch.from_numpy(rng.uniform(0.2, 2.0, size=(4, 6)))
    torch.testing.assert_close(fit_diag_psd(xn, xn * diag[:, None], 0.0).diag, diag)

    u, v = torch.from_numpy(rng.normal(size=(4, 6, 2))), torch.from_numpy(rng.normal(size=(4, 6, 2)))
    b_true = u @ v.transpose(1, 2)
    fit = fit_lowrank(xn, xn + xn @ b_true.transpose(1, 2), 2, 0.0)
    torch.testing.assert_close(fit.u @ fit.v.transpose(1, 2), b_true)

    q_true = torch.linalg.qr(torch.from_numpy(rng.normal(size=(4, 6, 6)))).Q
    fit = fit_orthogonal(xn, 1.7 * xn @ q_true.transpose(1, 2), with_scale=True)
    torch.testing.assert_close(fit.rotation, q_true, atol=1e-10, rtol=0)
    torch.testing.assert_close(fit.scale, torch.full((4,), 1.7, dtype=torch.float64))
    assert not fit.unidentified.any()


def test_a_scaled_rotation_is_recovered_and_never_flagged():
    """`similarity` on a planted `y = s Q x` (float32-stored, near-singular inputs whose Procrustes matrix the
    old test cut at 1e-6 of its largest singular value): every anchor's value and operator are identified,
    `T(x_a) = y_a` to float32 precision, and the scale-free class misses by the scale."""
    rng = np.random.default_rng(24)
    d, n = 8, 600
    spread = np.logspace(0, -3.5, d)  # the inputs' condition ~3e3, C's ~1e7: below the old cut-off
    x = (rng.normal(size=(n, d)) * spread) @ np.linalg.qr(rng.normal(size=(d, d)))[0]
    q = np.linalg.qr(rng.normal(size=(d, d)))[0]
    y = 0.6 * x @ q.T
    seq = np.arange(n)
    cfg = AnalysisConfig(k=24, anchors=30, p=2)
    anchors = choose_anchors(n, cfg.anchors, seed=1)
    tables, _ = fit_layer(
        x.astype(np.float32), y.astype(np.float32), seq, seq, seq, anchors, ["similarity", "orthogonal"], cfg
    )
    sim = tables["similarity"]
    assert all(sim.column("value_identified").to_pylist()) and all(sim.column("operator_identified").to_pylist())
    patched = arrow_to_vectors(sim.column("patched"))
    np.testing.assert_allclose(patched, y[anchors].astype(np.float32), rtol=0, atol=1e-5 * np.abs(y).max())
    assert max(sim.column("rel_err").to_pylist()) < 1e-3
    assert min(tables["orthogonal"].column("rel_err").to_pylist()) > 0.24  # ‖0.4 Qx‖ / ‖0.6 Qx − x‖ ≥ 0.4 / 1.6


# ------------------------------------------------------------------------ synthetic ground truth
def synthetic_layer(rng, fn, n_seq=300, seq_len=20, d=4):
    """`y = T*(x) + c`: a known tokenwise map of the class, and a cross-token term `c` (a mix of the
    other tokens of the sequence), independent of the token's own `x`."""
    n = n_seq * seq_len
    x = rng.normal(size=(n, d))
    seq = np.repeat(np.arange(n_seq), seq_len)
    seq_sum = np.array([x[seq == s].sum(axis=0) for s in range(n_seq)])[seq]
    cross = 0.3 * ((seq_sum - x) / (seq_len - 1)) @ rng.normal(size=(d, d)).T
    if fn == "diag_psd":
        mapped = x * rng.uniform(0.3, 2.0, size=d)
    elif fn == "lowrank":
        mapped = x + x @ (rng.normal(size=(d, 2)) @ rng.normal(size=(2, d))).T
    elif fn == "orthogonal":
        mapped = x @ np.linalg.qr(rng.normal(size=(d, d)))[0].T
    else:
        mapped = x @ rng.normal(size=(d, d)).T + rng.normal(size=d)
    return x, mapped + cross, seq, mapped, cross


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["diag_psd", "lowrank", "orthogonal", "global_linear"])
def test_fits_recover_the_tokenwise_map_and_leave_the_cross_token_term(fn):
    rng = np.random.default_rng(23)
    x, y, seq, mapped, cross = synthetic_layer(rng, fn)
    cfg = AnalysisConfig(k=1500, anchors=20, rank=2, p=2, ridge=1e-6)
    anchors = choose_anchors(len(x), 20, seed=0)
    table, _ = fit_one(x, y, seq, np.zeros_like(seq), seq, anchors, fn, cfg)
    patched = arrow_to_vectors(table.column("patched"))
    residual = y[anchors] - patched
    c = cross[anchors]
    map_error = np.linalg.norm(patched - mapped[anchors], axis=1) / np.linalg.norm(c, axis=1)
    assert np.median(map_error) < 0.15
    cos = (residual * c).sum(1) / (np.linalg.norm(residual, axis=1) * np.linalg.norm(c, axis=1))
    assert np.median(cos) > 0.98
    # The identity baseline leaves the whole tokenwise update in the residual instead.
    base, _ = fit_one(x, y, seq, np.zeros_like(seq), seq, anchors, "identity", cfg)
    assert np.median(base.column("rel_err").to_numpy()) > 3 * np.median(table.column("rel_err").to_numpy())


# ------------------------------------------------------------------------------ nulls, non-finite
@pytest.mark.slow
@pytest.mark.parametrize("fn", CLASSES)
def test_non_finite_rows_are_counted_and_excluded(fn):
    rng = np.random.default_rng(30)
    x, y, seq, pos, tok = random_layer(rng)
    cfg = AnalysisConfig(**CONFIGS["euclid"])
    bad = np.array([4, 17, 50, 51])
    keep = np.isin(np.arange(len(x)), bad, invert=True)
    anchors = np.sort(np.concatenate([choose_anchors(len(x), 8, 1, keep), bad[:2]]))
    x_bad, y_bad = x.copy(), y.copy()
    x_bad[bad[:2], 1] = np.nan
    y_bad[bad[2], 0] = np.inf
    x_bad[bad[3]] = -np.inf
    table, info = fit_one(x_bad, y_bad, seq, pos, tok, anchors, fn, cfg)
    assert info.n_nonfinite == 4 and info.n_anchors_dropped == 2 and info.n_pool == len(x) - 4
    assert set(table.column("n_nonfinite").to_pylist()) == {4}
    # Identical to fitting the pool with those rows removed.
    clean_anchors = np.searchsorted(np.flatnonzero(keep), anchors[keep[anchors]])
    clean, _ = fit_one(x[keep], y[keep], seq[keep], pos[keep], tok[keep], clean_anchors, fn, cfg)
    assert table.drop_columns(["n_nonfinite"]).equals(clean.drop_columns(["n_nonfinite"]))
    assert set(clean.column("n_nonfinite").to_pylist()) == {0}


def test_undefined_columns_are_null():
    rng = np.random.default_rng(31)
    x, y, seq, pos, tok = random_layer(rng)
    y[7] = x[7]  # no update at this token: Δ_full = 0
    cfg = AnalysisConfig(**CONFIGS["euclid"])
    anchors = np.array([3, 7, 40])
    ident, _ = fit_one(x, y, seq, pos, tok, anchors, "identity", cfg)
    undefined = ("cos_full_tok", "angle_res_tok", "proj_full", "proj_res", "proj_full_global", "proj_res_global")
    for name in undefined:
        assert ident.column(name).null_count == 3, name
    assert ident.column("rel_err").to_pylist()[0] == pytest.approx(1.0)
    diag, _ = fit_one(x, y, seq, pos, tok, anchors, "diag_psd", cfg)
    row = diag.slice(1, 1).to_pylist()[0]
    for name in ("rel_err", "cos_full_tok", "cos_full_res", "proj_full", "proj_full_global"):
        assert row[name] is None, name
    assert row["norm_full"] == 0.0 and row["angle_res_tok"] is not None


def test_choose_anchors_is_seeded_sorted_and_valid():
    valid = np.ones(100, dtype=bool)
    valid[::3] = False
    picked = choose_anchors(100, 20, seed=5, valid_mask=valid)
    assert len(set(picked)) == 20 and (np.diff(picked) > 0).all() and valid[picked].all()
    np.testing.assert_array_equal(picked, choose_anchors(100, 20, seed=5, valid_mask=valid))
    assert not np.array_equal(picked, choose_anchors(100, 20, seed=6, valid_mask=valid))
    assert len(choose_anchors(100, 500, seed=5, valid_mask=valid)) == valid.sum()


def test_neighbours_are_searched_once_per_pool(monkeypatch):
    """One search for the real inputs, shared by every class and by `shuffled` (which permutes outputs only),
    whatever the order of the nulls; `gaussian` draws new inputs, so it gets its own."""
    import lmgeo.study_a.fits as fits

    rng = np.random.default_rng(32)
    x, y, seq, pos, tok = random_layer(rng)
    cfg = AnalysisConfig(**CONFIGS["euclid"])
    anchors = choose_anchors(len(x), 8, 2)
    searches = []

    def counted(pool, *args, **kwargs):
        searches.append(pool)
        return nearest_neighbours(pool, *args, **kwargs)

    monkeypatch.setattr(fits, "nearest_neighbours", counted)
    shuffled = []
    for samples in (("real", "shuffled", "gaussian"), ("real", "gaussian", "shuffled"), ("gaussian", "shuffled")):
        searches.clear()
        tables, _ = fit_layer(x, y, seq, pos, tok, anchors, ["diag_psd", "lowrank", "identity"], cfg, samples=samples)
        assert len(searches) == 2
        table = tables["lowrank"]
        shuffled.append(table.filter(pa.compute.equal(table["sample"], "shuffled")))
    assert shuffled[0].equals(shuffled[1]) and shuffled[0].equals(shuffled[2])


# ------------------------------------------------------------------------- layer-wide fits, locality
LOCAL = [fn for fn in CLASSES if FIT_CLASSES[fn].local]


@pytest.mark.slow
@pytest.mark.parametrize("fn", LOCAL)
def test_layer_wide_fit_matches_the_reference_on_the_whole_pool(fn):
    """`<class>.layer`: the class fitted once on every pair of the pool, evaluated at the same anchors."""
    rng = np.random.default_rng(12)
    x, y, seq, pos, tok = random_layer(rng, d=6)
    cfg = AnalysisConfig(**CONFIGS["euclid"])
    anchors = choose_anchors(len(x), cfg.anchors, seed=3)
    tables, _ = fit_layer(x.astype(np.float32), y.astype(np.float32), seq, pos, tok, anchors, [fn], cfg)
    assert list(tables) == [fn, fn + ".layer"]
    layer = tables[fn + ".layer"]
    x32, y32 = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    assert_rows_match(layer, reference_rows(x32, y32, seq, anchors, FIT_CLASSES[fn], cfg, layer_wide=True))
    assert layer.column("locality").null_count == layer.num_rows
    assert set(layer.column("input_rank").to_pylist()) == {6}


def test_locality_is_the_kth_neighbour_over_the_median_pair_distance():
    """Against an independent computation: the k-th neighbour's distance by brute force over the exact median of
    the distances of every pair of distinct pool rows (NumPy); typically below 1 for neighbourhoods much
    smaller than the pool."""
    from lmgeo.study_a.reference import ref_distances

    rng = np.random.default_rng(13)
    x, y, seq, pos, tok = random_layer(rng, n_seq=40, d=5)
    cfg = AnalysisConfig(**CONFIGS["euclid"])
    anchors = choose_anchors(len(x), cfg.anchors, seed=3)
    table, _ = fit_one(x, y, seq, pos, tok, anchors, "diag_psd", cfg)
    i, j = np.triu_indices(len(x), 1)
    typical = np.median(np.sqrt(((x[i] - x[j]) ** 2).sum(axis=1)))
    kth = [np.sort(ref_distances(x, a, "euclidean"))[cfg.k - 1] for a in anchors]
    np.testing.assert_allclose(table.column("locality").to_numpy(), np.array(kth) / typical, rtol=1e-12)
    assert np.median(table.column("locality").to_numpy()) < 1


def test_locality_is_small_for_tight_clusters_and_large_for_a_uniform_pool():
    """Planted: 20 clusters of 30 rows, each of width 1e-3 around centres spread over the unit cube, with k = 10
    (the neighbours lie in the anchor's own cluster) give a radius near 0; a uniform pool of as many rows a
    radius of the order of 1 (k = 10 of 600 in 4 dimensions: about 0.4 of the typical pair distance)."""
    rng = np.random.default_rng(15)
    n_clusters, size, d = 20, 30, 4
    centres = rng.uniform(0, 1, (n_clusters, d))
    clustered = np.repeat(centres, size, axis=0) + 1e-3 * rng.normal(size=(n_clusters * size, d))
    uniform = rng.uniform(0, 1, (n_clusters * size, d))
    ids = np.arange(n_clusters * size)
    cfg = AnalysisConfig(**CONFIGS["euclid"])
    anchors = choose_anchors(len(ids), cfg.anchors, seed=3)
    radius = {}
    for name, x in (("clustered", clustered), ("uniform", uniform)):
        y = x @ np.diag([0.5, 1.0, 1.5, 2.0])
        table, _ = fit_one(x, y, ids, ids, ids, anchors, "diag_psd", cfg)
        radius[name] = table.column("locality").to_numpy()
    assert radius["clustered"].max() < 0.01
    assert radius["uniform"].min() > 0.15 and np.median(radius["uniform"]) > 0.3


@pytest.mark.parametrize("fn", ["diag_psd", "lowrank", "similarity"])
def test_a_map_that_varies_along_the_manifold_makes_local_beat_layer_wide(fn):
    """Planted locality: on a 1-D manifold, a map of the class whose parameters vary along it is fitted far
    better locally than once for the layer; a single global map of the class is fitted as well either way."""
    rng = np.random.default_rng(14)
    n, d = 2000, 4
    t = np.sort(rng.uniform(0, 1, n))
    x = np.stack([np.cos(3 * t), np.sin(3 * t), t, 1 + 0 * t], axis=1) * 3 + 0.05 * rng.normal(size=(n, d))
    angle = 2.5 * t  # a rotation (diag: a scale; lowrank: a shear) that turns along the manifold
    if fn == "diag_psd":
        varying, fixed = x * (1 + np.stack([np.sin(4 * t)] * d, axis=1)), x * np.array([0.5, 1.5, 1.0, 2.0])
    elif fn == "lowrank":
        varying = x + np.stack([np.sin(4 * t) * x[:, 2], 0 * t, 0 * t, 0 * t], axis=1) * 3
        fixed = x + np.stack([0.7 * x[:, 2], 0 * t, 0 * t, 0 * t], axis=1)
    else:
        c, s = np.cos(angle), np.sin(angle)
        varying = np.stack([c * x[:, 0] - s * x[:, 1], s * x[:, 0] + c * x[:, 1], x[:, 2], x[:, 3]], axis=1)
        fixed = x @ np.linalg.qr(rng.normal(size=(d, d)))[0].T * 1.3
    seq = np.arange(n)
    cfg = AnalysisConfig(k=40, anchors=60, rank=1, p=1, ridge=1e-9)
    anchors = choose_anchors(n, cfg.anchors, seed=0)
    medians = {}
    for name, y in (("varying", varying), ("fixed", fixed)):
        tables, _ = fit_layer(x, y, seq, seq, seq, anchors, [fn], cfg)
        medians[name] = [np.median(tables[part].column("rel_err").to_numpy()) for part in (fn, fn + ".layer")]
    local, layer = medians["varying"]
    assert local < 0.3 * layer  # locality pays where the map varies
    local, layer = medians["fixed"]
    assert layer < 1e-6 and local < 1e-6  # one map: the layer-wide fit is as good as the local one


def test_capacity_orders_the_classes():
    cfg = AnalysisConfig(rank=4, mlp_hidden=8)
    d = 64
    capacity = {fn: FIT_CLASSES[fn].parameters(d, cfg) for fn in CLASSES}
    assert capacity["identity"] == 0 and capacity["diag_psd"] == d
    assert capacity["orthogonal"] == d * (d - 1) // 2 and capacity["similarity"] == capacity["orthogonal"] + 1
    # rank-4 d × d matrices: dimension of the manifold, by counting the Jacobian rank of (U, V) ↦ U Vᵀ
    small, rank = 7, 2
    u, v = np.random.default_rng(15).normal(size=(2, small, rank))
    jac = np.concatenate([np.kron(np.eye(small), v), np.kron(u, np.eye(small))], axis=1)
    lowrank = FIT_CLASSES["lowrank"].parameters(small, AnalysisConfig(rank=rank))
    assert lowrank == np.linalg.matrix_rank(jac)
    assert capacity["global_linear"] == d * d + d and capacity["mlp"] == 2 * 8 * d + 8 + d
    order = sorted(CLASSES, key=lambda fn: capacity[fn])
    assert order.index("diag_psd") < order.index("lowrank") < order.index("orthogonal") < order.index("global_linear")


def test_every_class_mlp_included_is_fitted_on_every_sample():
    """`mlp` gets the null samples every class gets (the claims test it against them), locally and layer-wide."""
    rng = np.random.default_rng(16)
    x, y, seq, pos, tok = random_layer(rng)
    cfg = AnalysisConfig(**CONFIGS["euclid"])
    anchors = choose_anchors(len(x), 4, 2)
    tables, _ = fit_layer(
        x, y, seq, pos, tok, anchors, ["mlp", "diag_psd"], cfg, samples=("real", "shuffled", "gaussian")
    )
    for fn in ("mlp", "mlp.layer", "diag_psd"):
        assert tables[fn].column("sample").to_pylist() == ["real"] * 4 + ["shuffled"] * 4 + ["gaussian"] * 4, fn
    real, shuffled = (tables["mlp"].filter(pa.compute.equal(tables["mlp"]["sample"], s)) for s in ("real", "shuffled"))
    assert real.column("rel_err").to_pylist() != shuffled.column("rel_err").to_pylist()


def test_the_gaussian_pool_has_the_pools_moments_and_a_singular_covariance_is_kept_singular():
    """`gaussian` draws from the Gaussian with the pool's joint mean and covariance of (h_l, h_{l+1}): on 20,000
    pairs whose outputs are a linear map of the inputs (a singular joint covariance) the draws' mean and
    covariance match the pool's, and the draws keep the map exactly where the pool had it."""
    rng = np.random.default_rng(30)
    x = torch.from_numpy(rng.normal(size=(20000, 3)) * [1.0, 2.0, 0.5] + [1.0, -1.0, 0.0])
    y = x @ torch.from_numpy(rng.normal(size=(3, 3)))
    xs, ys = null_sample(x, y, "gaussian", seed=0)
    joint, drawn = torch.cat([x, y], 1), torch.cat([xs, ys], 1)
    torch.testing.assert_close(drawn.mean(0), joint.mean(0), atol=0.05, rtol=0)
    torch.testing.assert_close(torch.cov(drawn.T), torch.cov(joint.T), atol=0.1, rtol=0.05)
    mapping = torch.linalg.lstsq(x - x.mean(0), y - y.mean(0)).solution
    torch.testing.assert_close(ys - ys.mean(0), (xs - xs.mean(0)) @ mapping, atol=1e-8, rtol=0)


def test_an_mlp_on_neighbours_that_are_one_point_is_the_constant_mean_update():
    """k copies of one input (a frequent token's embedding at layer 0) with different outputs: the map can only
    be a constant, so its value at the anchor is the mean update and J − I is 0 — finite, where 1/σ of the
    rounding noise overflowed before."""
    from lmgeo.study_a.classes.mlp import fit_mlp

    rng = np.random.default_rng(3)
    d, k = 8, 24
    point = torch.from_numpy(rng.normal(size=d))
    xn = (point + 1e-12 * torch.from_numpy(rng.normal(size=(k, d))))[None]  # one point below float32 resolution
    yn = xn + torch.from_numpy(rng.normal(size=(1, k, d)))
    mlp, _ = fit_mlp(xn, yn, hidden=8, max_steps=30, tol=1e-6, ridge=1e-4, seed=0)
    update = mlp.update(xn[:, 0], p=2)
    assert torch.isfinite(update.delta_tok).all() and not bool(update.basis.columns.abs().sum())
    mean_update = (yn - xn).mean(dim=1)
    assert torch.allclose(update.delta_tok, mean_update, atol=1e-3 * float(mean_update.norm()))


def test_a_layer_with_no_identified_anchor_has_an_empty_global_subspace():
    """No identified value to span it (a tiny or degenerate layer): the layer's subspace is empty, not an error."""
    from lmgeo.study_a.geometry import global_basis

    basis = global_basis(torch.zeros(0, 5, dtype=torch.float64), 2)
    assert not bool(basis.columns.abs().sum()) and not bool(basis.tied.any())
