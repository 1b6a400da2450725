"""`mlp`: `T(x) = x + τ (W₂ tanh(W₁ (x − μ)/σ + b₁) + b₂)`, one hidden layer of `mlp_hidden` units, fitted
per anchor neighbourhood.

`μ` is the neighbours' mean input, `σ` the RMS of the centred inputs and `τ` the RMS of the updates
`y_j − x_j`, so that the optimiser sees unit-scale problems. Objective per anchor:
`f = mean_{j,c} (residual/τ)² + λ(‖W₁‖² + ‖W₂‖²)`.

Fitting is variable projection: for given `(W₁, b₁)` the output layer `(W₂, b₂)` minimising `f` is a ridge
regression in closed form, so only `(W₁, b₁)` are optimised, by Adam (lr 3e-2) on `f` with the output layer
solved at every step (its gradient there is the partial one, the output layer being optimal), the gradient
in closed form (`fit_mlp`; the reference takes it by autograd). `W₁ ~ N(0,
1/d)` (drawn on the CPU from `seed` and the anchor's index, so every device and chunking starts alike),
`b₁ = 0`. Anchors are independent problems: Adam is element-wise, so one optimiser on the summed objective
is exactly one per anchor.

Convergence criterion (stated, and recorded per anchor as `converged`): the objective fell by less than
`mlp_tol` (relative) over the last `WINDOW` steps. Training stops when every anchor meets it, or after
`mlp_steps` steps; an anchor that has not met it is reported as not converged (its values are kept).
`J − I = (τ/σ) W₂ diag(tanh') W₁`.

Identification (SPEC §4.5) follows the one rule of every class, on the inputs the map sees, `x_j − μ`
(`centres_inputs`): the value at `x_a` is identified where `x_a − μ` lies in the span of the centred inputs (the
data's affine span; off it, `W₁`'s components the data never reach would decide it), the map itself where the
centred inputs have rank `d`. Like every fit of a non-convex objective, both are also functions of the seeded
start, which is part of the fit's definition. It is fitted on every null sample, as every class is."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmgeo.study_a.classes.base import FitClass, FitContext, RefContext
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import F64, Update, ridge_inverse, top_left_singular

LEARNING_RATE = 3e-2  # 1e-2 met the criterion ~1.7× later for a 1–3% lower rel_err (default study)
BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults (the reference runs it)
WINDOW = 20  # steps over which the relative decrease of the objective is measured
FLAT = 2.0**-24  # float32's unit roundoff: inputs spread less than this, relative to their size, are one point


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


class _Projected(NamedTuple):
    """The output layer solved for given hidden activations, and what the objective and its gradient need."""

    w2: Tensor  # (A, d, h)
    b2: Tensor  # (A, d)
    explained: Tensor  # (A,) ⟨Hcᵀ Tc, W₂ᵀ⟩: ‖Tc‖² − explained is the ridge objective's minimum over W₂


def output_layer(hidden_t: Tensor, centred_target: Tensor, target_mean: Tensor, ridge: float) -> _Projected:
    """`(W₂, b₂)` minimising `mean (target − H W₂ᵀ − b₂)² + λ‖W₂‖²` for hidden activations `H`, given transposed
    as `Hᵀ` (A, h, k) (every product below then has the hidden units as its short side, ~3× faster in batched
    float64 GEMMs than with them inner), from the centred targets `Tc` (A, k, d) and their mean (A, 1, d)."""
    k = hidden_t.shape[2]
    h_mean = hidden_t.mean(dim=2, keepdim=True)  # (A, h, 1)
    hc_t = hidden_t - h_mean
    cross = hc_t @ centred_target  # G = Hcᵀ Tc (A, h, d)
    penalty = ridge * k * centred_target.shape[2]
    gram = hc_t @ hc_t.transpose(1, 2)
    if penalty > 0:  # positive definite: its inverse (an h × h one costs a tenth of an eigendecomposition)
        w2_t = torch.linalg.inv(gram + penalty * torch.eye(len(gram[0]), dtype=gram.dtype, device=gram.device)) @ cross
    else:  # the minimum-norm solution where the hidden activations are collinear
        w, _, inv = ridge_inverse(gram, 0.0)
        w2_t = w @ (inv[..., None] * (w.transpose(1, 2) @ cross))  # (A, h, d)
    b2 = target_mean[:, 0] - (h_mean.transpose(1, 2) @ w2_t)[:, 0]
    return _Projected(w2_t.transpose(1, 2), b2, (cross * w2_t).sum(dim=(1, 2)))


def fit_mlp(
    xn: Tensor, yn: Tensor, hidden: int, max_steps: int, tol: float, ridge: float, seed: int, first: int = 0
) -> tuple[MLPFit, Tensor]:
    """The fitted maps and, per anchor, whether the convergence criterion was met (`first`: the first
    anchor's index in the layer, which its initial weights depend on).

    The objective and its gradient are in closed form (variable projection makes both cheap): with `W₂`
    optimal, `k d f = ‖Tc‖² − ⟨Hcᵀ Tc, W₂ᵀ⟩ + λ k d ‖W₁‖²`, and by the envelope theorem
    `∂(k d f)/∂H = −2 (Tc W₂ − Hc W₂ᵀW₂)` (already centred), then through `tanh` to `W₁` and `b₁`. No
    (A, k, d) residual is formed per step. An anchor that meets the criterion leaves the batch with the
    weights it met it at; the others go on."""
    n_anchors, k, d = xn.shape
    tiny = torch.finfo(F64).tiny
    centre = xn.mean(dim=1)
    in_scale = (xn - centre[:, None]).square().mean(dim=(1, 2)).sqrt()
    # Neighbours whose inputs are one point at float32 resolution (a frequent token's position-free embedding, k
    # copies of it): the map sees a constant, so it is constant (σ = ∞: J − I = 0, the value the mean update),
    # instead of the rounding noise blown up by 1/σ (which overflowed to inf).
    in_scale = torch.where(in_scale <= FLAT * xn.square().mean(dim=(1, 2)).sqrt(), math.inf, in_scale)
    out_scale = (yn - xn).square().mean(dim=(1, 2)).sqrt().clamp_min(tiny)
    scaled = (xn - centre[:, None]) / in_scale[:, None, None]
    target = (yn - xn) / out_scale[:, None, None]
    target_mean = target.mean(dim=1, keepdim=True)
    state = _Training(
        scaled, target - target_mean, target_mean, initial_w1(first, n_anchors, hidden, d, seed, xn.device)
    )
    w1, b1 = state.w1.clone(), state.b1.clone()
    w2, b2 = xn.new_zeros((n_anchors, d, hidden)), xn.new_zeros((n_anchors, d))
    converged = torch.zeros(n_anchors, dtype=torch.bool, device=xn.device)
    for step in range(max_steps + 1):
        out = state.evaluate(ridge)
        met = state.met(tol)
        leaving = met if step < max_steps else torch.ones_like(met)
        if bool(leaving.any()):  # these leave the batch: their weights, and their output layer at those weights
            rows = state.rows[leaving]
            w1[rows], b1[rows], w2[rows], b2[rows] = (v[leaving] for v in (state.w1, state.b1, out.w2, out.b2))
            converged[rows] = met[leaving]
            if bool(leaving.all()):
                break
            state.keep(~leaving)
            out = _Projected(*(v[~leaving] for v in out))
        state.adam_step(out, ridge, step + 1)
    return MLPFit(centre, in_scale, out_scale, w1, b1, w2, b2), converged


class _Training:
    """The anchors still training: their data (kept transposed too, `*_t`, for the short-side products of
    `output_layer`), weights, Adam moments and objective history, in the batch's order (`rows`: their places
    among all anchors)."""

    def __init__(self, scaled: Tensor, centred: Tensor, target_mean: Tensor, w1: Tensor) -> None:
        self.scaled, self.centred, self.target_mean, self.w1 = scaled, centred, target_mean, w1
        self.scaled_t, self.centred_t = scaled.transpose(1, 2).contiguous(), centred.transpose(1, 2).contiguous()
        self.energy = centred.square().sum(dim=(1, 2))
        self.b1 = w1.new_zeros(w1.shape[:2])
        self.moments = [torch.zeros_like(v) for v in (w1, w1, self.b1, self.b1)]  # m, v of W₁; m, v of b₁
        self.rows = torch.arange(len(w1), device=w1.device)
        self.history: list[Tensor] = []

    def evaluate(self, ridge: float) -> _Projected:
        """The hidden activations (transposed, (A, h, k)), the output layer solved for them, and the objective
        appended to the history."""
        k, d = self.centred.shape[1:]
        self.hidden_t = torch.tanh(self.w1 @ self.scaled_t + self.b1[..., None])
        out = output_layer(self.hidden_t, self.centred, self.target_mean, ridge)
        self.history.append((self.energy - out.explained) / (k * d) + ridge * self.w1.square().sum(dim=(1, 2)))
        return out

    def met(self, tol: float) -> Tensor:
        if len(self.history) <= WINDOW:
            return torch.zeros_like(self.rows, dtype=torch.bool)
        return _met(self.history[-WINDOW - 1], self.history[-1], tol)

    def keep(self, mask: Tensor) -> None:
        """Drop the anchors outside `mask` from every per-anchor tensor."""
        for name in (
            "scaled",
            "centred",
            "scaled_t",
            "centred_t",
            "target_mean",
            "w1",
            "b1",
            "energy",
            "rows",
            "hidden_t",
        ):
            setattr(self, name, getattr(self, name)[mask])
        self.moments = [m[mask] for m in self.moments]
        self.history = [h[mask] for h in self.history[-WINDOW - 1 :]]

    def adam_step(self, out: _Projected, ridge: float, step: int) -> None:
        """One step of Adam (torch's defaults: β = (0.9, 0.999), ε = 1e-8) on the closed-form gradient, in the
        transposed layout: `∂/∂Hᵀ = −2 (W₂ᵀ Tcᵀ − (W₂ᵀW₂) Hcᵀ) / (k d)`."""
        k, d = self.centred.shape[1:]
        hc_t = self.hidden_t - self.hidden_t.mean(dim=2, keepdim=True)
        w2_t = out.w2.transpose(1, 2)
        d_hidden_t = (w2_t @ self.centred_t - (w2_t @ out.w2) @ hc_t) * (-2 / (k * d))
        d_pre_t = d_hidden_t * (1 - self.hidden_t.square())
        grads = (d_pre_t @ self.scaled + 2 * ridge * self.w1, d_pre_t.sum(dim=2))
        for index, (weight, grad) in enumerate(zip((self.w1, self.b1), grads, strict=True)):
            first, second = self.moments[2 * index], self.moments[2 * index + 1]
            first.lerp_(grad, 1 - BETAS[0])
            second.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
            denom = (second.sqrt() / math.sqrt(1 - BETAS[1] ** step)).add_(ADAM_EPS)
            weight.addcdiv_(first, denom, value=-LEARNING_RATE / (1 - BETAS[0] ** step))


def _objective(h: Tensor, w2: Tensor, b2: Tensor, target: Tensor, w1: Tensor, ridge: float) -> Tensor:
    """The objective, term by term (the per-anchor reference's; `fit_mlp` uses its closed form)."""
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
    return d  # centred inputs of lower rank: W₁'s components off their span are set by its start, not the data


def parameters(d: int, cfg: AnalysisConfig) -> int:
    return 2 * cfg.mlp_hidden * d + cfg.mlp_hidden + d  # W₁, W₂, b₁, b₂


CLASS = FitClass(
    "mlp",
    local=True,
    fit=fit,
    reference=reference,
    summary="T(x) = x + MLP(x), one tanh hidden layer",
    parameters=parameters,
    iterative=True,
    linear=False,
    needs_rank=needs_rank,
    centres_inputs=True,
)
