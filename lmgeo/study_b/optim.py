"""The optimizers of a Study B run (SPEC §3.2), built from its recipe (`lmgeo.study_b.recipes`) and its
model family's parameter groups (`lmgeo.models`).

Every recipe but `adamw` trains the hidden 2-D matrices with Muon (`lmgeo.study_b.muon`: torch.optim.Muon's
step, its bf16 Newton–Schulz products computed in float32 on CPU) and embeddings, norms,
biases (and SSM parameters) with AdamW, so that only the head differs between recipes.

`M` is the head's momentum, an EMA with β = 0.95 read with Nesterov exactly as torch.optim.Muon does
(`buf ← lerp(buf, g, 1−β)`, `M = lerp(g, buf, β)`). For recipes with a trust region the step may be given
in nats (`tau`): η_t = tau_t / r_t with r_t the radius of the batch's final hidden states, which the
trainer passes to `RecipeOptimizer.step`.

Decoupled weight decay `W ← (1 − η·λ) W` applies to the hidden matrices and the head (never to
embeddings, norms or biases). With `tau` the decay is inside the trust region: the decay moves a token by
at most `η·λ·‖h‖·diam(W)` nats and diam(W) ≤ 2·max_i ‖w_i − w̄‖, so
η_t = tau_t / (r_t·(1 + 2λ·max_i ‖w_i − w̄‖)) keeps the whole head step (decay plus LMO) within tau.

torch.optim.Muon scales a matrix's step by √max(1, A/B) for its shape (A, B), read as (out, in). A family
whose hidden matrices are stored (in, out) (GPT-2's Conv1D) gets the scale of the same matrix stored
(out, in), so equivalent GPT-2 and GPT-NeoX matrices take equal steps.

The matched-budget sweep (`train.matched_budget`) rescales every recipe's realised head step, up or down, so
that diam(ΔW) = budget_t / r_t: the same worst-case nats per step for every recipe, so that only the step's
direction differs.

On CUDA the step never waits for the device: AdamW is torch's fused kernel, Muon batches its Newton–Schulz
chains (`lmgeo.study_b.muon`), and the step's data-dependent scalars (r_t, η_t of a tau recipe) stay
0-dim tensors on the device (`host_scalar`). On the CPU everything is as it always was (the single-tensor
AdamW loop, Python floats): bit for bit the path the study's results come from.
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

from lmgeo.models.family import GroupRule
from lmgeo.models.registry import family_of
from lmgeo.study_b.config import RecipeConfig, Schedule, TrainConfig
from lmgeo.study_b.hilbert import center_rows, diam_upper
from lmgeo.study_b.muon import Muon
from lmgeo.study_b.recipes import RECIPES
from lmgeo.study_b.recipes.base import Direction, LMOKnobs

MOMENTUM = 0.95
ADAMW_BETAS = (0.9, 0.95)

Scalar = float | Tensor  # a Python float, or on CUDA a 0-dim tensor left on the device


def host_scalar(value: Tensor) -> Scalar:
    """A 0-dim tensor as the step uses it: on the CPU a Python float (reading it costs nothing, and the
    step's scalar arithmetic stays in double precision, as it always was); on CUDA the tensor itself, since
    reading it would make the host wait for the device every step."""
    return value if value.is_cuda else float(value)


# ------------------------------------------------------------------------------------ step sizes
@dataclass(frozen=True)
class HeadStep:
    """The resolved head step of one run. `lr` is η, or tau in nats when `trust_region`."""

    lr: float
    trust_region: bool
    radius_quantile: float
    knobs: LMOKnobs
    schedule: Schedule
    hidden_lr: float | None = None  # the recipe's own lr for its hidden matrices (`adamw`); None: the run's
    spreads_rows: bool = False  # the equidistance step: `knobs.equi_alignment` is one of its tuned knobs

    def describe(self) -> str:
        """The tuned knobs as runs record them and `lmgeo tune` names its choices: `tau=<nats>` or
        `head_lr=<η>`, then `hidden_lr=<lr>` and `equi_alignment=<c>` where the recipe has them."""
        parts = [f"{'tau' if self.trust_region else 'head_lr'}={self.lr:g}"]
        if self.hidden_lr is not None:
            parts.append(f"hidden_lr={self.hidden_lr:g}")
        if self.spreads_rows:
            parts.append(f"equi_alignment={self.knobs.equi_alignment:g}")
        return " ".join(parts)


def resolve_head_step(recipe: str, cfg: TrainConfig) -> HeadStep:
    """Recipe override (`train.recipe_overrides`) over the recipe's default over the run's lrs, knob by
    knob (the head step as one knob: `head_lr` or `tau`)."""
    override = cfg.recipe_overrides.get(recipe, RecipeConfig())  # type: ignore[call-overload]
    if override.tau is not None and override.head_lr is not None:
        raise ValueError(f"recipe_overrides.{recipe}: set head_lr or tau, not both")
    spec = RECIPES[recipe]
    default = spec.default_step
    chosen = override if (override.tau, override.head_lr) != (None, None) else default
    if chosen.tau is not None and not spec.trust_region:
        raise ValueError(f"{recipe}: tau applies only to recipes with a trust region")
    if override.hidden_lr is not None and spec.hidden != "adamw":
        raise ValueError(f"{recipe}: hidden_lr applies only to a recipe with AdamW hidden matrices (adamw)")
    if chosen.tau is not None:
        lr = chosen.tau
    else:
        lr = chosen.head_lr if chosen.head_lr is not None else cfg.adamw_lr
    alignment = override.equi_alignment if override.equi_alignment is not None else default.equi_alignment
    return HeadStep(
        lr=lr,
        trust_region=chosen.tau is not None,
        radius_quantile=override.radius_quantile,
        knobs=LMOKnobs(equi_iters=override.equi_iters, equi_alignment=1.0 if alignment is None else alignment),
        schedule=override.schedule or cfg.schedule,
        hidden_lr=override.hidden_lr if override.hidden_lr is not None else default.hidden_lr,
        spreads_rows=default.equi_alignment is not None,
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
            "every trainable parameter must be in exactly one group (is the head untied?):\n  " + "\n  ".join(offenders)
        )
    return groups


def muon_transposed_scale(shape: Sequence[int]) -> float:
    """For a matrix stored (in, out): the factor that turns torch.optim.Muon's step scale for that shape,
    √max(1, A/B), into the scale of the same matrix stored (out, in), √max(1, B/A)."""
    rows, cols = shape
    return math.sqrt(max(1.0, cols / rows)) / math.sqrt(max(1.0, rows / cols))


# ------------------------------------------------------------------------------------ head LMOs
class HeadLMO(torch.optim.Optimizer):
    """Muon's momentum followed by a linear minimisation oracle: `W ← (1 − ηλ) W − η·direction(M)`.

    With `trust_region`, a group's `lr` is tau (nats) and η = tau / (r·(1 + 2λ·max_i ‖w_i − w̄‖)), r set by
    `set_radius` before each step, so that the decay and the LMO step together stay within tau (module
    docstring). The direction gets the head's optimizer state (`self.state[p]`) to keep what it carries
    between steps (the equidistance solver's warm start).
    """

    def __init__(
        self,
        params: Any,
        direction: Direction,
        lr: float,
        knobs: LMOKnobs,
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
        self.knobs = knobs
        self.trust_region = trust_region
        self.radius: Scalar | None = None
        self.last_eta: Scalar | None = None

    def set_radius(self, radius: Scalar) -> None:
        """r_t for the next step. A float is checked here; a device tensor is not (that would wait for the
        device): a radius that is not positive and finite makes the step, and so the next loss, non-finite."""
        if not isinstance(radius, Tensor) and not (math.isfinite(radius) and radius > 0):
            raise ValueError(f"the hidden-state radius must be positive and finite, got {radius}")
        self.radius = radius

    def eta(self, lr: float, weight: Tensor, weight_decay: float) -> Scalar:
        if not self.trust_region:
            return lr
        if self.radius is None:
            raise ValueError("a tau step needs the batch's hidden-state radius: call set_radius first")
        spread = 2.0 * host_scalar(center_rows(weight.float()).norm(dim=1).max()) if weight_decay else 0.0
        return lr / (self.radius * (1.0 + weight_decay * spread))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                momentum = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                direction = self.direction(momentum.float(), self.knobs, state)
                eta = self.eta(group["lr"], p, group["weight_decay"])
                p.mul_(1 - eta * group["weight_decay"])
                if isinstance(eta, Tensor):
                    p.addcmul_(direction.to(p.dtype), eta, value=-1.0)
                else:
                    p.add_(direction.to(p.dtype), alpha=-eta)
                self.last_eta = eta
        self.radius = None  # a radius belongs to one batch
        return loss


class RecipeOptimizer:
    """The 1–3 torch optimizers of a recipe and their schedulers, stepped together; with a head budget
    (a matched-budget run, `train.matched_budget`), the head's realised step is then rescaled to it."""

    def __init__(
        self,
        recipe: str,
        optimizers: dict[str, torch.optim.Optimizer],
        schedulers: dict[str, LambdaLR],
        head_step: HeadStep,
        head: nn.Parameter,
        budget: Callable[[int], float] | None = None,
    ) -> None:
        self.recipe = recipe
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.head_step = head_step
        self.head = head
        self.budget = budget  # optimizer step (0-based) -> nats; None: the recipe's own step
        head_opt = optimizers.get("head")
        self._head_lmo = head_opt if isinstance(head_opt, HeadLMO) else None
        self._last_lrs: dict[str, Scalar] | None = None
        self.steps_taken = 0
        self.last_head_scale: float | None = None  # the budget's factor at the last step (None: no budget)

    @property
    def radius_quantile(self) -> float:
        """Which quantile of ‖h‖ over the batch the trainer should pass as `radius` (the budget, when
        set, always uses the maximum)."""
        return 1.0 if self.budget is not None else self.head_step.radius_quantile

    @property
    def needs_radius(self) -> bool:
        return self.head_step.trust_region or self.budget is not None

    def step(self, radius: Scalar | None = None) -> None:
        """One step of every group. `radius` (r_t) is required by tau recipes and by a head budget, and
        ignored otherwise."""
        if self.needs_radius and radius is None:
            raise ValueError(f"{self.recipe} with tau or a head budget needs the batch's hidden-state radius")
        if self.head_step.trust_region:
            assert self._head_lmo is not None and radius is not None
            self._head_lmo.set_radius(radius)
        before = self.head.detach().clone() if self.budget is not None else None
        for optimizer in self.optimizers.values():
            optimizer.step()
        if before is not None:
            assert self.budget is not None and radius is not None
            # float(): the match reads the step's diameter on the host anyway (a synchronisation on CUDA)
            self.last_head_scale = match_step(self.head, before, self.budget(self.steps_taken) / float(radius))
        self._last_lrs = self._current_lrs()
        for scheduler in self.schedulers.values():
            scheduler.step()
        self.steps_taken += 1

    def zero_grad(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def lrs(self) -> dict[str, Scalar]:
        """Step size per group at the last step taken (before any step: the first step's), keyed
        `hidden`, `embed`, `scalar`, `head`; a tau recipe's `head` is η_t, and `head_tau` is tau_t.
        Hidden matrices stored transposed report the run's hidden lr, before their shape correction.
        On CUDA a tau recipe's η_t is a device tensor (`host_scalar`)."""
        return dict(self._last_lrs) if self._last_lrs is not None else self._current_lrs()

    def head_lr(self) -> Scalar:
        return self.lrs()["head"]

    def _current_lrs(self) -> dict[str, Scalar]:
        groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        lrs: dict[str, Scalar] = {g["name"]: float(g["lr"]) / g.get("lr_scale", 1.0) for g in groups}
        if self.head_step.trust_region:
            assert self._head_lmo is not None
            lrs["head_tau"] = lrs.pop("head")
            lrs["head"] = self._head_lmo.last_eta if self._head_lmo.last_eta is not None else math.nan
        return lrs


@torch.no_grad()
def match_step(weight: nn.Parameter, before: Tensor, budget_diam: float) -> float:
    """Rescale the step `weight − before`, up or down, to diam = `budget_diam`, so that only its direction
    is the recipe's; returns the factor applied (a zero step stays zero). An upper bound of the diameter,
    tight to ~1e-4 relative, is used: the rescaled step is within the budget and at least (1 − 1e-4) of it."""
    delta = weight.detach() - before
    size = diam_upper(delta)
    if size <= 0:
        return 1.0
    scale = budget_diam / size
    weight.copy_(before).add_(delta, alpha=scale)
    return scale


def build_optimizers(
    model: nn.Module,
    head: nn.Parameter,
    recipe: str,
    cfg: TrainConfig,
    head_budget_tau: float | None = None,
) -> RecipeOptimizer:
    """The recipe's optimizers over `model`, whose untied head weight `(vocab, width)` is `head`; the
    parameter groups come from the model's family; `head_budget_tau` (a matched-budget run) rescales the
    head's realised steps to that many nats."""
    spec = RECIPES[recipe]
    family = family_of(model)  # type: ignore[arg-type]  # a PreTrainedModel, annotated as its nn.Module base
    groups = partition_parameters(model, head, family.param_groups)
    head_step = resolve_head_step(recipe, cfg)
    wd = cfg.weight_decay

    def group(name: str, lr: float, weight_decay: float) -> dict[str, Any]:
        return {"name": name, "params": groups[name], "lr": lr, "weight_decay": weight_decay}

    adamw_groups = [group("embed", cfg.adamw_lr, 0.0), group("scalar", cfg.adamw_lr, 0.0)]
    muon_groups = _hidden_muon_groups(groups["hidden"], cfg.hidden_lr, wd, family.hidden_stored_transposed)
    head_group = group("head", head_step.lr, wd)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if spec.hidden == "adamw":
        hidden_lr = head_step.hidden_lr if head_step.hidden_lr is not None else cfg.adamw_lr
        adamw_groups.insert(0, group("hidden", hidden_lr, wd))
    if spec.head == "adamw":
        adamw_groups.append(head_group)
    elif spec.head == "muon":
        muon_groups.append(head_group)
    else:
        assert spec.direction is not None, f"{recipe}: an `lmo` head needs a direction"
        optimizers["head"] = HeadLMO(
            [head_group],
            spec.direction,
            lr=head_step.lr,
            knobs=head_step.knobs,
            weight_decay=wd,
            trust_region=head_step.trust_region,
        )
    if spec.hidden == "muon":
        optimizers["muon"] = Muon(
            _non_empty(muon_groups), lr=cfg.hidden_lr, weight_decay=wd, momentum=MOMENTUM, nesterov=True
        )
    # torch's fused kernel on CUDA (one launch for every tensor); on the CPU its single-tensor loop, as always
    optimizers["adamw"] = torch.optim.AdamW(
        _non_empty(adamw_groups), lr=cfg.adamw_lr, betas=ADAMW_BETAS, fused=True if head.is_cuda else None
    )
    schedulers = {name: _scheduler(opt, cfg, head_step) for name, opt in optimizers.items()}
    budget = None
    if head_budget_tau is not None:
        budget = partial(_budget, tau=head_budget_tau, total_steps=cfg.steps, schedule=head_step.schedule)
    return RecipeOptimizer(recipe, optimizers, schedulers, head_step, head, budget)


def head_only_optimizer(recipe: str, head: nn.Parameter, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer that steps the head inside `recipe`, on the head alone (the bench times head steps at
    GPT-2 scale without a model): AdamW, Muon or the recipe's `HeadLMO`, with its resolved step (a tau is
    taken as η: no radius is needed, and the cost is the same)."""
    spec = RECIPES[recipe]
    step = resolve_head_step(recipe, cfg)
    if spec.head == "adamw":
        return torch.optim.AdamW([head], lr=step.lr, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay)
    if spec.head == "muon":
        return Muon([head], lr=step.lr, weight_decay=cfg.weight_decay, momentum=MOMENTUM, nesterov=True)
    assert spec.direction is not None, f"{recipe}: an `lmo` head needs a direction"
    return HeadLMO([head], spec.direction, lr=step.lr, knobs=step.knobs, weight_decay=cfg.weight_decay)


def _hidden_muon_groups(
    params: list[nn.Parameter], lr: float, weight_decay: float, transposed: bool
) -> list[dict[str, Any]]:
    """One `hidden` group, or for matrices stored (in, out) one per shape correction (`lr_scale`)."""
    if not transposed:
        return [{"name": "hidden", "params": params, "lr": lr, "weight_decay": weight_decay}]
    by_scale: dict[float, list[nn.Parameter]] = {}
    for p in params:
        by_scale.setdefault(muon_transposed_scale(p.shape), []).append(p)
    return [
        {"name": "hidden", "params": ps, "lr": lr * scale, "lr_scale": scale, "weight_decay": weight_decay}
        for scale, ps in by_scale.items()
    ]


def _budget(step: int, tau: float, total_steps: int, schedule: Schedule) -> float:
    """The head budget in nats at optimizer step `step`: tau on the head's schedule, like a tau recipe."""
    return tau * schedule_factor(step, total_steps, schedule)


def _non_empty(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [g for g in groups if g["params"]]


def _scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, head_step: HeadStep) -> LambdaLR:
    """The run's schedule on every group; the head follows its recipe's schedule when one is set."""
    schedules = [head_step.schedule if g["name"] == "head" else cfg.schedule for g in optimizer.param_groups]
    factors: list[Callable[[int], float]] = [
        partial(schedule_factor, total_steps=cfg.steps, schedule=s) for s in schedules
    ]
    return LambdaLR(optimizer, factors)
