"""`hilbert_equi`: as `hilbert`, plus the seed's "equidistant" spreading: `equi_iters` × (centre,
Newton–Schulz, rownorm), then centre and scale so `diam(ΔW) ≤ η`."""

from torch import Tensor

from pipeline.study_b.hilbert import center_rows
from pipeline.study_b.lmo import orthogonalise, unit_rows
from pipeline.study_b.recipes.base import HeadRecipe, HeadStepDefault, newton_schulz_flops


def direction(m: Tensor, equi_iters: int) -> Tensor:
    """Alternate orthogonalisation of the centred matrix (rows become a tight frame) with
    row-normalisation (equal norms); equal-norm tight frames are the configurations that approach the
    Welch bound on the min/max distance ratio. Ends on unit rows, then as `hilbert`: centre and halve,
    so diam ≤ 1."""
    x = m
    for _ in range(equi_iters):
        x = unit_rows(orthogonalise(center_rows(x)))
    return 0.5 * center_rows(x)


def head_flops(vocab: int, width: int, equi_iters: int) -> float:
    n = vocab * width
    per_iter = 2 * n + (2 * n + newton_schulz_flops(vocab, width)) + 3 * n  # centre, NS, rownorm
    return 4 * n + equi_iters * per_iter + (2 + 1 + 1 + 2) * n  # momentum; centre, scale, decay, update


RECIPE = HeadRecipe(
    name="hilbert_equi",
    summary="equi_iters × (centre, Newton–Schulz, rownorm), centre, η/2",
    hidden="muon",
    head="lmo",
    direction=direction,
    trust_region=True,
    records_spread=True,
    default_step=HeadStepDefault(tau=0.8),
    head_flops=head_flops,
    step_time_bar=("muon_head", 1.2),
)
