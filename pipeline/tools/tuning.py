"""The head step-size tuning sweep behind each recipe's `default_step` (SPEC §3.2: "defaults chosen by a
documented tuning protocol").

Protocol: for one recipe on one arch, train one run per (head step size, seed) with everything else of
the base `TrainConfig` fixed — hidden (Muon) and AdamW learning rates, schedule, model, batch — so only
the head's step differs, and pick the step with the lowest mean final validation loss. A diverged run
(or a non-finite final loss) counts as +inf, so a step that diverges on any seed never wins.

Every recipe gets the same budget: a log-spaced grid around its current default. That includes the
AdamW head of `adamw` and `muon` (tuned through `recipe_overrides.<recipe>.head_lr`, which sets the
head's own AdamW group and nothing else): tuning only the new heads would bias the comparison against
the baselines. The Hilbert recipes get a second family in nats (`tau`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

import numpy as np
import pyarrow as pa

from pipeline.core.contracts import RunSpec
from pipeline.study_b.config import RecipeConfig, TrainConfig
from pipeline.study_b.recipes import RECIPES
from pipeline.study_b.train import train_run

KNOBS = ("head_lr", "tau")  # also the tie-break order between families
GRID_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
EDGE_FACTOR = 2.0  # one more grid step beyond an edge that won

TRIAL_SCHEMA = pa.schema(
    [
        ("recipe", pa.string()),
        ("arch", pa.string()),
        ("knob", pa.string()),
        ("value", pa.float64()),
        ("seed", pa.int64()),
        ("final_val_loss", pa.float64()),
        ("diverged", pa.bool_()),
        ("steps_done", pa.int64()),
        ("wall_time_s", pa.float64()),
    ]
)


@dataclass(frozen=True)
class Trial:
    """One training run of the sweep: `recipe` on `arch` with the head step `knob` = `value`."""

    recipe: str
    arch: str
    knob: str
    value: float
    seed: int

    def __post_init__(self) -> None:
        if self.knob not in KNOBS:
            raise ValueError(f"knob must be one of {KNOBS}, got {self.knob!r}")
        if self.knob == "tau" and not RECIPES[self.recipe].trust_region:
            raise ValueError(f"{self.recipe}: tau applies only to recipes with a trust region")

    @property
    def key(self) -> str:
        return f"{self.arch}-{self.recipe}-{self.knob}={self.value:g}-s{self.seed}"


@dataclass(frozen=True)
class Choice:
    """The winning head step of one recipe."""

    knob: str
    value: float
    mean_val_loss: float


def round_sig(x: float, digits: int = 3) -> float:
    """Grid values with few significant digits: readable in the docs and stable as table keys."""
    return float(f"{x:.{digits}g}")


def default_step(recipe: str, cfg: TrainConfig) -> tuple[str, float]:
    """The recipe's head step when no override is given, as (knob, value): its `default_step`, or the
    run's `adamw_lr` where the default follows it."""
    default = RECIPES[recipe].default_step
    if default.tau is not None:
        return "tau", default.tau
    return "head_lr", default.head_lr if default.head_lr is not None else cfg.adamw_lr


def default_grid(recipe: str, cfg: TrainConfig, factors: Sequence[float] = GRID_FACTORS) -> dict[str, list[float]]:
    """Log-spaced grids around the recipe's default step (`default_step`), one per family.

    For the Hilbert recipes η and tau are converted with ‖h‖ ≈ √d, the norm of a hidden state after the
    final norm: a step of diameter η moves a token by at most ‖h‖·η nats, so the `tau` family is centred
    on η·√d (and the `head_lr` family on tau/√d when the default is a tau).
    """
    knob, value = default_step(recipe, cfg)
    sqrt_d = math.sqrt(cfg.model.d_model)
    eta = value / sqrt_d if knob == "tau" else value
    centres = {"head_lr": eta}
    if RECIPES[recipe].trust_region:
        centres["tau"] = value if knob == "tau" else eta * sqrt_d
    return {knob: [round_sig(c * f) for f in factors] for knob, c in centres.items()}


def trials_for(recipe: str, arch: str, grid: dict[str, Sequence[float]], seeds: Sequence[int]) -> list[Trial]:
    return [
        Trial(recipe, arch, knob, value, seed) for knob, values in grid.items() for value in values for seed in seeds
    ]


def trial_config(base: TrainConfig, trial: Trial) -> TrainConfig:
    """`base` with only the trial recipe's head step replaced (its other overrides, e.g. `equi_iters`
    or a head schedule, are kept)."""
    current = base.recipe_overrides.get(trial.recipe, RecipeConfig())  # type: ignore[call-overload]
    override = current.model_copy(update={"head_lr": None, "tau": None, trial.knob: trial.value})
    return base.model_copy(update={"recipe_overrides": {**base.recipe_overrides, trial.recipe: override}})


def run_trial(
    trial: Trial,
    base: TrainConfig,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    vocab_size: int,
    seq_len: int,
) -> dict:
    """Train one trial (no checkpoints) and return its row of `TRIAL_SCHEMA`."""
    result, _ = train_run(
        RunSpec(trial.arch, trial.recipe, trial.seed), trial_config(base, trial), train_tokens, val_tokens,
        vocab_size, seq_len, params_hash="tuning", save_checkpoint=_no_checkpoint,
    )
    loss = result.final_val_loss
    finite = loss is not None and math.isfinite(loss)
    return {
        "recipe": trial.recipe, "arch": trial.arch, "knob": trial.knob, "value": trial.value, "seed": trial.seed,
        "final_val_loss": loss if finite else None, "diverged": result.diverged or not finite,
        "steps_done": result.steps_done, "wall_time_s": result.wall_time_s,
    }


def _no_checkpoint(*_: object) -> None:
    """Tuning runs keep only their final loss."""


def results_table(rows: Sequence[dict]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=TRIAL_SCHEMA)


@dataclass(frozen=True)
class StepScore:
    """Mean final val loss of one (knob, value) over its seeds; +inf if any seed diverged."""

    knob: str
    value: float
    mean_val_loss: float
    seeds: int
    diverged: int


def step_scores(table: pa.Table) -> list[StepScore]:
    """One score per (knob, value) of a one-recipe table, best first; ties go to the `KNOBS` order,
    then to the smaller step (the more conservative choice)."""
    recipes = set(table.column("recipe").to_pylist())
    if len(recipes) != 1:
        raise ValueError(f"expected the trials of one recipe, got {sorted(recipes) or 'none'}")
    losses: dict[tuple[str, float], list[float]] = {}
    for row in table.select(["knob", "value", "final_val_loss", "diverged"]).to_pylist():
        loss = row["final_val_loss"]
        ok = not row["diverged"] and loss is not None and math.isfinite(loss)
        losses.setdefault((row["knob"], row["value"]), []).append(loss if ok else math.inf)
    scores = [
        StepScore(knob, value, fmean(ls), len(ls), sum(math.isinf(x) for x in ls))
        for (knob, value), ls in losses.items()
    ]
    return sorted(scores, key=lambda s: (s.mean_val_loss, KNOBS.index(s.knob), s.value))


def best_step(table: pa.Table) -> Choice:
    """The head step with the lowest mean final val loss in a one-recipe table (see `step_scores`).
    Raises when every step diverged: there is no default to choose."""
    best = step_scores(table)[0]
    if math.isinf(best.mean_val_loss):
        raise ValueError(f"{table.column('recipe')[0]}: every head step diverged; widen the grid downwards")
    return Choice(best.knob, best.value, best.mean_val_loss)


def edge_extensions(table: pa.Table, factor: float = EDGE_FACTOR) -> dict[str, list[float]]:
    """For each family whose best value is the largest (smallest) tried, the next value beyond it, so the
    optimum is bracketed rather than clipped by the grid. Empty when every family is bracketed."""
    scores = step_scores(table)
    extensions: dict[str, list[float]] = {}
    for knob in dict.fromkeys(s.knob for s in scores):
        family = [s for s in scores if s.knob == knob]  # best first
        values = [s.value for s in family]
        if family[0].value == max(values) and not math.isinf(family[0].mean_val_loss):
            extensions[knob] = [round_sig(max(values) * factor)]
        elif family[0].value == min(values):  # also when all diverged: go smaller
            extensions[knob] = [round_sig(min(values) / factor)]
    return extensions
