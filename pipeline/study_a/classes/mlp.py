"""`mlp`: `T(x) = x + τ (W₂ tanh(W₁ (x − μ)/σ + b₁) + b₂)`, one hidden layer of `mlp_hidden` units, fitted
per anchor neighbourhood.

`μ` is the neighbours' mean input, `σ` the RMS of the centred inputs and `τ` the RMS of the updates
`y_j − x_j`, so that Adam sees unit-scale problems. Loss per anchor: `mean_{j,c} (residual/τ)² +
λ(‖W₁‖² + ‖W₂‖²)`; `mlp_steps` steps of Adam (lr 1e-2) from `W₁ ~ N(0, 1/d)` (drawn on the CPU from
`seed`, so every device starts alike), `b₁ = W₂ = b₂ = 0`. Anchors are independent problems: Adam is
element-wise, so one optimiser on the summed loss is exactly one optimiser per anchor.
`J − I = (τ/σ) W₂ diag(tanh') W₁`."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.study_a.classes.base import FitClass, RefContext
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import F64, Update, top_left_singular

LEARNING_RATE = 1e-2

class MLPFit(NamedTuple):
    centre: Tensor  # (A, d) μ
    in_scale: Tensor  # (A,) σ
    out_scale: Tensor  # (A,) τ
    w1: Tensor  # (A, h, d)
    b1: Tensor  # (A, h)
    w2: Tensor  # (A, d, h)
    b2: Tensor  # (A, d)

    def pre_activation(self, x: Tensor) -> Tensor:
        """`W₁ (x − μ)/σ + b₁` for `x` of shape (A, n, d)."""
        scaled = (x - self.centre[:, None]) / self.in_scale[:, None, None]
        return scaled @ self.w1.transpose(1, 2) + self.b1[:, None]

    def scaled_update(self, x: Tensor) -> Tensor:
        """`(T(x) − x)/τ` for `x` of shape (A, n, d)."""
        return torch.tanh(self.pre_activation(x)) @ self.w2.transpose(1, 2) + self.b2[:, None]

    def update(self, x_a: Tensor, p: int) -> Update:
        delta = self.out_scale[:, None] * self.scaled_update(x_a[:, None])[:, 0]
        slope = 1 - torch.tanh(self.pre_activation(x_a[:, None])[:, 0]) ** 2  # (A, h)
        q2, r2 = torch.linalg.qr(self.w2)  # J − I = (τ/σ) W₂ diag(slope) W₁ = Q₂ · core
        core = (self.out_scale / self.in_scale)[:, None, None] * (r2 * slope[:, None, :]) @ self.w1
        return Update(delta, top_left_singular(q2, core, p))


def initial_w1(n_anchors: int, hidden: int, d: int, seed: int, device: torch.device | str) -> Tensor:
    """`W₁ ~ N(0, 1/d)` for every anchor, drawn on the CPU from `seed` (part of the fit's definition)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn((n_anchors, hidden, d), generator=generator, dtype=F64) / math.sqrt(d)).to(device)


def fit_mlp(xn: Tensor, yn: Tensor, hidden: int, steps: int, ridge: float, seed: int) -> MLPFit:
    n_anchors, _, d = xn.shape
    centre = xn.mean(dim=1)
    tiny = torch.finfo(F64).tiny
    in_scale = (xn - centre[:, None]).square().mean(dim=(1, 2)).sqrt().clamp_min(tiny)
    out_scale = (yn - xn).square().mean(dim=(1, 2)).sqrt().clamp_min(tiny)
    params = [
        initial_w1(n_anchors, hidden, d, seed, xn.device),
        xn.new_zeros((n_anchors, hidden)),
        xn.new_zeros((n_anchors, d, hidden)),
        xn.new_zeros((n_anchors, d)),
    ]
    for t in params:
        t.requires_grad_(True)
    target = (yn - xn) / out_scale[:, None, None]
    optimiser = torch.optim.Adam(params, lr=LEARNING_RATE)
    with torch.enable_grad():
        for _ in range(steps):
            optimiser.zero_grad()
            fit = MLPFit(centre, in_scale, out_scale, *params)
            misfit = (target - fit.scaled_update(xn)).square().mean(dim=(1, 2))
            penalty = ridge * (params[0].square().sum(dim=(1, 2)) + params[2].square().sum(dim=(1, 2)))
            (misfit + penalty).sum().backward()
            optimiser.step()
    return MLPFit(centre, in_scale, out_scale, *(t.detach() for t in params))


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig) -> Update:
    return fit_mlp(xn, yn, cfg.mlp_hidden, cfg.mlp_steps, cfg.ridge, cfg.seed).update(x_a, cfg.p)


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, context: RefContext
) -> tuple[np.ndarray, np.ndarray]:
    """The MLP map fitted with Adam on this neighbourhood alone: (T(x_a), J − I) by autograd."""
    w1_init = initial_w1(context.n_anchors, cfg.mlp_hidden, xn.shape[1], cfg.seed, torch.device("cpu"))[context.anchor]
    xt, yt, at = (torch.from_numpy(v) for v in (xn, yn, xa))
    d = xt.shape[1]
    mu = xt.mean(dim=0)
    sigma = ((xt - mu) ** 2).mean().sqrt()
    tau = ((yt - xt) ** 2).mean().sqrt()
    w1 = w1_init.clone().requires_grad_(True)
    b1 = torch.zeros(cfg.mlp_hidden, dtype=torch.float64, requires_grad=True)
    w2 = torch.zeros(d, cfg.mlp_hidden, dtype=torch.float64, requires_grad=True)
    b2 = torch.zeros(d, dtype=torch.float64, requires_grad=True)

    def t_map(v: torch.Tensor) -> torch.Tensor:
        return v + tau * (w2 @ torch.tanh(w1 @ ((v - mu) / sigma) + b1) + b2)

    opt = torch.optim.Adam([w1, b1, w2, b2], lr=LEARNING_RATE)
    for _ in range(cfg.mlp_steps):
        opt.zero_grad()
        pred = torch.stack([t_map(v) for v in xt])
        loss = (((yt - pred) / tau) ** 2).mean() + cfg.ridge * ((w1**2).sum() + (w2**2).sum())
        loss.backward()
        opt.step()
    with torch.no_grad():
        t_val = t_map(at)
    jac = torch.autograd.functional.jacobian(t_map, at)
    return t_val.numpy(), jac.numpy() - np.eye(d)


CLASS = FitClass(
    "mlp", local=True, fit=fit, reference=reference, summary="T(x) = x + MLP(x), one tanh hidden layer", iterative=True
)
