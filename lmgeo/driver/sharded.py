"""The one loop of every sharded stage: plan (validated), prune what the plan no longer has, skip the
shards that are complete, fan the rest out as Ray tasks; and how data reaches a task and comes back: the
driver reads a task's inputs (`Load`s such as `partition_input`) and writes what it returns (`write_to`), so
tasks never touch the workspace and run on any node of a cluster (SPEC §1)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmgeo.core.config import digest
from lmgeo.core.contracts import Dataset, read
from lmgeo.core.execution import Load, Shard, run_shards
from lmgeo.core.fingerprint import CodeSpec, code_version, index_members
from lmgeo.core.store import (
    CorruptShardError,
    ManifestKey,
    ShardParts,
    dataset_digest,
    incomplete_shards,
    lineage_of,
    prune_shards,
    read_plan,
    verified_files,
    write_plan,
)
from lmgeo.driver.layout import Layout
from lmgeo.params import Params

Plan = Sequence[tuple[Shard, ManifestKey]]


def planned_keys(stage: str, params: Params, layout: Layout) -> dict[str, ManifestKey]:
    """shard → key of another stage's current plan: what a reader of that stage's output must find.

    The stage is imported by name, so a reader's code version does not include the writer's code (the
    writer's output, keyed by it, is what the reader depends on)."""
    module = importlib.import_module(f"lmgeo.stages.{stage}")
    return {shard.key: key for shard, key in module.plan(params, layout)}


def stage_params(stage: str, params: Params, *values: Any) -> str:
    """The params hash of a stage's shards: the values its tasks use, and the threads each task runs with
    (a reduction over another number of threads sums in another order: floats change in the last bits)."""
    return digest((values, params.ray.resources_for(stage).threads))


def stage_code(stage: str, layout: Layout, members: Sequence[str] = (), schemas: Sequence[Any] = ()) -> CodeSpec:
    """What the code version of a shard of `stage` covers: the stage's module, the registry `members` it
    uses (module names) and the declared `schemas` (pyarrow) of what it writes."""
    return CodeSpec(f"lmgeo.stages.{stage}", tuple(sorted(members)), tuple(schema.to_string() for schema in schemas))


def members(index: str, layout: Layout, names: Sequence[str] | None = None) -> list[str]:
    """The modules of registry `index`'s members `names` (all of them when None): one module each, named as
    the member."""
    listed = index_members(index, [layout.root])
    chosen = listed if names is None else [f"{index}.{name}" for name in names]
    missing = sorted(set(chosen) - set(listed))
    if missing:
        raise ValueError(f"{index} lists no module {', '.join(missing)}: a member is one module named as it")
    return chosen


def versioned(spec: CodeSpec, layout: Layout) -> tuple[CodeSpec, str]:
    """`(spec, version)` as the stage's Ray workers will import the code, computed once per spec."""
    return spec, _version(spec, layout.root)


@functools.cache
def _version(spec: CodeSpec, root: Path) -> str:
    return code_version(spec, roots=[root])


def partition_input(
    root: Path,
    dataset: Dataset,
    planned: Mapping[str, ManifestKey],
    where: dict[str, Any],
    columns: Sequence[str] | None = None,
    *,
    rebuild: str,
) -> Load:
    """A task's input: the rows of `dataset` in partition `where` (`columns`, or all), from the verified
    files of the `planned` shards under `root`, read by the driver when it submits the task."""
    key = f"{root}:{sorted(where.items())}:{columns}"
    return Load(key, functools.partial(_read_partition, root, dataset, dict(planned), where, columns, rebuild))


def _read_partition(
    root: Path,
    dataset: Dataset,
    planned: dict[str, ManifestKey],
    where: dict[str, Any],
    columns: Sequence[str] | None,
    rebuild: str,
) -> Any:
    return read(root, dataset, verified_files(root, planned, rebuild=rebuild), where, columns)


def write_to(root: Path, shard: str, key: ManifestKey) -> Callable[[ShardParts], None]:
    """A shard's `write`: the driver commits the parts its task returned under `root`."""
    return lambda parts: parts.commit(root, shard, key)


def _record_in_progress(root: Path, planned: dict[str, ManifestKey]) -> None:
    """Record `planned` as in progress in `root`, unless that very plan is recorded already: a rerun that redoes
    a few shards of the completed plan (one found corrupt) keeps its record, and changes nothing when it fails."""
    try:
        if read_plan(root).keys == planned:
            return
    except CorruptShardError:  # none (or an unreadable one) yet
        pass
    write_plan(root, planned, complete=False)


def run_sharded_stage(
    stage: str,
    params: Params,
    ray_address: str | None,
    layout: Layout,
    plan: Plan,
    writes: Sequence[Path],
    reads: Sequence[Path] = (),
    unit: str = "shards",
) -> dict[str, Any]:
    """Run the planned shards that are not complete in every one of `writes` (the datasets the stage
    writes; a shard is complete when its manifest has the planned key, its files are intact and it is what
    the workspace's dvc.lock records of it, `lmgeo.core.committed`); first remove shards that are no
    longer in the plan; record the plan as in progress when there is work to do; last, record the plan as
    complete in each dataset (`write_plan`), with the lineage of the datasets it `reads` and of those it
    writes beside it; the progress bar counts `unit`. Returns each run task's result."""
    from lmgeo.core.committed import committed
    from lmgeo.driver.runtime import check_reachable, start_ray

    check_reachable(params.ray, ray_address)  # before the prune: a stage that cannot run changes nothing
    keep = {shard.key for shard, _ in plan}
    removed = max((prune_shards(root, keep) for root in writes), default=0)
    keys = {shard.key: key for shard, key in plan}
    redo = set().union(*(incomplete_shards(root, keys, committed(layout.root, root)) for root in writes))
    todo = [shard for shard, _ in plan if shard.key in redo]
    if todo:
        for root in writes:  # what a query of the stage's output, stopped half-way, reads as planned but missing
            _record_in_progress(root, keys)
    print(
        f"{stage}: {len(plan) - len(todo)}/{len(plan)} shards complete, {len(todo)} to do"
        + (f", {removed} stale removed" if removed else ""),
        flush=True,
    )
    lineage = lineage_of(reads)  # what the tasks read: before they run
    results: dict[str, Any] = {}
    if todo:
        start_ray(params.ray, ray_address)
        results = run_shards(
            todo,
            params.ray.resources_for(stage),
            max_in_flight=params.ray.max_in_flight,
            max_retries=params.ray.max_retries,
            label=stage,
            shards_per_task=params.ray.shards_per_task,
            unit=unit,
        )
    for root in writes:  # every planned shard is complete: what a reader without a plan checks against
        beside = {other.name: dataset_digest(other) for other in writes if other != root}
        write_plan(root, keys, lineage | beside)
    return results
