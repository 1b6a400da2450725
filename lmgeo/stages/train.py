"""`lmgeo train`: one shard per run (arch × recipe × seed, and each budget of the sweep), resumable per run;
consecutive runs of one recipe and family share a Ray task (`ray.shards_per_task`).

A run is one shard in two datasets: its checkpoints `data/models/<run>/{init,final}/` and its log
`data/train/run=<run>/steps.parquet`. The task returns both (checkpoint files as bytes) and the driver
writes them, the log first and the checkpoints last, so a run is complete when both manifests hold its key;
anything else left by a killed run is removed and the run redone.

Wall-clock times are not results: the same code and params must give the same bytes on every run, so
each run's step times go to `telemetry/train/<run>.json` (a DVC output outside the cache, SPEC §1).
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

from lmgeo.core.contracts import RunSpec
from lmgeo.core.execution import Load, Shard
from lmgeo.core.fingerprint import CodeSpec
from lmgeo.core.store import ManifestKey, ShardParts, file_sha256, read_folder
from lmgeo.driver.layout import Layout
from lmgeo.driver.sharded import Plan, members, run_sharded_stage, stage_code, stage_params, versioned
from lmgeo.driver.telemetry import RunTimes, read_telemetry, write_telemetry
from lmgeo.params import Params
from lmgeo.study_b.config import TrainConfig

RUN_JSON = "run.json"


def train_task(
    spec: RunSpec,
    cfg: TrainConfig,
    seq_len: int,
    params_hash: str,
    tokens: dict[str, Any],
    tokenizer_files: dict[str, bytes],
) -> dict:
    """Ray task: train one run on the `tokens` (each split, and the vocabulary size); returns its log and
    its checkpoints (each with `run.json` and the tokenizer's files, copied as `prepare` wrote them) for the
    driver to write. Consecutive runs of one recipe and family share a task (`ray.shards_per_task`)."""
    import torch

    from lmgeo.core.progress import Progress, StepClock
    from lmgeo.core.store import write_folder
    from lmgeo.study_b.train import train_run

    run_id = spec.run_id
    checkpoints, log = ShardParts(), ShardParts()

    def save_checkpoint(model: torch.nn.Module, name: str, info: dict) -> None:
        with checkpoints.directory(f"{run_id}/{name}") as folder:
            model.save_pretrained(folder, safe_serialization=True)  # type: ignore[operator]
            write_folder(folder, tokenizer_files)
            (folder / RUN_JSON).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

    # Ray forwards a task's output to the driver: one line every 15 s per run, and the last step.
    steps_progress = Progress(cfg.steps, f"train {run_id}", unit="steps", stream=sys.stdout, min_interval_s=15)
    clock = StepClock()

    def on_step(step: int, loss: float) -> None:
        clock.tick()
        steps_progress.advance(detail=f"loss {loss:.3f}")

    result, steps = train_run(
        spec,
        cfg,
        tokens["train"],
        tokens["val"],
        vocab_size=tokens["vocab_size"],
        seq_len=seq_len,
        params_hash=params_hash,
        save_checkpoint=save_checkpoint,
        on_step=on_step,
        test_tokens=tokens["test"],
    )
    steps_progress.close()
    log.write({"run": run_id}, steps, name="steps.parquet")
    telemetry = RunTimes(round(clock.wall_time_s, 3), [round(t, 6) for t in clock.step_times])
    return {
        "diverged": result.diverged,
        "final_test_loss": result.final_test_loss,
        "telemetry": telemetry,
        "log": log,
        "checkpoints": checkpoints,
    }


def write_run(layout: Layout, run_id: str, key: ManifestKey, trained: dict) -> dict:
    """In the driver: a run's log, then its checkpoints (the run's completion marker); returns the rest of
    what the task returned."""
    trained = dict(trained)
    trained.pop("log").commit(layout.train, run_id, key)
    trained.pop("checkpoints").commit(layout.models, run_id, key)
    return trained


def training_tokens(layout: Layout) -> dict[str, Any]:
    """What every run trains and evaluates on: each split's token ids and the vocabulary size."""
    from lmgeo.core.contracts import SPLITS
    from lmgeo.text.corpus import load_meta, load_tokens

    return {
        **{split: load_tokens(layout.tokens, split) for split in SPLITS},
        "vocab_size": load_meta(layout.tokens)["vocab_size"],
    }


def code_spec(layout: Layout, recipe: str, arch: str) -> CodeSpec:
    """A run's code: the stage's, its recipe's and its family's, and the schemas of what it writes."""
    from lmgeo.core.contracts import STEPS, RunRecord

    used = [
        *members("lmgeo.study_b.recipes", layout, [recipe]),
        *members("lmgeo.models.families", layout, [arch]),
    ]
    return stage_code("train", layout, used, [STEPS.declared_schema, RunRecord.arrow_schema()])


def plan(params: Params, layout: Layout) -> Plan:
    """One shard per run, keyed by what that run reads: the tokens, its own settings (`for_run`: not the
    grid, other recipes' step sizes or other runs' budget) and the code of its recipe and family."""
    from lmgeo.text.corpus import load_meta

    load_meta(layout.tokens)  # refuses a missing or unreadable one, naming `lmgeo prepare`
    tokens = {"tokens": file_sha256(layout.tokens / "meta.json")}
    seq_len = params.prepare.seq_len
    # Read by the driver when the first run is submitted, then shared by every run.
    tokens_input = Load("tokens", functools.partial(training_tokens, layout))
    tokenizer_input = Load("tokenizer", functools.partial(read_folder, layout.tokenizer))
    measured = read_telemetry(layout)  # the longest runs of the last training here are dispatched first
    planned = []
    for spec in params.trained_runs():
        run = spec.run_id
        cfg = params.train.for_run(spec)
        code = versioned(code_spec(layout, spec.recipe, spec.arch), layout)
        key = ManifestKey(tokens, stage_params("train", params, seq_len, cfg), code[1])
        args = (spec, cfg, seq_len, key.params_hash, tokens_input, tokenizer_input)
        write = functools.partial(write_run, layout, run, key)
        expected_s = measured[run].wall_time_s if run in measured else None
        planned.append((Shard(run, train_task, args, code=code, write=write, expected_s=expected_s), key))
    return planned


def run(params: Params, layout: Layout, ray_address: str | None = None) -> None:
    planned = plan(params, layout)
    results = run_sharded_stage(
        "train", params, ray_address, layout, planned, [layout.train, layout.models], unit="runs"
    )
    telemetry = {run: out["telemetry"] for run, out in results.items()}
    write_telemetry(layout, {shard.key for shard, _ in planned}, telemetry)
    diverged = sorted(run for run, out in results.items() if out["diverged"])
    if diverged:
        print(f"train: diverged (marked in run.json, pipeline continues): {', '.join(diverged)}", flush=True)
