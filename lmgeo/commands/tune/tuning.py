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

from lmgeo.core.contracts import RunSpec
from lmgeo.core.progress import StepClock
from lmgeo.params import Params
from lmgeo.study_b.config import RecipeConfig, TrainConfig
from lmgeo.study_b.recipes import RECIPES
from lmgeo.study_b.train import train_run

KNOBS = ("head_lr", "tau", "hidden_lr", "equi_alignment")
GRID_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
# The descent share c ∈ (0, 1] of the equidistance step: a bounded knob, so an evenly spaced grid.
ALIGNMENT_GRID = (0.2, 0.4, 0.6, 0.8, 1.0)
ALIGNMENT_STEP = 0.1
REFINEMENTS = 2
TRANSFER_FACTORS = (0.5, 1.0, 2.0)
TUNING_SEEDS = (1000, 1001)  # not the study's seeds: those evaluate
GRID_TEXT = (
    "×{1/4, 1/2, 1, 2, 4} around the default at sweep time, then 2 more: ×2^(±1/2) around the best, "
    "or ×2 and ×4 beyond it when it is on an edge; the descent share c of `hilbert_equi`, a second knob at its "
    "chosen tau, on {0.2, 0.4, 0.6, 0.8, 1}, then ±0.1 around the best (0.1, 0.05 below 0.2; 0.9, 0.95 at 1)"
)  # GRID_FACTORS, ALIGNMENT_GRID and `refinement` in words, for docs/tuning.md

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
    """One training run of the sweep: `recipe` on `arch` with its knob `knob` = `value` (its other knobs as
    the base config holds them)."""

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
        if self.knob in ("hidden_lr", "equi_alignment") and self.knob not in knobs_of(self.recipe):
            raise ValueError(f"{self.recipe} has no knob {self.knob}; its knobs: {', '.join(knobs_of(self.recipe))}")

    @property
    def key(self) -> str:
        return f"{self.arch}-{self.recipe}-{self.knob}={self.value:g}-s{self.seed}"


@dataclass(frozen=True)
class Choice:
    """The winning value of one knob of one recipe on one arch."""

    knob: str
    value: float
    mean_val_loss: float

    def describe(self) -> str:
        return f"{self.knob}={self.value:g}"


def round_sig(x: float, digits: int = 3) -> float:
    """Grid values with few significant digits: readable in the docs and stable as table keys."""
    return float(f"{x:.{digits}g}")


def knobs_of(recipe: str) -> tuple[str, ...]:
    """What a recipe is tuned in, in order: its step — nats per step where it has a trust region, η
    otherwise; for `adamw`, whose hidden matrices are AdamW's too, their lr (its head's lr is `muon`'s,
    the same AdamW head) — then, for the equidistance step, its descent share."""
    spec = RECIPES[recipe]
    step = "hidden_lr" if spec.hidden == "adamw" else "tau" if spec.trust_region else "head_lr"
    return (step, "equi_alignment") if spec.default_step.equi_alignment is not None else (step,)


def default_value(recipe: str, cfg: TrainConfig, knob: str | None = None) -> float:
    """The recipe's default in `knob` (its first knob when None): its `default_step`, the run's lr where the
    default follows it, and for a trust-region recipe whose default is an η, that η in nats with ‖h‖ ≈ √d
    (the norm of a hidden state after the final norm: a step of diameter η moves a token by at most ‖h‖·η
    nats)."""
    knob = knob or knobs_of(recipe)[0]
    default = RECIPES[recipe].default_step
    if knob == "equi_alignment":
        assert default.equi_alignment is not None, f"{recipe} has no descent share"
        return default.equi_alignment
    if knob == "hidden_lr":
        return default.hidden_lr if default.hidden_lr is not None else cfg.adamw_lr
    eta = default.head_lr if default.head_lr is not None else cfg.adamw_lr
    if knob == "head_lr":
        return eta
    return default.tau if default.tau is not None else eta * math.sqrt(cfg.model.d_model)


def first_round(recipe: str, cfg: TrainConfig, knob: str | None = None) -> list[float]:
    knob = knob or knobs_of(recipe)[0]
    if knob == "equi_alignment":
        return list(ALIGNMENT_GRID)
    centre = default_value(recipe, cfg, knob)
    return [round_sig(centre * f) for f in GRID_FACTORS]


def refinement(table: pa.Table) -> list[float]:
    """The `REFINEMENTS` round-2 values of a one-recipe, one-knob table of round-1 trials (module docstring)."""
    scores = step_scores(table)
    values = sorted(s.value for s in scores)
    best = scores[0].value
    if scores[0].knob == "equi_alignment":
        return _alignment_refinement(best, math.isinf(scores[0].mean_val_loss), values)
    if math.isinf(scores[0].mean_val_loss) or best == min(values):  # all diverged: go smaller
        return [round_sig(min(values) / 2), round_sig(min(values) / 4)]
    if best == max(values):
        return [round_sig(best * 2), round_sig(best * 4)]
    return [round_sig(best / math.sqrt(2)), round_sig(best * math.sqrt(2))]


def _alignment_refinement(best: float, all_diverged: bool, values: list[float]) -> list[float]:
    """±ALIGNMENT_STEP around the best share inside the grid; at the low edge (or when every share diverged)
    half and a quarter of it; at c = 1, the two shares just below (c cannot exceed 1)."""
    if all_diverged or best == min(values):
        return [round_sig(min(values) / 2), round_sig(min(values) / 4)]
    if best == max(values) == 1.0:
        return [round_sig(1 - ALIGNMENT_STEP), round_sig(1 - ALIGNMENT_STEP / 2)]
    return [round_sig(best - ALIGNMENT_STEP), round_sig(best + ALIGNMENT_STEP)]


def transfer_values(choice: Choice) -> list[float]:
    return [
        round_sig(min(choice.value * f, 1.0) if choice.knob == "equi_alignment" else choice.value * f)
        for f in TRANSFER_FACTORS
    ]


def trials_for(
    recipe: str, arch: str, values: Sequence[float], seeds: Sequence[int], knob: str | None = None
) -> list[Trial]:
    knob = knob or knobs_of(recipe)[0]
    return [Trial(recipe, arch, knob, value, seed) for value in values for seed in seeds]


def trial_config(base: TrainConfig, trial: Trial) -> TrainConfig:
    """`base` with only the trial recipe's knob replaced (its other overrides, e.g. `equi_iters`, a head
    schedule or an already chosen knob, are kept; a head step replaces the other kind of head step)."""
    current = base.recipe_overrides.get(trial.recipe, RecipeConfig())  # type: ignore[call-overload]
    step = {"head_lr": None, "tau": None} if trial.knob in ("head_lr", "tau") else {}
    override = current.model_copy(update={**step, trial.knob: trial.value})
    return base.model_copy(update={"recipe_overrides": {**base.recipe_overrides, trial.recipe: override}})


def with_choice(base: TrainConfig, recipe: str, choice: Choice) -> TrainConfig:
    """`base` with a recipe's chosen knob set, so that its next knob is tuned at it."""
    return trial_config(base, Trial(recipe, "-", choice.knob, choice.value, 0))


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
        RunSpec(trial.arch, trial.recipe, trial.seed),
        trial_config(base, trial),
        train_tokens,
        val_tokens,
        vocab_size,
        seq_len,
        params_hash="tuning",
        save_checkpoint=_no_checkpoint,
        on_step=lambda *_: clock.tick(),
    )
    loss = result.final_val_loss
    finite = loss is not None and math.isfinite(loss)
    return {
        "recipe": trial.recipe,
        "arch": trial.arch,
        "knob": trial.knob,
        "value": trial.value,
        "seed": trial.seed,
        "final_val_loss": loss if finite else None,
        "diverged": result.diverged or not finite,
        "steps_done": result.steps_done,
        "wall_time_s": clock.wall_time_s,
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
    """One score per (knob, value) of a one-recipe, one-arch, one-knob table, best first; ties go to the
    smaller value."""
    for column in ("recipe", "arch", "knob"):
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


def table_of(rows: list[dict], recipe: str, arch: str, knob: str | None = None) -> pa.Table:
    """The trials of `recipe`'s `knob` (its first when None) on `arch` among `rows`, as a table."""
    knob = knob or knobs_of(recipe)[0]
    return results_table([row for row in rows if (row["recipe"], row["arch"], row["knob"]) == (recipe, arch, knob)])


def seed_noise(table: pa.Table) -> float | None:
    """The seed noise of a one-knob table's trials: the SD of a run's final val loss about its value's mean
    over the seeds, pooled over the values whose seeds all finished (None below two seeds). A winning
    margin below it is not resolved by these trials."""
    by_value: dict[float, list[float]] = {}
    for row in table.to_pylist():
        by_value.setdefault(row["value"], []).append(math.inf if row["diverged"] else row["final_val_loss"])
    finished = [np.asarray(v) for v in by_value.values() if len(v) > 1 and np.isfinite(v).all()]
    dof = sum(len(v) - 1 for v in finished)
    return float(np.sqrt(sum(((v - v.mean()) ** 2).sum() for v in finished) / dof)) if dof else None


def margin(table: pa.Table) -> float | None:
    """The winner's lead: the runner-up's mean val loss minus the winner's (None without a finite runner-up)."""
    scores = [s for s in step_scores(table) if math.isfinite(s.mean_val_loss)]
    return scores[1].mean_val_loss - scores[0].mean_val_loss if len(scores) > 1 else None


def choose(table: pa.Table) -> Choice | None:
    """`best_step`, or None when every step diverged (reported as such: no default to take)."""
    try:
        return best_step(table)
    except ValueError:
        return None


Choices = dict[str, dict[str, Choice | None]]  # recipe -> knob -> its choice (None: every value diverged)


def transfer_summary(rows: list[dict], choices: Choices, others: list[str]) -> str | None:
    """Per other arch, the recipes whose choice of their first knob is also the best of its ×½, ×1, ×2 there."""
    if not others:
        return None
    first = {r: by_knob[knobs_of(r)[0]] for r, by_knob in choices.items()}
    parts = []
    for arch in others:
        holds = [
            r
            for r, c in first.items()
            if c is not None
            and table_of(rows, r, arch).num_rows
            and best_step(table_of(rows, r, arch)).value == c.value
        ]
        tried = [r for r, c in first.items() if c is not None]
        parts.append(
            f"{arch}: the choice is also the best of ×½, ×1, ×2 for {len(holds)} of {len(tried)} recipes"
            + (f" (not for {', '.join(r for r in tried if r not in holds)})" if len(holds) < len(tried) else "")
        )
    return "; ".join(parts)


def protocol(
    params: Params,
    base: TrainConfig,
    arch: str,
    seeds: list[int],
    defaults: dict[str, dict[str, float]],
    others: list[str],
    wall_s: float,
    vocab: int,
) -> dict[str, Any]:
    """What the sweep held fixed and what it varied, for `render` and the report's Study B protocol;
    `defaults`: recipe -> knob -> its default at sweep time."""
    from lmgeo.models.registry import build_model

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
        "values_per_knob": len(GRID_FACTORS) + REFINEMENTS,
        "defaults_at_sweep": defaults,
        "wall_time_s": round(wall_s, 1),
        "threads_per_run": params.ray.resources_for("train").threads,
        "machine": f"{platform.machine()}, {platform.system()}, device={base.device}",
    }


def curves(rows: list[dict], choices: Choices, arch: str) -> list[dict[str, Any]]:
    """Per recipe and knob on `arch`: the tuning curve (each value's seeds and mean), the choice, its lead over
    the runner-up and the trials' seed noise — what docs/tuning.md draws and the report states."""
    out = []
    for recipe, by_knob in choices.items():
        for knob, choice in by_knob.items():
            table = table_of(rows, recipe, arch, knob)
            if not table.num_rows:
                continue
            by_seed = _by_step(rows, arch)
            points = [
                {
                    "value": sc.value,
                    "mean": None if math.isinf(sc.mean_val_loss) else sc.mean_val_loss,
                    "seeds": by_seed[(recipe, knob, sc.value)],
                }
                for sc in sorted(step_scores(table), key=lambda sc: sc.value)
            ]
            out.append(
                {
                    "recipe": recipe,
                    "knob": knob,
                    "chosen": None if choice is None else choice.value,
                    "margin": margin(table),
                    "seed_noise": seed_noise(table),
                    "points": points,
                }
            )
    return out


def render(protocol: dict, rows: list[dict], choices: Choices) -> str:
    """docs/tuning.md: the protocol, the chosen defaults with their lead and the seed noise, the curves'
    figure, and every trial."""
    p = protocol
    m = p["model"]
    lines = [
        "# Step-size tuning",
        "",
        "Generated by `lmgeo tune` (`lmgeo/commands/tune/command.py`, library `lmgeo/commands/tune/tuning.py`); "
        "the chosen values are",
        "the `default_step` of each recipe (`lmgeo/study_b/recipes/`), and the report's Study B protocol",
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
        f" norms, biases), weight decay {p['weight_decay']:g}, grad clip {p['grad_clip']}, schedule"
        f" {_schedule(p['schedule'])} on every group, head included. So only the head's step differs between runs"
        " of a recipe, and only the head's optimizer between recipes (`adamw`: its hidden matrices too).",
        "- **Equal budget**: one knob per recipe — `tau` (nats per step, η_t = tau / max‖h‖ over the batch) for"
        " the recipes with a Hilbert trust region, `head_lr` (η; for `muon` the lr of its AdamW head) for the"
        " others, and for `adamw` (AdamW everywhere) the lr of its hidden matrices, `hidden_lr` (its AdamW head"
        f" takes `muon`'s) — with {p['values_per_knob']} values each: {p['grid']}. The baselines get the same"
        " budget: tuning only the new heads would bias the comparison against them. `hilbert_equi` has a second"
        " knob, its descent share c, tuned the same way at its chosen tau: 14 trials of 2 seeds, twice the"
        " others' (its step size and its direction's trade-off are both the proposal's).",
        f"- **Selection**: the value with the lowest final **validation** loss (mean over the seeds,"
        f" {p['eval_batches']} fixed val batches); a run that diverges counts as +inf, so a value that diverges on"
        " any seed never wins; ties go to the smaller value. The test split is never evaluated by tuning.",
        "- **Seed noise**: the SD of a trial's val loss about its value's mean over the seeds, pooled over the"
        " values; a winner whose lead over the runner-up is below it is not resolved by these trials (the"
        " optimum is flat at that resolution: any of the close values would do).",
        "- **Transfer**: "
        + (
            f"the choice and its ×½ and ×2 neighbours, same seeds, on {', '.join(p['transfer_archs'])}: "
            f"{p['transfer']}."
            if p.get("transfer")
            else "the study trains one architecture, the one tuned here; nothing to transfer."
        ),
        "",
        "## Chosen defaults",
        "",
        "*Bracketed*: a smaller and a larger value were tried (and lost). *Lead*: the runner-up's mean val loss"
        " minus the winner's.",
        "",
        "| recipe | knob | value | mean val loss | bracketed | lead | seed noise | default at sweep time: val loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += _choice_rows(p, rows, choices)
    lines += [
        "",
        "![tuning curves](tuning.png)",
        "",
        "Each knob's tuning curve: the mean val loss over the seeds (line), every seed's (dots), the choice (ringed).",
    ]
    lines += _trial_rows(p, rows, choices)
    return "\n".join(lines) + "\n"


def _choice_rows(p: dict, rows: list[dict], choices: Choices) -> list[str]:
    lines = []
    for recipe, by_knob in choices.items():
        for knob, choice in by_knob.items():
            table = table_of(rows, recipe, p["arch"], knob)
            scores = {s.value: s for s in step_scores(table)} if table.num_rows else {}
            before = p["defaults_at_sweep"][recipe][knob]
            before_cell = f"`{knob}` {before:g}: {_mean_cell(scores[before]) if before in scores else '–'}"
            if choice is None:
                lines.append(f"| `{recipe}` | `{knob}` | every value diverged | — | — | — | — | {before_cell} |")
                continue
            edge = "yes" if bracketed(table, choice) else "no"
            lines.append(
                f"| `{recipe}` | `{knob}` | {choice.value:g} | {choice.mean_val_loss:.4f} | {edge} | "
                f"{_num(margin(table))} | {_num(seed_noise(table))} | {before_cell} |"
            )
    return lines


def _trial_rows(p: dict, rows: list[dict], choices: Choices) -> list[str]:
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
        for (recipe, knob, value), by_seed in _by_step(rows, arch).items():
            choice = choices[recipe].get(knob)
            mark = "✔" if choice is not None and choice.value == value else ""
            cells = " | ".join(_loss_cell(by_seed.get(s)) for s in seeds)
            score = {s.value: s for s in step_scores(table_of(rows, recipe, arch, knob))}[value]
            lines.append(f"| {arch} | `{recipe}` | `{knob}` | {value:g} | {cells} | {_mean_cell(score)} | {mark} |")
    return lines


def _by_step(rows: list[dict], arch: str) -> dict[tuple[str, str, float], dict[int, float | None]]:
    grouped: dict[tuple[str, str, float], dict[int, float | None]] = {}
    for row in rows:
        if row["arch"] == arch:
            loss = None if row["diverged"] else row["final_val_loss"]
            grouped.setdefault((row["recipe"], row["knob"], row["value"]), {})[row["seed"]] = loss
    return grouped


def _mean_cell(score: StepScore) -> str:
    return "inf (diverged)" if math.isinf(score.mean_val_loss) else f"{score.mean_val_loss:.4f}"


def _loss_cell(loss: float | None) -> str:
    return "*diverged*" if loss is None else f"{loss:.4f}"


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.4f}"


def _schedule(s: dict) -> str:
    return f"linear warm-up {s['warmup_steps']} steps, then {s['decay']} decay to {s['final_frac']:g}× the peak"


def figure(curves_of: list[dict[str, Any]]) -> Any:
    """docs/tuning.png: one panel per recipe and knob, the mean val loss against the value (log axis for
    step sizes), every seed's loss as a dot, the choice ringed."""
    from matplotlib.figure import Figure

    columns = max(1, min(4, len(curves_of)))  # a tune of one or two knobs: a figure as narrow as its panels
    rows = math.ceil(len(curves_of) / columns)
    fig = Figure(figsize=(3.2 * columns, 2.6 * rows), layout="constrained")
    for i, curve in enumerate(curves_of):
        ax = fig.add_subplot(rows, columns, i + 1)
        finite = [pt for pt in curve["points"] if pt["mean"] is not None]
        ax.plot([pt["value"] for pt in finite], [pt["mean"] for pt in finite], color="black", linewidth=1.2)
        for pt in curve["points"]:
            losses = [v for v in pt["seeds"].values() if v is not None]
            ax.scatter([pt["value"]] * len(losses), losses, s=12, color="tab:blue", zorder=3)
        chosen = next((pt for pt in finite if pt["value"] == curve["chosen"]), None)
        if chosen:
            ax.scatter([chosen["value"]], [chosen["mean"]], s=90, facecolors="none", edgecolors="tab:red", zorder=4)
        if curve["knob"] != "equi_alignment":
            ax.set_xscale("log")
        ax.set_title(f"{curve['recipe']}: {curve['knob']}", fontsize=9)
        ax.set_xlabel(curve["knob"], fontsize=8)
        ax.set_ylabel("final val loss (nats)", fontsize=8)
        ax.tick_params(labelsize=7)
    return fig
