"""Spearman and its bootstrap against scipy and a brute-force replicate loop."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from scipy.stats import rankdata, spearmanr

from lmgeo.results.stats import (
    ranks_of_draws,
    spearman,
    spearman_bootstrap,
    spearman_by_layer,
    spearman_of_draws,
    spearman_rows,
)


def with_ties_and_gaps(rng, n=80):
    x = rng.integers(0, 12, size=n).astype(float)  # many ties
    y = x + rng.normal(size=n) * 3
    y[::9] = np.round(y[::9])
    x[3], y[10], x[20], y[20] = np.nan, np.nan, np.nan, np.nan
    return x, y


def test_spearman_matches_scipy_with_ties_and_nulls():
    x, y = with_ties_and_gaps(np.random.default_rng(1))
    keep = ~(np.isnan(x) | np.isnan(y))
    assert spearman(x, y) == pytest.approx(spearmanr(x[keep], y[keep]).statistic, abs=1e-12)
    as_list = [None if np.isnan(v) else v for v in x]
    assert spearman(as_list, pa.array(list(y), from_pandas=True)) == pytest.approx(spearman(x, y), abs=1e-15)


def brute_force_bootstrap(x, y, n_boot, ci, seed):
    keep = ~(np.isnan(x) | np.isnan(y))
    x, y = x[keep], y[keep]
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(n_boot):
        rows = rng.integers(0, len(x), size=len(x))
        reps.append(spearmanr(x[rows], y[rows]).statistic)
    reps = np.array(reps)
    reps = reps[~np.isnan(reps)]
    lo, hi = np.percentile(reps, [100 * (1 - ci) / 2, 100 * (1 + ci) / 2])
    return spearmanr(x, y).statistic, lo, hi, len(reps)


@pytest.mark.parametrize("n", [3, 11, 400])
def test_ranks_and_spearman_of_draws_match_scipy_on_each_draw(n):
    """Counting ranks per draw gives scipy's average ranks exactly (ties in the values and repeated draws);
    the correlation is scipy's to rounding, NaN exactly where a draw is constant on one side."""
    rng = np.random.default_rng(n)
    x = rng.integers(0, 5, n).astype(float)
    y = rng.normal(size=n)
    y[: n // 3] = 0.5
    draws = rng.integers(0, n, size=(300, n))
    assert np.array_equal(ranks_of_draws(x, draws), rankdata(x[draws], axis=-1))
    got = spearman_of_draws(x, y, draws)
    want = np.array([spearmanr(x[d], y[d]).statistic for d in draws])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=0, atol=1e-12)


def test_bootstrap_matches_a_brute_force_loop():
    rng = np.random.default_rng(2)
    x, y = with_ties_and_gaps(rng, n=60)
    result = spearman_bootstrap(x, y, n_boot=200, ci=0.9, seed=7)
    rho, lo, hi, n_ok = brute_force_bootstrap(x, y, 200, 0.9, 7)
    assert result.rho == pytest.approx(rho, abs=1e-12)
    assert (result.low, result.high) == pytest.approx((lo, hi), abs=1e-12)
    assert result.n_boot == n_ok
    assert result.n == int((~(np.isnan(x) | np.isnan(y))).sum())
    assert result.low <= result.rho <= result.high


def test_bootstrap_is_seeded_and_degenerate_inputs_give_nan():
    x, y = with_ties_and_gaps(np.random.default_rng(3))
    assert spearman_bootstrap(x, y, n_boot=50, seed=1) == spearman_bootstrap(x, y, n_boot=50, seed=1)
    assert spearman_bootstrap(x, y, n_boot=50, seed=1) != spearman_bootstrap(x, y, n_boot=50, seed=2)
    short = spearman_bootstrap([1.0, 2.0], [2.0, 1.0], n_boot=10)
    assert np.isnan(short.rho) and short.n == 2
    assert np.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_by_layer_and_stratified():
    """Stratified = the mean of the layers' rhos, its interval from the mean of their replicates; never the
    rho of rows of different layers ranked together (which Simpson's paradox can push anywhere)."""
    rng = np.random.default_rng(4)
    layer = np.repeat([0, 1, 2], 30)
    x = rng.normal(size=90)
    y = x * np.array([1.0, 0.2, -1.0])[layer] + rng.normal(size=90) * 0.3
    result = spearman_by_layer(layer, x, y, n_boot=100, seed=0)
    assert set(result) == {0, 1, 2, "stratified"}
    per_layer = [spearmanr(x[layer == v], y[layer == v]).statistic for v in (0, 1, 2)]
    for value in (0, 1, 2):
        assert result[value].rho == pytest.approx(per_layer[value])
        assert result[value] == spearman_bootstrap(x[layer == value], y[layer == value], n_boot=100, seed=0)
    assert result["stratified"].rho == pytest.approx(np.mean(per_layer))
    reps = []
    for value in (0, 1, 2):
        xs, ys = x[layer == value], y[layer == value]
        draws = np.random.default_rng(0).integers(0, 30, size=(100, 30))
        reps.append([spearmanr(xs[d], ys[d]).statistic for d in draws])
    low, high = np.percentile(np.mean(reps, axis=0), [2.5, 97.5])
    assert (result["stratified"].low, result["stratified"].high) == pytest.approx((low, high))


# ------------------------------------------------------------------------- comparisons over seeds (Study B)
def test_mean_interval_is_the_student_t_interval():
    from scipy import stats as sps

    from lmgeo.results.stats import mean_interval

    x = np.random.default_rng(1).normal(4.8, 0.015, size=7)
    got = mean_interval(list(x) + [np.nan], ci=0.9)
    low, high = sps.t.interval(0.9, 6, loc=x.mean(), scale=sps.sem(x))
    assert (got.n, got.mean, got.sd) == (7, pytest.approx(x.mean()), pytest.approx(x.std(ddof=1)))
    assert (got.low, got.high) == (pytest.approx(low), pytest.approx(high))
    assert np.isnan(mean_interval([4.0]).low)


def test_paired_difference_matches_scipy_and_recovers_a_planted_difference():
    """Seeds share a large effect (init, data order) that pairing removes: a planted −0.02 nats is found
    with a CI that covers it, while an unpaired comparison of the same runs could not tell."""
    from scipy import stats as sps

    from lmgeo.results.stats import paired_difference

    rng = np.random.default_rng(2)
    seed_effect = rng.normal(0, 0.02, size=10)
    base = {s: 4.8 + seed_effect[s] + rng.normal(0, 0.004) for s in range(10)}
    better = {s: 4.78 + seed_effect[s] + rng.normal(0, 0.004) for s in range(10)}
    better[10] = 1.0  # a seed the baseline lacks is not paired
    got = paired_difference(better, base)
    a, b = [better[s] for s in range(10)], [base[s] for s in range(10)]
    assert got.p == pytest.approx(sps.ttest_rel(a, b).pvalue, rel=1e-9)
    assert got.diff.n == 10 and got.diff.low < -0.02 < got.diff.high and got.p < 1e-4
    assert sps.ttest_ind(a, b).pvalue > 0.01  # the seed effect hides it without pairing


def test_seeds_needed_gives_the_power_a_simulation_measures():
    from scipy import stats as sps

    from lmgeo.results.stats import detectable_difference, paired_t_power, seeds_needed

    rng = np.random.default_rng(3)
    effect, sd = 0.02, 0.03
    n = seeds_needed(effect, sd)
    assert n is not None and n > 2

    def simulated_power(pairs: int, trials: int = 4000) -> float:
        diffs = rng.normal(effect, sd, size=(trials, pairs))
        return float((sps.ttest_1samp(diffs, 0, axis=1).pvalue < 0.05).mean())

    assert simulated_power(n) >= 0.8 - 0.02 and paired_t_power(effect, sd, n) >= 0.8
    assert simulated_power(n - 1) < 0.8 + 0.02 and paired_t_power(effect, sd, n - 1) < 0.8
    assert detectable_difference(sd, n) <= effect < detectable_difference(sd, n - 1)
    assert seeds_needed(0.0, sd) is None and seeds_needed(effect, 0.0) is None


def test_holm_adjusts_step_down_and_keeps_missing_values():
    from lmgeo.results.stats import holm

    got = holm([0.01, 0.04, np.nan, 0.03, 0.5])
    # sorted 0.01, 0.03, 0.04, 0.5 → ×4, ×3, ×2, ×1, then made monotone
    assert got[0] == pytest.approx(0.04) and got[3] == pytest.approx(0.09) and got[1] == pytest.approx(0.09)
    assert got[4] == pytest.approx(0.5) and np.isnan(got[2])


def test_spearman_rows_is_scipys_spearman_row_by_row():
    """Rows with ties (average ranks) and a constant row (NaN), against `scipy.stats.spearmanr` on each."""
    from scipy.stats import spearmanr

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 15)), rng.integers(0, 4, size=(6, 15)).astype(float)
    y[2] = 1.0
    got = spearman_rows(x, y)
    want = [np.nan if i == 2 else spearmanr(x[i], y[i]).statistic for i in range(6)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.isnan(got[2]) and np.isfinite(np.delete(got, 2)).all()


def test_average_ranks_are_scipys_rankdata_with_ties():
    from lmgeo.results.stats import average_ranks

    rng = np.random.default_rng(4)
    values = rng.integers(0, 5, size=(3, 4, 20)).astype(float)
    values[0, 0] = 2.0  # one row all tied
    np.testing.assert_array_equal(average_ranks(values), rankdata(values, axis=-1))
    continuous = rng.normal(size=(7, 33))
    np.testing.assert_array_equal(average_ranks(continuous), rankdata(continuous, axis=-1))


def test_finite_keeps_only_measured_values_in_order():
    from lmgeo.results.common import finite

    kept = finite([1.5, None, float("nan"), float("inf"), -2.0, -float("inf"), 0.0])
    assert kept.dtype == np.float64 and kept.tolist() == [1.5, -2.0, 0.0]
    assert finite([None, float("nan")]).size == 0
