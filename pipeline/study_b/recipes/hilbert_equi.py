"""`hilbert_equi`: the seed's equidistance LMO. Maximise the smallest distance between two rows of the step
while its diameter stays within η, trading against alignment with the momentum M (SPEC §3.2).

The trade-off is one knob, `equi_alignment` = c: every row keeps at least c of its alignment with its
centred momentum row, `⟨u_i, m̃_i/‖m̃_i‖⟩ ≥ c`, so `⟨M, ΔW⟩` is at least c times `hilbert`'s at the same η
(exactly c before the spreading moves anything). Within those cones the rows are spread apart:

1. start on each cone's boundary in a fresh random tangent direction (a seeded stream: rows whose
   momenta are parallel then start apart, which right-multiplying by any d × d matrix cannot do);
2. `equi_iters` times: find each row's nearest row (among candidates found once, exactly or on a sketch
   when d is large) and push it away by half its gap to the median nearest-row distance, then project
   back into its cone. Rows already as far from their neighbours as the median do not move, so only the
   closest pairs are pushed: this is ascent on the minimum distance, not on an average.

Unit rows are then centred and halved, so diam(ΔW) ≤ η exactly (a common shift changes no distance).
The step in Hilbert units is therefore the same as `hilbert`'s; only its direction differs.
"""

import torch
from torch import Tensor

from pipeline.study_b.hilbert import center_rows
from pipeline.study_b.lmo import into_cones, nearest_among, nearest_candidates, tangent_rows, unit_rows
from pipeline.study_b.recipes.base import HeadRecipe, HeadStepDefault, LMOKnobs

CANDIDATES = 8  # nearest rows kept per row for the spreading iterations


def direction(m: Tensor, knobs: LMOKnobs, gen: torch.Generator) -> Tensor:
    axes = unit_rows(center_rows(m))
    c = knobs.equi_alignment
    start = torch.randn(m.shape, generator=gen, device=m.device, dtype=m.dtype)
    u = c * axes + (1 - c * c) ** 0.5 * tangent_rows(start, axes)
    if knobs.equi_iters:
        candidates = nearest_candidates(u, CANDIDATES)
        for _ in range(knobs.equi_iters):
            nearest, gap = nearest_among(u, candidates)
            push = 0.5 * (gap.median() - gap).clamp_min(0)
            u = into_cones(unit_rows(u + push[:, None] * unit_rows(u - u[nearest])), axes, c)
    return 0.5 * center_rows(u)


def head_flops(vocab: int, width: int, equi_iters: int) -> float:
    """Momentum 4, centring and unit axes 5, random start and tangent 8; the candidate search
    2·V²·min(d, 64); per iteration the candidate distances 3·k·V·d and push, renormalise, project 16·V·d;
    centre, scale, decay, update 6 (all per V·d unless stated)."""
    n = vocab * width
    search = 2.0 * vocab * vocab * min(width, 64) if equi_iters else 0.0
    return (4 + 5 + 8 + 6) * n + search + equi_iters * (3 * CANDIDATES + 16) * n


RECIPE = HeadRecipe(
    name="hilbert_equi",
    summary="rows spread apart (max-min distance) within alignment cones ≥ c, centred, η/2",
    hidden="muon",
    head="lmo",
    direction=direction,
    trust_region=True,
    default_step=HeadStepDefault(tau=0.8),
    head_flops=head_flops,
    step_time_bar=("muon_head", 1.5),
)
