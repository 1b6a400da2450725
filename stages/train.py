"""`lmgeo train`: one Ray task per run (arch × recipe × seed), resumable per run.

A run is one shard in two datasets: its checkpoints `data/models/<run>/{init,final}/` and its log
`data/train/run=<run>/steps.parquet`. The log commits first and the checkpoints last, so a run is complete
when both manifests hold its key; anything else left by a killed run is removed and the run redone.
"""

from __future__ import annotations

import json
import sys

from pipeline.core.execution import Shard
from pipeline.core.store import ManifestKey, ShardWriter
from pipeline.params import Params
from stages.layout import Layout
from stages.sharded import Plan, run_sharded_stage, stage_code, stage_params

RUN_JSON = "run.json"


def train_task(layout: Layout, run_id: str, params: Params, key: ManifestKey) -> dict:
    """Ray task: train one run and write its log, then its checkpoints (each with `run.json`)."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.core.contracts import parse_run_id
    from pipeline.core.progress import Progress
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
        steps_progress = Progress(params.train.steps, f"train {run_id}", unit="steps", stream=sys.stdout, min_interval_s=15)
        result, steps = train_run(
            parse_run_id(run_id), params.train, load_tokens(layout.tokens, "train"), load_tokens(layout.tokens, "val"),
            vocab_size=load_meta(layout.tokens)["vocab_size"], seq_len=params.prepare.seq_len,
            params_hash=key.params_hash, save_checkpoint=save_checkpoint,
            on_step=lambda step, loss: steps_progress.advance(detail=f"loss {loss:.3f}"),
            test_tokens=load_tokens(layout.tokens, "test"),
        )
        steps_progress.close()
        with ShardWriter(layout.train, run_id, key) as log:
            log.write({"run": run_id}, steps, name="steps.parquet")
    return {"run": run_id, "diverged": result.diverged, "final_test_loss": result.final_test_loss}


def plan(params: Params, layout: Layout) -> Plan:
    from pipeline.text.corpus import load_meta

    code = stage_code("train", layout)
    key = ManifestKey(
        inputs={"tokens": load_meta(layout.tokens)["corpus_sha256"]},
        params_hash=stage_params("train", params, params.prepare, params.train),
        code_version=code,
    )
    return [(Shard(run, train_task, (layout, run, params, key), code=("stages.train", code)), key) for run in params.trained_runs()]


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    results = run_sharded_stage("train", params, ray_address, [layout.train, layout.models], plan(params, layout))
    diverged = sorted(run for run, out in results.items() if out["diverged"])
    if diverged:
        print(f"train: diverged (marked in run.json, pipeline continues): {', '.join(diverged)}", flush=True)
