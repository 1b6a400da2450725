"""`lmgeo tune`: the equal-budget head step-size sweep of `tools/tuning.py`, one Ray task per trial.

It writes the protocol and every trial to `docs/tuning.md` (and the same data as JSON next to it, which the
report's Study B protocol reads); the chosen values are then copied by hand into each recipe's
`default_step` (`pipeline/study_b/recipes/`), so a default only changes through a reviewed edit that points
at the document. Not a DVC stage: its output documents the defaults that `train` uses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.params import Params
from pipeline.study_b.config import TrainConfig
from stages.layout import Layout

if TYPE_CHECKING:  # at run time it loads torch, which `lmgeo --help` must not
    from tools.tuning import Choice, Trial


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
    from stages.runtime import start_ray
    from tools import tuning

    layout = Layout.here()
    arch = arch or params.train.archs[0]
    base = tuning.tuning_config(params.train, steps or params.train.steps)
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
    refine = [
        t for r in recipes
        for t in tuning.trials_for(r, arch, tuning.refinement(tuning.table_of(rows, r, arch)), seeds)
    ]  # fmt: skip
    rows += execute(refine)
    choices = {r: tuning.choose(tuning.table_of(rows, r, arch)) for r in recipes}
    others = [a for a in params.train.archs if a != arch]
    transfer = execute([
        t for a in others for r, c in choices.items() if c is not None
        for t in tuning.trials_for(r, a, tuning.transfer_values(c), seeds)
    ])  # fmt: skip
    rows = sorted(rows + transfer, key=lambda r: (
        r["arch"] != arch, r["arch"], recipes.index(r["recipe"]), r["value"], r["seed"]
    ))  # fmt: skip
    protocol = tuning.protocol(params, base, arch, seeds, defaults, others, time.perf_counter() - started, vocab_size)
    protocol["transfer"] = tuning.transfer_summary(rows, choices, others)
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
        raise InputError(
            f"tune: unknown arch {arch!r}; expected one of {', '.join(f.name for f in FAMILIES if f.trainable)}"
        )
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or len(set(recipes)) != len(recipes):
        raise InputError(f"tune: recipes must be distinct names from {', '.join(RECIPES.names())}; got {recipes}")


def _write(out: Path, protocol: dict, rows: list[dict], choices: dict[str, Choice | None]) -> None:
    from pipeline.core.store import atomic_path
    from tools import tuning

    chosen = {r: None if c is None else asdict(c) for r, c in choices.items()}
    with atomic_path(out.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps({"protocol": protocol, "chosen": chosen, "trials": rows}, indent=2) + "\n")
    with atomic_path(out) as tmp:
        tmp.write_text(tuning.render(protocol, rows, choices))
