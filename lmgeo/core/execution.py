"""Fan a stage's shards out as Ray tasks and collect them with a bounded ``ray.wait`` loop (SPEC §1).

The driver keeps at most ``max_in_flight`` tasks submitted, so a stage with thousands of shards
never holds thousands of refs or results at once. Every task runs through ``run_batch``, in a worker
whose kernels and thread counts are pinned (``lmgeo.core.determinism``; parallelism comes from Ray,
not from BLAS oversubscription): it checks that the worker runs the code the driver planned with before
it computes anything, and runs a batch of consecutive small shards, so the fixed cost of a task is paid
once per batch. Where a stage knows how long its shards ran last time, the longest are submitted first.

Data moves through Ray's object store only, so a task never touches the driver's filesystem (SPEC §1): a
shard's inputs are ``Load`` arguments, read by the driver when the task is submitted and put in the
object store once for every shard that names them; a task yields each shard's result as soon as it is
computed (a Ray streaming generator, whose objects the driver owns), and the driver hands it to the
shard's ``write`` (atomic, with a manifest) before it waits for the next. This module never calls
``ray.init``: the CLI (``lmgeo.driver.runtime.start_ray``) does.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmgeo.core.config import TaskResources
from lmgeo.core.determinism import pin_torch, pinned_environment
from lmgeo.core.errors import InputError
from lmgeo.core.fingerprint import CodeSpec
from lmgeo.core.progress import Progress

if TYPE_CHECKING:
    from ray import ObjectRef, ObjectRefGenerator
    from ray.remote_function import RemoteFunction

# How long one ray.wait blocks: the loop wakes up this often to redraw the progress clock and to let
# Ctrl-C through; completions are still handled the moment they arrive.
WAIT_TIMEOUT_S = 1.0
# A shard expected to run this long (seconds) gets a task of its own: a task's fixed cost (~2 s: scheduling,
# the code check, its inputs) is then a tenth of it at most, and long shards spread over the workers.
ALONE_S = 20.0


@dataclass(frozen=True)
class Load:
    """An input of a task that the driver reads (``read()``) when it submits the task, and passes through
    Ray's object store: the task receives the value. Shards naming the same ``key`` share one copy, read
    once while they are submitted one after another (the driver drops it when its last shard is in flight)."""

    key: str
    read: Callable[[], Any] = field(compare=False)


@dataclass(frozen=True)
class Shard:
    """One unit of work: ``fn(*args, **kwargs)`` run as a Ray task, then ``write(result)`` in the driver.
    ``fn`` must be module-level; ``Load`` arguments (at the top level of ``args`` and ``kwargs``) reach it as
    the values they read. The shard's result is what ``write`` returns (``fn``'s result without one).

    ``code`` is ``(what the version covers, code version)`` when the shard's output is keyed by that
    version: the task refuses to run on a worker whose code has another version.

    ``expected_s`` is how long the shard is expected to run (its last measured time), where the stage knows it:
    tasks are submitted longest first, so no long shard starts last while the other workers idle, and a shard
    expected to run ``ALONE_S`` or longer has a task of its own. It changes when a shard runs, never what it
    computes.
    """

    key: str
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    code: tuple[CodeSpec, str] | None = None
    write: Callable[[Any], Any] | None = None
    expected_s: float | None = None

    def loads(self) -> list[Load]:
        return [value for value in (*self.args, *self.kwargs.values()) if isinstance(value, Load)]


class CodeMismatch(InputError):
    """A Ray worker imports other code than the driver planned with."""


class ShardError(Exception):
    """Raised in a worker: shard ``key`` of a batch failed with ``cause`` (arguments kept for pickling). A cause
    that does not survive pickling (a third party's exception whose constructor takes other arguments than it
    keeps) travels as its message, as an ``InputError`` when it was one, so the driver still reports it."""

    def __init__(self, key: str, cause: BaseException) -> None:
        cause = cause if _round_trips(cause) else _stand_in(cause)
        super().__init__(key, cause)
        self.key, self.cause = key, cause


def _round_trips(err: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any failure to rebuild the exception is what is tested
        return False
    return True


def _stand_in(err: BaseException) -> BaseException:
    message = f"{type(err).__name__}: {err}"
    return InputError(str(err)) if isinstance(err, InputError) else RuntimeError(message)


@functools.cache
def _running_code(spec: CodeSpec) -> str:
    """The digest of the code this worker process runs (its imports do not change while it lives: a Ray
    worker serves one job)."""
    from lmgeo.core.fingerprint import code_digest

    return code_digest(spec)


def run_batch(
    threads: int, code: tuple[CodeSpec, str] | None, calls: list[tuple[str, Callable[..., Any], tuple, dict]]
) -> Iterator[Any]:
    """The body of every task, in the worker: one thread count, one code check, then each shard's
    ``fn(*args, **kwargs)`` in turn (several small shards share one task's fixed cost), its inputs taken from
    the object store; each result is yielded as soon as it is computed, so the driver writes it at once."""
    import ray

    pin_torch(threads)
    if code is not None:
        spec, planned = code
        running = _running_code(spec)
        if planned.rpartition("+")[2] != running:  # the package version is the driver's label
            import importlib

            where = importlib.import_module(spec.module.split(".")[0]).__file__
            raise ShardError(
                calls[0][0],
                CodeMismatch(
                    f"this Ray worker runs {spec.module} with code digest {running} (imported from {where}), but the "
                    f"driver planned version {planned}: run lmgeo from the workspace whose code you mean to run; "
                    "lmgeo's code reaches the workers from the driver (runtime_env py_modules)"
                ),
            )
    for key, fn, args, kwargs in calls:
        try:
            yield fn(*_fetched(ray, args), **dict(zip(kwargs, _fetched(ray, kwargs.values()), strict=True)))
        except Exception as err:
            raise ShardError(key, err) from err


def _fetched(ray: Any, values: Iterable[Any]) -> list[Any]:
    """The arguments with each object reference (a ``Load``'s value) replaced by its object."""
    return [ray.get(value) if isinstance(value, ray.ObjectRef) else value for value in values]


class ShardFailed(RuntimeError):
    """A shard's task raised (or its worker died more often than ``max_retries``)."""

    def __reduce__(self) -> tuple[type, tuple[str, BaseException]]:
        return type(self), (self.key, self.cause)

    def __init__(self, key: str, cause: BaseException) -> None:
        original = getattr(cause, "cause", None) or cause  # RayTaskError wraps the task's exception
        if isinstance(original, ShardError):  # which shard of the batch
            key, original = original.key, original.cause
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
    shards_per_task: int = 1,
    unit: str = "shards",
) -> dict[str, Any]:
    """Run every shard in Ray tasks of up to ``shards_per_task`` consecutive shards (one for a GPU task,
    whose worker is replaced after each task to free the device's memory, and for a shard expected to run
    long), submitted longest first (``Shard.expected_s``), write each shard's result as it arrives
    (``Shard.write``) and return ``{shard.key: result}``. On the first failure the remaining tasks are
    cancelled and ``ShardFailed`` names the shard. The progress bar counts ``unit`` (what a shard is to a person:
    ``runs`` for training)."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    _check_unique_keys(shards)
    if not shards:
        return {}
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised: the CLI must call lmgeo.driver.runtime.start_ray first")
    _check_feasible(resources, label)
    remote_fn = _as_remote(resources, max_retries)  # one RemoteFunction: Ray exports the code once
    pending = iter(_longest_first(_batches(shards, 1 if resources.num_gpus > 0 else shards_per_task)))
    inputs = _Inputs(shards)
    in_flight: dict[ObjectRefGenerator, list[Shard]] = {}  # a task → its shards not yet collected
    results: dict[str, Any] = {}
    with Progress(len(shards), label, unit=unit) as progress:
        try:
            while True:
                _fill(in_flight, pending, max_in_flight, remote_fn, resources.threads, inputs)
                if not in_flight:
                    return results
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=WAIT_TIMEOUT_S)
                for task in ready:
                    collected = _collect_next(in_flight, task)
                    if collected is not None:
                        results[collected[0]] = collected[1]
                        progress.advance(detail=collected[0])
                progress.refresh()
        except BaseException:
            _cancel(in_flight)
            raise


def _batches(shards: Sequence[Shard], size: int) -> Iterator[list[Shard]]:
    """Consecutive shards (a stage plans them model by model, layer by layer) sharing a function and a
    code version, at most ``size`` per batch; a shard expected to run long is a batch of its own."""
    batch: list[Shard] = []
    for shard in shards:
        if batch and (
            len(batch) == size
            or (shard.fn, shard.code) != (batch[0].fn, batch[0].code)
            or _runs_alone(shard)
            or _runs_alone(batch[0])
        ):
            yield batch
            batch = []
        batch.append(shard)
    if batch:
        yield batch


def _runs_alone(shard: Shard) -> bool:
    return shard.expected_s is not None and shard.expected_s >= ALONE_S


def _longest_first(batches: Iterable[list[Shard]]) -> list[list[Shard]]:
    """The batches in the order to submit them: those holding a shard of unknown length first, in plan order
    (any of them may be long), then the others by expected length, longest first (the longest-processing-time
    rule: the last tasks to start are short, so the workers finish together)."""

    def expected_s(batch: list[Shard]) -> float:
        known = [shard.expected_s for shard in batch if shard.expected_s is not None]
        return sum(known) if len(known) == len(batch) else math.inf

    return sorted(batches, key=expected_s, reverse=True)  # stable: ties keep plan order


class _Inputs:
    """The object-store copy of each ``Load`` while a shard not yet submitted still needs it."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        self._waiting = Counter(load.key for shard in shards for load in shard.loads())
        self._refs: dict[str, ObjectRef] = {}

    def submitted(self, shard: Shard) -> tuple[tuple, dict]:
        """The shard's ``args`` and ``kwargs`` with each ``Load`` replaced by its object's reference (a task in
        flight keeps its objects alive; the driver forgets one once no shard waits for it)."""
        import ray

        def ref(value: Any) -> Any:
            if not isinstance(value, Load):
                return value
            if value.key not in self._refs:
                self._refs[value.key] = ray.put(value.read())
            found = self._refs[value.key]
            self._waiting[value.key] -= 1
            if not self._waiting[value.key]:
                del self._refs[value.key]
            return found

        return tuple(map(ref, shard.args)), {name: ref(value) for name, value in shard.kwargs.items()}


def _fill(
    in_flight: dict[ObjectRefGenerator, list[Shard]],
    pending: Iterator[list[Shard]],
    max_in_flight: int,
    remote_fn: RemoteFunction,
    threads: int,
    inputs: _Inputs,
) -> None:
    while len(in_flight) < max_in_flight:
        batch = next(pending, None)
        if batch is None:
            return
        # Named after the stage's task (`ray::fit_task` in process lists and the dashboard), not `run_batch`.
        task = remote_fn.options(name=batch[0].fn.__name__)
        calls = [(s.key, s.fn, *inputs.submitted(s)) for s in batch]
        in_flight[task.remote(threads, batch[0].code, calls)] = batch


def _as_remote(resources: TaskResources, max_retries: int) -> RemoteFunction:
    import ray

    options: dict[str, Any] = {
        "num_cpus": resources.num_cpus,
        "num_gpus": resources.num_gpus,
        # Worker death only: exceptions raised by fn are not retried. A retried task yields its shards again
        # from the first; Ray passes on only those the driver has not received.
        "max_retries": max_retries,
        # The kernels and thread counts results depend on, whatever the node's environment says.
        "runtime_env": {"env_vars": pinned_environment(resources.threads)},
    }
    if resources.resources:
        options["resources"] = dict(resources.resources)
    if resources.num_gpus > 0:
        # A fresh worker per GPU task: CUDA memory (allocator caches, contexts) is freed between shards.
        options["max_calls"] = 1
    return ray.remote(**options)(run_batch)  # type: ignore[return-value]  # ray types it RemoteFunction2[...]


def _collect_next(in_flight: dict[ObjectRefGenerator, list[Shard]], task: ObjectRefGenerator) -> tuple[str, Any] | None:
    """``(key, result)`` of the next shard of a ready task, written (``Shard.write``); None when the task
    has ended."""
    import ray

    shards = in_flight[task]
    try:
        ref = next(task)
    except StopIteration:  # every shard collected, or the task ended early (an error raised from its next)
        del in_flight[task]
        return None
    shard = shards.pop(0)
    if not shards:
        del in_flight[task]
    try:
        value = ray.get(ref)
    except ray.exceptions.RayError as err:
        raise ShardFailed(shard.key, err) from err
    del ref  # the driver owns the object: dropping it frees the object store before the write
    return shard.key, (value if shard.write is None else shard.write(value))


def _cancel(in_flight: dict[ObjectRefGenerator, list[Shard]]) -> None:
    import ray

    for task in in_flight:
        # force: a task that ignores KeyboardInterrupt (e.g. inside a torch kernel) must not keep
        # its CPU/GPU after the stage has failed; its partial output is never marked complete.
        ray.cancel(task, force=True)
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
    raise InputError(
        f"{label}: no node of the Ray cluster can run a task needing {need}; its nodes offer {shown}. "
        "Lower the stage's task resources (ray.tasks in params.yaml) or join a cluster that has them."
    )


# Resources every Ray node reports that no task of ours asks for; left out of error messages.
_BOOKKEEPING = ("node:", "memory", "object_store_memory", "accelerator_type:")
