"""Summary statistics: Spearman correlation with a bootstrap CI (Study A, SPEC §4.4), and paired comparisons
over seeds (Study B, SPEC §3.2).

Nulls (None) and NaN are treated alike: missing. A pair with a missing side is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    return spearman_rows(xs[draws], ys[draws])


def _correlation(rho: float, replicates: np.ndarray, n: int, ci: float) -> Correlation:
    if not 0 < ci < 1:
        raise ValueError(f"ci must lie in (0, 1), got {ci}")
    if n < 3:
        return Correlation(np.nan, np.nan, np.nan, n, 0)
    defined = replicates[~np.isnan(replicates)]
    low, high = np.percentile(defined, [50 * (1 - ci), 50 * (1 + ci)]) if defined.size else (np.nan, np.nan)
    return Correlation(rho, float(low), float(high), n, int(defined.size))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, tied values sharing the mean of their ranks."""
    unique, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # 0-based rank of each distinct value's first occurrence
    return (first + (counts + 1) / 2)[inverse]


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / den) if den > 0 else np.nan


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row pair of two (..., n) arrays (NaN where a row is constant)."""
    from scipy.stats import rankdata

    rx, ry = rankdata(x, axis=-1), rankdata(y, axis=-1)
    rx, ry = rx - rx.mean(axis=-1, keepdims=True), ry - ry.mean(axis=-1, keepdims=True)
    den = np.sqrt((rx * rx).sum(axis=-1) * (ry * ry).sum(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(axis=-1) / den, np.nan)


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
    half = float(t.ppf(0.5 + ci / 2, x.size - 1)) * sd / np.sqrt(x.size)
    return Interval(mean, sd, mean - half, mean + half, int(x.size))


def paired_difference(a: dict[int, float], b: dict[int, float], ci: float = 0.95) -> PairedDifference:
    """`a` and `b` map seed → value; only seeds finite in both are paired (same seed: same
    initialisation and data order, so the seed's own effect cancels)."""
    seeds = sorted(s for s in a.keys() & b.keys() if np.isfinite(a[s]) and np.isfinite(b[s]))
    diff = mean_interval([a[s] - b[s] for s in seeds], ci)
    if diff.n < 2:
        return PairedDifference(diff, np.nan)
    from scipy.stats import t

    if diff.sd == 0:
        return PairedDifference(diff, 0.0 if diff.mean != 0 else 1.0)
    statistic = diff.mean / (diff.sd / np.sqrt(diff.n))
    return PairedDifference(diff, float(2 * t.sf(abs(statistic), diff.n - 1)))


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
    """Holm's step-down adjustment of a family of p-values (NaN stays NaN and is not counted)."""
    p = np.asarray(p_values, dtype=float)
    tested = np.flatnonzero(np.isfinite(p))
    adjusted = np.full(p.shape, np.nan)
    running = 0.0
    for rank, i in enumerate(tested[np.argsort(p[tested], kind="stable")]):
        running = max(running, min(1.0, (len(tested) - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()
