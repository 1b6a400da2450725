"""`lmgeo tune`: the head step-size sweep of `pipeline/tuning.py`, one Ray task per trial.

It writes the protocol and every trial to `docs/tuning.md` (and the same data as JSON next to it);
the chosen values are then copied by hand into each recipe's `default_step` (`pipeline/study_b/recipes/`), so a
default only changes through a reviewed edit that points at the document. Not a DVC stage: its
output documents the defaults that `train` uses, it is not an input of `train`.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.params import Params
from pipeline.study_b.config import TrainConfig
from stages.layout import Layout

if TYPE_CHECKING:  # at run time these load torch, which `lmgeo --help` must not
    import pyarrow as pa

    from pipeline.tools.tuning import Choice, StepScore, Trial

# Edge rounds: each moves a family whose best value sits on the grid's edge one ×2 step further out.
MAX_EXTENSION_ROUNDS = 4


def tuning_config(train: TrainConfig, steps: int) -> TrainConfig:
    """The study's training config at `steps`, evaluating and measuring geometry only at the end: a
    tuning run needs only its final val loss, and neither measurement touches the training trajectory
    (no dropout; evaluation and the probe forward use no random numbers)."""
    return train.model_copy(update={"steps": steps, "eval_interval": steps, "geometry_interval": steps})


def tune_task(tokens_dir: Path, trial: Trial, base: TrainConfig, seq_len: int) -> dict:
    """Ray task: train one trial and return its row."""
    from pipeline.text.corpus import load_meta, load_tokens
    from pipeline.tools.tuning import run_trial

    return run_trial(
        trial, base, load_tokens(tokens_dir, "train"), load_tokens(tokens_dir, "val"),
        load_meta(tokens_dir)["vocab_size"], seq_len,
    )


def run(
    params: Params,
    ray_address: str | None = None,
    *,
    arch: str = "neox",
    steps: int | None = None,
    seeds: Sequence[int] | None = None,
    recipes: Sequence[str] | None = None,
    out: Path = Path("docs/tuning.md"),
) -> dict[str, Choice | None]:
    """Sweep every recipe's head step on `arch` (defaults: the study's steps and seeds, all recipes),
    extend edge winners, write `out` and `out.with_suffix('.json')`; returns the chosen steps."""
    from pipeline.core.execution import Shard, run_shards
    from pipeline.text.corpus import load_meta
    from pipeline.tools import tuning
    from stages.runtime import start_ray

    layout = Layout.here()
    base = tuning_config(params.train, steps or params.train.steps)
    seeds = list(seeds or params.train.seeds)
    from pipeline.study_b.recipes import RECIPES

    recipes = list(recipes or RECIPES.names())
    _check_choices(arch, recipes)
    vocab_size = load_meta(layout.tokens)["vocab_size"]  # fails here, not in every task, before `prepare`
    resources = params.ray.resources_for("train")
    start_ray(params.ray, ray_address)

    def execute(trials: list[Trial]) -> list[dict]:
        shards = [Shard(t.key, tune_task, (layout.tokens, t, base, params.prepare.seq_len)) for t in trials]
        results = run_shards(
            shards, resources, max_in_flight=params.ray.max_in_flight,
            max_retries=params.ray.max_retries, label="tune",
        )
        return list(results.values())

    started = time.perf_counter()
    previous = {r: _rounded(tuning.default_step(r, base)) for r in recipes}
    grids = {r: tuning.default_grid(r, base) for r in recipes}
    rows = execute([t for r in recipes for t in tuning.trials_for(r, arch, grids[r], seeds)])
    for _ in range(MAX_EXTENSION_ROUNDS):
        extra = [
            t for r in recipes
            for t in tuning.trials_for(r, arch, tuning.edge_extensions(_of_recipe(rows, r)), seeds)
        ]
        if not extra:
            break
        rows += execute(extra)
    rows.sort(key=lambda r: (recipes.index(r["recipe"]), tuning.KNOBS.index(r["knob"]), r["value"], r["seed"]))
    choices = {r: _choose(_of_recipe(rows, r)) for r in recipes}
    protocol = _protocol(params, base, arch, seeds, grids, previous, time.perf_counter() - started, vocab_size)
    _write(out, protocol, rows, choices)
    print(f"tune: wrote {out} and {out.with_suffix('.json')}", flush=True)
    for recipe, choice in choices.items():
        print(f"tune: {recipe}: {'every step diverged' if choice is None else f'{choice.knob}={choice.value:g}'}")
    return choices


def _check_choices(arch: str, recipes: list[str]) -> None:
    from pipeline.core.errors import InputError
    from pipeline.models.registry import FAMILIES
    from pipeline.study_b.recipes import RECIPES

    if arch not in FAMILIES or not FAMILIES[arch].trainable:
        raise InputError(f"tune: unknown arch {arch!r}; expected one of {', '.join(f.name for f in FAMILIES if f.trainable)}")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or len(set(recipes)) != len(recipes):
        raise InputError(f"tune: recipes must be distinct names from {', '.join(RECIPES.names())}; got {recipes}")


def _rounded(step: tuple[str, float]) -> tuple[str, float]:
    """As the grid writes it, so the ×1 point is found among the trials."""
    from pipeline.tools.tuning import round_sig

    return step[0], round_sig(step[1])


def _of_recipe(rows: list[dict], recipe: str) -> pa.Table:
    from pipeline.tools.tuning import results_table

    return results_table([row for row in rows if row["recipe"] == recipe])


def _choose(table: pa.Table) -> Choice | None:
    from pipeline.tools.tuning import best_step

    try:
        return best_step(table)
    except ValueError:  # every step diverged: reported as such, no default to take
        return None


def _protocol(
    params: Params, base: TrainConfig, arch: str, seeds: list[int], grids: dict, previous: dict, wall_s: float,
    vocab: int,
) -> dict:
    from pipeline.models.registry import build_model
    from pipeline.tools.tuning import EDGE_FACTOR, GRID_FACTORS

    model = build_model(arch, base.model, vocab, params.prepare.seq_len, seed=0)
    return {
        "arch": arch,
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
        "grid_factors": list(GRID_FACTORS),
        "edge_factor": EDGE_FACTOR,
        "max_extension_rounds": MAX_EXTENSION_ROUNDS,
        "grids": grids,
        "defaults_at_sweep": {r: {"knob": knob, "value": value} for r, (knob, value) in previous.items()},
        "wall_time_s": round(wall_s, 1),
        "threads_per_run": params.ray.resources_for("train").threads,
        "machine": f"{platform.machine()}, {platform.system()}, device={base.device}",
    }


def _write(out: Path, protocol: dict, rows: list[dict], choices: dict[str, Choice | None]) -> None:
    from pipeline.core.store import atomic_path

    chosen = {r: None if c is None else asdict(c) for r, c in choices.items()}
    with atomic_path(out.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps({"protocol": protocol, "chosen": chosen, "trials": rows}, indent=2) + "\n")
    with atomic_path(out) as tmp:
        tmp.write_text(render(protocol, rows, choices))


def render(protocol: dict, rows: list[dict], choices: dict[str, Choice | None]) -> str:
    from pipeline.tools.tuning import edge_extensions

    p = protocol
    m = p["model"]
    seeds = p["seeds"]
    lines = [
        "# Head step-size tuning",
        "",
        "Generated by `lmgeo tune` (`stages/tune.py`, library `pipeline/tuning.py`); the chosen values are",
        "the `default_step` of each recipe (`pipeline/study_b/recipes/`). SPEC §3.2 asks for per-recipe defaults",
        "chosen by a documented protocol; this is it.",
        "",
        "## Protocol",
        "",
        f"- **Runs**: arch `{p['arch']}`, d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads,"
        f" vocab {p['vocab_size']} ({p['n_params']:,} parameters, untied head); {p['steps']} steps of batch"
        f" {p['batch_size']} × seq_len {p['seq_len']} ({p['tokens_per_run']:,} tokens); seeds {seeds};"
        f" {p['threads_per_run']} thread(s) per run ({p['machine']}). Total wall time {p['wall_time_s']:.0f} s.",
        f"- **Fixed for every run**: hidden (Muon) lr {p['hidden_lr']:g}, AdamW lr {p['adamw_lr']:g} (embeddings,"
        f" norms, biases; every parameter for `adamw` except its head), weight decay {p['weight_decay']:g},"
        f" grad clip {p['grad_clip']}, schedule {_schedule(p['schedule'])} on every group, head included."
        " So only the head's step size differs between runs of a recipe, and only the head's optimizer"
        " between recipes.",
        "- **Grid**: per recipe, the step × {" + ", ".join(f"{f:g}" for f in p["grid_factors"]) + "} around the"
        " default at sweep time (×1). `head_lr` is η (for `adamw` and `muon`: the lr of the head's own AdamW"
        " group; the AdamW lr of the run where the default follows it). `hilbert` and `hilbert_equi` also"
        " get a `tau` family (nats per step, η_t = tau / max‖h‖ over the batch), centred on η·√d_model,"
        " the tau the default η takes on a typical token after the final norm (‖h‖ ≈ √d).",
        "- **Baselines are tuned too**: the AdamW head of `adamw` and `muon` gets the same"
        f" {len(p['grid_factors'])}-point budget as the new heads; tuning only the new heads would bias the"
        " comparison against the baselines.",
        "- **Edges**: when a family's best value is the largest (smallest) tried, one more value"
        f" ×{p['edge_factor']:g} (÷) beyond it is run, at most {p['max_extension_rounds']} times, so a"
        " winner is bracketed by worse values rather than clipped by the grid (marked *edge* below).",
        "- **Selection**: the (family, value) with the lowest final validation loss (mean over seeds,"
        f" {p['eval_batches']} fixed val batches); a run that diverges (non-finite loss) counts as +inf, so"
        " a step that diverges on any seed never wins. Ties go to `head_lr` over `tau`, then to the smaller"
        " step.",
        "- **Schedules**: warm-up and decay are the run's schedule for every recipe (above); they are not"
        " tuned per recipe here. A recipe can still be given its own head schedule with"
        " `train.recipe_overrides.<recipe>.schedule`.",
        "",
        "## Chosen defaults",
        "",
        "*Bracketed*: a worse value was tried on both sides of the chosen one (otherwise the optimum may lie"
        " beyond the grid even after the edge rounds).",
        "",
        "| recipe | family | value | mean val loss | bracketed | default before the sweep (×1): mean val loss |",
        "|---|---|---|---|---|---|",
    ]
    scores = _scores(rows, list(choices))
    for recipe, choice in choices.items():
        before = p["defaults_at_sweep"][recipe]
        before_score = scores[(recipe, before["knob"], before["value"])]
        before_cell = f"`{before['knob']}` {before['value']:g}: {_mean_cell(before_score)}"
        if choice is None:
            lines.append(f"| `{recipe}` | — | every step diverged | — | — | {before_cell} |")
        else:
            bracketed = "no" if choice.knob in edge_extensions(_of_recipe(rows, recipe)) else "yes"
            chosen = f"`{choice.knob}` | {choice.value:g} | {choice.mean_val_loss:.4f} | {bracketed}"
            lines.append(f"| `{recipe}` | {chosen} | {before_cell} |")
    seed_cols = " | ".join(f"val loss s{s}" for s in seeds)
    lines += [
        "",
        "## All trials",
        "",
        "Final validation loss per seed (*diverged* where the loss became non-finite); ✔ marks the chosen value.",
        "",
        f"| recipe | family | value | grid | {seed_cols} | mean | chosen |",
        "|---|---|---|---|" + "---|" * len(seeds) + "---|---|",
    ]
    for (recipe, knob, value), by_seed in _by_step(rows).items():
        choice = choices[recipe]
        in_grid = value in p["grids"][recipe].get(knob, [])
        cells = " | ".join(_loss_cell(by_seed.get(s)) for s in seeds)
        mean = _mean_cell(scores[(recipe, knob, value)])
        mark = "✔" if choice is not None and (choice.knob, choice.value) == (knob, value) else ""
        origin = "grid" if in_grid else "edge"
        lines.append(f"| `{recipe}` | `{knob}` | {value:g} | {origin} | {cells} | {mean} | {mark} |")
    return "\n".join(lines) + "\n"


def _by_step(rows: list[dict]) -> dict[tuple[str, str, float], dict[int, float | None]]:
    grouped: dict[tuple[str, str, float], dict[int, float | None]] = {}
    for row in rows:
        loss = None if row["diverged"] else row["final_val_loss"]
        grouped.setdefault((row["recipe"], row["knob"], row["value"]), {})[row["seed"]] = loss
    return grouped


def _scores(rows: list[dict], recipes: list[str]) -> dict[tuple[str, str, float], StepScore]:
    from pipeline.tools.tuning import step_scores

    return {(r, s.knob, s.value): s for r in recipes for s in step_scores(_of_recipe(rows, r))}


def _mean_cell(score: StepScore) -> str:
    return "inf (diverged)" if math.isinf(score.mean_val_loss) else f"{score.mean_val_loss:.4f}"


def _loss_cell(loss: float | None) -> str:
    return "*diverged*" if loss is None else f"{loss:.4f}"


def _schedule(s: dict) -> str:
    return f"linear warm-up {s['warmup_steps']} steps, then {s['decay']} decay to {s['final_frac']:g}× the peak"
