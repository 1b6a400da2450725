"""What a head-optimizer recipe of Study B is (SPEC §3.2): how the head is stepped (the hidden matrices and
the rest follow the recipe's `hidden` choice), its tuned default step, and what the bench needs to know
about its cost.

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


def newton_schulz_flops(vocab: int, width: int, steps: int = 5) -> float:
    """torch.optim.Muon's quintic Newton–Schulz on an `m × M` matrix (m = min side): per step
    `A = XXᵀ` (2m²M), `B = bA + cA²` (2m³), `X ← aX + BX` (2m²M)."""
    m, big = min(vocab, width), max(vocab, width)
    return steps * (4 * m * m * big + 2 * m**3)


@dataclass(frozen=True)
class HeadRecipe:
    name: str
    summary: str  # the head step, in one line
    hidden: Literal["adamw", "muon"]  # the optimizer of the hidden 2-D matrices
    head: Literal["adamw", "muon", "lmo"]  # the head's optimizer; `lmo` steps along `direction`
    default_step: HeadStepDefault  # chosen by the tuning protocol of docs/tuning.md
    # Analytic FLOPs of one head step on a (vocab, width) head with `equi_iters`, for the bench.
    head_flops: Callable[[int, int, int], float]
    direction: Direction | None = None
    trust_region: bool = False  # the step may be given in nats per step (`tau`)
    baseline: bool = False  # the recipe the others are compared with
    # The bench's bars: this recipe's training step takes at most `ratio` × that of `recipe` (at the bench's
    # model size), and its head step alone at GPT-2 scale (V = 50,304, d = 768) at most `ratio` × `recipe`'s.
    step_time_bar: tuple[str, float] | None = None
    head_step_bar: tuple[str, float] | None = None
