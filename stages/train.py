"""`lmgeo train`: one Ray task per run (arch × recipe × seed), resumable per run.

A run is complete when `data/models/<run>/final/run.json` exists with a matching manifest; it is
written last, after the checkpoints and `data/train/run=<run>/steps.parquet` are in place. Anything
else left by a killed run is removed and the run is redone. Runs no longer in the grid are pruned so
that later stages never read them.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from pipeline.core.config import Params, TaskResources
from stages.layout import Layout

RUN_JSON = "run.json"


def manifest_for(params: Params, layout: Layout) -> dict[str, str]:
    from pipeline.text.corpus import load_meta
    from pipeline.core.store import code_version

    return {
        "params_hash": params.section_hash("prepare", "train"),
        "code_version": code_version(),
        "tokens": load_meta(layout.tokens)["corpus_sha256"],
    }


def run_complete(layout: Layout, run_id: str, manifest: dict[str, str]) -> bool:
    run_json = layout.run_dir(run_id) / "final" / RUN_JSON
    steps = layout.steps_file(run_id)
    if not (run_json.is_file() and steps.is_file()):
        return False
    try:
        return json.loads(run_json.read_text()).get("manifest") == manifest
    except json.JSONDecodeError:
        return False


def remove_run(layout: Layout, run_id: str) -> None:
    shutil.rmtree(layout.run_dir(run_id), ignore_errors=True)
    shutil.rmtree(layout.steps_file(run_id).parent, ignore_errors=True)


def prune_stale(layout: Layout, keep: set[str]) -> None:
    for root, prefix in ((layout.models, ""), (layout.train, "run=")):
        if root.is_dir():
            for entry in root.iterdir():
                if entry.is_dir() and entry.name.removeprefix(prefix) not in keep:
                    shutil.rmtree(entry)


def train_task(layout: Layout, run_id: str, params: Params, manifest: dict[str, str], resources: TaskResources) -> dict:
    """Ray task: train one run and write its checkpoints, steps and run.json (last)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer

    from pipeline.text.corpus import load_meta, load_tokens
    from pipeline.core.progress import Progress
    from pipeline.core.store import atomic_path
    from pipeline.study_b.train import RunSpec, train_run

    torch.set_num_threads(max(1, int(resources.num_cpus)))  # no oversubscription; deterministic on CPU
    remove_run(layout, run_id)
    meta = load_meta(layout.tokens)
    tokenizer = AutoTokenizer.from_pretrained(layout.tokenizer)
    run_dir = layout.run_dir(run_id)

    def save_checkpoint(model: torch.nn.Module, name: str, info: dict) -> None:
        with atomic_path(run_dir / name) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if name == "init":  # the final run.json is written last, as the completion marker
                write_json(tmp / RUN_JSON, info)

    # Ray forwards a task's output to the driver: one line every 15 s per run, and the last step.
    steps_progress = Progress(params.train.steps, f"train {run_id}", unit="steps", stream=sys.stdout, min_interval_s=15)
    result, steps = train_run(
        RunSpec.parse(run_id), params.train, load_tokens(layout.tokens, "train"), load_tokens(layout.tokens, "val"),
        vocab_size=meta["vocab_size"], seq_len=params.prepare.seq_len,
        params_hash=manifest["params_hash"], save_checkpoint=save_checkpoint,
        on_step=lambda step, loss: steps_progress.advance(detail=f"loss {loss:.3f}"),
    )
    steps_progress.close()
    with atomic_path(layout.steps_file(run_id)) as tmp:
        pq.write_table(steps, tmp, compression="zstd")
    with atomic_path(run_dir / "final" / RUN_JSON) as tmp:  # the completion marker: last
        write_json(tmp, {"checkpoint": "final", **asdict(result), "manifest": manifest})
    return {"run": run_id, "diverged": result.diverged, "final_val_loss": result.final_val_loss}


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def run(params: Params, ray_address: str | None = None) -> None:
    from pipeline.core.execution import Shard, run_shards
    from stages.runtime import start_ray

    layout = Layout.here()
    manifest = manifest_for(params, layout)
    runs = params.train.runs()
    prune_stale(layout, set(runs))
    todo = [r for r in runs if not run_complete(layout, r, manifest)]
    print(f"train: {len(runs) - len(todo)}/{len(runs)} runs complete, {len(todo)} to do", flush=True)
    if not todo:
        return
    start_ray(params.ray, ray_address)
    resources = params.ray.resources_for("train")
    shards = [Shard(key=r, fn=train_task, args=(layout, r, params, manifest, resources)) for r in todo]
    results = run_shards(
        shards, resources, max_in_flight=params.ray.max_in_flight,
        max_retries=params.ray.max_retries, label="train",
    )
    diverged = sorted(r for r, out in results.items() if out["diverged"])
    if diverged:
        print(f"train: diverged (marked in run.json, pipeline continues): {', '.join(diverged)}", flush=True)

