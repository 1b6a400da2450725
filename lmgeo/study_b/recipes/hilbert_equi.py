"""`hilbert_equi`: the Study B paper's equidistance step, as the solution of its problem (SPEC §3.2;
`lmgeo.study_b.equidistance`): the head step's rows spread as evenly as possible — the smallest pairwise
distance maximised with diam(ΔW) = η — while keeping at least c = `equi_alignment` of `hilbert`'s descent
per unit diameter.

The solver is warm-started from the previous step's solution (its rows and their candidates, kept in the
optimizer's state), `equi_iters` iterations per step; the first step is a cold solve of `COLD_ITERS`
iterations. The rows are centred and divided by their certified diameter (exact to float32 rounding up to
2048 rows; above, the sphere's bound 2, so diam(ΔW) ≤ η), so the step in Hilbert units is the whole budget
(`hilbert` reaches it only when two rows are antipodal).
"""

from typing import Any

from torch import Tensor

from lmgeo.study_b.equidistance import solve
from lmgeo.study_b.hilbert import center_rows
from lmgeo.study_b.recipes.base import HeadRecipe, HeadStepDefault, LMOKnobs

COLD_ITERS = 100  # the first step's solve, from hilbert's rows
STATE_KEY = "equi_solution"


def direction(m: Tensor, knobs: LMOKnobs, state: dict[str, Any]) -> Tensor:
    previous = state.get(STATE_KEY)
    solution = solve(m, knobs.equi_alignment, COLD_ITERS if previous is None else knobs.equi_iters, previous)
    state[STATE_KEY] = solution
    return center_rows(solution.rows).div_(solution.diameter)


RECIPE = HeadRecipe(
    name="hilbert_equi",
    summary="rows spread apart (max-min distance) at diam(ΔW) = η, keeping ≥ c of hilbert's descent",
    hidden="muon",
    head="lmo",
    direction=direction,
    trust_region=True,
    # Tuned alone at the study's protocol (docs/tuning-hilbert-equi/): tau first, then c at that tau.
    default_step=HeadStepDefault(tau=0.2, equi_alignment=0.95),
)
