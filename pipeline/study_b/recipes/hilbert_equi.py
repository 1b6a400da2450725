"""`hilbert_equi`: the seed's equidistance LMO. Maximise the smallest distance between two rows of the step
while its diameter stays within η, trading against alignment with the momentum M (SPEC §3.2).

The trade-off is one knob, `equi_alignment` = c: every row keeps at least c of its alignment with its
centred momentum row, `⟨u_i, m̃_i/‖m̃_i‖⟩ ≥ c`, so `⟨M, ΔW⟩` is at least c times `hilbert`'s at the same
η (exactly c before the spreading moves anything). Within those cones the rows are spread apart:

1. start on each cone's boundary in a fresh random tangent direction (a seeded stream: rows whose
   momenta are parallel then start apart, which right-multiplying by any d × d matrix cannot do);
2. `equi_iters` times: find each row's nearest row among `CANDIDATES` found once (exactly for V ≤ 2048 and
   d ≤ 64; above, on a width-64 sketch of the rows and within buckets of ~2048 rows, so nothing costs
   V²) and push it away by half its gap to the median nearest-row distance, then project back into its
   cone. Rows already as far from their neighbours as the median do not move, so only the closest pairs
   are pushed: this is ascent on the minimum distance, not on an average.

Unit rows are then centred and halved, so diam(ΔW) ≤ η exactly (a common shift changes no distance).
The step in Hilbert units is therefore the same as `hilbert`'s; only its direction differs.
"""

import torch
from torch import Tensor

from pipeline.study_b.hilbert import center_rows, center_rows_
from pipeline.study_b.lmo import (
    into_cones_,
    nearest_among,
    nearest_candidates,
    on_cone_,
    sketch,
    sketch_projection,
    tangent_rows,
    unit_rows_,
)
from pipeline.study_b.recipes.base import HeadRecipe, HeadStepDefault, LMOKnobs

CANDIDATES = 8  # nearest rows kept per row for the spreading iterations


def direction(m: Tensor, knobs: LMOKnobs, gen: torch.Generator) -> Tensor:
    # In place wherever a V × d temporary can be reused: a fresh one costs ~10× a pass over it (`unit_rows_`).
    axes = unit_rows_(center_rows(m))
    c = knobs.equi_alignment
    u = on_cone_(tangent_rows(torch.randn(m.shape, generator=gen, device=m.device, dtype=m.dtype), axes), axes, c)
    if knobs.equi_iters:
        projection = sketch_projection(m.shape[1], m)
        compared = sketch(u, projection)
        candidates = nearest_candidates(compared, CANDIDATES)
        for _ in range(knobs.equi_iters):
            nearest, gap = nearest_among(compared, candidates)
            push = 0.5 * (gap.median() - gap)
            moving = torch.nonzero(push > 0).flatten()  # only rows closer to a neighbour than the median move
            rows = u[moving]
            away = unit_rows_(rows - u[nearest[moving]])
            rows = into_cones_(unit_rows_(rows.addcmul_(push[moving, None], away)), axes[moving], c)
            u[moving] = rows
            compared[moving] = sketch(rows, projection)
    return center_rows_(u).mul_(0.5)


RECIPE = HeadRecipe(
    name="hilbert_equi",
    summary="rows spread apart (max-min distance) within alignment cones ≥ c, centred, η/2",
    hidden="muon",
    head="lmo",
    direction=direction,
    trust_region=True,
    default_step=HeadStepDefault(tau=0.8),
)
