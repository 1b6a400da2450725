"""Fan a stage's shards out as Ray tasks and collect them with a bounded ``ray.wait`` loop (SPEC §1).

The driver keeps at most ``max_in_flight`` tasks submitted, so a stage with thousands of shards
never holds thousands of refs or results at once, and it handles each result as soon as it arrives
(``on_result`` runs in the driver: with no shared filesystem, tasks return Arrow data and the driver
writes it). This module never calls ``ray.init``: the CLI (``stages.runtime.start_ray``) does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.core.config import TaskResources
from pipeline.core.progress import Progress

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.remote_function import RemoteFunction

# How long one ray.wait blocks: the loop wakes up this often to redraw the progress clock and to let
# Ctrl-C through; completions are still handled the moment they arrive.
WAIT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Shard:
    """One unit of work: ``fn(*args, **kwargs)`` run as a Ray task. ``fn`` must be module-level."""

    key: str
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


class ShardFailed(RuntimeError):
    """A shard's task raised (or its worker died more often than ``max_retries``)."""

    def __init__(self, key: str, cause: BaseException) -> None:
        original = getattr(cause, "cause", None) or cause  # RayTaskError wraps the task's exception
        message = f"shard {key!r} failed: {type(original).__name__}: {original}"
        if original is not cause:  # add the remote traceback
            message += f"\n{cause}"
        super().__init__(message)
        self.key = key
        self.cause = original


def run_shards(
    shards: Sequence[Shard],
    resources: TaskResources,
    *,
    max_in_flight: int,
    max_retries: int,
    label: str,
    on_result: Callable[[Shard, Any], Any] | None = None,
) -> dict[str, Any]:
    """Run every shard as a Ray task and return ``{shard.key: result}``.

    With ``on_result``, it is called in the driver as each shard completes and the dict holds what
    it returns instead of the task's result, so large results are not kept alive. On the first
    failure the remaining tasks are cancelled and ``ShardFailed`` names the shard.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    _check_unique_keys(shards)
    if not shards:
        return {}
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised: the CLI must call stages.runtime.start_ray first")
    _check_feasible(resources, label)
    remote_fns: dict[Callable[..., Any], RemoteFunction] = {}
    pending: Iterator[Shard] = iter(shards)
    in_flight: dict[ObjectRef, Shard] = {}
    results: dict[str, Any] = {}
    with Progress(len(shards), label) as progress:
        try:
            while True:
                _fill(in_flight, pending, max_in_flight, remote_fns, resources, max_retries)
                if not in_flight:
                    return results
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=WAIT_TIMEOUT_S)
                for ref in ready:
                    shard = in_flight.pop(ref)
                    results[shard.key] = _collect(shard, ref, on_result)
                    progress.advance(detail=shard.key)
                progress.refresh()
        except BaseException:
            _cancel(in_flight)
            raise


def _fill(
    in_flight: dict[ObjectRef, Shard],
    pending: Iterator[Shard],
    max_in_flight: int,
    remote_fns: dict[Callable[..., Any], RemoteFunction],
    resources: TaskResources,
    max_retries: int,
) -> None:
    while len(in_flight) < max_in_flight:
        shard = next(pending, None)
        if shard is None:
            return
        if shard.fn not in remote_fns:  # one RemoteFunction per fn: Ray exports the code once
            remote_fns[shard.fn] = _as_remote(shard.fn, resources, max_retries)
        in_flight[remote_fns[shard.fn].remote(*shard.args, **shard.kwargs)] = shard


def _as_remote(fn: Callable[..., Any], resources: TaskResources, max_retries: int) -> RemoteFunction:
    import ray

    options: dict[str, Any] = {
        "num_cpus": resources.num_cpus,
        "num_gpus": resources.num_gpus,
        "max_retries": max_retries,  # worker death only: exceptions raised by fn are not retried
    }
    if resources.resources:
        options["resources"] = dict(resources.resources)
    if resources.num_gpus > 0:
        # A fresh worker per GPU task: CUDA memory (allocator caches, contexts) is freed between shards.
        options["max_calls"] = 1
    return ray.remote(**options)(fn)


def _collect(shard: Shard, ref: ObjectRef, on_result: Callable[[Shard, Any], Any] | None) -> Any:
    import ray

    try:
        value = ray.get(ref)
    except ray.exceptions.RayError as err:
        raise ShardFailed(shard.key, err) from err
    if on_result is None:
        return value
    try:
        return on_result(shard, value)
    except Exception as err:
        err.add_note(f"while handling the result of shard {shard.key!r}")
        raise


def _cancel(in_flight: dict[ObjectRef, Shard]) -> None:
    import ray

    for ref in in_flight:
        # force: a task that ignores KeyboardInterrupt (e.g. inside a torch kernel) must not keep
        # its CPU/GPU after the stage has failed; its partial output is never marked complete.
        ray.cancel(ref, force=True)
    in_flight.clear()


def _check_unique_keys(shards: Sequence[Shard]) -> None:
    duplicates = sorted(key for key, n in Counter(s.key for s in shards).items() if n > 1)
    if duplicates:
        raise ValueError(f"duplicate shard keys: {duplicates}")


def _check_feasible(resources: TaskResources, label: str) -> None:
    """Fail fast when no live node can ever run the task (Ray would otherwise wait forever)."""
    import ray

    need = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.resources}
    need = {name: amount for name, amount in need.items() if amount > 0}
    offers = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if any(all(offer.get(name, 0) >= amount for name, amount in need.items()) for offer in offers):
        return
    shown = [{k: v for k, v in offer.items() if not k.startswith(_BOOKKEEPING)} for offer in offers]
    raise RuntimeError(
        f"{label}: no node of the Ray cluster can run a task needing {need}; its nodes offer {shown}. "
        "Lower the stage's task resources (ray.tasks in params.yaml) or join a cluster that has them."
    )


# Resources every Ray node reports that no task of ours asks for; left out of error messages.
_BOOKKEEPING = ("node:", "memory", "object_store_memory", "accelerator_type:")
