"""`hilbert`: the diameter LMO of SPEC §3.1: `−(η/2)·centre(rownorm(centre(M)))`, so `diam(ΔW) ≤ η`."""

from typing import Any

from torch import Tensor

from lmgeo.study_b.hilbert import center_rows
from lmgeo.study_b.lmo import unit_rows
from lmgeo.study_b.recipes.base import HeadRecipe, HeadStepDefault, LMOKnobs


def direction(m: Tensor, knobs: LMOKnobs, state: dict[str, Any]) -> Tensor:
    """Centred rows on the sphere of radius 1/2, so diam ≤ 1. The final re-centring removes only the
    common shift that row-normalisation reintroduced; diam is shift-invariant, so the bound still holds
    exactly (up to float32 rounding, ~1e-7 relative)."""
    del knobs, state
    return 0.5 * center_rows(unit_rows(center_rows(m)))


RECIPE = HeadRecipe(
    name="hilbert",
    summary="−(η/2)·centre(rownorm(centre(M))): diam(ΔW) ≤ η",
    hidden="muon",
    head="lmo",
    direction=direction,
    trust_region=True,
    default_step=HeadStepDefault(tau=0.4),
)
