"""What a head-optimizer recipe of Study B is (SPEC §3.2): how the head is stepped (the hidden matrices and
the rest follow the recipe's `hidden` choice), and its tuned default step (what only the bench reads of
it, its cost model and speed bars, is in `tools/bench/recipe_costs.py`).

A recipe is one module of `pipeline/study_b/recipes/` defining `RECIPE = HeadRecipe(...)`, plus one line in
`pipeline/study_b/recipes/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class HeadStepDefault:
    """A recipe's default head step size: `head_lr` (η; None = the run's `adamw_lr`) or `tau` (nats)."""

    head_lr: float | None = None
    tau: float | None = None


@dataclass(frozen=True)
class LMOKnobs:
    """The knobs of the equidistance spreading (`train.recipe_overrides.<recipe>.equi_*`); directions
    that do not spread rows ignore them."""

    equi_iters: int
    equi_alignment: float


# (momentum (V, d), knobs, the run's generator on the momentum's device) -> the unit step, diam ≤ 1 for
# the Hilbert recipes; the optimizer applies −η times it. Directions that draw no random numbers ignore
# the generator.
Direction = Callable[[Tensor, LMOKnobs, torch.Generator], Tensor]


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
