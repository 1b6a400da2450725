"""`sign`: Scion's "Sign" LMO (ℓ₁→ℓ∞): `−η·sign(M)/d`."""

from typing import Any

import torch
from torch import Tensor

from lmgeo.study_b.recipes.base import HeadRecipe, HeadStepDefault, LMOKnobs


def direction(m: Tensor, knobs: LMOKnobs, state: dict[str, Any]) -> Tensor:
    """Entries ±1/d, d the head's input width."""
    del knobs, state
    return torch.sign(m) / m.shape[1]


RECIPE = HeadRecipe(
    name="sign",
    summary="−η·sign(M)/d",
    hidden="muon",
    head="lmo",
    direction=direction,
    default_step=HeadStepDefault(head_lr=0.4),
)
