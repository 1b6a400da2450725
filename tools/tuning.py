"""The head step-size tuning sweep behind each recipe's `default_step` (SPEC §3.2: equal tuning budgets at the
evaluation horizon, selected on val, never on test).

Protocol, the same for every recipe, the baselines' AdamW heads included (tuning only the new heads would
bias the comparison against the baselines):

- one knob per recipe: `tau` (nats per step) for recipes with a Hilbert trust region, `head_lr` (η) for
  the others; everything else of the study's `TrainConfig` stays fixed (hidden and AdamW learning rates,
  schedule, model, batch, steps), so only the head's step differs;
- round 1: the knob × `GRID_FACTORS` around the recipe's default at sweep time;
- round 2: `REFINEMENTS` more values: ×2^(±1/2) around the round-1 best when it is inside the grid, or
  ×2 and ×4 beyond it when it sits on an edge (so the optimum is bracketed rather than clipped);
- every value is trained with the same tuning seeds, which are not the study's (the study's seeds are its
  evaluation); the value with the lowest mean final **val** loss wins, a divergence counting as +inf;
- transfer: on every other architecture of the study, the chosen value and its ×½ and ×2 neighbours are
  trained with the same seeds, and the sweep reports whether the choice is also the best there.

So every recipe gets exactly `len(GRID_FACTORS) + REFINEMENTS` values × seeds runs.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.contracts import RunSpec
from pipeline.core.progress import StepClock
from pipeline.params import Params
from pipeline.study_b.config import RecipeConfig, TrainConfig
from pipeline.study_b.recipes import RECIPES
from pipeline.study_b.train import train_run

KNOBS = ("head_lr", "tau")
GRID_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
REFINEMENTS = 2
TRANSFER_FACTORS = (0.5, 1.0, 2.0)
TUNING_SEEDS = (1000, 1001)  # not the study's seeds: those evaluate
GRID_TEXT = (
    "×{1/4, 1/2, 1, 2, 4} around the default at sweep time, then 2 more: ×2^(±1/2) around the best, "
    "or ×2 and ×4 beyond it when it is on an edge"
)  # GRID_FACTORS and `refinement` in words, for docs/tuning.md

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
    """The winning head step of one recipe on one arch."""

    knob: str
    value: float
    mean_val_loss: float

    def describe(self) -> str:
        return f"{self.knob}={self.value:g}"


def round_sig(x: float, digits: int = 3) -> float:
    """Grid values with few significant digits: readable in the docs and stable as table keys."""
    return float(f"{x:.{digits}g}")


def knob_of(recipe: str) -> str:
    """The one knob a recipe is tuned in: nats per step where it has a trust region, η otherwise."""
    return "tau" if RECIPES[recipe].trust_region else "head_lr"


def default_value(recipe: str, cfg: TrainConfig) -> float:
    """The recipe's default step in its knob: its `default_step`, the run's `adamw_lr` where the default
    follows it, and for a trust-region recipe whose default is an η, that η in nats with ‖h‖ ≈ √d (the norm
    of a hidden state after the final norm: a step of diameter η moves a token by at most ‖h‖·η nats)."""
    default = RECIPES[recipe].default_step
    eta = default.head_lr if default.head_lr is not None else cfg.adamw_lr
    if knob_of(recipe) == "head_lr":
        return eta
    return default.tau if default.tau is not None else eta * math.sqrt(cfg.model.d_model)


def first_round(recipe: str, cfg: TrainConfig) -> list[float]:
    centre = default_value(recipe, cfg)
    return [round_sig(centre * f) for f in GRID_FACTORS]


def refinement(table: pa.Table) -> list[float]:
    """The `REFINEMENTS` round-2 values of a one-recipe table of round-1 trials (module docstring)."""
    scores = step_scores(table)
    values = sorted(s.value for s in scores)
    best = scores[0].value
    if math.isinf(scores[0].mean_val_loss) or best == min(values):  # all diverged: go smaller
        return [round_sig(min(values) / 2), round_sig(min(values) / 4)]
    if best == max(values):
        return [round_sig(best * 2), round_sig(best * 4)]
    return [round_sig(best / math.sqrt(2)), round_sig(best * math.sqrt(2))]


def transfer_values(choice: Choice) -> list[float]:
    return [round_sig(choice.value * f) for f in TRANSFER_FACTORS]


def trials_for(recipe: str, arch: str, values: Sequence[float], seeds: Sequence[int]) -> list[Trial]:
    return [Trial(recipe, arch, knob_of(recipe), value, seed) for value in values for seed in seeds]


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
    """Train one trial (no checkpoints, never the test split) and return its row of `TRIAL_SCHEMA`."""
    clock = StepClock()
    result, _ = train_run(
        RunSpec(trial.arch, trial.recipe, trial.seed), trial_config(base, trial), train_tokens, val_tokens,
        vocab_size, seq_len, params_hash="tuning", save_checkpoint=_no_checkpoint, on_step=lambda *_: clock.tick(),
    )
    loss = result.final_val_loss
    finite = loss is not None and math.isfinite(loss)
    return {
        "recipe": trial.recipe, "arch": trial.arch, "knob": trial.knob, "value": trial.value, "seed": trial.seed,
        "final_val_loss": loss if finite else None, "diverged": result.diverged or not finite,
        "steps_done": result.steps_done, "wall_time_s": clock.wall_time_s,
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
    """One score per (knob, value) of a one-recipe, one-arch table, best first; ties go to the smaller step
    (the more conservative choice)."""
    for column in ("recipe", "arch"):
        found = set(table.column(column).to_pylist())
        if len(found) != 1:
            raise ValueError(f"expected the trials of one {column}, got {sorted(found) or 'none'}")
    losses: dict[tuple[str, float], list[float]] = {}
    for row in table.select(["knob", "value", "final_val_loss", "diverged"]).to_pylist():
        loss = row["final_val_loss"]
        ok = not row["diverged"] and loss is not None and math.isfinite(loss)
        losses.setdefault((row["knob"], row["value"]), []).append(loss if ok else math.inf)
    scores = [
        StepScore(knob, value, fmean(ls), len(ls), sum(math.isinf(x) for x in ls))
        for (knob, value), ls in losses.items()
    ]
    return sorted(scores, key=lambda s: (s.mean_val_loss, s.value))


def best_step(table: pa.Table) -> Choice:
    """The head step with the lowest mean final val loss in a one-recipe table (see `step_scores`).
    Raises when every step diverged: there is no default to choose."""
    best = step_scores(table)[0]
    if math.isinf(best.mean_val_loss):
        raise ValueError(f"{table.column('recipe')[0]}: every head step diverged; widen the grid downwards")
    return Choice(best.knob, best.value, best.mean_val_loss)


def bracketed(table: pa.Table, choice: Choice) -> bool:
    """Whether a value below and a value above the choice were tried (and were worse, as it won)."""
    values = {s.value for s in step_scores(table)}
    return min(values) < choice.value < max(values)


# ------------------------------------------------------------- the sweep's choices and docs/tuning.md
def tuning_config(train: TrainConfig, steps: int) -> TrainConfig:
    """The study's training config at `steps`, evaluating and measuring geometry only at the end: a
    tuning run needs only its final val loss, and neither measurement touches the training trajectory
    (no dropout; evaluation and the probe forward use no random numbers)."""
    return train.model_copy(update={"steps": steps, "eval_interval": steps, "geometry_interval": steps})


def table_of(rows: list[dict], recipe: str, arch: str) -> pa.Table:
    """The trials of `recipe` on `arch` among `rows`, as a table."""
    return results_table([row for row in rows if row["recipe"] == recipe and row["arch"] == arch])


def choose(table: pa.Table) -> Choice | None:
    """`best_step`, or None when every step diverged (reported as such: no default to take)."""
    try:
        return best_step(table)
    except ValueError:
        return None


def transfer_summary(rows: list[dict], choices: dict[str, Choice | None], others: list[str]) -> str | None:
    """Per other arch, the recipes whose choice is also the best of its ×½, ×1, ×2 there."""
    if not others:
        return None
    parts = []
    for arch in others:
        holds = [r for r, c in choices.items() if c is not None and table_of(rows, r, arch).num_rows
                 and best_step(table_of(rows, r, arch)).value == c.value]  # fmt: skip
        tried = [r for r, c in choices.items() if c is not None]
        parts.append(f"{arch}: the choice is also the best of ×½, ×1, ×2 for {len(holds)} of {len(tried)} recipes"
                     + (f" (not for {', '.join(r for r in tried if r not in holds)})"
                        if len(holds) < len(tried) else ""))  # fmt: skip
    return "; ".join(parts)


def protocol(
    params: Params, base: TrainConfig, arch: str, seeds: list[int], defaults: dict[str, float], others: list[str],
    wall_s: float, vocab: int,
) -> dict[str, Any]:
    """What the sweep held fixed and what it varied, for `render` and the report's Study B protocol."""
    from pipeline.models.registry import build_model

    model = build_model(arch, base.model, vocab, params.prepare.seq_len, seed=0)
    return {
        "arch": arch,
        "transfer_archs": others,
        "model": base.model.model_dump(),
        "n_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "seq_len": params.prepare.seq_len,
        "steps": base.steps,
        "batch_size": base.batch_size,
        "tokens_per_run": base.steps * base.batch_size * params.prepare.seq_len,
        "seeds": seeds,
        "hidden_lr": base.hidden_lr,
        "adamw_lr": base.adamw_lr,
        "weight_decay": base.weight_decay,
        "grad_clip": base.grad_clip,
        "schedule": base.schedule.model_dump(),
        "eval_batches": base.eval_batches,
        "grid": GRID_TEXT,
        "values_per_recipe": len(GRID_FACTORS) + REFINEMENTS,
        "defaults_at_sweep": {r: {"knob": knob_of(r), "value": v} for r, v in defaults.items()},
        "wall_time_s": round(wall_s, 1),
        "threads_per_run": params.ray.resources_for("train").threads,
        "machine": f"{platform.machine()}, {platform.system()}, device={base.device}",
    }


def render(protocol: dict, rows: list[dict], choices: dict[str, Choice | None]) -> str:
    """docs/tuning.md: the protocol, the chosen defaults and every trial."""
    p = protocol
    m = p["model"]
    lines = [
        "# Head step-size tuning",
        "",
        "Generated by `lmgeo tune` (`tools/tune.py`, library `tools/tuning.py`); the chosen values are",
        "the `default_step` of each recipe (`pipeline/study_b/recipes/`), and the report's Study B protocol",
        "states this sweep. SPEC §3.2 asks for equal tuning budgets at the evaluation horizon; this is it.",
        "",
        "## Protocol",
        "",
        f"- **Runs**: arch `{p['arch']}`, d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads,"
        f" vocab {p['vocab_size']} ({p['n_params']:,} parameters, untied head); {p['steps']} steps of batch"
        f" {p['batch_size']} × seq_len {p['seq_len']} ({p['tokens_per_run']:,} tokens), the study's horizon;"
        f" seeds {p['seeds']}, not the study's; {p['threads_per_run']} thread(s) per run ({p['machine']})."
        f" Total wall time {p['wall_time_s']:.0f} s.",
        f"- **Fixed for every run**: hidden (Muon) lr {p['hidden_lr']:g}, AdamW lr {p['adamw_lr']:g} (embeddings,"
        f" norms, biases; every parameter for `adamw` except its head), weight decay {p['weight_decay']:g},"
        f" grad clip {p['grad_clip']}, schedule {_schedule(p['schedule'])} on every group, head included."
        " So only the head's step size differs between runs of a recipe, and only the head's optimizer"
        " between recipes.",
        "- **Equal budget**: one knob per recipe — `tau` (nats per step, η_t = tau / max‖h‖ over the batch) for"
        " the recipes with a Hilbert trust region, `head_lr` (η; for `adamw` and `muon` the lr of the head's own"
        f" AdamW group) for the others — and {p['values_per_recipe']} values each: {p['grid']}. The baselines'"
        " heads get the same budget: tuning only the new heads would bias the comparison against them.",
        f"- **Selection**: the value with the lowest final **validation** loss (mean over the seeds,"
        f" {p['eval_batches']} fixed val batches); a run that diverges counts as +inf, so a value that diverges on"
        " any seed never wins; ties go to the smaller step. The test split is never evaluated by tuning.",
        "- **Transfer**: "
        + (f"the choice and its ×½ and ×2 neighbours, same seeds, on {', '.join(p['transfer_archs'])}: {p['transfer']}."
           if p.get("transfer") else "the study trains one architecture, the one tuned here; nothing to transfer."),
        "",
        "## Chosen defaults",
        "",
        "*Bracketed*: a smaller and a larger value were tried (and lost).",
        "",
        "| recipe | knob | value | mean val loss | bracketed | default at sweep time: mean val loss |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    lines += _choice_rows(p, rows, choices)
    lines += _trial_rows(p, rows, choices)
    return "\n".join(lines) + "\n"


def _choice_rows(p: dict, rows: list[dict], choices: dict[str, Choice | None]) -> list[str]:
    scores = _scores(rows, list(choices), p["arch"])
    lines = []
    for recipe, choice in choices.items():
        before = p["defaults_at_sweep"][recipe]
        before_score = scores.get((recipe, before["value"]))
        before_cell = f"`{before['knob']}` {before['value']:g}: {_mean_cell(before_score) if before_score else '–'}"
        if choice is None:
            lines.append(f"| `{recipe}` | — | every step diverged | — | — | {before_cell} |")
        else:
            edge = "yes" if bracketed(table_of(rows, recipe, p["arch"]), choice) else "no"
            lines.append(f"| `{recipe}` | `{choice.knob}` | {choice.value:g} | {choice.mean_val_loss:.4f} | "
                         f"{edge} | {before_cell} |")
    return lines


def _trial_rows(p: dict, rows: list[dict], choices: dict[str, Choice | None]) -> list[str]:
    seeds = p["seeds"]
    lines = [
        "",
        "## All trials",
        "",
        "Final validation loss per seed (*diverged* where the loss became non-finite); ✔ marks the chosen value;"
        " rows of another arch are the transfer check.",
        "",
        f"| arch | recipe | knob | value | {' | '.join(f'val loss s{s}' for s in seeds)} | mean | chosen |",
        "|---|---|---|---|" + "---|" * len(seeds) + "---|---|",
    ]
    for arch in dict.fromkeys(r["arch"] for r in rows):
        scores = _scores(rows, list(choices), arch)
        for (recipe, knob, value), by_seed in _by_step(rows, arch).items():
            choice = choices[recipe]
            mark = "✔" if choice is not None and (choice.knob, choice.value) == (knob, value) else ""
            cells = " | ".join(_loss_cell(by_seed.get(s)) for s in seeds)
            lines.append(f"| {arch} | `{recipe}` | `{knob}` | {value:g} | {cells} | "
                         f"{_mean_cell(scores[(recipe, value)])} | {mark} |")
    return lines


def _by_step(rows: list[dict], arch: str) -> dict[tuple[str, str, float], dict[int, float | None]]:
    grouped: dict[tuple[str, str, float], dict[int, float | None]] = {}
    for row in rows:
        if row["arch"] == arch:
            loss = None if row["diverged"] else row["final_val_loss"]
            grouped.setdefault((row["recipe"], row["knob"], row["value"]), {})[row["seed"]] = loss
    return grouped


def _scores(rows: list[dict], recipes: list[str], arch: str) -> dict[tuple[str, float], StepScore]:
    return {(r, s.value): s for r in recipes if table_of(rows, r, arch).num_rows
            for s in step_scores(table_of(rows, r, arch))}


def _mean_cell(score: StepScore) -> str:
    return "inf (diverged)" if math.isinf(score.mean_val_loss) else f"{score.mean_val_loss:.4f}"


def _loss_cell(loss: float | None) -> str:
    return "*diverged*" if loss is None else f"{loss:.4f}"


def _schedule(s: dict) -> str:
    return f"linear warm-up {s['warmup_steps']} steps, then {s['decay']} decay to {s['final_frac']:g}× the peak"
