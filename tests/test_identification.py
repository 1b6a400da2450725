"""Identification per quantity (SPEC §4.5): the input rank and the span test against NumPy's SVD, planted
neighbourhoods whose answer is known, and the claim behind the cut-offs: a quantity called identified moves
by about the float32 rounding under a float32-level perturbation of the stored values, one that is not
moves by O(1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_a.classes.base import FitContext
from lmgeo.study_a.classes.lowrank import fit_lowrank
from lmgeo.study_a.classes.orthogonal import fit_orthogonal, procrustes_reference
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.fits import Fitted, _identifications, _identified
from lmgeo.study_a.identification import U32, NeighbourhoodGram, identify
from lmgeo.study_a.reference import identification


def float32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(np.float64)


def planted(rng, k, d, rank, inside):
    """Inputs of rank `rank` (singular values over three orders of magnitude) and an anchor inside their span
    (a combination of the rows) or not (a random vector), all stored as float32."""
    left, right = rng.normal(size=(k, rank)), rng.normal(size=(rank, d))
    xn = (left * np.logspace(0, -3, rank)) @ right
    x_a = rng.normal(size=k) @ xn if inside else rng.normal(size=d)
    return float32(xn), float32(x_a)


@pytest.mark.parametrize(("k", "d"), [(12, 7), (5, 9), (9, 9)])
def test_rank_and_span_match_numpys_svd(k, d):
    """Both Gram forms (d × d when k > d, else k × k) agree with an SVD and an explicit projection."""
    rng = np.random.default_rng(8)
    cases = [(rank, inside) for rank in range(1, min(k, d) + 1) for inside in (True, False)]
    xn, x_a = (np.stack(v) for v in zip(*(planted(rng, k, d, r, i) for r, i in cases), strict=True))
    xt, at = torch.from_numpy(xn), torch.from_numpy(x_a)
    got = identify(xt, at, NeighbourhoodGram(xt))
    want = [identification(m, v) for m, v in zip(xn, x_a, strict=True)]
    assert got.input_rank.tolist() == [r for r, _ in want] == [r for r, _ in cases]
    assert got.in_span.tolist() == [s for _, s in want]
    # Inside the span is always in it; outside is out of it unless the inputs span the whole space.
    assert got.in_span.tolist() == [inside or rank == d for rank, inside in cases]


def test_identification_does_not_depend_on_what_is_decomposed_with_it():
    """The span test decomposes only the neighbourhoods that lack full rank, one matrix at a time in LAPACK:
    the same answer for each anchor alone, all together, and after a class has asked for every
    eigendecomposition (`lowrank` does, after identification)."""
    rng = np.random.default_rng(9)
    cases = [planted(rng, 14, 8, rank, inside) for rank in (8, 5, 3, 8) for inside in (True, False)]
    xt, at = (torch.from_numpy(np.stack(v)) for v in zip(*cases, strict=True))
    together = identify(xt, at, NeighbourhoodGram(xt))
    decomposed = NeighbourhoodGram(xt)
    decomposed.eigen()
    after_eigen = identify(xt, at, decomposed)
    alone = [identify(xt[i : i + 1], at[i : i + 1], NeighbourhoodGram(xt[i : i + 1])) for i in range(len(cases))]
    assert after_eigen.input_rank.tolist() == together.input_rank.tolist()
    assert after_eigen.in_span.tolist() == together.in_span.tolist()
    assert [int(a.input_rank) for a in alone] == together.input_rank.tolist() == [8, 8, 5, 5, 3, 3, 8, 8]
    # full rank (d = 8): every anchor is in the span; deficient: only those planted inside
    assert (
        [bool(a.in_span) for a in alone]
        == together.in_span.tolist()
        == [True, True, True, False, True, False, True, True]
    )


def refit(fn, xn, yn, x_a, cfg):
    xt, yt, at = (torch.from_numpy(v)[None] for v in (xn, yn, x_a))
    gram = NeighbourhoodGram(xt)
    update = FIT_CLASSES[fn].fit(xt, yt, at[0], cfg, FitContext(0, gram))
    seen = _identifications(xt, at[0], gram, [fn])[FIT_CLASSES[fn].centres_inputs]
    return _identified(fn, update, seen, None), (at[0] + update.delta_tok)[0].numpy()


def perturbed(rng, a):
    """`a` (float32 values) with every value moved by up to one float32 rounding, relative."""
    return a * (1 + U32 * rng.uniform(-1, 1, size=a.shape))


def neighbourhood(case):
    rng = np.random.default_rng({"near_singular": 1, "deficient_inside": 2, "deficient_outside": 3}[case])
    k, d = 40, 10
    xn, x_a = planted(rng, k, d, d if case == "near_singular" else 6, inside=case != "deficient_outside")
    q = np.linalg.qr(rng.normal(size=(d, d)))[0]
    yn = float32(0.8 * xn @ q.T + 0.05 * np.tanh(xn))  # a smooth map, not of the class: a real residual
    return rng, xn, yn, x_a, AnalysisConfig(k=k, rank=2, p=2, ridge=0.0)


@pytest.mark.parametrize("fn", ["diag_psd", "lowrank", "orthogonal", "similarity"])
@pytest.mark.parametrize("case", ["near_singular", "deficient_inside"])
def test_identified_values_move_by_the_float32_rounding(fn, case):
    """Near-singular but determined (full rank, condition 1e3), and rank-deficient with the anchor in the
    span: the value is kept, and perturbing every stored value at the float32 level moves `T(x_a)` by
    ~1e-7 of the update (far below the 1e-4 asserted)."""
    rng, xn, yn, x_a, cfg = neighbourhood(case)
    fitted, value = refit(fn, xn, yn, x_a, cfg)
    assert fitted.value_identified.tolist() == [True]
    if case == "deficient_inside" and FIT_CLASSES[fn].needs_rank(x_a.size) == x_a.size:
        assert fitted.operator_identified.tolist() == [False]  # rank 6 < d: the map itself is not determined
    scale = np.linalg.norm(value - x_a)
    moves = [
        np.linalg.norm(refit(fn, *(perturbed(rng, v) for v in (xn, yn, x_a)), cfg)[1] - value) / scale for _ in range(4)
    ]
    assert max(moves) < 1e-4, moves


def test_an_anchor_outside_a_deficient_span_is_flagged_and_undetermined():
    """Rank 6 < d = 10 and the anchor outside the span: flagged for every class, and for the linear classes
    another map of the class fits the neighbours exactly as well and moves `T(x_a)` by O(1) of the update:
    `Q H` (H the reflection along a direction the inputs lack) for the Procrustes maps, `B + U c nᵀ` for
    `lowrank`."""
    _, xn, yn, x_a, cfg = neighbourhood("deficient_outside")
    for fn in ("diag_psd", "lowrank", "orthogonal", "similarity"):
        assert refit(fn, xn, yn, x_a, cfg)[0].value_identified.tolist() == [False], fn
    null = np.linalg.svd(xn)[2][-1]  # a direction the inputs lack
    xt, yt = torch.from_numpy(xn)[None], torch.from_numpy(yn)[None]
    q = fit_orthogonal(xt, yt, True).rotation[0].numpy()
    lowrank = fit_lowrank(xt, yt, 2, 0.0)
    b = (lowrank.u @ lowrank.v.mT)[0].numpy()
    other_b = b + lowrank.u[0].numpy() @ np.ones((2, 1)) * null[None]
    for first, second in ((q, q @ (np.eye(10) - 2 * np.outer(null, null))), (np.eye(10) + b, np.eye(10) + other_b)):
        # the neighbours cannot tell them apart (their inputs lack `null` up to the float32 rounding)
        np.testing.assert_allclose(xn @ second.T, xn @ first.T, atol=1e-6 * np.abs(xn).max(), rtol=0)
        assert np.linalg.norm((second - first) @ x_a) > 1e-2 * np.linalg.norm(first @ x_a - x_a)


def test_an_anchor_among_copies_is_kept():
    """Every neighbour a copy of the anchor (a repeated token): rank 1, the anchor in the span, its value
    identified (the mean output), its operator not."""
    x_a = float32(np.random.default_rng(5).normal(size=6))
    xn = np.tile(x_a, (8, 1))
    fitted, _ = refit("lowrank", xn, xn + 1.0, x_a, AnalysisConfig(k=8, rank=2, p=2))
    assert isinstance(fitted, Fitted)
    assert fitted.input_rank.tolist() == [1]
    assert fitted.value_identified.tolist() == [True] and fitted.operator_identified.tolist() == [False]


def test_the_mlp_is_identified_by_the_same_rule_on_the_inputs_it_sees():
    """The MLP sees its inputs centred on the neighbours' mean, so the one span rule is applied to `x_j − μ`:
    inputs on an affine plane of dimension 5 (off the origin) span 6 dimensions linearly but 5 centred. An
    anchor on the plane: kept by every class, the MLP's operator not identified (centred rank 5 < d = 8). An
    anchor in the linear span but off the plane: kept by the linear classes, flagged for the MLP (its centred
    value is not a fact of the data)."""
    rng = np.random.default_rng(11)
    k, d, plane = 30, 8, 5
    offset, directions = rng.normal(size=d), rng.normal(size=(plane, d))
    xn = float32(offset + rng.normal(size=(k, plane)) @ directions)
    yn = float32(xn + 0.3 * np.tanh(xn))
    cfg = AnalysisConfig(k=k, rank=2, p=2, mlp_hidden=3, mlp_steps=5)
    on_plane = float32(offset + rng.normal(size=plane) @ directions)
    off_plane = float32(2 * offset + rng.normal(size=plane) @ directions)
    for x_a, mlp_kept in ((on_plane, True), (off_plane, False)):
        mlp, _ = refit("mlp", xn, yn, x_a, cfg)
        assert mlp.value_identified.tolist() == [mlp_kept]
        assert mlp.input_rank.tolist() == [plane] and mlp.operator_identified.tolist() == [False]
        linear, _ = refit("lowrank", xn, yn, x_a, cfg)
        assert linear.value_identified.tolist() == [True] and linear.input_rank.tolist() == [plane + 1]


def test_procrustes_is_unidentified_where_inputs_and_outputs_of_full_rank_meet_at_a_right_angle():
    """k > d: `X` and `Y` both of rank d = 5 in R^12, `Y`'s column space holding a direction orthogonal to all of
    `X`'s. Then `C = YᵀX` is singular (σ_d(C) = 0 < σ_d(Y) σ_d(X), so the inequality the old note relied on is
    false for k > d) and `Q` is not unique: flagged, by the batched fit and by SciPy's principal angles in the
    reference. Tilting that direction back towards `X`'s column space by well more than the rounding's reach
    makes `Q` unique: identified."""
    rng = np.random.default_rng(12)
    k, d = 12, 5
    basis = np.linalg.qr(rng.normal(size=(k, k)))[0]
    x = float32(basis[:, :d] @ rng.normal(size=(d, d)))
    for tilt, identified in ((0.0, False), (1e-2, True)):
        outputs = np.concatenate([basis[:, : d - 1], (basis[:, d] + tilt * basis[:, d - 1])[:, None]], axis=1)
        y = float32(outputs @ rng.normal(size=(d, d)))
        assert np.linalg.matrix_rank(x) == np.linalg.matrix_rank(y) == d
        singular = np.linalg.svd(y.T @ x, compute_uv=False)
        smallest = [np.linalg.svd(v, compute_uv=False)[-1] for v in (x, y)]
        if not identified:
            assert singular[-1] < 1e-6 * singular[0] and smallest[0] * smallest[1] > 1e-3
        for with_scale in (False, True):
            fit = fit_orthogonal(torch.from_numpy(x)[None], torch.from_numpy(y)[None], with_scale)
            assert fit.unidentified.tolist() == [not identified]
            assert procrustes_reference(x, y, with_scale)[1] is identified
