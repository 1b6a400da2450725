"""`lmgeo train`: one Ray task per run (arch × recipe × seed), resumable per run.

A run is one shard in two datasets: its checkpoints `data/models/<run>/{init,final}/` and its log
`data/train/run=<run>/steps.parquet`. The log commits first and the checkpoints last, so a run is complete
when both manifests hold its key; anything else left by a killed run is removed and the run redone.

Wall-clock times are not results: the same code and params must give the same bytes on every run, so
each run's step times go to `telemetry/train/<run>.json` (a DVC output outside the cache, SPEC §1).
"""

from __future__ import annotations

import json
import sys

from pipeline.core.execution import Shard
from pipeline.core.fingerprint import CodeSpec
from pipeline.core.store import ManifestKey, ShardWriter, file_sha256
from pipeline.params import Params
from pipeline.study_b.config import TrainConfig
from stages.layout import Layout
from stages.sharded import Plan, members, run_sharded_stage, stage_code, stage_params, versioned

RUN_JSON = "run.json"


def train_task(layout: Layout, run_id: str, cfg: TrainConfig, seq_len: int, key: ManifestKey) -> dict:
    """Ray task: train one run and write its log, then its checkpoints (each with `run.json`)."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.core.contracts import parse_run_id
    from pipeline.core.progress import Progress, StepClock
    from pipeline.study_b.train import train_run
    from pipeline.text.corpus import load_meta, load_tokens

    tokenizer = AutoTokenizer.from_pretrained(layout.tokenizer)
    with ShardWriter(layout.models, run_id, key) as checkpoints:

        def save_checkpoint(model: torch.nn.Module, name: str, info: dict) -> None:
            with checkpoints.directory(f"{run_id}/{name}") as folder:
                model.save_pretrained(folder, safe_serialization=True)
                tokenizer.save_pretrained(folder)
                (folder / RUN_JSON).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

        # Ray forwards a task's output to the driver: one line every 15 s per run, and the last step.
        steps_progress = Progress(cfg.steps, f"train {run_id}", unit="steps", stream=sys.stdout, min_interval_s=15)
        clock = StepClock()

        def on_step(step: int, loss: float) -> None:
            clock.tick()
            steps_progress.advance(detail=f"loss {loss:.3f}")

        result, steps = train_run(
            parse_run_id(run_id), cfg, load_tokens(layout.tokens, "train"), load_tokens(layout.tokens, "val"),
            vocab_size=load_meta(layout.tokens)["vocab_size"], seq_len=seq_len,
            params_hash=key.params_hash, save_checkpoint=save_checkpoint,
            on_step=on_step,
            test_tokens=load_tokens(layout.tokens, "test"),
        )
        steps_progress.close()
        with ShardWriter(layout.train, run_id, key) as log:
            log.write({"run": run_id}, steps, name="steps.parquet")
    telemetry = {"run": run_id, "wall_time_s": round(clock.wall_time_s, 3),
                 "step_time_s": [round(t, 6) for t in clock.step_times]}  # fmt: skip
    return {"diverged": result.diverged, "final_test_loss": result.final_test_loss, "telemetry": telemetry}


def code_spec(layout: Layout, recipe: str, arch: str) -> CodeSpec:
    """A run's code: the stage's, its recipe's and its family's, and the schemas of what it writes."""
    from pipeline.core.contracts import STEPS, RunRecord

    used = [
        *members("pipeline.study_b.recipes", layout, [recipe]),
        *members("pipeline.models.families", layout, [arch]),
    ]
    return stage_code("train", layout, used, [STEPS.declared_schema, RunRecord.arrow_schema()])


def plan(params: Params, layout: Layout) -> Plan:
    """One shard per run, keyed by what that run reads: the tokens, its own settings (`for_run`: not the
    grid, other recipes' step sizes or other runs' budget) and the code of its recipe and family."""
    from pipeline.core.contracts import parse_run_id
    from pipeline.text.corpus import load_meta

    load_meta(layout.tokens)  # refuses a missing or unreadable one, naming `lmgeo prepare`
    tokens = {"tokens": file_sha256(layout.tokens / "meta.json")}
    seq_len = params.prepare.seq_len
    planned = []
    for run in params.trained_runs():
        spec = parse_run_id(run)
        cfg = params.train.for_run(spec)
        code = versioned(code_spec(layout, spec.recipe, spec.arch), layout)
        key = ManifestKey(tokens, stage_params("train", params, seq_len, cfg), code[1])
        planned.append((Shard(run, train_task, (layout, run, cfg, seq_len, key), code=code), key))
    return planned


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    planned = plan(params, layout)
    results = run_sharded_stage("train", params, ray_address, [layout.train, layout.models], planned)
    telemetry = {run: out["telemetry"] for run, out in results.items()}
    write_telemetry(layout, {shard.key for shard, _ in planned}, telemetry)
    diverged = sorted(run for run, out in results.items() if out["diverged"])
    if diverged:
        print(f"train: diverged (marked in run.json, pipeline continues): {', '.join(diverged)}", flush=True)


def write_telemetry(layout: Layout, planned: set[str], measured: dict[str, dict]) -> None:
    """Each run's wall-clock times, `telemetry/train/<run>.json`: those just measured are written, those of
    runs no longer planned removed (a run skipped as complete keeps the times of the run that made it)."""
    from pipeline.core.store import atomic_write

    folder = layout.telemetry / "train"
    folder.mkdir(parents=True, exist_ok=True)
    for run, telemetry in measured.items():
        atomic_write(folder / f"{run}.json", json.dumps(telemetry, sort_keys=True) + "\n")
    for stale in folder.glob("*.json"):
        if stale.stem not in planned:
            stale.unlink()
