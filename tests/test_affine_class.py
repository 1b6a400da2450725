"""The local `affine` class (`T(x) = A x + b` per neighbourhood): its closed form against NumPy's least squares
with an appended ones column, its identification (`k ≥ d + 1` centred inputs of rank `d`), and the two planted
layers that decide whether locality buys anything over one affine map (`global_linear`): one affine map for every
token (no local class may beat it) and a map that is affine only locally (`affine` must beat it clearly)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_a.classes.affine import fit_affine
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.fits import choose_anchors, fit_layer

LOCAL = [fn for fn in FIT_CLASSES.names() if FIT_CLASSES[fn].local]


def lstsq_with_ones(x: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
    """`[Aᵀ; bᵀ]` minimising `‖Y − [X, 1] W‖² + λ‖Aᵀ‖²`: NumPy's lstsq on `[X, 1]` stacked over `[√λ I, 0]`."""
    n, d = x.shape
    design = np.vstack([np.hstack([x, np.ones((n, 1))]), np.hstack([np.sqrt(ridge) * np.eye(d), np.zeros((d, 1))])])
    return np.linalg.lstsq(design, np.vstack([y, np.zeros((d, d))]), rcond=None)[0]


@pytest.mark.parametrize(("k", "d", "ridge"), [(15, 5, 0.0), (15, 5, 0.3), (6, 9, 0.3)])
def test_the_fit_is_least_squares_with_an_intercept(k, d, ridge):
    """Batched over anchors, primal (k > d) and kernel (k ≤ d) forms: the map, its value and `J − I`."""
    rng = np.random.default_rng(0)
    n_anchors = 4
    xn, yn = rng.normal(size=(2, n_anchors, k, d)) + 0.7
    x_a = rng.normal(size=(n_anchors, d))
    fitted = fit_affine(torch.from_numpy(xn), torch.from_numpy(yn), ridge)
    update = fitted.update(torch.from_numpy(x_a), p=2)
    for i in range(n_anchors):
        coef = lstsq_with_ones(xn[i], yn[i], ridge)
        np.testing.assert_allclose(fitted.a_t[i].numpy(), coef[:-1], atol=1e-9)
        want = coef[:-1].T @ x_a[i] + coef[-1]
        np.testing.assert_allclose(update.delta_tok[i].numpy(), want - x_a[i], atol=1e-9)
        # the dominant subspace is that of J − I = A − I: its top-p left singular vectors
        top = np.linalg.svd(coef[:-1].T - np.eye(d))[0][:, :2]
        got = update.basis.columns[i].numpy()
        np.testing.assert_allclose(got @ got.T, top @ top.T, atol=1e-8)


def test_the_map_is_identified_from_d_plus_one_neighbours_and_not_from_d():
    """`d + 1` unknowns per output: `k = d` neighbours leave the centred inputs of rank `d − 1` (the operator is
    not identified, and an anchor off their affine span has no value); `k = d + 1` in general position do."""
    rng = np.random.default_rng(1)
    n, d = 400, 5
    x = rng.normal(size=(n, d))
    y = x @ rng.normal(size=(d, d)) + 1.0
    seq = np.arange(n)
    anchors = choose_anchors(n, 20, seed=0)
    for k, identified in ((d, False), (d + 1, True)):
        cfg = AnalysisConfig(k=k, anchors=20, rank=2, p=2, ridge=0.0)
        table = fit_layer(x, y, seq, seq, seq, anchors, ["affine"], cfg)[0]["affine"]
        assert set(table.column("operator_identified").to_pylist()) == {identified}
        assert set(table.column("value_identified").to_pylist()) == {identified}
        assert max(table.column("input_rank").to_pylist()) == (d if identified else d - 1)


def median_rel_err(x: np.ndarray, y: np.ndarray, classes: list[str], cfg: AnalysisConfig) -> dict[str, float]:
    seq = np.arange(len(x))
    anchors = choose_anchors(len(x), cfg.anchors, seed=0)
    tables = fit_layer(x, y, seq, seq, seq, anchors, classes, cfg)[0]
    return {fn: float(np.median(tables[fn].column("rel_err").to_numpy())) for fn in classes}


CFG = AnalysisConfig(k=48, anchors=60, rank=2, p=2, ridge=1e-6, mlp_hidden=4, mlp_steps=100)


def test_planted_null_one_affine_map_is_not_beaten_by_any_local_class():
    """The update IS one affine map (plus noise at 1e-3 of it): one map fitted on the layer is as good as any
    local fit, `affine` included (which only adds the noise of fitting it on `k` pairs)."""
    rng = np.random.default_rng(2)
    n, d = 2000, 6
    x = rng.normal(size=(n, d)) * 2 + 1
    a0, b0 = rng.normal(size=(d, d)) * 0.5, rng.normal(size=d)
    delta = x @ a0.T + b0
    y = x + delta + 1e-3 * np.linalg.norm(delta, axis=1).mean() / np.sqrt(d) * rng.normal(size=(n, d))
    err = median_rel_err(x, y, [*LOCAL, "global_linear"], CFG)
    assert err["global_linear"] < 3e-3  # the noise level
    for fn in LOCAL:
        assert err["global_linear"] <= err[fn] + 1e-4, (fn, err)
    assert err["affine"] < 2 * err["global_linear"]  # and the local affine fit recovers it too


def test_planted_positive_a_locally_affine_map_makes_affine_beat_global_linear():
    """`Δ = sin(W x)`: smooth, so affine on a small neighbourhood, but far from one affine map over the pool."""
    rng = np.random.default_rng(3)
    n, d = 3000, 3
    x = rng.normal(size=(n, d))
    w = rng.normal(size=(d, d)) * 1.5
    y = x + np.sin(x @ w.T)
    err = median_rel_err(x, y, ["affine", "global_linear"], CFG)
    assert err["global_linear"] > 0.3 and err["affine"] < 0.3 * err["global_linear"], err
