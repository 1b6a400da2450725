"""Building blocks of the head LMOs: unit rows, and torch's own Newton–Schulz orthogonalisation (the
kernel torch.optim.Muon runs, so the spectral step is the same code in every recipe; it is private in
torch, hence pinned in constraints.txt)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _zeropower_via_newtonschulz,
)


def unit_rows(m: Tensor) -> Tensor:
    """Rows scaled to norm 1; zero rows stay zero (still feasible: inside every ball)."""
    return m / m.norm(dim=1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)


def orthogonalise(m: Tensor) -> Tensor:
    ortho = _zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS)
    return ortho.to(m.dtype)
