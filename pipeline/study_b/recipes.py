"""The seven head-optimizer recipes of Study B (SPEC §3.2).

Every recipe but `adamw` trains the hidden 2-D matrices with `torch.optim.Muon` and embeddings, norms,
biases (and SSM parameters) with AdamW, so that only the head differs between recipes:

| recipe         | head step                                                               |
|----------------|-------------------------------------------------------------------------|
| `adamw`        | AdamW (as everything else)                                              |
| `muon`         | AdamW                                                                   |
| `muon_head`    | `torch.optim.Muon` (its own param group)                                |
| `sign`         | `−η·sign(M)/d`                                                          |
| `rownorm`      | `−η·m_i/‖m_i‖`                                                          |
| `hilbert`      | `−(η/2)·centre(rownorm(centre(M)))`: `diam(ΔW) ≤ η`                     |
| `hilbert_equi` | `equi_iters` × (centre, Newton–Schulz, rownorm), centre, `η/2`           |

`M` is the head's momentum, an EMA with β = 0.95 read with Nesterov exactly as torch.optim.Muon does
(`buf ← lerp(buf, g, 1−β)`, `M = lerp(g, buf, β)`). For the two Hilbert recipes the step may be given in
nats (`tau`): η_t = tau_t / r_t with r_t the radius of the batch's final hidden states, which the trainer
passes to `RecipeOptimizer.step`.

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

# torch's own Newton–Schulz kernel (the one torch.optim.Muon runs), reused for `hilbert_equi` so the
# spectral step is the same code in every recipe. Private in torch, hence pinned in constraints.txt.
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _zeropower_via_newtonschulz,
)

from pipeline.core.config import RecipeConfig, Schedule, TrainConfig
from pipeline.study_b.hilbert import center_rows, equi_ratio

MOMENTUM = 0.95
ADAMW_BETAS = (0.9, 0.95)
HILBERT_RECIPES = ("hilbert", "hilbert_equi")


# ------------------------------------------------------------------------------------ step sizes
@dataclass(frozen=True)
class HeadStepDefault:
    """A recipe's default head step size: `head_lr` (η; None = the run's `adamw_lr`) or `tau` (nats)."""

    head_lr: float | None = None
    tau: float | None = None


# Chosen by the tuning sweep documented in docs/tuning.md (`lmgeo tune`: neox, d_model 64, 150 steps,
# 2 seeds; every head, the AdamW heads of `adamw` and `muon` included, tuned on a ×2 grid with the hidden
# and AdamW lrs fixed). Rerun the sweep before relying on them for other archs or sizes. The Hilbert
# recipes won in nats per step (`tau`); their best η (0.1) was within seed noise of it.
DEFAULT_HEAD_STEP: dict[str, HeadStepDefault] = {
    "adamw": HeadStepDefault(head_lr=0.096),
    "muon": HeadStepDefault(head_lr=0.024),
    "muon_head": HeadStepDefault(head_lr=0.06),
    "sign": HeadStepDefault(head_lr=0.4),
    "rownorm": HeadStepDefault(head_lr=0.03),
    "hilbert": HeadStepDefault(tau=0.8),
    "hilbert_equi": HeadStepDefault(tau=0.8),
}


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
    chosen = override if (override.tau, override.head_lr) != (None, None) else DEFAULT_HEAD_STEP[recipe]
    if chosen.tau is not None and recipe not in HILBERT_RECIPES:
        raise ValueError(f"{recipe}: tau applies to {HILBERT_RECIPES} only")
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
@dataclass(frozen=True)
class GroupRule:
    """Parameters whose qualified name matches `pattern` (re.search) belong to `group`."""

    group: str
    pattern: str


# By name, torchtitan style, for GPT-2, GPT-NeoX and Mamba. The head is assigned by identity.
DEFAULT_GROUP_RULES: tuple[GroupRule, ...] = (
    GroupRule("embed", r"(?:^|\.)(?:wte|wpe|embed_in|embeddings)\.weight$"),
    GroupRule(
        "hidden",
        r"\.\d+\.(?:attn|attention|mlp|mixer)\.(?:c_attn|c_proj|c_fc|query_key_value|dense\w*|\w+_proj)\.weight$",
    ),
    GroupRule("scalar", r"(?:\.bias|\.A_log|\.D|(?:^|[._])(?:ln_\w+|\w*norm\w*)\.weight|\.conv1d\.weight)$"),
)


class ParamGroupError(ValueError):
    """The group rules do not partition the model's trainable parameters."""


def partition_parameters(
    model: nn.Module, head: nn.Parameter, rules: Sequence[GroupRule] = DEFAULT_GROUP_RULES
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
Direction = Callable[[Tensor], Tensor]  # momentum -> unit step; the optimizer applies −η times it


def _unit_rows(m: Tensor) -> Tensor:
    """Rows scaled to norm 1; zero rows stay zero (still feasible: inside every ball)."""
    return m / m.norm(dim=1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)


def sign_direction(m: Tensor) -> Tensor:
    """Scion "Sign" (ℓ₁→ℓ∞): entries ±1/d, d the head's input width."""
    return torch.sign(m) / m.shape[1]


def rownorm_direction(m: Tensor) -> Tensor:
    """Scion "RowNorm" (ℓ₂→ℓ∞): unit rows, not centred."""
    return _unit_rows(m)


def hilbert_direction(m: Tensor) -> Tensor:
    """The diameter LMO of SPEC §3.1: centred rows on the sphere of radius 1/2, so diam ≤ 1. The final
    re-centring removes only the common shift that row-normalisation reintroduced; diam is
    shift-invariant, so the bound still holds exactly (up to float32 rounding, ~1e-7 relative)."""
    return 0.5 * center_rows(_unit_rows(center_rows(m)))


def equidistant_direction(m: Tensor, iters: int) -> Tensor:
    """The seed's equidistant spreading: alternate orthogonalisation of the centred matrix (rows become a
    tight frame) with row-normalisation (equal norms); equal-norm tight frames are the configurations
    that approach the Welch bound on the min/max distance ratio. Ends on unit rows, then as
    `hilbert_direction`: centre and halve, so diam ≤ 1."""
    x = m
    for _ in range(iters):
        x = _unit_rows(_orthogonalise(center_rows(x)))
    return 0.5 * center_rows(x)


def _orthogonalise(m: Tensor) -> Tensor:
    ortho = _zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS)
    return ortho.to(m.dtype)


class HeadLMO(torch.optim.Optimizer):
    """Muon's momentum followed by a linear minimisation oracle: `W ← (1 − ηλ) W − η·direction(M)`.

    With `trust_region`, a group's `lr` is tau (nats) and η = tau / r, r set by `set_radius` before each
    step. `record_equi_rows` > 0 records `equi_ratio` of each step's direction (on that many rows).
    """

    def __init__(
        self,
        params: Any,
        direction: Direction,
        lr: float,
        momentum: float = MOMENTUM,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        trust_region: bool = False,
        record_equi_rows: int = 0,
    ) -> None:
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"HeadLMO takes (vocab, width) matrices, got shape {tuple(p.shape)}")
        self.direction = direction
        self.trust_region = trust_region
        self.record_equi_rows = record_equi_rows
        self.radius: float | None = None
        self.last_eta: float | None = None
        self._last_direction: torch.Tensor | None = None

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

    @property
    def last_equi_ratio(self) -> float | None:
        """`equi_ratio` of the last step's direction, computed when asked (a 1024-row pairwise
        distance matrix per step would cost as much as the step itself)."""
        if self._last_direction is None:
            return None
        return equi_ratio(self._last_direction, self.record_equi_rows)

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
                if self.record_equi_rows:
                    self._last_direction = direction
            self.last_eta = eta
        self.radius = None  # a radius belongs to one batch
        return loss


def head_direction(recipe: str, equi_iters: int) -> Direction:
    directions: dict[str, Direction] = {
        "sign": sign_direction,
        "rownorm": rownorm_direction,
        "hilbert": hilbert_direction,
        "hilbert_equi": partial(equidistant_direction, iters=equi_iters),
    }
    return directions[recipe]


# ------------------------------------------------------------------------------- the optimizer
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

    @property
    def head_equi_ratio(self) -> float | None:
        """`equi_ratio` of `hilbert_equi`'s last head direction; None for the other recipes."""
        return self._head_lmo.last_equi_ratio if self._head_lmo is not None else None

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

    def state_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()},
            "schedulers": {name: sch.state_dict() for name, sch in self.schedulers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["recipe"] != self.recipe or state["optimizers"].keys() != self.optimizers.keys():
            raise ValueError(f"optimizer state of recipe {state['recipe']!r} cannot resume {self.recipe!r}")
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state["optimizers"][name])
        for name, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state["schedulers"][name])


def build_optimizers(
    model: nn.Module,
    head: nn.Parameter,
    recipe: str,
    cfg: TrainConfig,
    rules: Sequence[GroupRule] = DEFAULT_GROUP_RULES,
) -> RecipeOptimizer:
    """The recipe's optimizers over `model`, whose untied head weight `(vocab, width)` is `head`."""
    if recipe not in DEFAULT_HEAD_STEP:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {sorted(DEFAULT_HEAD_STEP)}")
    groups = partition_parameters(model, head, rules)
    head_step = resolve_head_step(recipe, cfg)
    wd = cfg.weight_decay

    def group(name: str, lr: float, weight_decay: float) -> dict[str, Any]:
        return {"name": name, "params": groups[name], "lr": lr, "weight_decay": weight_decay}

    adamw_groups = [group("embed", cfg.adamw_lr, 0.0), group("scalar", cfg.adamw_lr, 0.0)]
    muon_groups = [group("hidden", cfg.hidden_lr, wd)]
    head_group = group("head", head_step.lr, wd)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if recipe == "adamw":
        adamw_groups = [group("hidden", cfg.adamw_lr, wd), *adamw_groups, head_group]
    elif recipe == "muon":
        adamw_groups.append(head_group)
    elif recipe == "muon_head":
        muon_groups.append(head_group)
    else:
        optimizers["head"] = HeadLMO(
            [head_group],
            head_direction(recipe, head_step.equi_iters),
            lr=head_step.lr,
            weight_decay=wd,
            trust_region=head_step.trust_region,
            record_equi_rows=cfg.equi_sample_rows if recipe == "hilbert_equi" else 0,
        )
    if recipe != "adamw":
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
