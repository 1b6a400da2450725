"""Building blocks of the head LMOs: unit rows, and the sketch on which the equidistance solver
(`lmgeo.study_b.equidistance`) compares wide rows. (The spectral LMO, Newton–Schulz, is Muon's:
`lmgeo.study_b.muon`.)"""

from __future__ import annotations

import torch
from torch import Tensor


def _row_norms(m: Tensor) -> Tensor:
    return m.norm(dim=1, keepdim=True).clamp_min_(torch.finfo(m.dtype).tiny)


def unit_rows(m: Tensor) -> Tensor:
    """Rows scaled to norm 1; zero rows stay zero (still feasible: inside every ball)."""
    return m / _row_norms(m)


def unit_rows_(m: Tensor) -> Tensor:
    """`unit_rows` in place. At the head's size (V × d) a fresh temporary costs ~10× an in-place pass over
    it (page faults of a new mapping), so the LMOs reuse their own temporaries."""
    return m.div_(_row_norms(m))


# Above this width, rows are compared for the candidate search on a fixed random projection (Johnson–
# Lindenstrauss): close rows stay close, and the search costs V·(bucket size)·SKETCH_WIDTH instead of V²·d.
SKETCH_WIDTH = 64


def sketch_projection(width: int, like: Tensor, seed: int = 0) -> Tensor | None:
    """None up to `SKETCH_WIDTH` columns (rows are compared as they are), else a seeded Gaussian
    (width, SKETCH_WIDTH) projection: distances between unit rows survive it to about 1/√SKETCH_WIDTH."""
    if width <= SKETCH_WIDTH:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(width, SKETCH_WIDTH, generator=gen).to(like.device, like.dtype)


def sketch(u: Tensor, projection: Tensor | None) -> Tensor:
    """The rows as compared by the candidate search: themselves, or projected and renormalised."""
    return u if projection is None else unit_rows_(u @ projection)
