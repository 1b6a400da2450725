"""Summary statistics of the fit tables (SPEC §4.4): Spearman correlation with a bootstrap CI.

Nulls (None) and NaN are treated alike: missing. A pair with a missing side is dropped.
"""

from __future__ import annotations

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
