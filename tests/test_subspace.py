"""The dominant subspace's cut (SPEC §4.2, `lmgeo.study_a.geometry.dominant`): at least `p` singular values,
cut at a gap so that a tie is kept whole; the subspace is then unique, and the projections written from it do
not move when the inputs move by float64 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmgeo.study_a.classes.orthogonal import OrthogonalFit
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.fits import choose_anchors, fit_layer
from lmgeo.study_a.geometry import TIE, dominant, tied


def kept(values: list[float], p: int) -> list[bool]:
    return dominant(torch.tensor([values], dtype=torch.float64), p)[0].tolist()


@pytest.mark.parametrize(
    ("values", "p", "count"),
    [
        ([3.0, 2.5, 2.0, 1.0], 2, 2),  # a gap after p: the strict top p
        ([3.0, 2.0, 2.0, 1.0], 2, 3),  # the p-th tied with the next: the pair is kept whole
        ([2.0, 1.0, 1.0, 1.0, 0.5], 2, 4),  # a tied group of three past p
        ([2.0, 2.0, 1.0], 1, 2),  # a tie at the top
        ([1.0, 1.0, 1.0], 2, 3),  # everything tied: the whole range
        ([3.0, 1.0, 0.0, 0.0], 4, 2),  # rank below p: the range, never a zero
        ([3.0, 1e-13, 1e-13], 2, 1),  # values at rounding level count as zero, tied or not
        ([0.0, 0.0], 1, 0),  # nothing: empty
        ([3.0, 2.0], 5, 2),  # p beyond the spectrum
    ],
)
def test_the_cut_keeps_at_least_p_and_never_splits_a_tie(values, p, count):
    assert kept(values, p) == [i < count for i in range(len(values))]
    assert bool(tied(torch.tensor([values], dtype=torch.float64), p)[0]) is (count > p)


def test_a_tie_is_closer_than_tie_of_the_largest_and_a_gap_wider_than_it():
    assert kept([1.0, 0.5, 0.5 - 0.5 * TIE], 2) == [True, True, True]
    assert kept([1.0, 0.5, 0.5 - 2 * TIE], 2) == [True, True, False]


def test_a_reflection_keeps_the_unpaired_top_and_whole_rotation_planes():
    """`Q − I` for `Q` orthogonal with det −1 in R^6: singular values 2 (the reflected axis, unpaired), then a
    pair per rotation plane. With p = 4 the strict top 4 would split the second pair; the cut keeps 5, and the
    projector on it is the same whatever basis the decomposition returns for each plane."""
    rng = np.random.default_rng(0)
    angles = [2.5, 1.0]
    blocks = [np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]]) for a in angles]
    q = np.zeros((6, 6))
    q[0, 0], q[1, 1] = -1.0, 1.0
    q[2:4, 2:4], q[4:6, 4:6] = blocks
    basis = np.linalg.qr(rng.normal(size=(6, 6)))[0]
    rotation = torch.from_numpy(basis @ q @ basis.T)[None]
    fit = OrthogonalFit(rotation, torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.bool))
    subspace = fit.update(torch.zeros(1, 6, dtype=torch.float64), 4).basis
    assert subspace.dim().tolist() == [5] and subspace.tied.tolist() == [True]
    projector = subspace.columns[0] @ subspace.columns[0].T
    # the reflected axis and both planes' pairs of singular value 2 sin(θ/2): everything but the fixed axis
    fixed = torch.from_numpy(basis[:, 1])
    torch.testing.assert_close(projector, torch.eye(6, dtype=torch.float64) - torch.outer(fixed, fixed))


def strict_top_p(singular: torch.Tensor, p: int) -> torch.Tensor:
    """The cut before this change: exactly the first p non-zero singular values, splitting a tie."""
    first = torch.arange(singular.shape[-1]) < p
    return first & (singular > 1e-12 * singular[..., :1])


def random_pairs(seed: int, n: int = 600, d: int = 8) -> tuple[np.ndarray, ...]:
    """Unrelated inputs and outputs: the Procrustes maps are arbitrary rotations, about half with det −1."""
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(n, d)), rng.normal(size=(n, d))
    seq = np.repeat(np.arange(n // 10), 10)
    return x, y, seq, np.tile(np.arange(10), n // 10)


def projections(x: np.ndarray, y: np.ndarray, seq: np.ndarray, pos: np.ndarray, fn: str) -> dict[str, np.ndarray]:
    cfg = AnalysisConfig(k=24, anchors=60, p=4, rank=2, classes=[fn])
    tables, _ = fit_layer(x, y, seq, pos, seq, choose_anchors(len(x), cfg.anchors, 0), [fn], cfg)
    return {
        c: np.asarray(tables[fn].column(c).to_pylist(), dtype=float)
        for c in ("proj_full", "proj_res", "subspace_tied", "subspace_dim")
    }


def rounded(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`a` with every value moved by one float64 rounding at most (relative 2⁻⁵²)."""
    return a * (1 + 2.0**-52 * rng.uniform(-1, 1, size=a.shape))


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["orthogonal", "similarity", "diag_psd", "lowrank"])
def test_projections_do_not_move_with_float64_rounding(fn, monkeypatch):
    """Inputs and outputs moved by float64 rounding: every anchor's proj_full and proj_res within 1e-9 and the
    same flags, tied anchors (a third to a half of the Procrustes fits here) included. The strict top-p cut
    on the same data moves the Procrustes projections of tied anchors by far more: the check has teeth."""
    x, y, seq, pos = random_pairs(1)
    before = projections(x, y, seq, pos, fn)
    rng = np.random.default_rng(2)
    after = projections(rounded(x, rng), rounded(y, rng), seq, pos, fn)
    assert np.isfinite(before["proj_res"]).sum() >= 50
    for column in ("proj_full", "proj_res"):
        np.testing.assert_allclose(after[column], before[column], rtol=0, atol=1e-9, err_msg=column)
    np.testing.assert_array_equal(after["subspace_dim"], before["subspace_dim"])
    if fn in ("orthogonal", "similarity"):
        assert 0.2 < np.nanmean(before["subspace_tied"]) < 0.8
        from lmgeo.study_a.classes import orthogonal

        monkeypatch.setattr(orthogonal, "dominant", strict_top_p)
        strict = [projections(*pair, seq, pos, fn) for pair in ((x, y), (rounded(x, rng), rounded(y, rng)))]
        assert np.nanmax(np.abs(strict[0]["proj_res"] - strict[1]["proj_res"])) > 1e-3
