"""The `mlp` class's fit per optimisation step against one plain batched Adam step of the same problem.

The fit (`fit_mlp`: variable projection, the output layer solved in closed form, Adam by hand on `(W₁, b₁)`)
and the plain step (the batched MLP's forward and backward by autograd, `torch.optim.Adam` on all four
weights) both run `MLP_STEPS` steps on the same `A` neighbourhoods of `k` points in `d` dimensions with
`mlp_hidden` units, interleaved. Per step the fit does four `k × d × h` products (`X W₁ᵀ`, `Hcᵀ Tc`, `Tc W₂`,
`∂Pᵀ X`) and `h × h` work; the plain step five (two forward, three backward). So the fit's step should cost
no more than the plain one, plus the batched `h × h` eigendecompositions of the ridge solve and the
convergence bookkeeping: the bar is ≤ 1.5×. The plain step also forms the (A, k, d) residual and its
gradient every step, which the fit never does (its objective is in closed form); at large `d` that memory
traffic, not the products, is most of the plain step's time."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmgeo.commands.bench.measure import Bar, bar, interleaved
from lmgeo.study_a.classes.mlp import LEARNING_RATE, _objective, fit_mlp
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.knn import nearest_neighbours

MLP_STEPS = 10  # per timed fit; its setup (scaling, W₁'s draws, one last evaluation) counts against the fit
STEP_BAR = 1.5


def neighbourhoods(x: Tensor, y: Tensor, anchors: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each anchor's `k` nearest inputs and their outputs, (A, k, d) each, as `fit_layer` gives the fits."""
    index = nearest_neighbours(x, anchors, k)
    return x[index], y[index]


def fit_steps(xn: Tensor, yn: Tensor, cfg: AnalysisConfig, steps: int) -> None:
    """`fit_mlp` for exactly `steps` steps on every anchor: with `tol = −∞` no anchor meets the criterion, so
    none leaves the batch early and every step is a full batch's (the cost of a step, not of convergence)."""
    fit_mlp(xn, yn, cfg.mlp_hidden, steps, -math.inf, cfg.ridge, cfg.seed)


class PlainMLP:
    """The batched MLP trained the plain way: all of `(W₁, b₁, W₂, b₂)` by `torch.optim.Adam` on the summed
    per-anchor objective (anchors are independent: Adam is element-wise), gradients by autograd."""

    def __init__(self, inputs: Tensor, targets: Tensor, hidden: int, ridge: float, seed: int) -> None:
        n_anchors, _, d = inputs.shape
        draw = torch.Generator().manual_seed(seed)
        self.inputs, self.targets, self.ridge = inputs, targets, ridge
        self.w1 = torch.randn((n_anchors, hidden, d), generator=draw, dtype=inputs.dtype) / math.sqrt(d)
        self.w2 = torch.randn((n_anchors, d, hidden), generator=draw, dtype=inputs.dtype) / math.sqrt(hidden)
        self.b1, self.b2 = inputs.new_zeros((n_anchors, hidden)), inputs.new_zeros((n_anchors, d))
        self.weights = [w.requires_grad_(True) for w in (self.w1, self.b1, self.w2, self.b2)]
        self.optimiser = torch.optim.Adam(self.weights, lr=LEARNING_RATE)

    def step(self) -> None:
        self.optimiser.zero_grad()
        hidden = torch.tanh(self.inputs @ self.w1.transpose(1, 2) + self.b1[:, None])
        _objective(hidden, self.w2, self.b2, self.targets, self.w1, self.ridge).sum().backward()
        self.optimiser.step()


def plain_steps(inputs: Tensor, targets: Tensor, cfg: AnalysisConfig, steps: int) -> None:
    plain = PlainMLP(inputs, targets, cfg.mlp_hidden, cfg.ridge, cfg.seed)
    for _ in range(steps):
        plain.step()


def mlp_step_ratio(
    x: np.ndarray, y: np.ndarray, anchors: np.ndarray, cfg: AnalysisConfig, repeats: int, label: str
) -> tuple[dict[str, Any], Bar]:
    """Seconds per step of the `mlp` fit over those of the plain batched Adam step, interleaved, on the
    float64 neighbourhoods of `anchors` in the layer `x → y`."""
    xn, yn = neighbourhoods(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(anchors), cfg.k)
    update = yn - xn  # unscaled: no step depends on the values' scale for its cost
    timings = interleaved(
        {
            "mlp fit": lambda: fit_steps(xn, yn, cfg, MLP_STEPS),
            "plain Adam": lambda: plain_steps(xn, update, cfg, MLP_STEPS),
        },
        repeats,
    )
    ratio = timings.ratio("mlp fit", "plain Adam")
    shape = {"anchors": len(anchors), "k": cfg.k, "d": x.shape[1], "hidden": cfg.mlp_hidden, "steps": MLP_STEPS}
    result = {"ratio": ratio, **shape, "timings": timings.summary()}
    return result, bar(
        f"fits mlp, {label}: step over a plain batched Adam step",
        ratio,
        "<=",
        STEP_BAR,
        note=f"A={len(anchors)}, k={cfg.k}, h={cfg.mlp_hidden}",
    )
