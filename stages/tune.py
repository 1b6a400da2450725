"""`lmgeo tune`: the equal-budget head step-size sweep of `tools/tuning.py`, one Ray task per trial.

It writes the protocol and every trial to `docs/tuning.md` (and the same data as JSON next to it, which the
report's Study B protocol reads); the chosen values are then copied by hand into each recipe's
`default_step` (`pipeline/study_b/recipes/`), so a default only changes through a reviewed edit that points
at the document. Not a DVC stage: its output documents the defaults that `train` uses.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.params import Params
from pipeline.study_b.config import TrainConfig
from stages.layout import Layout

if TYPE_CHECKING:  # at run time these load torch, which `lmgeo --help` must not
    import pyarrow as pa

    from tools.tuning import Choice, StepScore, Trial

GRID_TEXT = (
    "×{1/4, 1/2, 1, 2, 4} around the default at sweep time, then 2 more: ×2^(±1/2) around the best, "
    "or ×2 and ×4 beyond it when it is on an edge"
)


def tuning_config(train: TrainConfig, steps: int) -> TrainConfig:
    """The study's training config at `steps`, evaluating and measuring geometry only at the end: a
    tuning run needs only its final val loss, and neither measurement touches the training trajectory
    (no dropout; evaluation and the probe forward use no random numbers)."""
    return train.model_copy(update={"steps": steps, "eval_interval": steps, "geometry_interval": steps})


def tune_task(tokens_dir: Path, trial: Trial, base: TrainConfig, seq_len: int) -> dict:
    """Ray task: train one trial on train, evaluate on val, and return its row."""
    from pipeline.text.corpus import load_meta, load_tokens
    from tools.tuning import run_trial

    return run_trial(
        trial, base, load_tokens(tokens_dir, "train"), load_tokens(tokens_dir, "val"),
        load_meta(tokens_dir)["vocab_size"], seq_len,
    )


def run(
    params: Params,
    ray_address: str | None = None,
    *,
    arch: str | None = None,
    steps: int | None = None,
    seeds: Sequence[int] | None = None,
    recipes: Sequence[str] | None = None,
    out: Path = Path("docs/tuning.md"),
) -> dict[str, Choice | None]:
    """Sweep every recipe's head step on `arch` (defaults: the study's first arch and steps, the tuning
    seeds, all recipes), check the choices on the study's other archs, write `out` and its JSON."""
    from pipeline.core.execution import Shard, run_shards
    from pipeline.study_b.recipes import RECIPES
    from pipeline.text.corpus import load_meta
    from tools import tuning
    from stages.runtime import start_ray

    layout = Layout.here()
    arch = arch or params.train.archs[0]
    base = tuning_config(params.train, steps or params.train.steps)
    seeds = list(seeds or tuning.TUNING_SEEDS)
    recipes = list(recipes or RECIPES.names())
    _check_choices(arch, recipes)
    vocab_size = load_meta(layout.tokens)["vocab_size"]  # fails here, not in every task, before `prepare`
    start_ray(params.ray, ray_address)

    def execute(trials: list[Trial]) -> list[dict]:
        shards = [Shard(t.key, tune_task, (layout.tokens, t, base, params.prepare.seq_len)) for t in trials]
        resources = params.ray.resources_for("train")
        results = run_shards(shards, resources, max_in_flight=params.ray.max_in_flight,
                             max_retries=params.ray.max_retries, label="tune")  # fmt: skip
        return list(results.values())

    started = time.perf_counter()
    defaults = {r: tuning.round_sig(tuning.default_value(r, base)) for r in recipes}
    rows = execute([t for r in recipes for t in tuning.trials_for(r, arch, tuning.first_round(r, base), seeds)])
    refine = [t for r in recipes for t in tuning.trials_for(r, arch, tuning.refinement(_of(rows, r, arch)), seeds)]
    rows += execute(refine)
    choices = {r: _choose(_of(rows, r, arch)) for r in recipes}
    others = [a for a in params.train.archs if a != arch]
    transfer = execute([
        t for a in others for r, c in choices.items() if c is not None
        for t in tuning.trials_for(r, a, tuning.transfer_values(c), seeds)
    ])  # fmt: skip
    rows = sorted(rows + transfer, key=lambda r: (r["arch"] != arch, r["arch"], recipes.index(r["recipe"]), r["value"], r["seed"]))  # fmt: skip
    protocol = _protocol(params, base, arch, seeds, defaults, others, time.perf_counter() - started, vocab_size)
    protocol["transfer"] = _transfer_summary(rows, choices, others)
    _write(out, protocol, rows, choices)
    print(f"tune: wrote {out} and {out.with_suffix('.json')} in {protocol['wall_time_s']:.0f} s", flush=True)
    for recipe, choice in choices.items():
        print(f"tune: {recipe}: {'every step diverged' if choice is None else choice.describe()}")
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


def _of(rows: list[dict], recipe: str, arch: str) -> pa.Table:
    from tools.tuning import results_table

    return results_table([row for row in rows if row["recipe"] == recipe and row["arch"] == arch])


def _choose(table: pa.Table) -> Choice | None:
    from tools.tuning import best_step

    try:
        return best_step(table)
    except ValueError:  # every step diverged: reported as such, no default to take
        return None


def _transfer_summary(rows: list[dict], choices: dict[str, Choice | None], others: list[str]) -> str | None:
    """Per other arch, the recipes whose choice is also the best of its ×½, ×1, ×2 there."""
    from tools.tuning import best_step

    if not others:
        return None
    parts = []
    for arch in others:
        holds = [r for r, c in choices.items() if c is not None and _of(rows, r, arch).num_rows
                 and best_step(_of(rows, r, arch)).value == c.value]  # fmt: skip
        tried = [r for r, c in choices.items() if c is not None]
        parts.append(f"{arch}: the choice is also the best of ×½, ×1, ×2 for {len(holds)} of {len(tried)} recipes"
                     + (f" (not for {', '.join(r for r in tried if r not in holds)})" if len(holds) < len(tried) else ""))  # fmt: skip
    return "; ".join(parts)


def _protocol(
    params: Params, base: TrainConfig, arch: str, seeds: list[int], defaults: dict[str, float], others: list[str],
    wall_s: float, vocab: int,
) -> dict[str, Any]:
    from pipeline.models.registry import build_model
    from tools.tuning import GRID_FACTORS, REFINEMENTS, knob_of

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


def _write(out: Path, protocol: dict, rows: list[dict], choices: dict[str, Choice | None]) -> None:
    from pipeline.core.store import atomic_path

    chosen = {r: None if c is None else asdict(c) for r, c in choices.items()}
    with atomic_path(out.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps({"protocol": protocol, "chosen": chosen, "trials": rows}, indent=2) + "\n")
    with atomic_path(out) as tmp:
        tmp.write_text(render(protocol, rows, choices))


def render(protocol: dict, rows: list[dict], choices: dict[str, Choice | None]) -> str:
    p = protocol
    m = p["model"]
    lines = [
        "# Head step-size tuning",
        "",
        "Generated by `lmgeo tune` (`stages/tune.py`, library `tools/tuning.py`); the chosen values are",
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
    from tools.tuning import bracketed

    scores = _scores(rows, list(choices), p["arch"])
    lines = []
    for recipe, choice in choices.items():
        before = p["defaults_at_sweep"][recipe]
        before_score = scores.get((recipe, before["value"]))
        before_cell = f"`{before['knob']}` {before['value']:g}: {_mean_cell(before_score) if before_score else '–'}"
        if choice is None:
            lines.append(f"| `{recipe}` | — | every step diverged | — | — | {before_cell} |")
        else:
            edge = "yes" if bracketed(_of(rows, recipe, p["arch"]), choice) else "no"
            lines.append(f"| `{recipe}` | `{choice.knob}` | {choice.value:g} | {choice.mean_val_loss:.4f} | {edge} | {before_cell} |")
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
            lines.append(f"| {arch} | `{recipe}` | `{knob}` | {value:g} | {cells} | {_mean_cell(scores[(recipe, value)])} | {mark} |")
    return lines


def _by_step(rows: list[dict], arch: str) -> dict[tuple[str, str, float], dict[int, float | None]]:
    grouped: dict[tuple[str, str, float], dict[int, float | None]] = {}
    for row in rows:
        if row["arch"] == arch:
            loss = None if row["diverged"] else row["final_val_loss"]
            grouped.setdefault((row["recipe"], row["knob"], row["value"]), {})[row["seed"]] = loss
    return grouped


def _scores(rows: list[dict], recipes: list[str], arch: str) -> dict[tuple[str, float], StepScore]:
    from tools.tuning import step_scores

    return {(r, s.value): s for r in recipes if _of(rows, r, arch).num_rows for s in step_scores(_of(rows, r, arch))}


def _mean_cell(score: StepScore) -> str:
    return "inf (diverged)" if math.isinf(score.mean_val_loss) else f"{score.mean_val_loss:.4f}"


def _loss_cell(loss: float | None) -> str:
    return "*diverged*" if loss is None else f"{loss:.4f}"


def _schedule(s: dict) -> str:
    return f"linear warm-up {s['warmup_steps']} steps, then {s['decay']} decay to {s['final_frac']:g}× the peak"
