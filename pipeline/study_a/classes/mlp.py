"""`mlp`: `T(x) = x + τ (W₂ tanh(W₁ (x − μ)/σ + b₁) + b₂)`, one hidden layer of `mlp_hidden` units, fitted
per anchor neighbourhood.

`μ` is the neighbours' mean input, `σ` the RMS of the centred inputs and `τ` the RMS of the updates
`y_j − x_j`, so that the optimiser sees unit-scale problems. Objective per anchor:
`f = mean_{j,c} (residual/τ)² + λ(‖W₁‖² + ‖W₂‖²)`.

Fitting is variable projection: for given `(W₁, b₁)` the output layer `(W₂, b₂)` minimising `f` is a ridge
regression in closed form, so only `(W₁, b₁)` are optimised, by Adam (lr 1e-2) on `f` with the output layer
solved at every step (its gradient there is the partial one, the output layer being optimal). `W₁ ~ N(0,
1/d)` (drawn on the CPU from `seed` and the anchor's index, so every device and chunking starts alike),
`b₁ = 0`. Anchors are independent problems: Adam is element-wise, so one optimiser on the summed objective
is exactly one per anchor.

Convergence criterion (stated, and recorded per anchor as `converged`): the objective fell by less than
`mlp_tol` (relative) over the last `WINDOW` steps. Training stops when every anchor meets it, or after
`mlp_steps` steps; an anchor that has not met it is reported as not converged (its values are kept).
`J − I = (τ/σ) W₂ diag(tanh') W₁`."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.study_a.classes.base import FitClass, FitContext, RefContext
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import F64, Update, ridge_inverse, top_left_singular

LEARNING_RATE = 1e-2
WINDOW = 20  # steps over which the relative decrease of the objective is measured


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

    def update(self, x_a: Tensor, p: int) -> Update:
        hidden = torch.tanh(self.pre_activation(x_a[:, None]))[:, 0]  # (A, h)
        delta = self.out_scale[:, None] * ((self.w2 @ hidden[..., None])[..., 0] + self.b2)
        slope = 1 - hidden**2
        q2, r2 = torch.linalg.qr(self.w2)  # J − I = (τ/σ) W₂ diag(slope) W₁ = Q₂ · core
        core = (self.out_scale / self.in_scale)[:, None, None] * (r2 * slope[:, None, :]) @ self.w1
        return Update(delta, top_left_singular(q2, core, p))


def initial_w1(first: int, n_anchors: int, hidden: int, d: int, seed: int, device: torch.device | str) -> Tensor:
    """`W₁ ~ N(0, 1/d)` for anchors `first … first + n_anchors − 1` of the layer, each drawn on the CPU from
    its own stream of `seed` (part of the fit's definition): the same whichever chunk the anchor is in."""
    draws = []
    for anchor in range(first, first + n_anchors):
        stream = int(np.random.SeedSequence([seed, anchor]).generate_state(1, np.uint64)[0] >> np.uint64(1))
        draws.append(torch.randn((hidden, d), generator=torch.Generator().manual_seed(stream), dtype=F64))
    return (torch.stack(draws) / math.sqrt(d)).to(device)


def output_layer(hidden: Tensor, target: Tensor, ridge: float) -> tuple[Tensor, Tensor]:
    """`(W₂, b₂)` minimising `mean (target − H W₂ᵀ − b₂)² + λ‖W₂‖²` for hidden activations `H` (A, k, h)."""
    k = hidden.shape[1]
    h_mean, t_mean = hidden.mean(dim=1, keepdim=True), target.mean(dim=1, keepdim=True)
    hc, tc = hidden - h_mean, target - t_mean
    w, _, inv = ridge_inverse(hc.transpose(1, 2) @ hc, ridge * k * target.shape[2])  # minimum norm if singular
    w2_t = w @ (inv[..., None] * (w.transpose(1, 2) @ (hc.transpose(1, 2) @ tc)))  # (A, h, d)
    return w2_t.transpose(1, 2), (t_mean - h_mean @ w2_t)[:, 0]


def fit_mlp(
    xn: Tensor, yn: Tensor, hidden: int, max_steps: int, tol: float, ridge: float, seed: int, first: int = 0
) -> tuple[MLPFit, Tensor]:
    """The fitted maps and, per anchor, whether the convergence criterion was met (`first`: the first
    anchor's index in the layer, which its initial weights depend on)."""
    n_anchors, _, d = xn.shape
    tiny = torch.finfo(F64).tiny
    centre = xn.mean(dim=1)
    in_scale = (xn - centre[:, None]).square().mean(dim=(1, 2)).sqrt().clamp_min(tiny)
    out_scale = (yn - xn).square().mean(dim=(1, 2)).sqrt().clamp_min(tiny)
    scaled = (xn - centre[:, None]) / in_scale[:, None, None]
    target = (yn - xn) / out_scale[:, None, None]
    w1 = initial_w1(first, n_anchors, hidden, d, seed, xn.device).requires_grad_(True)
    b1 = xn.new_zeros((n_anchors, hidden)).requires_grad_(True)
    optimiser = torch.optim.Adam([w1, b1], lr=LEARNING_RATE)
    history: list[Tensor] = []
    converged = torch.zeros(n_anchors, dtype=torch.bool, device=xn.device)
    with torch.enable_grad():
        for step in range(max_steps + 1):
            optimiser.zero_grad()
            h = torch.tanh(scaled @ w1.transpose(1, 2) + b1[:, None])
            w2, b2 = output_layer(h.detach(), target, ridge)
            objective = _objective(h, w2, b2, target, w1, ridge)
            history.append(objective.detach())
            if len(history) > WINDOW:
                converged |= _met(history[-WINDOW - 1], history[-1], tol)
            if step == max_steps or bool(converged.all()):
                break
            objective.sum().backward()
            before = (w1.detach().clone(), b1.detach().clone())
            optimiser.step()
            with torch.no_grad():  # an anchor that has converged stops where it met the criterion
                w1.copy_(torch.where(converged[:, None, None], before[0], w1))
                b1.copy_(torch.where(converged[:, None], before[1], b1))
    return MLPFit(centre, in_scale, out_scale, w1.detach(), b1.detach(), w2, b2), converged


def _objective(h: Tensor, w2: Tensor, b2: Tensor, target: Tensor, w1: Tensor, ridge: float) -> Tensor:
    misfit = (target - h @ w2.transpose(-1, -2) - b2[..., None, :]).square().mean(dim=(-2, -1))
    return misfit + ridge * (w1.square().sum(dim=(-2, -1)) + w2.square().sum(dim=(-2, -1)))


def _met(before: Tensor, now: Tensor, tol: float) -> Tensor:
    """The convergence criterion: a relative decrease below `tol` over the last `WINDOW` steps."""
    return before - now <= tol * now


def fit(xn: Tensor, yn: Tensor, x_a: Tensor, cfg: AnalysisConfig, context: FitContext) -> Update:
    mlp, converged = fit_mlp(xn, yn, cfg.mlp_hidden, cfg.mlp_steps, cfg.mlp_tol, cfg.ridge, cfg.seed, context.first)
    return mlp.update(x_a, cfg.p)._replace(converged=converged)


def reference(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, context: RefContext
) -> tuple[np.ndarray, np.ndarray]:
    """The MLP fitted on this neighbourhood alone, one step at a time with its own stopping rule:
    (T(x_a), J − I), the Jacobian by autograd."""
    w1_init = initial_w1(context.anchor, 1, cfg.mlp_hidden, xn.shape[1], cfg.seed, torch.device("cpu"))[0]
    xt, yt, at = (torch.from_numpy(v) for v in (xn, yn, xa))
    d = xt.shape[1]
    mu = xt.mean(dim=0)
    sigma = ((xt - mu) ** 2).mean().sqrt()
    tau = ((yt - xt) ** 2).mean().sqrt()
    w1 = w1_init.clone().requires_grad_(True)
    b1 = torch.zeros(cfg.mlp_hidden, dtype=torch.float64, requires_grad=True)

    def output(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ridge regression with an intercept
        design = torch.cat([h, torch.ones(len(h), 1, dtype=torch.float64)], dim=1)
        penalty = np.sqrt(cfg.ridge * len(h) * d) * torch.eye(cfg.mlp_hidden, cfg.mlp_hidden + 1, dtype=torch.float64)
        target = torch.cat([(yt - xt) / tau, torch.zeros(cfg.mlp_hidden, d, dtype=torch.float64)])
        coef = torch.linalg.lstsq(torch.cat([design, penalty]), target).solution
        return coef[:-1].T, coef[-1]

    opt = torch.optim.Adam([w1, b1], lr=LEARNING_RATE)
    history = []
    for step in range(cfg.mlp_steps + 1):
        opt.zero_grad()
        h = torch.tanh((xt - mu) / sigma @ w1.T + b1)
        w2, b2 = output(h.detach())
        loss = _objective(h, w2, b2, (yt - xt) / tau, w1, cfg.ridge)
        history.append(float(loss.detach()))
        met = len(history) > WINDOW and bool(_met(torch.tensor(history[-WINDOW - 1]), loss.detach(), cfg.mlp_tol))
        if met or step == cfg.mlp_steps:
            break
        loss.backward()
        opt.step()
    w2, b2 = output(torch.tanh((xt - mu) / sigma @ w1.detach().T + b1.detach()))

    def t_map(v: torch.Tensor) -> torch.Tensor:
        return v + tau * (w2 @ torch.tanh(w1.detach() @ ((v - mu) / sigma) + b1.detach()) + b2)

    with torch.no_grad():
        t_val = t_map(at)
    jac = torch.autograd.functional.jacobian(t_map, at)
    return t_val.numpy(), jac.numpy() - np.eye(d)


def needs_rank(d: int) -> int:
    return d  # fewer independent inputs than dimensions: W₁'s off-span columns keep their random start


def parameters(d: int, cfg: AnalysisConfig) -> int:
    return 2 * cfg.mlp_hidden * d + cfg.mlp_hidden + d  # W₁, W₂, b₁, b₂


CLASS = FitClass(
    "mlp", local=True, fit=fit, reference=reference, summary="T(x) = x + MLP(x), one tanh hidden layer",
    parameters=parameters, iterative=True, needs_rank=needs_rank, value_from_span=False,
)
