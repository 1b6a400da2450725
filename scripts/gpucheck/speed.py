"""Measurements side by side on the device: the machine's ceilings (disk writes, host↔device copies), extraction
against a bare forward, kNN and fits against the same code on the CPU, suffix patching's rate, one training step
of each recipe (eager and compiled) with the achieved TFLOP/s of its heaviest operations, Mamba's training step
on its CUDA kernels and on the fallback, and the bf16 matmul peak. The Study A measurements at GPT-2 width carry the
bars of the GPU node (issue 38), evaluated on CUDA only, and issue 39's training bars on the recipes' steps.

Timings synchronise the device before the clock stops and run interleaved (`A B B A …` after a warm-up,
`lmgeo.commands.bench.measure.interleaved`); training steps run back to back between synchronisations, as
`train_run` takes them. On the CPU stand-in the same code runs at tiny sizes; its figures are CPU figures
and say nothing about a GPU, and no bar is judged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmgeo.commands.bench.extraction import extract_to_parquet, fresh_roots
from lmgeo.commands.bench.measure import interleaved
from lmgeo.commands.bench.recipe_costs import COSTS
from lmgeo.commands.bench.sizes import fit_bench_classes
from lmgeo.commands.bench.synthetic import synthetic_states, token_ids
from lmgeo.models.config import ModelSize
from lmgeo.models.kernels import implementations, kernel_packages, kernels_chosen, use_mamba_kernels
from lmgeo.models.registry import build_model, family_of, head_of
from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.fits import choose_anchors, fit_layer
from lmgeo.study_a.knn import nearest_neighbours
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.config import TrainConfig
from lmgeo.study_b.optim import build_optimizers, partition_parameters, resolve_head_step
from lmgeo.study_b.recipes import RECIPES
from lmgeo.study_b.train import HeadInputs, training_forward
from scripts.gpucheck.summary import Outcome

CPU = torch.device("cpu")
# Dense bf16 matrix rate of the H200, as measured on such a machine (8192³ products, docs of the device):
# the ceiling each operation's achieved rate is compared with.
H200_BF16_TFLOPS = 790.0


@dataclass(frozen=True)
class ModelRun:
    """A model and the batch it runs: `batch` sequences of `seq_len` tokens."""

    arch: str
    size: ModelSize
    vocab: int
    seq_len: int
    batch: int
    repeats: int  # timed repetitions (or training steps)


@dataclass(frozen=True)
class KnnRun:
    pool: int
    d: int
    anchors: int
    chunk: int
    repeats: int


@dataclass(frozen=True)
class FitRun:
    d: int
    k: int  # neighbours: ≥ d + 64 at GPT-2 width, so that every local class is identified (SPEC §4.5)
    n_seq: int
    seq_len: int
    anchors: int
    repeats: int


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _synced(cases: dict[str, Callable[[], Any]], device: torch.device) -> dict[str, Callable[[], Any]]:
    """Each case followed by a device synchronisation, so the clock sees the work and not its launch."""

    def wrap(run: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: (run(), synchronize(device))[0]

    return {name: wrap(run) for name, run in cases.items()}


def _build(run: ModelRun, device: torch.device) -> Any:
    return build_model(run.arch, run.size, run.vocab, run.seq_len, seed=0).to(device)


def matmul_params(model: Any, head: bool = True) -> int:
    """Parameters that enter a matrix product for every token: the hidden matrices, and the head's with `head`."""
    groups = partition_parameters(model, head_of(model).weight, family_of(model).param_groups)
    return sum(p.numel() for name in ("hidden", "head")[: 2 if head else 1] for p in groups[name])


def forward_flops(model: Any, tokens: int, seq_len: int, head: bool = True) -> float:
    """Kaplan et al. (2020): `2·N + 2·L·T·d` per token, N the matrix parameters: the head's included with `head`
    (a training step runs it; extraction's forward of the base model does not)."""
    config = model.config
    layers, width = config.num_hidden_layers, config.hidden_size
    return tokens * (2 * matmul_params(model, head) + 2 * layers * seq_len * width)


# ------------------------------------------------------------------------------------- the peak
def matmul_peak(device: torch.device, n: int = 8192, repeats: int = 10) -> Outcome:
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    tflops = 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12
    share = tflops / H200_BF16_TFLOPS
    return Outcome(
        f"bf16 {n}³ product: {tflops:.0f} TFLOP/s ({share:.0%} of {H200_BF16_TFLOPS:.0f})",
        {"n": n, "repeats": repeats, "tflops": tflops},
    )


# ------------------------------------------------------------------------------------- ceilings
@dataclass(frozen=True)
class CeilingRun:
    disk_bytes: int  # written (then fsynced) per repetition, where extraction writes
    transfer_bytes: int  # per copy between host and device (CUDA only)
    repeats: int


@functools.cache
def disk_write_bytes_per_s(folder: str, nbytes: int, repeats: int) -> float:
    """Bytes per second of a sequential write of `nbytes` followed by its fsync, in `folder` (the fastest of
    `repeats`): the ceiling of anything written there that must reach the disk, as a shard must before its
    manifest. Random bytes, so no layer below can compress them."""
    block = np.random.default_rng(0).bytes(64 << 20)
    best = math.inf
    for _ in range(repeats):
        with tempfile.NamedTemporaryFile(dir=folder) as file:
            start = time.perf_counter()
            for _ in range(nbytes // len(block)):
                file.write(block)
            file.flush()
            os.fsync(file.fileno())
            best = min(best, time.perf_counter() - start)
    return (nbytes // len(block)) * len(block) / best


def transfer_bytes_per_s(device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """Host → device and device → host copies of `nbytes`, from pinned (page-locked) and pageable host memory:
    bytes per second, the fastest of `repeats`."""
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    hosts = {
        "pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "pageable": torch.empty(nbytes, dtype=torch.uint8),
    }
    rates = {}
    for kind, host in hosts.items():
        for direction, copy in (
            ("host→device", lambda h=host: on_device.copy_(h, non_blocking=True)),
            ("device→host", lambda h=host: h.copy_(on_device, non_blocking=True)),
        ):
            copy()
            synchronize(device)
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                copy()
                synchronize(device)
                seconds.append(time.perf_counter() - start)
            rates[f"{direction}, {kind}"] = nbytes / min(seconds)
    return rates


def ceilings(run: CeilingRun, device: torch.device) -> Outcome:
    """What no path can beat on this machine: writing to the disk where extraction writes (and fsyncing), and
    copying between host and device memory (CUDA only: on the CPU there is no device to copy to)."""
    folder = tempfile.gettempdir()
    disk = disk_write_bytes_per_s(folder, run.disk_bytes, run.repeats)
    transfers = transfer_bytes_per_s(device, run.transfer_bytes, run.repeats) if device.type == "cuda" else {}
    rows = [[f"disk write + fsync ({folder})", run.disk_bytes / 2**20, disk / 1e9]]
    rows += [[what, run.transfer_bytes / 2**20, rate / 1e9] for what, rate in transfers.items()]
    return Outcome(
        f"disk {disk / 1e9:.2f} GB/s written and fsynced"
        + "".join(f"; {what} {rate / 1e9:.1f} GB/s" for what, rate in transfers.items()),
        {
            "run": asdict(run),
            "disk_write_bytes_per_s": disk,
            "disk_folder": folder,
            "transfer_bytes_per_s": transfers,
            "tables": {"ceilings": {"columns": ["what", "MiB per copy", "GB/s"], "rows": rows}},
        },
    )


# ---------------------------------------------------------------------------------- extraction
# On the GPU the extract path must keep at least this share of a bare forward's tokens/s in float32, unless the
# disk cannot take the vectors that fast (then the disk's own rate is the bar).
EXTRACTION_SHARE = 0.3


def extraction_speed(run: ModelRun, ceiling: CeilingRun, device: torch.device) -> Outcome:
    """The extract stage's path for one shard (hooks, pinned asynchronous copies, Arrow, one writer thread per
    layer's file through `ShardWriter`, hashes and fsyncs) in float32 and float16, against a bare forward of
    the base model asking for every hidden state, on the same batches and device. Bar (CUDA): float32
    extraction at `EXTRACTION_SHARE` of the bare forward's tokens/s, or at the disk's measured write rate for
    its bytes when that is lower."""
    model = _build(run, device).eval()
    tokens = token_ids(run.batch * 4, run.seq_len, run.vocab, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        roots = fresh_roots(Path(tmp))
        cases = {
            "extract_path": lambda: extract_to_parquet(model, tokens, run.batch, roots()),
            "extract_path_float16": lambda: extract_to_parquet(model, tokens, run.batch, roots(), True),
            "bare_forward": lambda: _bare_forward(model, tokens, run.batch, device),
        }
        timings = interleaved(_synced(cases, device), run.repeats)
    per_s = {case: tokens.size / timings.median(case) for case in cases}
    bare_tflops = forward_flops(model, tokens.size, run.seq_len, head=False) / timings.median("bare_forward") / 1e12
    ratio = 1 / timings.ratio("extract_path", "bare_forward")
    bytes_per_token = (run.size.n_layers + 1) * run.size.d_model * 4
    disk = disk_write_bytes_per_s(tempfile.gettempdir(), ceiling.disk_bytes, ceiling.repeats)
    bar_tokens = min(EXTRACTION_SHARE * per_s["bare_forward"], disk / bytes_per_token)
    bound = (
        "the disk's write rate"
        if bar_tokens < EXTRACTION_SHARE * per_s["bare_forward"]
        else (f"{EXTRACTION_SHARE:g} of the bare forward")
    )
    return Outcome(
        f"{_describe(run, model)}: extract path {per_s['extract_path']:,.0f} tokens/s in float32 "
        f"({per_s['extract_path'] * bytes_per_token / 1e9:.2f} GB/s of vectors), "
        f"{per_s['extract_path_float16']:,.0f} in float16; bare forward {per_s['bare_forward']:,.0f} tokens/s "
        f"({bare_tflops:.1f} TFLOP/s, no head): ratio {ratio:.2f}; bar {bar_tokens:,.0f} tokens/s ({bound}; "
        f"disk {disk / 1e9:.2f} GB/s)",
        {
            "run": asdict(run),
            "tokens": int(tokens.size),
            "tokens_per_s": per_s,
            "throughput_ratio": ratio,
            "bare_forward_tflops": bare_tflops,
            "bytes_per_token": bytes_per_token,
            "disk_write_bytes_per_s": disk,
            "bar_tokens_per_s": bar_tokens,
            "timings": timings.summary(),
        },
        (per_s["extract_path"] >= bar_tokens) if device.type == "cuda" else None,
    )


def _bare_forward(model: Any, tokens: np.ndarray, batch: int, device: torch.device) -> None:
    with torch.inference_mode():
        for start in range(0, len(tokens), batch):
            ids = torch.as_tensor(tokens[start : start + batch], device=device)
            model.base_model(input_ids=ids, output_hidden_states=True, use_cache=False)


def _describe(run: ModelRun, model: Any) -> str:
    n = sum(p.numel() for p in model.parameters())
    return (
        f"{run.arch} {run.size.n_layers} × {run.size.d_model}, V = {run.vocab:,} ({n / 1e6:.0f}M params), "
        f"{run.batch} × {run.seq_len} tokens"
    )


# ------------------------------------------------------------------------------------- kNN, fits
def knn_speed(run: KnnRun, device: torch.device) -> Outcome:
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(run.pool, run.d, dtype=torch.float64, generator=generator)
    anchors = torch.randperm(run.pool, generator=generator)[: run.anchors]
    pool_dev, anchors_dev = pool.to(device), anchors.to(device)
    k = AnalysisConfig().k
    cases = {
        "device": lambda: nearest_neighbours(pool_dev, anchors_dev, k, chunk=run.chunk),
        "cpu": lambda: nearest_neighbours(pool, anchors, k, chunk=run.chunk),
    }
    timings = interleaved(_synced(cases, device), run.repeats)
    speedup = timings.ratio("cpu", "device")
    tflops = 2 * run.pool * run.anchors * run.d / timings.median("device") / 1e12
    return Outcome(
        f"pool {run.pool:,} × {run.d} float64, {run.anchors:,} anchors, k = {k}: device "
        f"{timings.median('device'):.3f} s ({tflops:.1f} TFLOP/s fp64), cpu {timings.median('cpu'):.2f} s: "
        f"{speedup:.1f}× faster",
        {"run": asdict(run), "speedup": speedup, "device_fp64_tflops": tflops, "timings": timings.summary()},
    )


# Bars of the fits on the GPU (CUDA only), per local class fitted in closed form, at GPT-2 width and k ≥ d + 64.
FIT_MS_PER_ANCHOR, FIT_SPEEDUP_OVER_CPU = 2.0, 10.0


def fits_speed(run: FitRun, device: torch.device) -> Outcome:
    """`fit_layer` of every class on the same synthetic layer at `k = run.k`, the device against every core of
    this machine's CPU (`torch.set_num_threads(os.cpu_count())`), interleaved. Bars (CUDA) for the local
    classes fitted in closed form: at most `FIT_MS_PER_ANCHOR` per anchor on the device and at least
    `FIT_SPEEDUP_OVER_CPU` × the CPU."""
    states = synthetic_states(run.n_seq, run.seq_len, run.d, n_layers=1, seed=3)
    seq = np.repeat(np.arange(run.n_seq), run.seq_len)
    cfg = AnalysisConfig(anchors=run.anchors, k=run.k)
    anchors = choose_anchors(states.shape[1], run.anchors, cfg.seed)
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    torch.set_num_threads(cores)
    rows, failed = [], []
    try:
        for fn in FIT_CLASSES.names():

            def fit(where: torch.device, fn: str = fn) -> Any:
                return fit_layer(states[0], states[1], seq, seq, seq, anchors, [fn], cfg, device=where)

            cases = {"device": lambda: fit(device), "cpu": lambda: fit(CPU)}
            timings = interleaved(_synced(cases, device), run.repeats)
            ms = timings.median("device") / len(anchors) * 1e3
            speedup = timings.ratio("cpu", "device")
            barred = fn in fit_bench_classes()
            if barred and (ms > FIT_MS_PER_ANCHOR or speedup < FIT_SPEEDUP_OVER_CPU):
                failed.append(fn)
            rows.append([fn, ms, timings.median("cpu") / len(anchors) * 1e3, speedup, "yes" if barred else "no"])
    finally:
        torch.set_num_threads(threads)
    ms_range = [r[1] for r in rows if r[4] == "yes"]
    return Outcome(
        f"pool {states.shape[1]:,} × {run.d}, k = {run.k}, {run.anchors} anchors: closed-form local classes "
        f"{min(ms_range):.2f}–{max(ms_range):.2f} ms per anchor on the device, "
        f"{min(r[3] for r in rows):.1f}–{max(r[3] for r in rows):.1f}× the CPU's {cores} cores"
        + (
            f"; over the bars (≤ {FIT_MS_PER_ANCHOR:g} ms, ≥ {FIT_SPEEDUP_OVER_CPU:g}×): {', '.join(failed)}"
            if failed and device.type == "cuda"
            else ""
        ),
        {
            "run": asdict(run),
            "cpu_threads": cores,
            "failed": failed,
            "tables": {
                "fit_layer per class": {
                    "columns": ["class", "device ms/anchor", "cpu ms/anchor", "speed-up over the cpu", "barred"],
                    "rows": rows,
                }
            },
        },
        not failed if device.type == "cuda" else None,
    )


# ------------------------------------------------------------------------------------- patching
@dataclass(frozen=True)
class PatchRun:
    arch: str
    size: ModelSize
    vocab: int
    seq_len: int
    n_seq: int
    copies_per_seq: int  # patched copies per sequence, at random positions
    batch: int
    repeats: int


def patching_speed(run: PatchRun, device: torch.device) -> Outcome:
    """`patch_kl_anchors` (the perturb stage's suffix patching) at the middle layer on the device: patched copies
    per second and the useful FLOP/s (`lmgeo.commands.bench.study_a.suffix_flops`: each sequence's clean pass, then
    the later blocks and the head from each anchor on)."""
    from lmgeo.commands.bench.study_a import suffix_flops
    from lmgeo.study_a.patching import patch_kl_anchors

    model = _build(run, device).eval()
    rng = np.random.default_rng(3)
    tokens = token_ids(run.n_seq, run.seq_len, run.vocab, seed=4)
    rows = np.repeat(np.arange(run.n_seq), run.copies_per_seq)
    positions = rng.integers(0, run.seq_len, size=len(rows))
    vectors = rng.normal(size=(len(rows), run.size.d_model)).astype(np.float32)
    layer = run.size.n_layers // 2
    timings = interleaved(
        _synced(
            {"patch": lambda: patch_kl_anchors(model, tokens, rows, positions, layer, vectors, run.batch, device)},
            device,
        ),
        run.repeats,
    )
    seconds = timings.median("patch")
    flops = suffix_flops(model, run.size.n_layers, np.zeros(run.n_seq, dtype=int), run.seq_len) + suffix_flops(
        model, run.size.n_layers - 1 - layer, positions, run.seq_len
    )
    return Outcome(
        f"{_describe(run, model)}: {len(rows) / seconds:,.0f} patched copies/s at block {layer} "
        f"({flops / seconds / 1e12:.1f} TFLOP/s useful)",
        {
            "run": asdict(run),
            "copies": len(rows),
            "seconds": seconds,
            "copies_per_s": len(rows) / seconds,
            "flops": flops,
            "flop_per_s": flops / seconds,
            "layer": layer,
            "timings": timings.summary(),
        },
    )


# ---------------------------------------------------------------------------------- training
# Issue #39's bars at GPT-2 small's shape on an H200 (V = 50,304, 8 × 1,024 tokens, bf16 autocast): the
# `adamw` step within 20 ms (≥ 40 % of the bf16 peak by this check's 6N·tokens count), every other recipe
# within 1.3× of it; Mamba's step on its kernels at least 5× faster than on the fallback.
ADAMW_STEP_BAR_S = 0.020
RECIPE_RATIO_BAR = 1.3
MAMBA_SPEEDUP_BAR = 5.0


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """What `train_run` runs a step under: bf16 autocast on CUDA, nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _training_setup(run: ModelRun, device: torch.device, compile: bool = False) -> tuple[Any, Any, HeadInputs]:
    """A model as `train_run` prepares it: the head's input hook registered, then its forward (the fused loss
    on CUDA, compiled where asked)."""
    model = _build(run, device)
    head_inputs = HeadInputs(head_of(model))
    return model, training_forward(model, device, compile), head_inputs


def _training_step(
    forward: Any, model: Any, optimizer: Any, head_inputs: HeadInputs, batch: torch.Tensor, cfg: TrainConfig
) -> None:
    """One step as `train_run` takes it, without its logging, and like it without waiting for the device:
    forward under autocast, backward, clipping, every optimizer of the recipe (a `tau` recipe's step size
    set from the batch's radius, on the device)."""
    with _autocast(batch.device):
        loss = forward(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step(radius=head_inputs.radius(optimizer.radius_quantile))
    optimizer.zero_grad()


def _step_seconds(step: Callable[[], None], device: torch.device, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Seconds per step: runs of `repeats` steps back to back, each timed from a synchronised start to a
    synchronised end, so that the host runs ahead of the device within a run as in `train_run` (the median
    of three runs on CUDA; one on the CPU stand-in, whose figures are not the point); and the first call's
    time (for a compiled model, mostly compilation)."""
    blocks = 3 if device.type == "cuda" else 1
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    per_step = []
    for _ in range(blocks):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        synchronize(device)
        per_step.append((time.perf_counter() - start) / repeats)
    return {"median_s": statistics.median(per_step), "first_s": first}


def _profile(run: Callable[[], None], device: torch.device) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_flops=True) as prof:
        run()
        synchronize(device)
    return prof


def heaviest_ops(run: Callable[[], None], device: torch.device, top: int = 5) -> list[dict[str, Any]]:
    """The operations that took the most time in one call of `run` (device time on CUDA), with their FLOPs
    where torch counts them (matrix products) and the rate they achieved."""
    from torch.autograd import DeviceType

    cuda = device.type == "cuda"
    prof = _profile(run, device)
    ops = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]  # kernels are charged to their op

    def micros(event: Any) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    total = sum(micros(e) for e in ops) or 1.0
    rows = []
    for event in sorted(ops, key=micros, reverse=True)[:top]:
        seconds = micros(event) / 1e6
        tflops = event.flops / seconds / 1e12 if event.flops and seconds else None
        rows.append(
            {
                "op": event.key,
                "calls": event.count,
                "ms": seconds * 1e3,
                "share": micros(event) / total,
                "gflop": event.flops / 1e9 if event.flops else None,
                "tflops": tflops,
                "of_h200_peak": tflops / H200_BF16_TFLOPS if (tflops and cuda) else None,
            }
        )
    return rows


def heaviest_kernels(run: Callable[[], None], device: torch.device, top: int = 15) -> dict[str, Any]:
    """The device kernels (and copies) that took the most time in one call of `run`, as a table: what a
    compiled step is made of, where the operations above are Inductor's generated code. Empty on the CPU."""
    from torch.autograd import DeviceType

    columns = ["kernel", "calls", "ms", "share of device time"]
    if device.type != "cuda":
        return {"columns": columns, "rows": []}
    kernels = [e for e in _profile(run, device).key_averages() if e.device_type == DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels) or 1.0
    rows = [
        [e.key[:90], e.count, e.self_device_time_total / 1e3, f"{e.self_device_time_total / total:.0%}"]
        for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    ]
    rows.append(["all kernels", sum(e.count for e in kernels), total / 1e3, "100%"])
    return {"columns": columns, "rows": rows}


def step_bars(ms_per_step: dict[str, float], reference: str = "adamw") -> dict[str, dict[str, Any]]:
    """Issue #39's bars on per-recipe step times (ms): the reference within `ADAMW_STEP_BAR_S`, every other
    recipe within `RECIPE_RATIO_BAR` of it."""
    bars = {
        f"{reference} ≤ {ADAMW_STEP_BAR_S * 1e3:.0f} ms": {
            "value": ms_per_step[reference],
            "passed": ms_per_step[reference] <= ADAMW_STEP_BAR_S * 1e3,
        }
    }
    for recipe, ms in ms_per_step.items():
        if recipe != reference:
            ratio = ms / ms_per_step[reference]
            bars[f"{recipe} ≤ {RECIPE_RATIO_BAR}× {reference}"] = {"value": ratio, "passed": ratio <= RECIPE_RATIO_BAR}
    return bars


def training_steps(run: ModelRun, device: torch.device, compile: bool = False) -> Outcome:
    """One training step of every recipe on the same model and batch (only the head's optimizer differs),
    as `train_run` takes it on this device, with the heaviest operations of each step and the rate they
    achieved, and the kernels of the `adamw` step. Eager, issue #39's bars apply on CUDA; compiled
    (`train.compile`, CUDA only), the step times, the first call's (mostly compilation) and the profile of
    the compiled step."""
    model, forward, head_inputs = _training_setup(run, device, compile)
    batch = torch.as_tensor(token_ids(run.batch, run.seq_len, run.vocab, seed=5), device=device)
    cfg = TrainConfig(model=run.size, steps=1000)
    step_flops = 3 * forward_flops(model, batch.numel(), run.seq_len)
    rows, details, kernels = [], {}, {}
    for recipe in RECIPES.names():
        optimizer = build_optimizers(model, head_of(model).weight, recipe, cfg)

        def step(optimizer: Any = optimizer) -> None:
            _training_step(forward, model, optimizer, head_inputs, batch, cfg)

        times = _step_seconds(step, device, run.repeats)
        ops = heaviest_ops(step, device)
        if recipe == "adamw":
            kernels = heaviest_kernels(step, device)
        equi_iters = resolve_head_step(recipe, cfg).knobs.equi_iters
        head_gflop = COSTS[recipe].head_flops(run.vocab, run.size.d_model, equi_iters) / 1e9
        tflops = step_flops / times["median_s"] / 1e12
        details[recipe] = {**times, "heaviest_ops": ops, "head_step_gflop": head_gflop, "model_tflops": tflops}
        matmul = next((o for o in ops if o["tflops"]), None)
        rows.append(
            [
                recipe,
                times["median_s"] * 1e3,
                times["first_s"],
                tflops,
                f"{tflops / H200_BF16_TFLOPS:.0%}",
                head_gflop,
                f"{matmul['op']} {matmul['tflops']:.0f}" if matmul else None,
                f"{ops[0]['op']} ({ops[0]['share']:.0%})" if ops else None,
            ]
        )
    ms = {r[0]: r[1] for r in rows}
    bars = step_bars(ms)
    judged = device.type == "cuda" and not compile
    columns = [
        "recipe",
        "ms per step",
        "first call s",
        "model TFLOP/s",
        f"of {H200_BF16_TFLOPS:.0f}",
        "head step GFLOP",
        "heaviest counted op (TFLOP/s)",
        "op with most time (share)",
    ]
    tables = {
        "per recipe": {"columns": columns, "rows": rows},
        "bars (issue #39)" + ("" if judged else ", not judged here"): {
            "columns": ["bar", "value", "met"],
            "rows": [[name, bar["value"], bar["passed"]] for name, bar in bars.items()],
        },
        "heaviest operations of one step": ops_table({r: d["heaviest_ops"] for r, d in details.items()}),
    }
    if kernels["rows"]:
        tables["kernels of one adamw step" + (" (compiled)" if compile else "")] = kernels
    missed = [name for name, bar in bars.items() if not bar["passed"]]
    verdict = f"; bars: {len(bars) - len(missed)}/{len(bars)} met" if judged else ""
    if judged and missed:
        verdict += f" (missed: {', '.join(missed)})"
    return Outcome(
        f"{_describe(run, model)}, {'compiled' if compile else 'eager'}: adamw {ms['adamw']:.1f} ms/step, "
        f"{min(ms.values()):.1f}–{max(ms.values()):.1f} over recipes "
        f"({step_flops / 1e12:.2f} TFLOP of model per step, 6N·tokens estimate)"
        + (f"; first call {rows[0][2]:.0f} s (compiling)" if compile else "")
        + verdict,
        {
            "run": asdict(run),
            "compiled": compile,
            "step_flops": step_flops,
            "per_recipe": details,
            "bars": bars,
            "tables": tables,
        },
        (not missed) if judged else None,
    )


def ops_table(ops: dict[str, list[dict[str, Any]]], top: int = 3) -> dict[str, Any]:
    rows = [
        [
            label,
            o["op"],
            o["calls"],
            o["ms"],
            f"{o['share']:.0%}",
            o["tflops"],
            f"{o['of_h200_peak']:.0%}" if o["of_h200_peak"] else None,
        ]
        for label, found in ops.items()
        for o in found[:top]
    ]
    return {
        "columns": ["recipe", "op", "calls", "ms", "share of step", "TFLOP/s", f"of {H200_BF16_TFLOPS:.0f}"],
        "rows": rows,
    }


def mamba_step(run: ModelRun, device: torch.device) -> Outcome:
    """Mamba's training step on mamba-ssm's and causal-conv1d's kernels and on transformers' PyTorch
    fallback (mambapy's scan), the same model, batch and device, interleaved by `use_mamba_kernels`; the
    speed-up's bar (≥ 5×) applies where CUDA has the kernels. Elsewhere both sides are the fallback."""
    chosen = device.type == "cuda" and kernels_chosen()
    model, forward, head_inputs = _training_setup(run, device)
    batch = torch.as_tensor(token_ids(run.batch, run.seq_len, run.vocab, seed=5), device=device)
    cfg = TrainConfig(model=run.size, steps=1000)
    optimizer = build_optimizers(model, head_of(model).weight, baseline().name, cfg)

    def step() -> None:
        _training_step(forward, model, optimizer, head_inputs, batch, cfg)

    seconds, ops = {}, {}
    for path, enabled in (("kernels", True), ("fallback", False)):
        with use_mamba_kernels(enabled):
            seconds[path] = _step_seconds(step, device, run.repeats)["median_s"]
            ops[path] = heaviest_ops(step, device)
    speedup = seconds["fallback"] / seconds["kernels"]
    where = (
        "on mamba-ssm's kernels"
        if chosen
        else "both sides on the fallback (no kernels chosen here: "
        + ("CPU" if device.type != "cuda" else "build them with scripts/gpucheck/build_mamba_wheels.sh")
        + ")"
    )
    return Outcome(
        f"{_describe(run, model)}, {where}: kernels {seconds['kernels'] * 1e3:.1f} ms/step, fallback "
        f"{seconds['fallback'] * 1e3:.1f} ms/step: {speedup:.1f}×"
        + (f" (bar ≥ {MAMBA_SPEEDUP_BAR:.0f}×)" if chosen else ""),
        {
            "run": asdict(run),
            "kernels_chosen": chosen,
            "implementations": implementations(),
            "step_s": seconds,
            "speedup": speedup,
            "tokens_per_s": {p: batch.numel() / t for p, t in seconds.items()},
            "tables": {"heaviest operations of one step": ops_table({f"{run.arch} {p}": o for p, o in ops.items()})},
        },
        speedup >= MAMBA_SPEEDUP_BAR if chosen else None,
    )


def mamba_kernel_path(device: torch.device) -> Outcome:
    """Which implementation transformers chose for each of Mamba's five kernel functions, and, where a kernel
    package is installed but was not chosen, why its import failed."""
    packages = kernel_packages()
    chosen = implementations()
    failures = {}
    for name, found in packages.items():
        if found:
            try:
                importlib.import_module(name)
            except Exception as error:  # noqa: BLE001 - whatever stopped transformers from choosing it
                failures[name] = f"{type(error).__name__}: {error}"
    on_kernels = kernels_chosen()
    summary = (
        "mamba-ssm's and causal-conv1d's kernels for CUDA tensors, the reference for the rest"
        if on_kernels
        else f"the PyTorch fallback: {'; '.join(f'{n} does not import ({e})' for n, e in failures.items())}"
        if failures
        else "the PyTorch fallback: mamba-ssm and causal-conv1d are not installed"
    )
    rows = [[function, path] for function, path in chosen.items()]
    return Outcome(
        summary,
        {
            "packages": packages,
            "implementations": chosen,
            "import_failures": failures,
            "tables": {"implementation per function": {"columns": ["function", "implementation"], "rows": rows}},
        },
        False if failures and device.type == "cuda" else (True if on_kernels and device.type == "cuda" else None),
    )
