"""`muon_head`: Muon (the spectral LMO, Newton–Schulz) on the head too."""

from lmgeo.study_b.recipes.base import HeadRecipe, HeadStepDefault

RECIPE = HeadRecipe(
    name="muon_head",
    summary="torch.optim.Muon (its own param group)",
    hidden="muon",
    head="muon",
    default_step=HeadStepDefault(head_lr=0.03),
)
