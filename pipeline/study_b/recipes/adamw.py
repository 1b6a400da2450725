"""`adamw`: AdamW everywhere, the head included: the common baseline."""

from pipeline.study_b.recipes.base import HeadRecipe, HeadStepDefault

RECIPE = HeadRecipe(
    name="adamw",
    summary="AdamW (as everything else)",
    hidden="adamw",
    head="adamw",
    default_step=HeadStepDefault(head_lr=0.192),
)
