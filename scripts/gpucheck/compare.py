"""Each study's library path on the device against the same calls on the CPU of the same machine.

Study A: extraction (`extract_batches`), the kNN search, every fit class (`fit_layer`) and patching
(`patch_kl_anchors`), on one model's activations extracted on the CPU, so both devices see identical
inputs. Study B: `train_run` for a few steps of every recipe (bf16 autocast on CUDA, float32 on the CPU, as
`train_run` chooses; `torch.compile` where `train.compile` asks for it), with the Hilbert invariant checked
on every logged step of the device run. And whether GPU work leaves memory allocated after a shard.

Every function takes the device to test; on the CPU (the stand-in run of the test suite) both sides are
the CPU and must agree exactly, which exercises the whole path without a GPU.
"""

from __future__ import annotations

import functools
import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from lmgeo.commands.bench.synthetic import token_ids
from lmgeo.core.contracts import FIT_METRICS, RunSpec, arrow_to_vectors
from lmgeo.core.progress import StepClock
from lmgeo.models.config import ModelSize
from lmgeo.models.registry import build_model
from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.extract import extract_batches
from lmgeo.study_a.fits import choose_anchors, finite_rows, fit_layer
from lmgeo.study_a.knn import nearest_neighbours, neighbour_distances
from lmgeo.study_a.patching import patch_kl_anchors
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.config import TrainConfig
from lmgeo.study_b.train import INVARIANT_RTOL, train_run
from scripts.gpucheck.summary import Outcome
from scripts.gpucheck.tolerances import TOLERANCES, Agreement, agree, combine, largest

CPU = torch.device("cpu")


@dataclass(frozen=True)
class StudyAShape:
    label: str
    size: ModelSize
    vocab: int
    seq_len: int
    n_seq: int  # sequences extracted; the fit pool is all their tokens
    batch: int  # sequences per forward (extraction and patching)
    anchors: int  # fitted anchors
    patch_anchors: int  # of those, patched
    knn_chunk: int  # small enough that the kNN merges several chunks
    k: int  # neighbours of a fit: more than d, so that every local class is identified and compared (SPEC §4.5)


@dataclass(frozen=True)
class TrainShape:
    label: str
    size: ModelSize
    vocab: int
    seq_len: int
    batch: int
    steps: int
    save_checkpoints: bool  # write both checkpoints with save_pretrained, as the train stage does


# ------------------------------------------------------------------------------------ Study A
@functools.cache
def cpu_states(arch: str, shape: StudyAShape) -> tuple[np.ndarray, dict[int, pa.Table]]:
    """Token ids and the CPU extraction of one model (every layer's rows): the inputs both devices share."""
    tokens = token_ids(shape.n_seq, shape.seq_len, shape.vocab, seed=1)
    return tokens, _extract(_model(arch, shape), tokens, shape.batch, CPU)


def _model(arch: str, shape: StudyAShape) -> Any:
    return build_model(arch, shape.size, shape.vocab, shape.seq_len, seed=0).eval()


def _extract(model: Any, tokens: np.ndarray, batch: int, device: torch.device) -> dict[int, pa.Table]:
    seq_ids = np.arange(len(tokens), dtype=np.int32)
    batches: dict[int, list[pa.RecordBatch]] = {}
    for layer, rows in extract_batches(model, tokens, seq_ids, batch, device):
        batches.setdefault(layer, []).append(rows)
    return {layer: pa.Table.from_batches(parts) for layer, parts in batches.items()}


def compare_extraction(arch: str, shape: StudyAShape, device: torch.device) -> Outcome:
    tokens, on_cpu = cpu_states(arch, shape)
    on_device = _extract(_model(arch, shape).to(device), tokens, shape.batch, device)
    if on_device.keys() != on_cpu.keys():
        return Outcome(f"layers differ: {sorted(on_device)} vs {sorted(on_cpu)}", passed=False)
    same_rows = all(on_device[layer].drop(["h"]).equals(on_cpu[layer].drop(["h"])) for layer in on_cpu)
    parts = {}
    for layer, table in on_cpu.items():
        h = arrow_to_vectors(table["h"])
        on_gpu = arrow_to_vectors(on_device[layer]["h"])
        parts[f"layer {layer}"] = agree(on_gpu, h, TOLERANCES["activations"], largest(h))
    overall = combine(parts)
    return Outcome(
        f"{len(parts)} layers × {tokens.size} tokens: {overall.describe()}" + ("" if same_rows else "; ids differ"),
        {"per_layer": parts, "same_ids": same_rows},
        overall.passed and same_rows,
    )


def _transition(arch: str, shape: StudyAShape) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(ids (n, 3), h_l, h_{l+1}, l) of the middle layer transition of the CPU extraction."""
    _, states = cpu_states(arch, shape)
    layer = (len(states) - 1) // 2
    ids = np.stack([states[layer][c].to_numpy() for c in ("seq_id", "pos", "token_id")], axis=1)
    return ids, arrow_to_vectors(states[layer]["h"]), arrow_to_vectors(states[layer + 1]["h"]), layer


def compare_knn(arch: str, shape: StudyAShape, device: torch.device) -> Outcome:
    """Both distances, with and without excluding the anchor's own sequence, chunked so the merge runs."""
    ids, x, _, _ = _transition(arch, shape)
    pool = torch.as_tensor(x, dtype=torch.float64)
    anchors = torch.as_tensor(choose_anchors(len(x), shape.anchors, seed=0))
    seq = torch.as_tensor(ids[:, 0])
    k = AnalysisConfig().k
    parts, mismatched = {}, 0
    for distance, same_seq in (("euclidean", False), ("cosine", True)):
        kwargs = {"distance": distance, "seq_id": seq if same_seq else None, "chunk": shape.knn_chunk}
        cpu = nearest_neighbours(pool, anchors, k, **kwargs)
        dev = nearest_neighbours(pool.to(device), anchors.to(device), k, **kwargs)
        label = f"{distance}{', other sequences' if same_seq else ''}"
        cpu_distance = neighbour_distances(pool, anchors, cpu, distance)
        dev_distance = neighbour_distances(pool.to(device), anchors.to(device), dev, distance)
        parts[label] = agree(dev_distance.cpu().numpy(), cpu_distance.numpy(), TOLERANCES["knn"])
        mismatched += int((dev.cpu() != cpu).sum())
    overall = combine(parts)
    return Outcome(
        f"{len(anchors)} anchors, k = {k}, pool {len(x)} × {x.shape[1]}: distances {overall.describe()}; "
        f"{mismatched} of {overall.size} neighbour indices differ (ties within tolerance)",
        {"parts": parts, "index_mismatches": mismatched},
        overall.passed,
    )


def compare_fit(fn: str, arch: str, shape: StudyAShape, device: torch.device) -> Outcome:
    """Every column of `fit_layer` on the device against the CPU, null-aware (`compare_fit_tables`)."""
    ids, x, y, layer = _transition(arch, shape)
    cfg = AnalysisConfig(anchors=shape.anchors, knn_chunk=shape.knn_chunk, k=shape.k)
    anchors = choose_anchors(len(x), cfg.anchors, cfg.seed, finite_rows(x, y))
    args = (x, y, ids[:, 0], ids[:, 1], ids[:, 2], anchors, [fn], cfg)
    cpu = fit_layer(*args, device=CPU)[0][fn]
    dev = fit_layer(*args, device=device)[0][fn]
    found = compare_fit_tables(dev, cpu)
    overall = combine(found.values)
    worst = max(found.values, key=lambda name: found.values[name].worst_ratio)
    identified = int(np.sum(cpu["operator_identified"].to_numpy(zero_copy_only=False)))
    return Outcome(
        f"layer {layer}→{layer + 1}, {len(anchors)} anchors, d = {x.shape[1]}, k = {cfg.k} ({identified} identified, "
        f"{found.tied} tied left out of proj_*): {overall.describe()}, worst: {worst}"
        + (f"; validity differs in {', '.join(found.mismatched)}" if found.mismatched else ""),
        {
            "per_column": found.values,
            "validity_mismatches": found.mismatched,
            "tied": found.tied,
            "identified": identified,
        },
        overall.passed and not found.mismatched,
    )


# Columns that need the map itself (its dominant subspace), left out where the Study A rule leaves them out:
# at an anchor flagged `subspace_tied` the top-p subspace is one choice among several (tests/test_fits.py does
# the same). An anchor where either device flags a tie is left out; the flags themselves must agree.
SUBSPACE_COLUMNS = ("proj_full", "proj_res")
FLAG_COLUMNS = ("input_rank", "value_identified", "operator_identified", "converged", "subspace_tied")


class FitComparison(NamedTuple):
    values: dict[str, Agreement]  # per column, on the rows valid on both devices
    mismatched: list[str]  # columns whose validity (null) mask or flag values differ between the devices
    tied: int  # anchors left out of the subspace columns


def compare_fit_tables(dev: pa.Table, cpu: pa.Table) -> FitComparison:
    """Null-aware: each column must be null on the same rows on both devices (a column that is not is named in
    `mismatched`), and its values are compared on the rows valid on both; the flags must be equal. The subspace
    columns leave out the anchors flagged `subspace_tied` on either device (`SUBSPACE_COLUMNS`); with a
    selection rule under which no tie occurs, nothing is left out."""
    mismatched = [name for name in FLAG_COLUMNS if dev[name].to_pylist() != cpu[name].to_pylist()]
    tied = np.asarray(cpu["subspace_tied"].fill_null(False)) | np.asarray(dev["subspace_tied"].fill_null(False))
    values = {}
    for name in (*FIT_METRICS, "patched"):
        valid_dev, valid_cpu = (np.asarray(t[name].is_valid()) for t in (dev, cpu))
        if not np.array_equal(valid_dev, valid_cpu):
            mismatched.append(name)
        keep = valid_dev & valid_cpu & (~tied if name in SUBSPACE_COLUMNS else True)
        picked = pa.array(keep)
        if name == "patched":
            on_dev, on_cpu = (arrow_to_vectors(t[name].filter(picked)) for t in (dev, cpu))
        else:
            on_dev, on_cpu = (
                t[name].filter(picked).to_numpy(zero_copy_only=False).astype(np.float64) for t in (dev, cpu)
            )
        values[name] = agree(on_dev, on_cpu, TOLERANCES["fits"])
    return FitComparison(values, mismatched, int(tied.sum()))


def compare_patching(arch: str, shape: StudyAShape, device: torch.device) -> Outcome:
    """The KLs of the same patches (the CPU fit of the first registered class) on both devices."""
    tokens, _ = cpu_states(arch, shape)
    ids, x, y, layer = _transition(arch, shape)
    cfg = AnalysisConfig(anchors=shape.patch_anchors, knn_chunk=shape.knn_chunk, k=shape.k)
    anchors = choose_anchors(len(x), cfg.anchors, cfg.seed, finite_rows(x, y))
    fn = FIT_CLASSES.names()[0]
    fit = fit_layer(x, y, ids[:, 0], ids[:, 1], ids[:, 2], anchors, [fn], cfg, device=CPU)[0][fn]
    fit = fit.filter(fit["patched"].is_valid())  # the anchors whose patch the data determine (SPEC §4.5)
    if fit.num_rows == 0:
        return Outcome(f"none of {len(anchors)} anchors has an identified patch at k = {cfg.k}", passed=False)
    rows, positions = fit["seq_id"].to_numpy(), fit["pos"].to_numpy()
    vectors = arrow_to_vectors(fit["patched"])
    model = _model(arch, shape)
    cpu = patch_kl_anchors(model, tokens, rows, positions, layer, vectors, shape.batch, CPU)
    dev = patch_kl_anchors(model.to(device), tokens, rows, positions, layer, vectors, shape.batch, device)
    parts = {"kl": agree(dev[0], cpu[0], TOLERANCES["kl"]), "kl_seq": agree(dev[1], cpu[1], TOLERANCES["kl"])}
    overall = combine(parts)
    return Outcome(
        f"{len(rows)} patches at block {layer} (KL {cpu[0].min():.2g}–{cpu[0].max():.2g}): {overall.describe()}",
        {"parts": parts, "kl_cpu": cpu[0], "kl_device": dev[0]},
        overall.passed,
    )


# ------------------------------------------------------------------------------------ Study B
# The CPU run only supplies reference losses: it logs geometry at its first and last step only and
# estimates the diameter from a row sample (an exact one over V = 50,304 rows costs ~4 TFLOP in float64).
# Geometry is measured under no_grad on a copy of the update, so the training itself is the same.
_CPU_EXACT_DIAM_ROWS = 1024


def _train_config(
    shape: TrainShape, device: str, compile: bool, geometry_interval: int, exact_rows: int
) -> TrainConfig:
    return TrainConfig(
        model=shape.size,
        steps=shape.steps,
        batch_size=shape.batch,
        eval_interval=shape.steps,
        eval_batches=1,
        geometry_interval=geometry_interval,
        probe_sequences=2,
        diam_exact_max_rows=exact_rows,
        equi_sample_rows=min(1024, shape.vocab),
        device=device,
        compile=compile,
    )


def _train(spec: RunSpec, cfg: TrainConfig, shape: TrainShape, save: bool) -> tuple[Any, pa.Table, StepClock]:
    clock = StepClock()
    stream = token_ids(1, 64 * shape.seq_len * shape.batch, shape.vocab, seed=3)[0]
    with tempfile.TemporaryDirectory() as tmp:

        def save_checkpoint(model: torch.nn.Module, name: str, info: dict) -> None:
            if save:
                model.save_pretrained(Path(tmp) / name, safe_serialization=True)

        record, steps = train_run(
            spec,
            cfg,
            stream[: len(stream) // 2],
            stream[len(stream) // 2 :],
            shape.vocab,
            shape.seq_len,
            "gpu-check",
            save_checkpoint,
            on_step=lambda *_: clock.tick(),
        )
    return record, steps, clock


def compare_training(arch: str, recipe: str, shape: TrainShape, device: torch.device, compile: bool = False) -> Outcome:
    spec = RunSpec(arch, recipe, seed=0)
    on_device = _train_config(shape, device.type, compile, geometry_interval=1, exact_rows=shape.vocab)
    on_cpu = _train_config(
        shape, "cpu", False, geometry_interval=shape.steps, exact_rows=min(shape.vocab, _CPU_EXACT_DIAM_ROWS)
    )
    dev_record, dev_steps, dev_clock = _train(spec, on_device, shape, shape.save_checkpoints)
    cpu_record, cpu_steps, cpu_clock = _train(spec, on_cpu, shape, save=False)
    if dev_record.diverged or cpu_record.diverged:
        return Outcome(
            f"diverged: device at {dev_record.diverged_at_step}, cpu at {cpu_record.diverged_at_step}", passed=False
        )
    tolerance = TOLERANCES["bf16 loss"]
    losses = {
        "train_loss": agree(_column(dev_steps, "train_loss"), _column(cpu_steps, "train_loss"), tolerance),
        "final val_loss": agree([dev_record.final_val_loss], [cpu_record.final_val_loss], tolerance),
    }
    relative = np.abs(_column(dev_steps, "train_loss") / _column(cpu_steps, "train_loss") - 1)
    invariant = hilbert_invariant(dev_steps)
    first_step_s = dev_clock.step_times[0]
    overall = combine(losses)
    return Outcome(
        f"{shape.steps} steps: loss rel Δ ≤ {relative.max():.1e} (per step {_short(relative)}); "
        f"Hilbert invariant {invariant['held']}/{invariant['logged']} logged steps, "
        f"max realized/bound {invariant['max_ratio']:.3f}"
        + (f"; first step (compiles) {first_step_s:.1f} s" if compile else ""),
        {
            "losses": losses,
            "relative_loss_diff": relative,
            "invariant": invariant,
            "device_train_loss": _column(dev_steps, "train_loss"),
            "cpu_train_loss": _column(cpu_steps, "train_loss"),
            "device_wall_s": dev_clock.wall_time_s,
            "cpu_wall_s": cpu_clock.wall_time_s,
            "first_step_s": first_step_s,
        },
        overall.passed and invariant["held"] == invariant["logged"] == shape.steps,
    )


def hilbert_invariant(steps: pa.Table) -> dict[str, Any]:
    """On every logged step: an exact diameter, and `hilbert_realized ≤ hilbert_bound` within the slack
    `train_run` allows (two float32 reductions of the same ΔW)."""
    logged = [row for row in steps.to_pylist() if row["hilbert_bound"] is not None]
    held = [
        r
        for r in logged
        if not r["head_diam_sampled"] and r["hilbert_realized"] <= r["hilbert_bound"] * (1 + INVARIANT_RTOL) + 1e-7
    ]
    ratios = [r["hilbert_realized"] / r["hilbert_bound"] for r in logged if r["hilbert_bound"] > 0]
    return {"logged": len(logged), "held": len(held), "max_ratio": max(ratios, default=float("nan"))}


def _column(steps: pa.Table, name: str) -> np.ndarray:
    return np.asarray(steps[name].to_pylist(), dtype=np.float64)


def _short(values: np.ndarray) -> str:
    return ", ".join(f"{v:.0e}" for v in values)


# ------------------------------------------------------------------------------------- memory
MEMORY_SLACK_BYTES = 2**20


def memory_between_shards(study_a: StudyAShape, train: TrainShape, device: torch.device) -> Outcome:
    """A shard of each stage (extract, fit, perturb, train) run twice in one process: after each, with
    its results dropped, the allocated CUDA memory must be back to the baseline taken after a first,
    warm-up round (which leaves cuBLAS workspaces and the like allocated by design).

    Ray starts GPU tasks with `max_calls=1` (`lmgeo.core.execution`), so a worker exits after its shard
    anyway; this shows the library itself holds on to nothing, so that guarantee does not rest on it."""
    arch, recipe = "gpt2", baseline().name
    shards = {
        "extract": lambda: compare_extraction(arch, study_a, device),
        "fit": lambda: compare_fit(FIT_CLASSES.names()[0], arch, study_a, device),
        "perturb": lambda: compare_patching(arch, study_a, device),
        "train": lambda: _train(
            RunSpec(arch, recipe, 0), _train_config(train, device.type, False, 1, train.vocab), train, save=False
        ),
    }
    for run in shards.values():
        run()
    floor = _settled_allocation(device)
    residual, peak = {}, {}
    for name, run in shards.items():
        torch.cuda.reset_peak_memory_stats(device)
        run()
        residual[name] = _settled_allocation(device) - floor
        peak[name] = torch.cuda.max_memory_allocated(device) - floor
    worst = max(residual, key=lambda name: residual[name])
    return Outcome(
        f"baseline {floor / 2**20:.1f} MiB after a warm-up round; after each shard "
        + ", ".join(f"{n} {r / 2**20:+.2f} MiB (peak +{peak[n] / 2**20:.0f})" for n, r in residual.items()),
        {
            "baseline_bytes": floor,
            "residual_bytes": residual,
            "peak_above_baseline_bytes": peak,
            "slack_bytes": MEMORY_SLACK_BYTES,
            "worst": worst,
        },
        residual[worst] <= MEMORY_SLACK_BYTES,
    )


def _settled_allocation(device: torch.device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)
