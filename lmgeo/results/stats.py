"""Summary statistics: Spearman correlation with a bootstrap CI (Study A, SPEC §4.4), and paired comparisons
over seeds (Study B, SPEC §3.2).

The standard statistics are scipy's: Spearman's rho (`spearmanr`; row by row, the Pearson correlation of
`rankdata`'s average ranks with `pearsonr`), the Student-t interval (`t.interval`), the paired t-test
(`ttest_1samp` of the differences) and the noncentral t behind its power (`nct`). What scipy lacks is
here: the seeded percentile bootstrap, the layer-stratified correlation, the seeds a difference needs and
Holm's step-down adjustment.

Nulls (None) and NaN are treated alike: missing. A pair with a missing side is dropped.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike


class Correlation(NamedTuple):
    """`rho` on all complete pairs, and the percentile bootstrap interval `[low, high]`.

    `n`: complete pairs used; `n_boot`: bootstrap replicates with a defined correlation (a replicate
    whose resample is constant on one side has none and is left out of the interval). NaN when fewer
    than 3 complete pairs.
    """

    rho: float
    low: float
    high: float
    n: int
    n_boot: int


def spearman(x: ArrayLike, y: ArrayLike) -> float:
    """Spearman's rho (Pearson correlation of average ranks) over the complete pairs."""
    xs, ys = _complete_pairs(x, y)
    return _spearman(xs, ys)


def spearman_bootstrap(x: ArrayLike, y: ArrayLike, *, n_boot: int, ci: float = 0.95, seed: int = 0) -> Correlation:
    """Spearman's rho with a seeded percentile bootstrap interval at level `ci`.

    The bootstrap resamples anchors with replacement: replicate `b` draws `rng.integers(0, n, size=n)` from
    `rng = np.random.default_rng(seed)`, `n` the number of complete pairs.
    """
    xs, ys = _complete_pairs(x, y)
    replicates = _replicates(xs, ys, n_boot, seed)
    return _correlation(_spearman(xs, ys), replicates, int(xs.size), ci)


def spearman_by_layer(
    layer: ArrayLike, x: ArrayLike, y: ArrayLike, *, n_boot: int, ci: float = 0.95, seed: int = 0
) -> dict[int | str, Correlation]:
    """Per-layer correlations, plus `"stratified"`: the mean of the per-layer rhos, its interval from the
    mean of the layers' replicates (each layer resampled on its own, so rows of different layers are never
    ranked together)."""
    if not 0 < ci < 1:
        raise ValueError(f"ci must lie in (0, 1), got {ci}")
    layer = np.asarray(layer)
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    result: dict[int | str, Correlation] = {}
    rhos, replicates, n = [], [], 0
    for value in np.unique(layer):
        xs, ys = _complete_pairs(x[layer == value], y[layer == value])
        reps = _replicates(xs, ys, n_boot, seed)
        result[int(value)] = _correlation(_spearman(xs, ys), reps, int(xs.size), ci)
        if not np.isnan(result[int(value)].rho):
            rhos.append(result[int(value)].rho)
            replicates.append(reps)
            n += int(xs.size)
    if rhos:
        result["stratified"] = _correlation(float(np.mean(rhos)), np.mean(replicates, axis=0), n, ci)
    return result


def _replicates(xs: np.ndarray, ys: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """`n_boot` bootstrap replicates of rho (NaN for a resample that is constant on one side); empty
    when fewer than 3 pairs."""
    if xs.size < 3:
        return np.empty(0)
    draws = np.random.default_rng(seed).integers(0, xs.size, size=(n_boot, xs.size))
    return spearman_of_draws(xs, ys, draws)


def _correlation(rho: float, replicates: np.ndarray, n: int, ci: float) -> Correlation:
    if not 0 < ci < 1:
        raise ValueError(f"ci must lie in (0, 1), got {ci}")
    if n < 3:
        return Correlation(np.nan, np.nan, np.nan, n, 0)
    defined = replicates[~np.isnan(replicates)]
    low, high = np.percentile(defined, [50 * (1 - ci), 50 * (1 + ci)]) if defined.size else (np.nan, np.nan)
    return Correlation(rho, float(low), float(high), n, int(defined.size))


@contextmanager
def _constant_is_nan() -> Iterator[None]:
    """scipy's correlations are NaN on a constant side, as here, but also warn; a constant resample is
    expected (and left out of the interval), so the warning is not shown."""
    from scipy.stats import ConstantInputWarning, NearConstantInputWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConstantInputWarning)
        warnings.simplefilter("ignore", NearConstantInputWarning)
        yield


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.stats import spearmanr

    if x.size < 2:
        return np.nan
    with _constant_is_nan():
        return float(spearmanr(x, y).statistic)


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row pair of two (..., n) arrays, n ≥ 2 (NaN where a row is constant): the
    Pearson correlation of the rows' average ranks, both computed here (scipy's `rankdata` and `pearsonr` cost
    ~20× more in checks on the many short rows the claims rank)."""
    return pearson_rows(average_ranks(x), average_ranks(y))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """`scipy.stats.rankdata(values, axis=-1)`: ranks 1..n along the last axis, ties given their mean rank."""
    values = np.asarray(values, dtype=float)
    rows = values.reshape(-1, values.shape[-1])
    order = np.argsort(rows, axis=-1, kind="stable")
    ordered = np.take_along_axis(rows, order, axis=-1)
    starts = np.ones(rows.shape, dtype=bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]  # where a run of equal values begins
    position = np.arange(rows.shape[-1])
    first = np.maximum.accumulate(np.where(starts, position, 0), axis=-1)  # each value's run's first position
    ends = np.ones(rows.shape, dtype=bool)
    ends[:, :-1] = starts[:, 1:]
    last = np.minimum.accumulate(np.where(ends, position, rows.shape[-1])[:, ::-1], axis=-1)[:, ::-1]
    ranks = np.empty(rows.shape)
    np.put_along_axis(ranks, order, (first + last) / 2 + 1, axis=-1)
    return ranks.reshape(values.shape)


def spearman_of_draws(x: np.ndarray, y: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """`spearman_rows(x[draws], y[draws])` for index rows `draws` (B, m) into the (n,) arrays `x`, `y`: the
    rank correlation of every bootstrap draw (NaN where a draw is constant on one side)."""
    return pearson_rows(ranks_of_draws(x, draws), ranks_of_draws(y, draws))


def ranks_of_draws(values: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """`rankdata(values[draws], axis=-1)` (average ranks of ties) without sorting each draw: `values` is
    ranked once, and a draw's rank of each distinct value is the count of smaller values it drew plus the
    mean position of its own copies, from per-draw counts (O(B·(m + n)) instead of O(B·m log m); the
    aggregate spent most of its time sorting bootstrap draws)."""
    levels, level_of = np.unique(values, return_inverse=True)
    drawn = level_of.reshape(-1)[draws]  # (B, m) the distinct value each drawn element has, in sorted order
    n_levels, n_draws = len(levels), drawn.shape[0]
    offsets = drawn + n_levels * np.arange(n_draws)[:, None]
    counts = np.bincount(offsets.ravel(), minlength=n_levels * n_draws).reshape(n_draws, n_levels)
    rank_of_level = np.cumsum(counts, axis=1) - counts + (counts + 1) / 2
    return np.take_along_axis(rank_of_level, drawn, axis=1)


def pearson_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson's r of each row pair, NaN where a row is constant, clipped to [−1, 1] as scipy does."""
    a = a - a.mean(axis=-1, keepdims=True)
    b = b - b.mean(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (a * b).sum(axis=-1) / np.sqrt((a * a).sum(axis=-1) * (b * b).sum(axis=-1))
    return np.clip(r, -1.0, 1.0)


def _as_float(values: ArrayLike) -> np.ndarray:
    """Floats with None → NaN (works for lists with None and for pyarrow arrays with nulls)."""
    if hasattr(values, "to_numpy"):
        values = values.to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=float)


def _complete_pairs(x: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = _as_float(x), _as_float(y)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(f"x and y must be 1-D of equal length, got {xs.shape} and {ys.shape}")
    keep = ~(np.isnan(xs) | np.isnan(ys))
    return xs[keep], ys[keep]


# ------------------------------------------------------------------------- comparisons over seeds (Study B)
class Interval(NamedTuple):
    """`mean` of `n` values with its Student-t confidence interval `[low, high]` (NaN below 2 values)."""

    mean: float
    sd: float
    low: float
    high: float
    n: int


class PairedDifference(NamedTuple):
    """Mean of the per-seed differences `a_s − b_s` over the seeds both have, its t-interval, and the
    two-sided paired t-test p-value (NaN below 2 pairs)."""

    diff: Interval
    p: float


def mean_interval(values: ArrayLike, ci: float = 0.95) -> Interval:
    x = _as_float(values)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return Interval(np.nan, np.nan, np.nan, np.nan, 0)
    if x.size < 2:
        return Interval(float(x[0]), np.nan, np.nan, np.nan, 1)
    from scipy.stats import t

    mean, sd = float(x.mean()), float(x.std(ddof=1))
    if sd == 0:  # scipy's interval needs a positive scale; this one has width 0
        return Interval(mean, sd, mean, mean, int(x.size))
    low, high = t.interval(ci, x.size - 1, loc=mean, scale=sd / np.sqrt(x.size))
    return Interval(mean, sd, float(low), float(high), int(x.size))


def paired_difference(a: dict[int, float], b: dict[int, float], ci: float = 0.95) -> PairedDifference:
    """`a` and `b` map seed → value; only seeds finite in both are paired (same seed: same
    initialisation and data order, so the seed's own effect cancels)."""
    seeds = sorted(s for s in a.keys() & b.keys() if np.isfinite(a[s]) and np.isfinite(b[s]))
    differences = [a[s] - b[s] for s in seeds]
    diff = mean_interval(differences, ci)
    if diff.n < 2:
        return PairedDifference(diff, np.nan)
    if diff.sd == 0:  # scipy's statistic is undefined here; the differences are certain
        return PairedDifference(diff, 0.0 if diff.mean != 0 else 1.0)
    from scipy.stats import ttest_1samp

    return PairedDifference(diff, float(ttest_1samp(differences, 0.0).pvalue))


def paired_t_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level `alpha` with `n` pairs when the true mean difference
    is `effect` and the differences' SD is `sd` (noncentral t)."""
    from scipy.stats import nct, t

    if n < 2:
        return 0.0
    critical = float(t.ppf(1 - alpha / 2, n - 1))
    shift = abs(effect) / sd * np.sqrt(n)
    return float(nct.sf(critical, n - 1, shift) + nct.cdf(-critical, n - 1, shift))


def seeds_needed(effect: float, sd: float, alpha: float = 0.05, power: float = 0.8, most: int = 10_000) -> int | None:
    """The fewest seeds (pairs) for which the paired t-test detects a true difference `effect` with
    `power`; None when `most` would not do (or `effect` is 0)."""
    if not (np.isfinite(sd) and sd > 0 and effect != 0):
        return None
    n = 2
    while paired_t_power(effect, sd, n, alpha) < power:
        n = n * 2 if paired_t_power(effect, sd, 2 * n, alpha) < power else n + 1
        if n > most:
            return None
    return n


def detectable_difference(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference the paired t-test with `n` pairs detects with `power` (bisection on
    `paired_t_power`); NaN below 2 pairs."""
    if n < 2 or not (np.isfinite(sd) and sd > 0):
        return np.nan
    low, high = 0.0, sd
    while paired_t_power(high, sd, n, alpha) < power:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if paired_t_power(middle, sd, n, alpha) < power else (low, middle)
    return high


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (NaN stays NaN and is not counted); scipy has
    only Benjamini–Hochberg/Yekutieli (`false_discovery_control`). The k-th smallest of m p-values is
    multiplied by m − k + 1, capped at 1, and made non-decreasing."""
    p = np.asarray(p_values, dtype=float)
    tested = np.flatnonzero(np.isfinite(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    adjusted = np.full(p.shape, np.nan)
    adjusted[order] = np.maximum.accumulate(np.minimum(1.0, (len(order) - np.arange(len(order))) * p[order]))
    return adjusted.tolist()
