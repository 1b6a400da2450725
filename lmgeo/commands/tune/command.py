"""`lmgeo tune`: the equal-budget head step-size sweep of `lmgeo/commands/tune/tuning.py`, one Ray task per trial.

It writes the protocol and every trial to `docs/tuning.md` (and the same data as JSON next to it, which the
report's Study B protocol reads); the chosen values are then copied by hand into each recipe's
`default_step` (`lmgeo/study_b/recipes/`), so a default only changes through a reviewed edit that points
at the document. Not a DVC stage: its output documents the defaults that `train` uses.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from lmgeo.driver.layout import Layout
from lmgeo.params import Params
from lmgeo.study_b.config import TrainConfig

if TYPE_CHECKING:  # at run time it loads torch, which `lmgeo --help` must not
    from lmgeo.commands.tune.tuning import Choices, Trial


def tune_task(tokens_dir: Path, trial: Trial, base: TrainConfig, seq_len: int) -> dict:
    """Ray task: train one trial on train, evaluate on val, and return its row."""
    from lmgeo.commands.tune.tuning import run_trial
    from lmgeo.text.corpus import load_meta, load_tokens

    return run_trial(
        trial,
        base,
        load_tokens(tokens_dir, "train"),
        load_tokens(tokens_dir, "val"),
        load_meta(tokens_dir)["vocab_size"],
        seq_len,
    )


def run(
    params: Params,
    layout: Layout,
    ray_address: str | None = None,
    *,
    arch: str | None = None,
    steps: int | None = None,
    seeds: Sequence[int] | None = None,
    recipes: Sequence[str] | None = None,
    out: Path = Path("docs/tuning.md"),
) -> Choices:
    """Tune every recipe's knobs on `arch` (defaults: the study's first arch and steps, the tuning seeds, all
    recipes but the controls, whose knobs are their subject's), each at the ones chosen before it; check the
    first knob's choice on the study's other archs; write `out`, its JSON and its figure (`out` with `.png`)."""
    from lmgeo.commands.tune import tuning
    from lmgeo.core.execution import Shard, run_shards
    from lmgeo.core.store import file_sha256
    from lmgeo.driver.runtime import start_ray
    from lmgeo.study_b.recipes import RECIPES
    from lmgeo.text.corpus import load_meta

    arch = arch or params.train.archs[0]
    base = tuning.tuning_config(params.train, steps or params.train.steps)
    seeds = list(seeds or tuning.TUNING_SEEDS)
    recipes = list(recipes or [r.name for r in RECIPES if r.control_of is None])  # a control is not tuned
    _check_choices(arch, recipes)
    vocab_size = load_meta(layout.tokens)["vocab_size"]  # fails here, not in every task, before `prepare`
    start_ray(params.ray, ray_address)

    cache = TrialCache(out.parent / f".{out.stem}.trials.jsonl", tokens=file_sha256(layout.tokens / "meta.json"))

    def execute(trials: list[Trial], bases: dict[str, TrainConfig]) -> list[dict]:
        """Each trial at its recipe's config so far (its knobs already chosen); a trial of an interrupted
        sweep with the same config, tokens and code is read back from the cache instead."""
        keys = {
            t.key: cache.key(t, tuning.trial_config(bases[t.recipe], t), params.prepare.seq_len, layout) for t in trials
        }
        done = {t.key: cache.rows[keys[t.key]] for t in trials if keys[t.key] in cache.rows}
        shards = [
            Shard(
                t.key,
                tune_task,
                (layout.tokens, t, bases[t.recipe], params.prepare.seq_len),
                write=functools.partial(cache.add, keys[t.key]),
            )
            for t in trials
            if t.key not in done
        ]
        resources = params.ray.resources_for("train")
        results = run_shards(
            shards, resources, max_in_flight=params.ray.max_in_flight, max_retries=params.ray.max_retries, label="tune"
        )
        return [done[t.key] if t.key in done else results[t.key] for t in trials]

    started = time.perf_counter()
    defaults = {r: {k: tuning.round_sig(tuning.default_value(r, base, k)) for k in tuning.knobs_of(r)} for r in recipes}
    rows: list[dict] = []
    choices: tuning.Choices = {r: {} for r in recipes}
    bases = dict.fromkeys(recipes, base)
    for depth in range(max(len(tuning.knobs_of(r)) for r in recipes)):  # each knob at the ones chosen before it
        knob = {r: tuning.knobs_of(r)[depth] for r in recipes if depth < len(tuning.knobs_of(r))}
        rows += execute(
            [t for r, k in knob.items() for t in tuning.trials_for(r, arch, tuning.first_round(r, base, k), seeds, k)],
            bases,
        )
        rows += execute(
            [
                t
                for r, k in knob.items()
                for t in tuning.trials_for(r, arch, tuning.refinement(tuning.table_of(rows, r, arch, k)), seeds, k)
            ],
            bases,
        )
        for r, k in knob.items():
            choice = choices[r][k] = tuning.choose(tuning.table_of(rows, r, arch, k))
            if choice is not None:
                bases[r] = tuning.with_choice(bases[r], r, choice)
    others = [a for a in params.train.archs if a != arch]
    first = {r: choices[r][tuning.knobs_of(r)[0]] for r in recipes}
    transfer = execute(
        [
            t
            for a in others
            for r, c in first.items()
            if c is not None
            for t in tuning.trials_for(r, a, tuning.transfer_values(c), seeds)
        ],
        bases,
    )
    rows = sorted(
        rows + transfer,
        key=lambda r: (r["arch"] != arch, r["arch"], recipes.index(r["recipe"]), r["knob"], r["value"], r["seed"]),
    )
    protocol = tuning.protocol(params, base, arch, seeds, defaults, others, time.perf_counter() - started, vocab_size)
    protocol["transfer"] = tuning.transfer_summary(rows, choices, others)
    _write(out, protocol, rows, choices)
    cache.path.unlink(missing_ok=True)  # the document holds every trial now
    print(f"tune: wrote {out} and {out.with_suffix('.json')} in {protocol['wall_time_s']:.0f} s", flush=True)
    for recipe, by_knob in choices.items():
        print(
            f"tune: {recipe}: "
            + ", ".join("every value diverged" if c is None else c.describe() for c in by_knob.values())
        )
    return choices


class TrialCache:
    """The trials of an interrupted sweep (`lmgeo tune` takes hours at the study's horizon on a laptop): one
    JSON line per finished trial, keyed by what decides its result — its config, the sequence length, the
    tokens and the code version of its recipe and family — so a rerun takes them back and trains the rest.
    Removed once the document is written."""

    def __init__(self, path: Path, tokens: str) -> None:
        self.path, self.tokens = path, tokens
        lines = path.read_text().splitlines() if path.is_file() else []
        self.rows: dict[str, dict] = {entry["key"]: entry["row"] for entry in map(json.loads, lines)}

    def key(self, trial: Trial, cfg: TrainConfig, seq_len: int, layout: Layout) -> str:
        from lmgeo.core.config import digest
        from lmgeo.driver.sharded import versioned
        from lmgeo.stages.train import code_spec

        code = versioned(code_spec(layout, trial.recipe, trial.arch), layout)[1]
        return digest({"trial": trial.key, "config": cfg, "seq_len": seq_len, "tokens": self.tokens, "code": code})

    def add(self, key: str, row: dict) -> dict:
        """Shard.write: append the finished trial's row (the driver writes one line at a time)."""
        with self.path.open("a") as handle:
            handle.write(json.dumps({"key": key, "row": row}) + "\n")
        self.rows[key] = row
        return row


def _check_choices(arch: str, recipes: list[str]) -> None:
    from lmgeo.core.errors import InputError
    from lmgeo.models.registry import FAMILIES
    from lmgeo.study_b.recipes import RECIPES

    if arch not in FAMILIES or not FAMILIES[arch].trainable:
        raise InputError(
            f"tune: unknown arch {arch!r}; expected one of {', '.join(f.name for f in FAMILIES if f.trainable)}"
        )
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or len(set(recipes)) != len(recipes):
        raise InputError(f"tune: recipes must be distinct names from {', '.join(RECIPES.names())}; got {recipes}")


def _write(out: Path, protocol: dict, rows: list[dict], choices: Choices) -> None:

    from lmgeo.commands.tune import tuning
    from lmgeo.core.store import atomic_path

    chosen = {r: {k: None if c is None else asdict(c) for k, c in by_knob.items()} for r, by_knob in choices.items()}
    curves = tuning.curves(rows, choices, protocol["arch"])
    with atomic_path(out.with_suffix(".json")) as tmp:
        tmp.write_text(
            json.dumps({"protocol": protocol, "chosen": chosen, "curves": curves, "trials": rows}, indent=2) + "\n"
        )
    with atomic_path(out.with_suffix(".png")) as tmp:
        tuning.figure(curves).savefig(tmp, format="png", dpi=110, metadata={"Software": None})
    with atomic_path(out) as tmp:
        tmp.write_text(tuning.render(protocol, rows, choices))
