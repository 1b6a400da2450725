"""The null patches of the functional claim (SPEC §4.5).

The real patch replaces block l's output `y = h_{l+1}` at an anchor by `T_i(h_l) = y − r`. Its nulls are
patches of the same size that carry no information from the fit: `y − r̃` with `r̃` a random direction of
norm `‖r‖` — several seeded directions per anchor, whose KLs are averaged (one direction is a noisy null:
the KL of a single direction varies by about a third between directions) — and with `r̃` another anchor's
residual (a seeded derangement of the layer's anchors of the same class) rescaled to `‖r‖`, which needs
two anchors at least. If the real residual predicts the output change only through its size,
`Spearman(rel_err, kl)` is matched by the nulls' and `kl / kl_null` is near 1.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lmgeo.core.contracts import arrow_to_vectors


class NullPatches(NamedTuple):
    """`valid` (n,): anchors with a patch (its value identified); the replacement vectors (float32) of those
    anchors: `real` = T_i(h_l) (m, d), `random` = y − r̃ for each direction (m, directions, d), and `other`
    = y − r̃ (m, d), or None when fewer than two anchors have a patch (no other anchor to borrow from)."""

    valid: np.ndarray
    real: np.ndarray
    random: np.ndarray
    other: np.ndarray | None


def null_patches(
    patched: pa.ChunkedArray | pa.Array, clean: np.ndarray, rng: np.random.Generator, directions: int
) -> NullPatches:
    """The real and null replacement vectors from the fits' `patched` column (null where the value is not
    identified) and the clean outputs `y` at the same anchors (n, d), with `directions` random directions
    per anchor."""
    valid = pc.is_valid(patched).to_numpy(zero_copy_only=False)
    real = arrow_to_vectors(patched.filter(pc.is_valid(patched))).astype(np.float64)
    y = np.asarray(clean, dtype=np.float64)[valid]
    residual = y - real
    size = np.linalg.norm(residual, axis=1, keepdims=True)
    direction = rng.normal(size=(len(residual), directions, residual.shape[1]))
    random = y[:, None] - size[:, None] * direction / np.linalg.norm(direction, axis=2, keepdims=True)
    other = None
    if len(residual) >= 2:
        borrowed = residual[derangement(len(residual), rng)]
        borrowed_size = np.linalg.norm(borrowed, axis=1, keepdims=True)
        scale = np.divide(size, borrowed_size, out=np.zeros_like(size), where=borrowed_size > 0)
        other = (y - scale * borrowed).astype(np.float32)
    return NullPatches(valid, real.astype(np.float32), random.astype(np.float32), other)


def derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    """`partner[i] ≠ i` for every i when n ≥ 2 (a random cycle through all n), seeded."""
    cycle = rng.permutation(n)
    partner = np.empty(n, dtype=np.int64)
    partner[cycle] = np.roll(cycle, -1)
    return partner
