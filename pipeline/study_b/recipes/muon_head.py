"""`muon_head`: Muon (the spectral LMO, Newton–Schulz) on the head too."""

from pipeline.study_b.recipes.base import HeadRecipe, HeadStepDefault, newton_schulz_flops

RECIPE = HeadRecipe(
    name="muon_head",
    summary="torch.optim.Muon (its own param group)",
    hidden="muon",
    head="muon",
    default_step=HeadStepDefault(head_lr=0.03),
    # momentum 4, decay 1, scaling 1, update 2, plus the Newton–Schulz input normalisation 2.
    head_flops=lambda vocab, width, equi_iters: 12.0 * vocab * width + newton_schulz_flops(vocab, width),
)
