"""`hilbert_ctl`: the control of `hilbert_equi` (issue #55): `hilbert`'s step, its own direction, at
`hilbert_equi`'s default trust region, so that between the two only the spread of the rows differs, not the
step size. Its tau is `hilbert_equi`'s `default_step.tau` itself, not a copy: a re-tuned `hilbert_equi`
moves its control with it, and the control is never tuned on its own (`HeadRecipe.control_of`)."""

from lmgeo.study_b.recipes.base import HeadRecipe, HeadStepDefault
from lmgeo.study_b.recipes.hilbert import RECIPE as HILBERT
from lmgeo.study_b.recipes.hilbert import direction
from lmgeo.study_b.recipes.hilbert_equi import RECIPE as HILBERT_EQUI

RECIPE = HeadRecipe(
    name="hilbert_ctl",
    summary=f"hilbert's step at hilbert_equi's tau (only the rows' spread differs): {HILBERT.summary}",
    hidden=HILBERT.hidden,
    head=HILBERT.head,
    direction=direction,
    trust_region=True,
    default_step=HeadStepDefault(tau=HILBERT_EQUI.default_step.tau),
    # Under a matched budget the step size is the budget's: the control's training is `hilbert`'s.
    matched_as="hilbert",
    control_of="hilbert_equi",
)
