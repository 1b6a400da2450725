"""`adamw`: AdamW everywhere, the head included: the common baseline."""

from pipeline.study_b.recipes.base import HeadRecipe, HeadStepDefault

# Element-wise FLOPs per head entry, counted from the code (multiply-adds as 2): AdamW's moments,
# bias-corrected step and decay.
RECIPE = HeadRecipe(
    name="adamw",
    summary="AdamW (as everything else)",
    hidden="adamw",
    head="adamw",
    default_step=HeadStepDefault(head_lr=0.192),
    head_flops=lambda vocab, width, equi_iters: 11.0 * vocab * width,
)
