"""The common shape of a sharded stage: plan shards, prune stale ones, skip complete ones, fan out."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core.config import Params
from pipeline.core.execution import Shard, run_shards
from pipeline.core.store import ManifestKey, prune_shards, shard_complete


def run_sharded_stage(
    stage: str,
    params: Params,
    ray_address: str | None,
    root: Path,
    plan: Sequence[tuple[Shard, ManifestKey]],
) -> dict[str, Any]:
    """Run the planned shards that are not complete under `root` (a shard is complete when its
    manifest matches its key); first remove shards that are no longer in the plan."""
    from stages.runtime import start_ray

    removed = prune_shards(root, keep={shard.key for shard, _ in plan})
    todo = [shard for shard, key in plan if not shard_complete(root, shard.key, key)]
    print(
        f"{stage}: {len(plan) - len(todo)}/{len(plan)} shards complete, {len(todo)} to do"
        + (f", {removed} stale removed" if removed else ""),
        flush=True,
    )
    if not todo:
        return {}
    start_ray(params.ray, ray_address)
    return run_shards(
        todo,
        params.ray.resources_for(stage),
        max_in_flight=params.ray.max_in_flight,
        max_retries=params.ray.max_retries,
        label=stage,
    )
