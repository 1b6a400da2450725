"""`adamw`: AdamW everywhere, the hidden matrices included: the common baseline. Its tuned knob is the lr of
its hidden matrices (`hidden_lr`); its head is `muon`'s AdamW head, at `muon`'s tuned lr (docs/tuning.md)."""

from lmgeo.study_b.recipes.base import HeadRecipe, HeadStepDefault

RECIPE = HeadRecipe(
    name="adamw",
    summary="AdamW (as everything else)",
    hidden="adamw",
    head="adamw",
    default_step=HeadStepDefault(head_lr=0.0339, hidden_lr=0.003),
)
