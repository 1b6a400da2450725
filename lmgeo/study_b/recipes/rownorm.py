"""`rownorm`: Scion's "RowNorm" LMO (ℓ₂→ℓ∞): `−η·m_i/‖m_i‖`, not centred."""

from typing import Any

from torch import Tensor

from lmgeo.study_b.lmo import unit_rows
from lmgeo.study_b.recipes.base import HeadRecipe, HeadStepDefault, LMOKnobs


def direction(m: Tensor, knobs: LMOKnobs, state: dict[str, Any]) -> Tensor:
    del knobs, state
    return unit_rows(m)


RECIPE = HeadRecipe(
    name="rownorm",
    summary="−η·m_i/‖m_i‖",
    hidden="muon",
    head="lmo",
    direction=direction,
    default_step=HeadStepDefault(head_lr=0.03),
    # Its rows are unit(M); `hilbert`'s, ½·unit(M) less a common shift (M's rows sum to zero): the same
    # direction in the Hilbert seminorm, so a matched budget makes the two the same training.
    matched_as="hilbert",
)
