"""SPEC §3.1 checked numerically against brute force on small random data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial.distance import pdist, squareform

from lmgeo.study_b import hilbert

DOUBLE = torch.float64


def brute_diam(w: torch.Tensor) -> float:
    return float(pdist(w.double().numpy()).max())


def test_osc_is_max_minus_min_over_last_dim() -> None:
    dz = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    expected = dz.numpy().max(axis=-1) - dz.numpy().min(axis=-1)
    np.testing.assert_allclose(hilbert.osc(dz).numpy(), expected, rtol=0, atol=0)


def test_hilbert_distance_of_a_logit_change_is_its_oscillation_whatever_the_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    dz = torch.randn(4, 50, dtype=DOUBLE, generator=gen)
    for scale in (0.1, 1.0, 10.0):
        z = scale * torch.randn(4, 50, dtype=DOUBLE, generator=gen)
        p, q = torch.softmax(z, -1), torch.softmax(z + dz, -1)
        # The definition, written out: max_i log(p_i/q_i) − min_j log(p_j/q_j).
        ratios = np.log(p.numpy() / q.numpy())
        by_definition = ratios.max(-1) - ratios.min(-1)
        np.testing.assert_allclose(hilbert.hilbert_distance(p, q).numpy(), by_definition, rtol=1e-12)
        np.testing.assert_allclose(hilbert.hilbert_distance_logits(z, z + dz).numpy(), by_definition, rtol=1e-9)
        np.testing.assert_allclose(hilbert.osc(dz).numpy(), by_definition, rtol=1e-9)


def test_hilbert_distance_logits_is_stable_where_probabilities_underflow() -> None:
    z = torch.tensor([0.0, -2000.0, 3.0], dtype=DOUBLE)
    dz = torch.tensor([1.0, -1.5, 0.25], dtype=DOUBLE)
    assert torch.softmax(z, -1)[1] == 0  # the probability form would be infinite here
    assert float(hilbert.hilbert_distance_logits(z, z + dz)) == pytest.approx(2.5, rel=1e-9)


def test_hilbert_distance_rejects_the_simplex_boundary() -> None:
    with pytest.raises(ValueError, match="open simplex"):
        hilbert.hilbert_distance(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]))


def test_kl_and_total_variation_are_bounded_by_the_hilbert_distance() -> None:
    gen = torch.Generator().manual_seed(2)
    for scale in (0.01, 0.3, 3.0, 30.0):
        z = torch.randn(200, 30, dtype=DOUBLE, generator=gen)
        dz = scale * torch.randn(200, 30, dtype=DOUBLE, generator=gen)
        p, q = torch.softmax(z, -1), torch.softmax(z + dz, -1)
        d_h = hilbert.hilbert_distance(p, q)
        kl = (p * (p.log() - q.log())).sum(-1)
        tv = 0.5 * (p - q).abs().sum(-1)
        logp_change = (p.log() - q.log()).abs().amax(-1)
        assert bool((kl <= d_h + 1e-12).all())
        assert bool((tv <= torch.tanh(d_h / 4) + 1e-12).all())
        assert bool((logp_change <= d_h + 1e-12).all())


def test_worst_case_over_unit_inputs_is_the_row_diameter() -> None:
    gen = torch.Generator().manual_seed(3)
    delta = torch.randn(40, 6, dtype=DOUBLE, generator=gen)
    found = hilbert.diam(delta)
    # By Cauchy–Schwarz nothing beats h ∝ w_i − w_j for the maximising pair, and that h attains it.
    h = delta[found.i] - delta[found.j]
    h = h / h.norm()
    assert float(hilbert.osc(delta @ h)) == pytest.approx(found.value, rel=1e-12)  # attained
    random_h = torch.randn(20000, 6, dtype=DOUBLE, generator=gen)
    random_h /= random_h.norm(dim=1, keepdim=True)
    reached = hilbert.osc(random_h @ delta.T)
    assert float(reached.max()) <= found.value * (1 + 1e-12)
    assert float(reached.max()) > 0.9 * found.value  # random directions come close in d = 6


def test_diam_is_blind_to_common_row_shifts_only() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(30, 5, dtype=DOUBLE, generator=gen)
    shift = torch.ones(30, 1, dtype=DOUBLE) * torch.randn(1, 5, dtype=DOUBLE, generator=gen)
    assert hilbert.diam(w + 100 * shift).value == pytest.approx(hilbert.diam(w).value, rel=1e-12)
    assert hilbert.diam(shift).value == 0.0


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 300, 1000])
@pytest.mark.parametrize(("n_rows", "width"), [(2, 3), (211, 4), (300, 17)])
def test_chunked_diam_equals_brute_force(n_rows: int, width: int, chunk_rows: int) -> None:
    w = torch.randn(n_rows, width, generator=torch.Generator().manual_seed(n_rows + chunk_rows))
    found = hilbert.diam(w, chunk_rows=chunk_rows)
    assert found.value == pytest.approx(brute_diam(w), rel=1e-12)
    assert float((w[found.i].double() - w[found.j].double()).norm()) == pytest.approx(found.value, rel=1e-12)
    assert not found.sampled
    assert float(found) == found.value


def test_diam_is_exact_for_rows_with_a_large_common_offset() -> None:
    """A naive float32 Gram computation cancels catastrophically here (‖w‖² ~ 1e8, distances ~ 1e-2)."""
    gen = torch.Generator().manual_seed(5)
    w = 1000.0 + 1e-2 * torch.randn(500, 16, generator=gen)
    assert hilbert.diam(w, chunk_rows=77).value == pytest.approx(brute_diam(w), rel=1e-9)


def test_diam_picks_the_true_maximum_among_near_ties() -> None:
    """Points on a circle with one pair 1e-13 farther apart than the rest: the re-check must find it."""
    angles = torch.linspace(0, torch.pi, 200, dtype=DOUBLE)
    w = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)
    w = torch.cat([w, -w])  # 200 antipodal pairs at distance 2
    w[7] *= 1 + 1e-13
    found = hilbert.diam(w, chunk_rows=33)
    assert {found.i, found.j} == {7, 207}
    assert found.value == pytest.approx(brute_diam(w), rel=1e-15)


def test_sampled_diam_is_a_flagged_lower_bound_with_stable_rows() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(400, 8, generator=gen)
    exact = hilbert.diam(w)
    for seed in range(5):
        sampled = hilbert.diam_sampled(w, 50, seed=seed)
        assert sampled.sampled
        assert sampled.value <= exact.value
        assert float((w[sampled.i].double() - w[sampled.j].double()).norm()) == pytest.approx(sampled.value)
        assert hilbert.diam_sampled(w, 50, seed=seed) == sampled
    everything = hilbert.diam_sampled(w, 1000, seed=0)
    assert not everything.sampled and everything.value == pytest.approx(exact.value, rel=1e-12)


def test_eccentricities_equal_brute_force_and_peak_at_the_diameter() -> None:
    w = torch.randn(123, 5, generator=torch.Generator().manual_seed(7))
    expected = squareform(pdist(w.double().numpy())).max(axis=1)
    got = hilbert.eccentricities(w, chunk_rows=10)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9)
    assert float(got.max()) == pytest.approx(hilbert.diam(w).value, rel=1e-9)


def test_equi_ratio_equals_brute_force_on_its_sample() -> None:
    w = torch.randn(300, 6, generator=torch.Generator().manual_seed(8))
    distances = pdist(w.double().numpy())
    assert hilbert.equi_ratio(w, 1024) == pytest.approx(distances.min() / distances.max(), rel=1e-9)
    rows = hilbert.row_sample(300, 40, seed=3)
    sampled = pdist(w[rows].double().numpy())
    assert hilbert.equi_ratio(w, 40, seed=3) == pytest.approx(sampled.min() / sampled.max(), rel=1e-9)


def test_equi_ratio_is_one_exactly_for_a_regular_simplex() -> None:
    simplex = torch.eye(6, dtype=DOUBLE)  # 6 equidistant points (V = d + 1 in their 5-D affine hull)
    assert hilbert.equi_ratio(simplex) == pytest.approx(1.0, rel=1e-12)
    assert hilbert.equi_ratio(torch.cat([simplex, simplex[:1]])) == 0.0  # a repeated row


def test_center_rows_removes_exactly_the_common_row_shifts() -> None:
    gen = torch.Generator().manual_seed(9)
    m = torch.randn(25, 4, dtype=DOUBLE, generator=gen)
    c = hilbert.center_rows(m)
    np.testing.assert_allclose(c.sum(0).numpy(), 0, atol=1e-12)
    np.testing.assert_allclose(hilbert.center_rows(c).numpy(), c.numpy(), atol=1e-14)  # idempotent
    shift = torch.ones(25, 1, dtype=DOUBLE) @ torch.randn(1, 4, dtype=DOUBLE, generator=gen)
    np.testing.assert_allclose(hilbert.center_rows(m + shift).numpy(), c.numpy(), atol=1e-12)
    projector = np.eye(25) - np.ones((25, 25)) / 25
    np.testing.assert_allclose(c.numpy(), projector @ m.numpy(), atol=1e-12)


def _head_gradient(logit_map, extra_loss=None) -> torch.Tensor:
    """dL/dW for a real head z = W h with cross-entropy on top of `logit_map(z)`."""
    gen = torch.Generator().manual_seed(10)
    w = (3 * torch.randn(20, 8, dtype=DOUBLE, generator=gen)).requires_grad_()
    h = torch.randn(16, 8, dtype=DOUBLE, generator=gen)
    targets = torch.randint(0, 20, (16,), generator=gen)
    z = logit_map(h @ w.T)
    loss = torch.nn.functional.cross_entropy(z, targets)
    if extra_loss is not None:
        loss = loss + extra_loss(z)
    loss.backward()
    return w.grad


def test_cross_entropy_head_gradient_rows_sum_to_zero() -> None:
    grad = _head_gradient(lambda z: z)
    assert float(grad.abs().max()) > 1e-3
    np.testing.assert_allclose(grad.sum(0).numpy(), 0, atol=1e-12)


@pytest.mark.parametrize(
    ("logit_map", "extra_loss"),
    [
        (lambda z: 5.0 * torch.tanh(z / 5.0), None),  # logit soft-cap: chain rule through tanh'
        (lambda z: z, lambda z: 1e-2 * torch.logsumexp(z, -1).pow(2).mean()),  # z-loss: 2α·lse·p
    ],
    ids=["soft_cap", "z_loss"],
)
def test_soft_cap_and_z_loss_break_the_zero_row_sum_until_centred(logit_map, extra_loss) -> None:
    grad = _head_gradient(logit_map, extra_loss)
    assert float(grad.sum(0).norm()) > 1e-3 * float(grad.norm())
    np.testing.assert_allclose(hilbert.center_rows(grad).sum(0).numpy(), 0, atol=1e-12)


def test_diam_of_two_antipodal_clusters_and_of_identical_rows() -> None:
    """Far more tied maximal pairs than the candidate cap (300 × 300), as `sign` steps on a rank-1
    gradient produce; and the degenerate all-equal case."""
    s = torch.sign(torch.randn(1, 16, generator=torch.Generator().manual_seed(11)))
    w = torch.cat([s.expand(300, 16), -s.expand(300, 16)])
    found = hilbert.diam(w, chunk_rows=128)
    assert found.value == pytest.approx(brute_diam(w), rel=1e-12)
    assert (found.i < 300) != (found.j < 300)
    assert hilbert.diam(torch.zeros(500, 4)).value == 0.0


# ----------------------------------------------------------------- cheap diameter bound, spread references
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_diam_upper_bounds_the_exact_diameter_tightly(offset: float) -> None:
    gen = torch.Generator().manual_seed(12)
    for n_rows, width in ((2, 3), (300, 17), (2048, 64)):
        w = offset + 1e-2 * torch.randn(n_rows, width, generator=gen)  # float32, as a training step is
        exact = brute_diam(w)
        upper = hilbert.diam_upper(w, chunk_rows=97)
        assert exact <= upper <= exact * (1 + 1e-4)


def test_random_unit_rows_reference_is_their_brute_force_ratio() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(300, 8, generator=gen, dtype=DOUBLE)
    distances = pdist((rows / rows.norm(dim=1, keepdim=True)).numpy())
    assert hilbert.equi_ratio_random(300, 8, seed=0) == pytest.approx(distances.min() / distances.max(), rel=1e-9)
    # One draw stands for the distribution: other seeds give nearly the same ratio.
    draws = [hilbert.equi_ratio_random(1024, 64, seed=s) for s in range(4)]
    assert max(draws) - min(draws) < 0.05


def _best_spread(n_points: int, width: int, restarts: int) -> float:
    """The largest min/max distance ratio found by maximising a smooth surrogate (log-sum-exp soft min
    over soft max of the distances) from random starts: a strong configuration to test the bound on."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(n_points * 10 + width)

    def negative_soft_ratio(flat: np.ndarray, sharpness: float = 60.0) -> float:
        d = pdist(flat.reshape(n_points, width))
        soft_min = -np.log(np.exp(-sharpness * d / d.max()).sum()) / sharpness
        soft_max = np.log(np.exp(sharpness * d / d.max()).sum()) / sharpness
        return -soft_min / soft_max

    best = 0.0
    for _ in range(restarts):
        found = minimize(
            negative_soft_ratio,
            rng.standard_normal(n_points * width),
            method="Nelder-Mead",
            options={"maxiter": 20000, "xatol": 1e-9, "fatol": 1e-12},
        )
        d = pdist(found.x.reshape(n_points, width))
        best = max(best, d.min() / d.max())
    return best


@pytest.mark.slow  # optimises configurations for a high ratio, with restarts
def test_equi_ratio_bound_is_one_up_to_a_simplex_and_never_exceeded() -> None:
    """`equi_ratio_bound` (SPEC §3.1): 1 exactly when n ≤ d + 1 (a regular simplex reaches it); below 1
    beyond, and no configuration exceeds it: the regular pentagon (0.618 in the plane), random unit rows,
    and configurations optimised for a high ratio."""
    assert hilbert.equi_ratio_bound(6, 5) == 1.0 == hilbert.equi_ratio(torch.eye(6, dtype=DOUBLE))
    assert hilbert.equi_ratio_bound(7, 5) < 1.0
    angles = 2 * np.pi * np.arange(5) / 5
    pentagon = pdist(np.stack([np.cos(angles), np.sin(angles)], 1))
    assert pentagon.min() / pentagon.max() == pytest.approx((np.sqrt(5) - 1) / 2)
    assert pentagon.min() / pentagon.max() <= hilbert.equi_ratio_bound(5, 2)
    for n_points, width in ((5, 2), (8, 2), (7, 3), (10, 4)):
        assert _best_spread(n_points, width, restarts=3) <= hilbert.equi_ratio_bound(n_points, width)
    for n_rows, width in ((1024, 64), (500, 8)):
        assert hilbert.equi_ratio_random(n_rows, width) < hilbert.equi_ratio_bound(n_rows, width) < 1


def test_equi_ratio_bound_follows_from_welchs_inequality_on_the_centred_gram() -> None:
    """The bound's proof, step by step, on random configurations: B = −½ C D² C is the centred Gram (PSD,
    rank ≤ d), so (tr B)² ≤ d·‖B‖²_F; with D² = a(J − I) + P this forces (b − a)/a ≥ √((n − d − 1)/(d n))."""
    rng = np.random.default_rng(13)
    for n_points, width in ((12, 3), (40, 5), (200, 16)):
        x = rng.standard_normal((n_points, width))
        sq = squareform(pdist(x)) ** 2
        centring = np.eye(n_points) - 1.0 / n_points
        gram = -0.5 * centring @ sq @ centring
        np.testing.assert_allclose(gram, (x - x.mean(0)) @ (x - x.mean(0)).T, atol=1e-9)
        assert np.trace(gram) ** 2 <= width * (gram**2).sum() * (1 + 1e-12)
        off = sq[~np.eye(n_points, dtype=bool)]
        a, b = off.min(), off.max()
        assert (b - a) / a >= np.sqrt((n_points - width - 1) / (width * n_points))
        assert np.sqrt(a / b) <= hilbert.equi_ratio_bound(n_points, width)
