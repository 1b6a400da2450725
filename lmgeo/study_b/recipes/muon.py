"""`muon`: Muon on the hidden matrices, AdamW on the head: today's standard practice, and the baseline."""

from lmgeo.study_b.recipes.base import HeadRecipe, HeadStepDefault

RECIPE = HeadRecipe(
    name="muon",
    summary="AdamW head",
    hidden="muon",
    head="adamw",
    default_step=HeadStepDefault(head_lr=0.0339),
    baseline=True,
)
