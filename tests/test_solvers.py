"""The fits' two ways to factorise (`lmgeo/study_a/solvers.py`): LAPACK (the CPU's) and the batched products
(CUDA's), the latter forced onto the CPU here. Each product-path result is checked against NumPy's own SVD or
eigendecomposition computed in the test, and whole fits against the LAPACK path on identified, untied anchors
within the GPU check's tolerances."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmgeo.commands.bench.synthetic import synthetic_states
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.fits import choose_anchors, fit_layer
from lmgeo.study_a.solvers import LAPACK, PRODUCTS, U32, forced, solver_for
from scripts.gpucheck.compare import compare_fit_tables

F64 = torch.float64


def _conditioned(rng: np.random.Generator, batch: int, d: int, condition: float) -> np.ndarray:
    """Random (batch, d, d) matrices with singular values spread log-evenly over `condition`."""
    left = np.linalg.qr(rng.normal(size=(batch, d, d)))[0]
    right = np.linalg.qr(rng.normal(size=(batch, d, d)))[0]
    singular = np.logspace(0, -np.log10(condition), d)
    return left @ (singular[:, None] * right)


@pytest.mark.parametrize("condition", [1e1, 1e6, 1e11])
def test_the_polar_factor_from_products_is_numpys(condition):
    c = _conditioned(np.random.default_rng(1), 4, 24, condition)
    u, singular, vt = np.linalg.svd(c)
    floor = torch.full((4,), singular[:, -1].min() / np.linalg.norm(c, axis=(1, 2)).max())
    polar = PRODUCTS.polar(torch.from_numpy(c), floor)
    np.testing.assert_allclose(polar.rotation.numpy(), u @ vt, atol=1e-9 * condition**0.5)
    np.testing.assert_allclose(polar.singular_sum.numpy(), singular.sum(axis=1), rtol=1e-12)
    # σ_min by inverse iteration: a Rayleigh quotient of H = QᵀC, from above up to H's own rounding (u‖C‖), within
    # a few percent where the smallest singular values crowd (1.1 apart at condition 10): enough for a cut-off
    # at the float32 rounding level
    rounding = 1e-14 * np.linalg.norm(c, axis=(1, 2))
    assert np.all(polar.smallest.numpy() >= singular[:, -1] - rounding)
    np.testing.assert_allclose(polar.smallest.numpy(), singular[:, -1], rtol=5e-2, atol=rounding.max())


def test_a_singular_matrix_has_its_smallest_singular_value_at_rounding_and_the_others_still_converge():
    rng = np.random.default_rng(2)
    c = _conditioned(rng, 2, 10, 1e3)
    u, singular, vt = np.linalg.svd(c)
    singular[0, -1] = 0.0  # exactly singular
    c = u @ (singular[..., None] * vt)
    polar = PRODUCTS.polar(torch.from_numpy(c), torch.full((2,), 1e-4))
    assert polar.smallest[0] <= 1e-14 * np.linalg.norm(c[0]) and polar.smallest[1] > 1e-4
    np.testing.assert_allclose(polar.rotation[1].numpy(), u[1] @ vt[1], atol=1e-10)


@pytest.mark.slow
def test_the_leading_eigenvectors_span_numpys_where_the_spectrum_has_a_gap():
    rng = np.random.default_rng(3)
    q = np.linalg.qr(rng.normal(size=(5, 40, 40)))[0]
    values = np.sort(rng.uniform(0.1, 4.0, size=(5, 40)), axis=1)[:, ::-1]
    sym = q @ (values[..., None] * q.swapaxes(1, 2))
    found, vectors = PRODUCTS.top_eigenvectors(torch.from_numpy(sym), 6)
    exact, exact_vectors = np.linalg.eigh(sym)
    np.testing.assert_allclose(found.numpy(), exact[:, ::-1][:, :6], rtol=1e-12)
    for m in range(1, 7):  # the span of the leading m, for every m: compared as projectors
        mine, theirs = vectors[..., :m].numpy(), exact_vectors[..., ::-1][..., :m]
        np.testing.assert_allclose(mine @ mine.swapaxes(1, 2), theirs @ theirs.swapaxes(1, 2), atol=1e-9)


def test_the_gram_spectrum_counts_the_rank_as_every_eigenvalue_would_and_falls_back_where_it_is_deficient():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 30, 12)) * np.logspace(0, -2, 12)
    x[1, :, 5] = x[1, :, 4]  # rank 11
    gram = torch.from_numpy(x.swapaxes(1, 2) @ x)
    spectrum = PRODUCTS.spectrum(gram)
    values = np.clip(np.linalg.eigvalsh(gram.numpy()), 0, None)
    trace = values.sum(axis=1)
    assert spectrum.rank.tolist() == (values > U32**2 * trace[:, None]).sum(axis=1).tolist() == [12, 11, 12]
    np.testing.assert_allclose(spectrum.trace.numpy(), trace, rtol=1e-12)
    np.testing.assert_allclose(spectrum.smallest.numpy()[[0, 2]], values[[0, 2], 0], rtol=1e-3)
    assert spectrum.values is None and LAPACK.spectrum(gram).values is not None


def test_left_singular_vectors_of_few_rows_from_their_gram_are_numpys():
    core = np.random.default_rng(5).normal(size=(4, 6, 50))
    u, singular = PRODUCTS.left_singular(torch.from_numpy(core))
    exact_u, exact_s, _ = np.linalg.svd(core, full_matrices=False)
    np.testing.assert_allclose(singular.numpy(), exact_s, rtol=1e-10)
    np.testing.assert_allclose(np.abs((u.numpy() * exact_u).sum(axis=1)), 1.0, atol=1e-10)  # same up to sign


def test_the_dispatch_is_by_device_unless_forced():
    assert solver_for(torch.device("cpu")) is LAPACK and solver_for(torch.device("cuda")) is PRODUCTS
    with forced(PRODUCTS):
        assert solver_for(torch.device("cpu")) is PRODUCTS
    assert solver_for(torch.device("cpu")) is LAPACK


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["diag_psd", "lowrank", "orthogonal", "similarity"])
def test_fits_on_the_product_path_match_the_lapack_path_on_identified_untied_anchors(fn):
    """A layer of width 24 with k = d + 64 neighbours: every anchor identified; the product path forced on
    the CPU against LAPACK, compared as the GPU check compares a device with the CPU (null-aware, ties left out
    of the subspace columns, `TOLERANCES["fits"]`)."""
    states = synthetic_states(n_seq=12, seq_len=16, d=24, n_layers=1, seed=6)
    seq = np.repeat(np.arange(12), 16)
    cfg = AnalysisConfig(k=24 + 64, anchors=16, rank=3, p=3)
    anchors = choose_anchors(len(states[0]), cfg.anchors, seed=0)
    args = (states[0], states[1], seq, seq, seq, anchors, [fn], cfg)
    lapack = fit_layer(*args)[0][fn]
    with forced(PRODUCTS):
        products = fit_layer(*args)[0][fn]
    assert all(lapack["operator_identified"].to_pylist())
    found = compare_fit_tables(products, lapack)
    assert not found.mismatched, found.mismatched
    assert all(agreement.passed for agreement in found.values.values()), {
        name: agreement.describe() for name, agreement in found.values.items() if not agreement.passed
    }


def test_a_tie_running_past_the_leading_vectors_found_is_cut_as_the_whole_spectrum_cuts_it():
    """A scaled rotation by the same angle in every plane: all singular values of `sQ − I` tie, so the gap cut
    keeps every direction. The product path finds only `p + 1` leading vectors; it must read the whole spectrum
    then, and keep the same subspace as LAPACK (all d directions)."""
    from lmgeo.study_a.classes.orthogonal import OrthogonalFit

    d, p, angle = 6, 2, 0.3
    plane = torch.tensor([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]], dtype=F64)
    rotation = torch.block_diag(*[plane] * (d // 2))[None]
    fit = OrthogonalFit(rotation, torch.full((1,), 1.2, dtype=F64), torch.zeros(1, dtype=torch.bool))
    lapack = fit._dominant_subspace(p)
    with forced(PRODUCTS):
        products = fit._dominant_subspace(p)
    for columns in (lapack, products):
        assert bool(columns.tied.all())
        kept = columns.columns[0][:, columns.columns[0].norm(dim=0) > 0]
        assert kept.shape[1] == d and torch.allclose(kept.T @ kept, torch.eye(d, dtype=F64), atol=1e-10)
