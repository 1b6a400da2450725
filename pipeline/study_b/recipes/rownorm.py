"""`rownorm`: Scion's "RowNorm" LMO (ℓ₂→ℓ∞): `−η·m_i/‖m_i‖`, not centred."""

import torch
from torch import Tensor

from pipeline.study_b.lmo import unit_rows
from pipeline.study_b.recipes.base import HeadRecipe, HeadStepDefault, LMOKnobs


def direction(m: Tensor, knobs: LMOKnobs, gen: torch.Generator) -> Tensor:
    del knobs, gen
    return unit_rows(m)


RECIPE = HeadRecipe(
    name="rownorm",
    summary="−η·m_i/‖m_i‖",
    hidden="muon",
    head="lmo",
    direction=direction,
    default_step=HeadStepDefault(head_lr=0.03),
)
