"""What a head-optimizer recipe of Study B is (SPEC §3.2): how the head is stepped (the hidden matrices and
the rest follow the recipe's `hidden` choice), and its tuned defaults (what only the bench reads of it, its
cost model and speed bars, is in `lmgeo/commands/bench/recipe_costs.py`).

A recipe is one module of `lmgeo/study_b/recipes/` defining `RECIPE = HeadRecipe(...)`, plus one line in
`lmgeo/study_b/recipes/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor


@dataclass(frozen=True)
class HeadStepDefault:
    """A recipe's tuned defaults (docs/tuning.md): the head step, `head_lr` (η; None = the run's
    `adamw_lr`) or `tau` (nats); `hidden_lr`, the lr of its hidden matrices where the recipe sets its own
    (`adamw`, whose hidden matrices are AdamW's; None = the run's); `equi_alignment`, the descent share of
    the equidistance step (`hilbert_equi`)."""

    head_lr: float | None = None
    tau: float | None = None
    hidden_lr: float | None = None
    equi_alignment: float | None = None


@dataclass(frozen=True)
class LMOKnobs:
    """The knobs of the equidistance step (`train.recipe_overrides.<recipe>.equi_*`): its descent share and
    its solver's iterations per step; directions that do not spread rows ignore them."""

    equi_iters: int
    equi_alignment: float


# (momentum (V, d), knobs, the optimizer's state for the head) -> the unit step, diam ≤ 1 for the Hilbert
# recipes; the optimizer applies −η times it. A direction may keep what it needs between steps in the
# state (the equidistance solver's warm start); the others ignore it.
Direction = Callable[[Tensor, LMOKnobs, dict[str, Any]], Tensor]


@dataclass(frozen=True)
class HeadRecipe:
    name: str
    summary: str  # the head step, in one line
    hidden: Literal["adamw", "muon"]  # the optimizer of the hidden 2-D matrices
    head: Literal["adamw", "muon", "lmo"]  # the head's optimizer; `lmo` steps along `direction`
    default_step: HeadStepDefault  # chosen by the tuning protocol of docs/tuning.md
    direction: Direction | None = None
    trust_region: bool = False  # the step may be given in nats per step (`tau`)
    baseline: bool = False  # the recipe the others are compared with
    # Under a matched budget this recipe's training is that recipe's, step for step (SPEC §3.2): the sweep
    # trains it once, as that one.
    matched_as: str | None = None
    # A control of that recipe (issue #55): its knobs are that recipe's defaults by construction, so it is never
    # tuned on its own (`lmgeo tune` leaves it out), and the report reads that recipe against it (paired seeds).
    control_of: str | None = None
