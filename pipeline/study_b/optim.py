"""The optimizers of a Study B run (SPEC §3.2), built from its recipe (`pipeline.study_b.recipes`) and its
model family's parameter groups (`pipeline.models`).

Every recipe but `adamw` trains the hidden 2-D matrices with `torch.optim.Muon` and embeddings, norms,
biases (and SSM parameters) with AdamW, so that only the head differs between recipes.

`M` is the head's momentum, an EMA with β = 0.95 read with Nesterov exactly as torch.optim.Muon does
(`buf ← lerp(buf, g, 1−β)`, `M = lerp(g, buf, β)`). For recipes with a trust region the step may be given
in nats (`tau`): η_t = tau_t / r_t with r_t the radius of the batch's final hidden states, which the
trainer passes to `RecipeOptimizer.step`.

Decoupled weight decay `W ← (1 − η·λ) W` applies to the hidden matrices and the head (never to
embeddings, norms or biases); with `tau`, the trust region bounds the LMO step, and a non-zero
`weight_decay` adds `η·λ·‖h‖·diam(W)` nats on top.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from pipeline.models.family import GroupRule
from pipeline.models.registry import family_of
from pipeline.study_b.config import RecipeConfig, Schedule, TrainConfig
from pipeline.study_b.recipes import RECIPES

MOMENTUM = 0.95
ADAMW_BETAS = (0.9, 0.95)


# ------------------------------------------------------------------------------------ step sizes
@dataclass(frozen=True)
class HeadStep:
    """The resolved head step of one run. `lr` is η, or tau in nats when `trust_region`."""

    lr: float
    trust_region: bool
    radius_quantile: float
    equi_iters: int
    schedule: Schedule


def resolve_head_step(recipe: str, cfg: TrainConfig) -> HeadStep:
    """Recipe override (`train.recipe_overrides`) over the recipe's default over the run's AdamW lr."""
    override = cfg.recipe_overrides.get(recipe, RecipeConfig())  # type: ignore[call-overload]
    if override.tau is not None and override.head_lr is not None:
        raise ValueError(f"recipe_overrides.{recipe}: set head_lr or tau, not both")
    spec = RECIPES[recipe]
    chosen = override if (override.tau, override.head_lr) != (None, None) else spec.default_step
    if chosen.tau is not None and not spec.trust_region:
        raise ValueError(f"{recipe}: tau applies only to recipes with a trust region")
    if chosen.tau is not None:
        lr = chosen.tau
    else:
        lr = chosen.head_lr if chosen.head_lr is not None else cfg.adamw_lr
    return HeadStep(
        lr=lr,
        trust_region=chosen.tau is not None,
        radius_quantile=override.radius_quantile,
        equi_iters=override.equi_iters,
        schedule=override.schedule or cfg.schedule,
    )


def schedule_factor(step: int, total_steps: int, schedule: Schedule) -> float:
    """Multiplier of the peak step size at optimizer step `step` (0-based): linear warm-up to 1 over
    `warmup_steps`, then cosine/linear decay reaching `final_frac` at the last step, or constant."""
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.decay == "constant":
        return 1.0
    progress = min(1.0, (step - schedule.warmup_steps) / max(1, total_steps - 1 - schedule.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.decay == "cosine" else 1 - progress
    return schedule.final_frac + (1 - schedule.final_frac) * shape


# ------------------------------------------------------------------------------ parameter groups
class ParamGroupError(ValueError):
    """The group rules do not partition the model's trainable parameters."""


def partition_parameters(
    model: nn.Module, head: nn.Parameter, rules: Sequence[GroupRule]
) -> dict[str, list[nn.Parameter]]:
    """Groups `head` + one per rule; every trainable parameter lands in exactly one, or this raises
    listing every offender (unmatched, matched twice, a tied head, a non-2-D `hidden` parameter)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not any(p is head for _, p in named):
        raise ParamGroupError("the head is not a trainable parameter of the model")
    groups: dict[str, list[nn.Parameter]] = {"head": [], **{rule.group: [] for rule in rules}}
    offenders = []
    for name, param in named:
        matched = (["head"] if param is head else []) + [r.group for r in rules if re.search(r.pattern, name)]
        if len(matched) != 1:
            offenders.append(f"{name} {tuple(param.shape)}: {' and '.join(matched) if matched else 'no group'}")
        elif matched[0] == "hidden" and param.ndim != 2:
            offenders.append(f"{name} {tuple(param.shape)}: hidden takes 2-D matrices only")
        else:
            groups[matched[0]].append(param)
    if offenders:
        raise ParamGroupError(
            "every trainable parameter must be in exactly one group (is the head untied?):\n  "
            + "\n  ".join(offenders)
        )
    return groups


# ------------------------------------------------------------------------------------ head LMOs
class HeadLMO(torch.optim.Optimizer):
    """Muon's momentum followed by a linear minimisation oracle: `W ← (1 − ηλ) W − η·direction(M)`.

    With `trust_region`, a group's `lr` is tau (nats) and η = tau / r, r set by `set_radius` before each
    step.
    """

    def __init__(
        self,
        params: Any,
        direction: Callable[[Tensor], Tensor],
        lr: float,
        momentum: float = MOMENTUM,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        trust_region: bool = False,
    ) -> None:
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"HeadLMO takes (vocab, width) matrices, got shape {tuple(p.shape)}")
        self.direction = direction
        self.trust_region = trust_region
        self.radius: float | None = None
        self.last_eta: float | None = None

    def set_radius(self, radius: float) -> None:
        if not (math.isfinite(radius) and radius > 0):
            raise ValueError(f"the hidden-state radius must be positive and finite, got {radius}")
        self.radius = radius

    def eta(self, lr: float) -> float:
        if not self.trust_region:
            return lr
        if self.radius is None:
            raise ValueError("a tau step needs the batch's hidden-state radius: call set_radius first")
        return lr / self.radius

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            eta = self.eta(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                momentum = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                direction = self.direction(momentum.float())
                p.mul_(1 - eta * group["weight_decay"])
                p.add_(direction.to(p.dtype), alpha=-eta)
            self.last_eta = eta
        self.radius = None  # a radius belongs to one batch
        return loss


class RecipeOptimizer:
    """The 1–3 torch optimizers of a recipe and their schedulers, stepped together."""

    def __init__(
        self,
        recipe: str,
        optimizers: dict[str, torch.optim.Optimizer],
        schedulers: dict[str, LambdaLR],
        head_step: HeadStep,
    ) -> None:
        self.recipe = recipe
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.head_step = head_step
        head = optimizers.get("head")
        self._head_lmo = head if isinstance(head, HeadLMO) else None
        self._last_lrs: dict[str, float] | None = None

    @property
    def radius_quantile(self) -> float:
        """Which quantile of ‖h‖ over the batch the trainer should pass as `radius`."""
        return self.head_step.radius_quantile

    @property
    def needs_radius(self) -> bool:
        return self.head_step.trust_region

    def step(self, radius: float | None = None) -> None:
        """One step of every group. `radius` (r_t) is required by tau recipes and ignored otherwise."""
        if self.needs_radius:
            if radius is None:
                raise ValueError(f"{self.recipe} with tau needs the batch's hidden-state radius")
            assert self._head_lmo is not None
            self._head_lmo.set_radius(radius)
        for optimizer in self.optimizers.values():
            optimizer.step()
        self._last_lrs = self._current_lrs()
        for scheduler in self.schedulers.values():
            scheduler.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def lrs(self) -> dict[str, float]:
        """Step size per group at the last step taken (before any step: the first step's), keyed
        `hidden`, `embed`, `scalar`, `head`; a tau recipe's `head` is η_t = tau_t/r_t, and `head_tau`
        is tau_t."""
        return dict(self._last_lrs) if self._last_lrs is not None else self._current_lrs()

    def head_lr(self) -> float:
        return self.lrs()["head"]

    def _current_lrs(self) -> dict[str, float]:
        lrs = {g["name"]: float(g["lr"]) for opt in self.optimizers.values() for g in opt.param_groups}
        if self.needs_radius:
            assert self._head_lmo is not None
            lrs["head_tau"] = lrs.pop("head")
            lrs["head"] = self._head_lmo.last_eta if self._head_lmo.last_eta is not None else math.nan
        return lrs


def build_optimizers(
    model: nn.Module,
    head: nn.Parameter,
    recipe: str,
    cfg: TrainConfig,
) -> RecipeOptimizer:
    """The recipe's optimizers over `model`, whose untied head weight `(vocab, width)` is `head`; the
    parameter groups come from the model's family."""
    spec = RECIPES[recipe]
    groups = partition_parameters(model, head, family_of(model).param_groups)
    head_step = resolve_head_step(recipe, cfg)
    wd = cfg.weight_decay

    def group(name: str, lr: float, weight_decay: float) -> dict[str, Any]:
        return {"name": name, "params": groups[name], "lr": lr, "weight_decay": weight_decay}

    adamw_groups = [group("embed", cfg.adamw_lr, 0.0), group("scalar", cfg.adamw_lr, 0.0)]
    muon_groups = [group("hidden", cfg.hidden_lr, wd)]
    head_group = group("head", head_step.lr, wd)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if spec.hidden == "adamw":
        adamw_groups.insert(0, group("hidden", cfg.adamw_lr, wd))
    if spec.head == "adamw":
        adamw_groups.append(head_group)
    elif spec.head == "muon":
        muon_groups.append(head_group)
    else:
        assert spec.direction is not None, f"{recipe}: an `lmo` head needs a direction"
        optimizers["head"] = HeadLMO(
            [head_group],
            partial(spec.direction, equi_iters=head_step.equi_iters),
            lr=head_step.lr,
            weight_decay=wd,
            trust_region=head_step.trust_region,
        )
    if spec.hidden == "muon":
        optimizers["muon"] = torch.optim.Muon(
            _non_empty(muon_groups), lr=cfg.hidden_lr, weight_decay=wd, momentum=MOMENTUM, nesterov=True
        )
    optimizers["adamw"] = torch.optim.AdamW(_non_empty(adamw_groups), lr=cfg.adamw_lr, betas=ADAMW_BETAS)
    schedulers = {name: _scheduler(opt, cfg, head_step) for name, opt in optimizers.items()}
    return RecipeOptimizer(recipe, optimizers, schedulers, head_step)


def _non_empty(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [g for g in groups if g["params"]]


def _scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, head_step: HeadStep) -> LambdaLR:
    """The run's schedule on every group; the head follows its recipe's schedule when one is set."""
    schedules = [head_step.schedule if g["name"] == "head" else cfg.schedule for g in optimizer.param_groups]
    factors = [partial(schedule_factor, total_steps=cfg.steps, schedule=s) for s in schedules]
    return LambdaLR(optimizer, factors)
