"""The benchmarks of SPEC §7: every figure is a ratio of two things measured side by side in one run.

The machines this runs on are shared and noisy (the 2-core development box has other engineers'
jobs on it), so a figure is never an absolute time compared with a number written down elsewhere:
- the two sides of a ratio run on the same data, interleaved `A B B A …` after an untimed warm-up,
  and the ratio is the median over repetitions of `A_i / B_i` (adjacent runs see the same load);
- each section runs in a fresh spawned process whose BLAS/OpenMP thread count is the one the stage's
  Ray task gets (`ray.tasks.<stage>.num_cpus`), as the stage itself does: an OpenMP team with more
  threads than free cores spins at its barriers and turns a 2 ms SVD into 100 ms;
- peak memory is the child's own high-water mark of its resident set (`VmHWM`, which sees torch's
  allocations, unlike `tracemalloc`; `ru_maxrss` would also count the parent's peak, which a spawned
  child inherits across exec), one fresh process per size.

This module only measures and renders; `stages/bench.py` chooses what runs, starts Ray for the
fan-out benchmark and writes `bench.json` / `bench.md`.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import math
import multiprocessing
import os
import platform
import pstats
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline.core.config import RECIPES, AnalysisConfig, ModelSize, TrainConfig

FIT_BENCH_CLASSES = ("diag_psd", "lowrank", "orthogonal")
PROFILE_LINES = 14
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


# ------------------------------------------------------------------------------------------ sizes
@dataclass(frozen=True)
class ExtractionSize:
    arch: str
    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    seq_len: int
    n_seq: int  # sequences per timed repetition: one extract shard
    rss_n_seq: tuple[int, int]  # token counts 4× apart, for peak memory
    repeats: int

    def model_size(self) -> ModelSize:
        return ModelSize(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads)


@dataclass(frozen=True)
class FitScale:
    label: str
    d: int
    n_seq: int
    seq_len: int
    anchors: int
    repeats: int


@dataclass(frozen=True)
class KnnSize:
    d: int
    chunk: int
    anchors: int
    pools: tuple[int, int]  # 4× apart


@dataclass(frozen=True)
class RecipeSize:
    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    seq_len: int
    batch: int
    repeats: int
    flops_vocab: int = 50304  # the analytic FLOP estimate is at GPT-2 scale whatever was timed
    flops_width: int = 768


@dataclass(frozen=True)
class FanoutSize:
    d: int
    n_layers: int
    n_seq: int
    seq_len: int
    anchors: int
    classes: tuple[str, ...]
    repeats: int  # repetitions of each worker count, interleaved 1 2 1 2 …


@dataclass(frozen=True)
class BenchSizes:
    extraction: ExtractionSize
    fits: tuple[FitScale, ...]
    knn: KnnSize
    recipes: RecipeSize
    fanout: FanoutSize
    gpu_knn: KnnSize  # CUDA only: a hub-model width and a pool of 2^16–2^18 tokens


FULL = BenchSizes(
    # A mid-size GPT-2: the writer's cost per token grows like (L+1)·d, the forward's like L·(12d² + 2Td),
    # so the ratio improves with width; d = 256 is a conservative stand-in for the hub models.
    extraction=ExtractionSize("gpt2", 256, 4, 4, 8192, 128, 16, (16, 64), 9),
    fits=(
        # The hub models the study is built for (GPT-2 small, Pythia-160m) have d = 768.
        FitScale("d=768 (GPT-2 small width)", 768, 64, 64, 32, 2),
        # The default study's own models: d = 64, 32 eval sequences of 64 tokens, 128 anchors.
        FitScale("d=64 (default study)", 64, 32, 64, 128, 5),
    ),
    knn=KnnSize(d=64, chunk=1024, anchors=1024, pools=(8192, 32768)),
    recipes=RecipeSize(128, 2, 4, 8192, 64, 8, 10),
    fanout=FanoutSize(d=128, n_layers=6, n_seq=32, seq_len=64, anchors=128, classes=FIT_BENCH_CLASSES, repeats=3),
    gpu_knn=KnnSize(d=768, chunk=4096, anchors=4096, pools=(65536, 262144)),
)

QUICK = BenchSizes(
    extraction=ExtractionSize("gpt2", 32, 2, 2, 256, 16, 4, (4, 16), 2),
    fits=(FitScale("d=16 (smoke)", 16, 8, 16, 4, 1),),
    knn=KnnSize(d=8, chunk=64, anchors=64, pools=(256, 1024)),
    recipes=RecipeSize(32, 1, 2, 512, 16, 2, 2, flops_vocab=50304, flops_width=768),
    fanout=FanoutSize(d=16, n_layers=2, n_seq=8, seq_len=16, anchors=8, classes=("diag_psd",), repeats=1),
    gpu_knn=KnnSize(d=64, chunk=256, anchors=256, pools=(1024, 4096)),
)


# ------------------------------------------------------------------------------------------- bars
@dataclass(frozen=True)
class Bar:
    """One row of the ratio table: `value op threshold` must hold (and `extra_ok`, e.g. null patterns)."""

    name: str
    value: float
    op: Literal[">=", "<="]
    threshold: float
    passed: bool
    unit: str = "×"
    note: str = ""


def bar(
    name: str, value: float, op: Literal[">=", "<="], threshold: float, unit: str = "×", note: str = "",
    extra_ok: bool = True,
) -> Bar:
    holds = value >= threshold if op == ">=" else value <= threshold
    return Bar(name, value, op, threshold, bool(holds and extra_ok and math.isfinite(value)), unit, note)


# ------------------------------------------------------------------------------------ measurement
@dataclass
class Timings:
    """Wall seconds and return values of each case, one entry per repetition."""

    times: dict[str, list[float]]
    results: dict[str, list[Any]] = field(default_factory=dict)

    def median(self, case: str) -> float:
        return statistics.median(self.times[case])

    def ratio(self, num: str, den: str) -> float:
        """Median over repetitions of `num_i / den_i`: a ratio of adjacent runs, robust to load swings."""
        return statistics.median(a / b for a, b in zip(self.times[num], self.times[den], strict=True))

    def summary(self) -> dict[str, dict[str, float]]:
        return {c: {"median_s": self.median(c), "min_s": min(t), "repeats": len(t)} for c, t in self.times.items()}


def interleaved(cases: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> Timings:
    """Run every case `warmup` times untimed, then `repeats` rounds timing each call, the order
    reversed every other round (`A B`, `B A`, `A B` …) so that neither side always runs first."""
    for _ in range(warmup):
        for run in cases.values():
            run()
    timings = Timings({name: [] for name in cases}, {name: [] for name in cases})
    names = list(cases)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            value = cases[name]()
            timings.times[name].append(time.perf_counter() - start)
            timings.results[name].append(value)
    return timings


def profile_top(run: Callable[[], Any], lines: int = PROFILE_LINES) -> list[str]:
    """cProfile of one call: the header and the top `lines` entries by own time."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime").print_stats(lines)
    text = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(text) if line.lstrip().startswith("ncalls"))
    return [line.rstrip() for line in text[start : start + lines + 1] if line.strip()]


def peak_rss_bytes() -> int:
    """This process image's peak resident set: `VmHWM` on Linux. Not `ru_maxrss`: across the exec
    that spawns a child it keeps the parent's peak (a child of a 500 MB parent reports 500 MB)."""
    status = Path("/proc/self/status")
    if status.exists():
        return _proc_status_kib(status.read_text(), "VmHWM") * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_rss() -> bool:
    """Reset the peak to the current resident set (Linux ≥ 4.0, `clear_refs` 5); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _proc_status_kib(text: str, field_name: str) -> int:
    line = next(line for line in text.splitlines() if line.startswith(f"{field_name}:"))
    return int(line.split()[1])


def current_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


@contextlib.contextmanager
def _child_env(variables: dict[str, str]) -> Iterator[None]:
    """Environment for a child about to be spawned (read when it starts and imports numpy/torch)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


Runner = Callable[..., Any]  # (fn, threads, **kwargs) -> fn(threads=threads, **kwargs), somewhere


def run_fresh(fn: Callable[..., Any], threads: int, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
    """`fn(threads=threads, **kwargs)` in a freshly spawned process with `threads` BLAS/OpenMP threads."""
    variables = {name: str(threads) for name in _THREAD_VARS} | (env or {})
    with _child_env(variables), ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, threads=threads, **kwargs).result()


def run_here(fn: Callable[..., Any], threads: int, **kwargs: Any) -> Any:
    """`fn(threads=threads, **kwargs)` in this process: for smoke runs, where a child's start-up
    (importing torch) would cost more than the measurement. Peak memory always needs `run_fresh`."""
    return fn(threads=threads, **kwargs)


# ----------------------------------------------------------------------------- synthetic data
def synthetic_states(n_seq: int, seq_len: int, d: int, n_layers: int, seed: int) -> np.ndarray:
    """`(n_layers + 1, n_seq·seq_len, d)` float32 residual streams: each layer adds a nonlinear
    tokenwise update and a cross-token one (the sequence mean), like the layers Study A fits."""
    rng = np.random.default_rng(seed)
    n = n_seq * seq_len
    h = rng.normal(size=(n, d)) + 0.5
    states = [h]
    for _ in range(n_layers):
        mix, context = rng.normal(size=(d, d)) / math.sqrt(d), rng.normal(size=(d, d)) / math.sqrt(d)
        seq_mean = h.reshape(n_seq, seq_len, d).mean(axis=1).repeat(seq_len, axis=0)
        h = h + 0.5 * np.tanh(h @ mix) + 0.3 * seq_mean @ context
        states.append(h)
    return np.stack(states).astype(np.float32)


def token_ids(n_seq: int, seq_len: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(n_seq, seq_len))


def activation_batch(states: np.ndarray, seq_len: int, tokens: np.ndarray) -> list[Any]:
    """One Arrow record batch per layer in the activation schema (SPEC §4.1) for synthetic `states`."""
    import pyarrow as pa

    from pipeline.study_a.extract import ACTIVATION_COLUMNS
    from pipeline.core.store import vectors_to_arrow

    n = states.shape[1]
    ids = [
        pa.array(np.repeat(np.arange(n // seq_len, dtype=np.int32), seq_len)),
        pa.array(np.tile(np.arange(seq_len, dtype=np.int32), n // seq_len)),
        pa.array(tokens.reshape(-1).astype(np.int32)),
    ]
    return [pa.RecordBatch.from_arrays([*ids, vectors_to_arrow(h)], names=list(ACTIVATION_COLUMNS)) for h in states]


# ------------------------------------------------------------------------------------ extraction
def _extraction_model(size: ExtractionSize) -> Any:
    from pipeline.models.arch import build_model

    return build_model(size.arch, size.model_size(), size.vocab, size.seq_len, seed=0).eval()


def extract_to_parquet(model: Any, tokens: np.ndarray, batch_size: int, root: Path) -> int:
    """The extract stage's path for one shard: hooks, Arrow batches, `ShardWriter` (atomic, manifest)."""
    from pipeline.study_a.extract import extract_batches
    from pipeline.core.store import ManifestKey, ShardWriter

    key = ManifestKey({"tokens": "bench"}, "bench", "bench")
    seq_ids = np.arange(len(tokens), dtype=np.int32)
    rows = 0
    with ShardWriter(root, "bench/seq=0", key) as writer:
        for layer, batch in extract_batches(model, tokens, seq_ids, batch_size):
            writer.write({"model": "bench", "layer": layer}, batch)
            rows += batch.num_rows
    return rows


def bare_forward(model: Any, tokens: np.ndarray, batch_size: int) -> int:
    """A plain transformers forward asking for `output_hidden_states`, on the same batches. The base
    model (no LM head, no KV cache), as extraction runs it, so the ratio prices hooks and writing only."""
    import torch

    with torch.inference_mode():
        for start in range(0, len(tokens), batch_size):
            ids = torch.as_tensor(tokens[start : start + batch_size], dtype=torch.long)
            out = model.base_model(input_ids=ids, output_hidden_states=True, use_cache=False)
            assert len(out.hidden_states) > 1
    return tokens.size


def forward_flops_per_token(size: ExtractionSize) -> float:
    """Kaplan et al. (2020): `2·N + 2·L·T·d` per token, N the non-embedding parameters (`12·L·d²`)."""
    return 2 * 12 * size.n_layers * size.d_model**2 + 2 * size.n_layers * size.seq_len * size.d_model


def extraction_throughput(size: ExtractionSize, batch_size: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    model = _extraction_model(size)
    tokens = token_ids(size.n_seq, size.seq_len, size.vocab, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "extract_path": lambda: extract_to_parquet(model, tokens, batch_size, Path(tmp)),
            "bare_forward": lambda: bare_forward(model, tokens, batch_size),
        }
        timings = interleaved(cases, size.repeats)
        ratio = 1 / timings.ratio("extract_path", "bare_forward")  # throughput ratio
        verdict = bar("extraction: extract path / bare HF forward (tokens/s)", ratio, ">=", 0.8)
        profile = [] if verdict.passed else profile_top(cases["extract_path"])
    n_tokens = tokens.size
    return {
        "model": {**asdict(size), "params": sum(p.numel() for p in model.parameters())},
        "batch_size": batch_size,
        "tokens_per_repeat": n_tokens,
        "tokens_per_s": {case: n_tokens / timings.median(case) for case in cases},
        "timings": timings.summary(),
        "bars": [verdict],
        "profile": {verdict.name: profile} if profile else {},
    }


def extraction_peak_rss(size: ExtractionSize, n_seq: int, batch_size: int, threads: int) -> dict[str, int]:
    """Peak RSS of a fresh process that builds the model and extracts `n_seq` sequences to Parquet."""
    import torch

    torch.set_num_threads(threads)
    model = _extraction_model(size)
    tokens = token_ids(n_seq, size.seq_len, size.vocab, seed=2)
    after_setup = current_rss_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        extract_to_parquet(model, tokens, batch_size, Path(tmp))
    return {"tokens": int(tokens.size), "rss_after_setup_bytes": after_setup, "peak_rss_bytes": peak_rss_bytes()}


# ------------------------------------------------------------------------------------------ fits
def compare_with_reference(table: Any, rows: list[dict[str, Any]]) -> dict[str, float | int]:
    """Max |fit_layer − reference| over every metric value and `patched`, and null-pattern mismatches."""
    from pipeline.study_a.fits import METRICS

    worst, mismatched = 0.0, 0
    for name in METRICS:
        got = table.column(name).to_pylist()
        for g, w in zip(got, (r[name] for r in rows), strict=True):
            if (g is None) != (w is None):
                mismatched += 1
            elif g is not None:
                worst = max(worst, abs(g - w))
    patched = np.array(table.column("patched").to_pylist())
    worst = max(worst, float(np.abs(patched - np.array([r["patched"] for r in rows])).max()))
    return {"max_abs_diff": worst, "null_mismatches": mismatched}


def fits_vs_reference(scale: FitScale, cfg: AnalysisConfig, threads: int) -> dict[str, Any]:
    """`fit_layer` vs the per-anchor reference on the same synthetic layer, per class."""
    import torch

    from pipeline.study_a.fits import choose_anchors, fit_layer
    from pipeline.study_a.reference import reference_rows

    torch.set_num_threads(threads)
    states = synthetic_states(scale.n_seq, scale.seq_len, scale.d, n_layers=1, seed=3)
    x32, y32 = states[0], states[1]
    x64, y64 = x32.astype(np.float64), y32.astype(np.float64)  # the reference sees the same float32 values
    seq = np.repeat(np.arange(scale.n_seq), scale.seq_len)
    pos = np.tile(np.arange(scale.seq_len), scale.n_seq)
    anchors = choose_anchors(len(x32), scale.anchors, cfg.seed)
    out: dict[str, Any] = {"scale": asdict(scale), "pool": len(x32), "classes": {}, "bars": [], "profile": {}}
    for fn in FIT_BENCH_CLASSES:
        cases = {
            "fit_layer": lambda fn=fn: fit_layer(x32, y32, seq, pos, seq, anchors, fn, cfg)[0],
            "reference": lambda fn=fn: reference_rows(x64, y64, seq, anchors, fn, cfg),
        }
        cases["fit_layer"]()  # warm-up: the first call pays lazy initialisation of torch's linalg
        reference_rows(x64, y64, seq, anchors[:1], fn, cfg)
        timings = interleaved(cases, scale.repeats, warmup=0)
        agreement = compare_with_reference(timings.results["fit_layer"][-1], timings.results["reference"][-1])
        speedup = timings.ratio("reference", "fit_layer")
        speed_bar = bar(f"fits {fn}, {scale.label}: speed-up over per-anchor reference", speedup, ">=", 20)
        same_bar = bar(
            f"fits {fn}, {scale.label}: max |fit_layer − reference|", agreement["max_abs_diff"], "<=", 1e-4,
            unit="", note=f"{agreement['null_mismatches']} null-pattern mismatches",
            extra_ok=agreement["null_mismatches"] == 0,
        )
        out["classes"][fn] = {"speedup": speedup, **agreement, "timings": timings.summary()}
        out["bars"] += [speed_bar, same_bar]
        if not speed_bar.passed:
            out["profile"][speed_bar.name] = profile_top(cases["fit_layer"])
    return out


def knn_peak_memory(size: KnnSize, n_pool: int, k: int, threads: int) -> dict[str, int]:
    """Peak RSS of a fresh process running `nearest_neighbours` over a float64 pool (as the fits do).
    `working_bytes` = peak − RSS with the pool already loaded: the search's own memory."""
    import torch

    from pipeline.study_a.fits import choose_anchors
    from pipeline.study_a.knn import nearest_neighbours

    torch.set_num_threads(threads)
    pool = torch.from_numpy(np.random.default_rng(4).normal(size=(n_pool, size.d)))
    anchors = torch.from_numpy(choose_anchors(n_pool, size.anchors, seed=0))
    # A small search first: torch's and the BLAS's one-off buffers (thread pools, workspaces) belong
    # to the process, not to the search; then the peak is reset, so it is the search's own.
    nearest_neighbours(pool[: 2 * k], torch.arange(2), k, chunk=size.chunk)
    reset = reset_peak_rss()
    before = current_rss_bytes()
    nearest_neighbours(pool, anchors, k, chunk=size.chunk)
    peak = peak_rss_bytes()
    return {"pool": n_pool, "pool_bytes": pool.numel() * 8, "rss_with_pool_bytes": before, "peak_reset": reset,
            "peak_rss_bytes": peak, "working_bytes": max(0, peak - before)}


# Peak RSS is read from the kernel's high-water mark; a fixed mmap threshold makes glibc return every
# large block to the system when freed, so the search's working set cannot hide in heap pages kept
# from earlier allocations.
_EXACT_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def knn_block_bytes(size: KnnSize, k: int) -> int:
    """One float64 matrix of an anchor block's candidates, `min(chunk, anchors) × (chunk + k)`: the
    unit the search's working memory is bounded by (it holds a few such matrices at once)."""
    return min(size.chunk, size.anchors) * (size.chunk + k) * 8


def knn_section(size: KnnSize, k: int, threads: int) -> dict[str, Any]:
    runs = [run_fresh(knn_peak_memory, threads, env=_EXACT_RSS_ENV, size=size, n_pool=n, k=k) for n in size.pools]
    block = knn_block_bytes(size, k)
    growth = max(runs[1]["working_bytes"], block) / max(runs[0]["working_bytes"], block)
    for run in runs:
        run["working_in_blocks"] = run["working_bytes"] / block
    return {
        "size": asdict(size), "k": k, "block_bytes": block, "runs": runs,
        "memory_accounting": "peak RSS (VmHWM, reset after a warm-up search) of a fresh process − its RSS "
                             "with the pool loaded",
        "bars": [bar("kNN: working memory, pool 4× larger", growth, "<=", 1.3,
                     note=f"{runs[1]['working_in_blocks']:.1f} blocks of {block / 2**20:.1f} MiB at the larger pool")],
    }


def extraction_section(size: ExtractionSize, batch_size: int, threads: int, runner: Runner = run_fresh) -> dict[str, Any]:
    section = runner(extraction_throughput, threads, size=size, batch_size=batch_size)
    runs = [run_fresh(extraction_peak_rss, threads, size=size, n_seq=n, batch_size=batch_size) for n in size.rss_n_seq]
    growth = runs[1]["peak_rss_bytes"] / runs[0]["peak_rss_bytes"]
    section["peak_rss"] = runs
    section["bars"].append(bar("extraction: peak RSS, 4× the tokens", growth, "<=", 1.3,
                               note=f"{runs[0]['tokens']} → {runs[1]['tokens']} tokens, whole process, nothing subtracted"))
    return section


# --------------------------------------------------------------------------------------- recipes
def newton_schulz_flops(vocab: int, width: int, steps: int = 5) -> float:
    """torch.optim.Muon's quintic Newton–Schulz on an `m × M` matrix (m = min side): per step
    `A = XXᵀ` (2m²M), `B = bA + cA²` (2m³), `X ← aX + BX` (2m²M)."""
    m, big = min(vocab, width), max(vocab, width)
    return steps * (4 * m * m * big + 2 * m**3)


# Element-wise FLOPs per head entry, counted from the code (multiply-adds as 2): momentum EMA +
# Nesterov read 4; AdamW's moments, bias-corrected step and decay ~11; centring 2; row
# normalisation 3; scaling 1; decoupled weight decay 1; the final `p.add_` 2.
_ELEMENTWISE = {"adamw": 11, "muon": 11, "muon_head": 4 + 2 + 1 + 1 + 2, "sign": 4 + 2 + 1 + 2,
                "rownorm": 4 + 3 + 1 + 2, "hilbert": 4 + 2 + 3 + 2 + 1 + 1 + 2}


def head_step_flops(recipe: str, vocab: int, width: int, equi_iters: int, equi_sample_rows: int) -> dict[str, float]:
    """Analytic FLOPs of one head step (`W ∈ R^{V×d}`): `lmo` for the update itself, `monitoring` for
    what the optimizer also records (`hilbert_equi`'s `equi_ratio`, pairwise distances of S rows in
    float64: 2·S²·d). The backward pass that produces the gradient is the same for every recipe."""
    n = vocab * width
    if recipe == "hilbert_equi":
        per_iter = 2 * n + (2 * n + newton_schulz_flops(vocab, width)) + 3 * n  # centre, NS, rownorm
        lmo = 4 * n + equi_iters * per_iter + (2 + 1 + 1 + 2) * n
        rows = min(equi_sample_rows, vocab)
        return {"lmo": float(lmo), "monitoring": float(2 * rows * rows * width)}
    spectral = 2 * n + newton_schulz_flops(vocab, width) if recipe == "muon_head" else 0
    return {"lmo": float(_ELEMENTWISE[recipe] * n + spectral), "monitoring": 0.0}


def recipe_step_times(size: RecipeSize, train: TrainConfig, threads: int) -> dict[str, Any]:
    """Training-step time of every recipe on the same GPT-NeoX and batch; only the head's optimizer differs."""
    import torch

    from pipeline.models.arch import build_model, head_of
    from pipeline.study_b.recipes import build_optimizers, resolve_head_step

    torch.set_num_threads(threads)
    model_size = ModelSize(d_model=size.d_model, n_layers=size.n_layers, n_heads=size.n_heads)
    batch = torch.from_numpy(token_ids(size.batch, size.seq_len, size.vocab, seed=5))
    optimizer_s: dict[str, list[float]] = {r: [] for r in RECIPES}

    def training_step(recipe: str, model: Any, optimizer: Any) -> None:
        model(input_ids=batch, labels=batch).loss.backward()
        start = time.perf_counter()
        optimizer.step(radius=1.0)  # the radius only sets η for `tau` recipes; it does not change the cost
        optimizer_s[recipe].append(time.perf_counter() - start)
        optimizer.zero_grad()

    cases = {}
    for recipe in RECIPES:
        model = build_model("neox", model_size, size.vocab, size.seq_len, seed=0)
        optimizer = build_optimizers(model, head_of(model).weight, recipe, train)
        cases[recipe] = lambda r=recipe, m=model, o=optimizer: training_step(r, m, o)
    timings = interleaved(cases, size.repeats, warmup=2)
    equi_iters = resolve_head_step("hilbert_equi", train).equi_iters
    flops = {r: head_step_flops(r, size.flops_vocab, size.flops_width, equi_iters, train.equi_sample_rows) for r in RECIPES}
    # Each bar from its own pair, interleaved A B B A: adjacent steps share the machine's load.
    bars, profile = [], {}
    for recipe, base, threshold in (("hilbert", "muon", 1.1), ("hilbert_equi", "muon_head", 1.2)):
        pair = interleaved({recipe: cases[recipe], base: cases[base]}, 3 * size.repeats, warmup=0)
        bars.append(bar(f"recipes: {recipe} / {base} (training-step time)", pair.ratio(recipe, base), "<=", threshold))
        if not bars[-1].passed:
            profile[bars[-1].name] = profile_top(cases[recipe])
    return {
        "model": asdict(size) | {"arch": "neox"},
        "vs_muon": {r: timings.ratio(r, "muon") for r in RECIPES},
        "optimizer_step_median_s": {r: statistics.median(optimizer_s[r]) for r in RECIPES},
        "timings": timings.summary(),
        "head_step_flops": {"vocab": size.flops_vocab, "width": size.flops_width, "equi_iters": equi_iters,
                            "per_recipe": flops},
        "bars": bars,
        "profile": profile,
    }


# ------------------------------------------------------------------------------------------- fan-out
def warm_worker(seconds: float) -> int:
    """A Ray task that makes its worker import what the fit tasks import, then holds it for `seconds`
    so that each of the N workers gets one; returns the worker's pid."""
    import pipeline.study_a.fits  # noqa: F401 - the import is the point
    import stages.fit  # noqa: F401

    time.sleep(seconds)
    return os.getpid()


# ------------------------------------------------------------------------------------------- GPU
def gpu_benchmarks(sizes: BenchSizes, cfg: AnalysisConfig, batch_size: int, threads: int) -> dict[str, Any]:
    """The same measurements on CUDA, as absolute figures with the device name: tokens/s and achieved
    TFLOP/s of extraction and of the kNN search, `fit_layer` seconds per class, and the kNN's memory
    by torch's own accounting (`max_memory_allocated` − allocated before)."""
    import torch

    torch.set_num_threads(threads)
    device = torch.device("cuda")
    return {
        "device": torch.cuda.get_device_name(device),
        "extraction": _gpu_extraction(sizes.extraction, batch_size, device),
        "knn": _gpu_knn(sizes.gpu_knn, cfg.k, device),
        "fits": _gpu_fits(sizes.fits[0], cfg, device),
    }


def _gpu_extraction(size: ExtractionSize, batch_size: int, device: Any) -> dict[str, Any]:
    import torch

    model = _extraction_model(size).to(device)
    tokens = token_ids(4 * size.n_seq, size.seq_len, size.vocab, seed=1)

    def extract() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            extract_to_parquet(model, tokens, batch_size, Path(tmp))

    def bare() -> None:
        with torch.inference_mode():
            for start in range(0, len(tokens), batch_size):
                ids = torch.as_tensor(tokens[start : start + batch_size], device=device)
                model.base_model(input_ids=ids, output_hidden_states=True, use_cache=False)
        torch.cuda.synchronize(device)

    timings = interleaved({"extract_path": extract, "bare_forward": bare}, size.repeats)
    flops = forward_flops_per_token(size) * tokens.size
    return {
        "model": asdict(size),
        "tokens_per_s": {c: tokens.size / timings.median(c) for c in timings.times},
        "tflops": {c: flops / timings.median(c) / 1e12 for c in timings.times},
        "throughput_ratio": 1 / timings.ratio("extract_path", "bare_forward"),
    }


def _gpu_knn(size: KnnSize, k: int, device: Any) -> dict[str, Any]:
    import torch

    from pipeline.study_a.knn import nearest_neighbours

    runs = []
    for n_pool in size.pools:
        pool = torch.randn(n_pool, size.d, dtype=torch.float64, device=device)  # float64, as the fits run it
        anchors = torch.randperm(n_pool, device=device)[: size.anchors]
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)

        def search(pool: Any = pool, anchors: Any = anchors) -> None:
            nearest_neighbours(pool, anchors, k, chunk=size.chunk)
            torch.cuda.synchronize(device)

        timings = interleaved({"knn": search}, 3)
        seconds = timings.median("knn")
        runs.append({
            "pool": n_pool, "d": size.d, "anchors": size.anchors, "chunk": size.chunk, "seconds": seconds,
            "tflops_fp64": 2 * n_pool * size.anchors * size.d / seconds / 1e12,
            "working_bytes": torch.cuda.max_memory_allocated(device) - before,
        })
        del pool, anchors
    return {"memory_accounting": "torch.cuda.max_memory_allocated − memory_allocated before", "runs": runs}


def _gpu_fits(scale: FitScale, cfg: AnalysisConfig, device: Any) -> dict[str, Any]:
    import torch

    from pipeline.study_a.fits import choose_anchors, fit_layer

    states = synthetic_states(scale.n_seq, scale.seq_len, scale.d, n_layers=1, seed=3)
    seq = np.repeat(np.arange(scale.n_seq), scale.seq_len)
    anchors = choose_anchors(states.shape[1], scale.anchors, cfg.seed)
    seconds = {}
    for fn in FIT_BENCH_CLASSES:
        def fit(fn: str = fn) -> None:
            fit_layer(states[0], states[1], seq, seq, seq, anchors, fn, cfg, device=device)
            torch.cuda.synchronize(device)

        seconds[fn] = interleaved({fn: fit}, 3).median(fn)
    return {"scale": asdict(scale), "seconds": seconds}


# ------------------------------------------------------------------------------------------ machine
def machine_info() -> dict[str, Any]:
    import psutil

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    gpu = None
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_bytes": psutil.virtual_memory().total,
        "gpu": gpu,
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()),
    }


def versions() -> dict[str, str]:
    from importlib import metadata

    from pipeline.core.store import code_version

    found = {"python": platform.python_version(), "lmgeo": code_version()}
    for package in ("torch", "transformers", "ray", "pyarrow", "numpy", "duckdb"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[package] = metadata.version(package)
    return found


# ------------------------------------------------------------------------------------------ report
def to_jsonable(value: Any) -> Any:
    """Dataclasses, tuples and numpy scalars as plain JSON values."""
    if hasattr(value, "__dataclass_fields__"):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# What the profile of a missed bar has pointed to so far, by benchmark; the profile printed next to it
# is this run's. Each names the function, why it costs, and the expected gain.
KNOWN_LEVERS = {
    "extraction: extract path": (
        "`pipeline/store.py` `ShardWriter.write` opens `pq.ParquetWriter(temp, schema)` with pyarrow's "
        "defaults, which dictionary-encode every column, the float vector column `h` included: pyarrow "
        "hashes every float until the dictionary page overflows, then falls back to plain encoding "
        "(`write_table` is the top non-torch entry below). Passing `use_dictionary=` the non-vector "
        "columns only (`seq_id`, `pos`, `token_id`) writes a 2048 × 128 float32 batch in 4 ms instead of "
        "31 ms and makes the file 36% smaller; with that one change (patched in a scratch run on the "
        "development machine, this benchmark's sizes) the ratio went from 0.49× to 0.83×. What remains "
        "is a fixed cost per shard (an fsync per file, per directory and for the manifest, a sha256 of "
        "each file), which `analysis.sequences_per_shard` amortises."
    ),
    "fits diag_psd": (
        "Already applied: the dominant coordinates are a mask (no dense `(A, d, d)` basis) and the kNN "
        "merge selects with `torch.topk` before a stable sort of the survivors. At d = 64 what remains is "
        "the fixed per-call work over the pool (float64 copy, `isfinite`, row norms, the chunked kNN), "
        "the same order as the reference's own per-anchor cost when d is this small; more anchors per "
        "call (the study's 128–256) amortise it, and at d = 768 the bar holds with room."
    ),
    "fits lowrank": (
        "Already applied: the top-`rank` subspace comes from an `eigh` of the smaller Gram matrix, not an "
        "SVD. At d = 64 with k = 32 the per-anchor reference solves one 64 × 64 ridge system per anchor, "
        "which LAPACK does in microseconds, so the batched fit cannot be 20× faster than it; the ratio "
        "grows with d (120× at d = 768)."
    ),
    "fits orthogonal": (
        "At d ≤ 2k (the default study: d = 64, k = 32) the span of the neighbours is all of R^d, so "
        "`fit_orthogonal` does per anchor the same dense d × d LAPACK work as the reference (the polar "
        "factor's SVD of the cross-covariance): batching cannot give 20× there; at d = 768 the fit works "
        "in the ≤ 2k-dimensional span and the bar holds. Already applied: one `eigh` of `(Q + Qᵀ)/2` "
        "for the local subspace instead of an SVD. Left: a batched Newton iteration for the polar "
        "factor, which a timing comparison here did not show to be faster at these condition numbers."
    ),
    "recipes: hilbert_equi": (
        "`hilbert_equi` runs `equi_iters` Newton–Schulz orthogonalisations per step (3 by default) where "
        "`muon_head` runs one, each 5·(4·V·d² + 2·d³) FLOPs (see the FLOP table); its `equi_ratio` is "
        "now computed only when asked (geometry steps), not every step. The rest is structural: "
        "≈ (fwd+bwd + equi_iters·NS)/(fwd+bwd + NS); `equi_iters = 1` costs as much as `muon_head`, "
        "and fewer NS steps per inner iteration (the iterate is nearly orthogonal after the first) "
        "would be the next lever."
    ),
    "recipes: hilbert /": (
        "`hilbert_direction` is element-wise (two centrings and a row normalisation, ≈ 15·V·d FLOPs "
        "against AdamW's ≈ 11·V·d); a miss here points at memory traffic (each centring and "
        "`_unit_rows` materialises a V × d temporary) or at load on the machine."
    ),
    "fan-out": (
        "Two Ray workers can only halve the time when two cores are free: compare the load average "
        "recorded below with the 2 cores. Per-task overhead (reading the layer pair from Parquet "
        "with DuckDB and verifying file hashes) is paid by every task in both configurations."
    ),
}

_HOW_TO_READ = """\
Every figure below is a **ratio of two measurements taken side by side in this run on the same data**,
so it holds on a shared, noisy machine where absolute times do not. The two sides run interleaved
(`A B B A …`, after an untimed warm-up) and a ratio is the **median over repetitions of `A_i / B_i`**:
adjacent runs see the same load. Each section runs in a fresh process with the thread count its
stage's Ray task gets (`ray.tasks.<stage>.num_cpus`), as the stage does. Peak memory is the
kernel's high-water mark of a fresh process's resident set (`VmHWM`; `ru_maxrss` would include
the parent's peak, which a spawned child inherits across exec), one process per size.

- `measured` is the ratio (or, for agreement rows, the largest absolute difference);
- `bar` is the target (SPEC §7 and the benchmark brief); `verdict` says whether this run met it;
- a missed bar is explained below the tables by this run's profile and the known levers;
- absolute seconds and tokens/s are in the detail tables and in `bench.json`, for context only.
"""


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.{digits}g}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render_markdown(report: dict[str, Any]) -> str:
    """`bench.md` from the JSON-ready report: how to read it, the ratio table, details, profiles."""
    lines = [f"# lmgeo benchmarks{' (quick smoke run: sizes too small to mean anything)' if report['quick'] else ''}", ""]
    lines += [f"Command: `{report['command']}` — started {report['started_utc']}, took {report['wall_s']:.0f} s.", ""]
    lines += ["## How to read this", "", _HOW_TO_READ, "## Ratios", ""]
    lines += _table(["benchmark", "measured", "bar", "verdict", "note"], [
        [b["name"], _num(b["value"]) + b["unit"], f"{b['op']} {_num(b['threshold'])}{b['unit']}",
         "met" if b["passed"] else "**missed**", b["note"]] for b in report["ratios"]])
    missed = [b for b in report["ratios"] if not b["passed"]]
    lines += ["", f"{len(report['ratios']) - len(missed)} of {len(report['ratios'])} bars met.", ""]
    lines += _extraction_md(report["extraction"]) + _fits_md(report["fits"]) + _knn_md(report["knn_memory"])
    lines += _recipes_md(report["recipes"]) + _fanout_md(report["fanout"]) + _gpu_md(report["gpu"])
    if missed:
        lines += ["## Missed bars: profiles and levers", ""]
        explained: set[str] = set()
        for b in missed:
            lines += [f"### {b['name']}", ""]
            prefix = next((p for p in KNOWN_LEVERS if b["name"].startswith(p)), None)
            if prefix in explained:
                lines += [f"Levers: as for the first missed `{prefix.strip()}` bar above.", ""]
            elif prefix is not None:
                lines += [KNOWN_LEVERS[prefix], ""]
                explained.add(prefix)
            if report["profiles"].get(b["name"]):
                lines += ["cProfile of one call of the code under test, top entries by own time:", "", "```",
                          *report["profiles"][b["name"]], "```", ""]
    lines += _machine_md(report)
    return "\n".join(lines) + "\n"


def _extraction_md(section: dict[str, Any]) -> list[str]:
    m = section["model"]
    lines = ["## Extraction", "",
             (f"A random-weight {m['arch']} (d = {m['d_model']}, {m['n_layers']} layers, V = {m['vocab']}, "
             f"{m['params'] / 1e6:.2g} M parameters), {section['tokens_per_repeat']} tokens per repetition "
             f"(one shard of {m['n_seq']} sequences × {m['seq_len']}), batch {section['batch_size']}. "
             "The extract path is `extract_batches` (forward with hooks on the blocks) streamed through "
             "`ShardWriter` into Parquet in a temporary directory; the baseline is the base model's "
             "forward with `output_hidden_states=True` on the same batches (no head, no KV cache)."), ""]
    lines += _table(["path", "tokens/s (median)"], [[c, _num(v, 4)] for c, v in section["tokens_per_s"].items()])
    lines += ["", "Peak RSS of a fresh process (model built, tokens extracted), nothing subtracted:", ""]
    lines += _table(["tokens", "RSS after setup", "peak RSS"], [
        [str(r["tokens"]), _mib(r["rss_after_setup_bytes"]), _mib(r["peak_rss_bytes"])] for r in section["peak_rss"]])
    return lines + [""]


def _fits_md(scales: list[dict[str, Any]]) -> list[str]:
    lines = ["## Fits", "",
             ("`fit_layer` (batched, float64) against `pipeline.study_a.reference` (one anchor at a time in NumPy: "
             "full sort of the distances, `lstsq` / SVD per anchor, full d × d SVD of each local operator), "
             "on the same synthetic layer (a tanh update plus a cross-token term, float32-rounded)."), ""]
    for scale in scales:
        s = scale["scale"]
        lines += [f"**{s['label']}**: pool {scale['pool']}, {s['anchors']} anchors, {s['repeats']} repetitions.", ""]
        lines += _table(["class", "fit_layer s", "reference s", "speed-up", "max abs diff", "null mismatches"], [
            [fn, _num(c["timings"]["fit_layer"]["median_s"]), _num(c["timings"]["reference"]["median_s"]),
             _num(c["speedup"]) + "×", _num(c["max_abs_diff"]), str(c["null_mismatches"])]
            for fn, c in scale["classes"].items()])
        lines += [""]
    return lines


def _knn_md(section: dict[str, Any]) -> list[str]:
    s = section["size"]
    lines = ["## kNN memory", "",
             (f"`nearest_neighbours` over a float64 pool (d = {s['d']}, k = {section['k']}, chunk = {s['chunk']}, "
             f"{s['anchors']} anchors) in a fresh process per pool size. Accounting: {section['memory_accounting']}. "
             f"One block = {_mib(section['block_bytes'])} (min(chunk, anchors) × (chunk + k) float64)."), ""]
    lines += _table(["pool", "pool bytes", "RSS with pool", "peak RSS", "working memory", "in blocks"], [
        [str(r["pool"]), _mib(r["pool_bytes"]), _mib(r["rss_with_pool_bytes"]), _mib(r["peak_rss_bytes"]),
         _mib(r["working_bytes"]), _num(r["working_in_blocks"])] for r in section["runs"]])
    return lines + [""]


def _recipes_md(section: dict[str, Any]) -> list[str]:
    m, f = section["model"], section["head_step_flops"]
    lines = ["## Head recipes", "",
             (f"One training step (forward, backward, `RecipeOptimizer.step`) of a random-weight GPT-NeoX "
             f"(d = {m['d_model']}, {m['n_layers']} layers, V = {m['vocab']}, batch {m['batch']} × {m['seq_len']}) "
             "per recipe, on the same batch; only the head's optimizer differs. The `vs muon` column comes "
             "from rounds over all seven recipes (order reversed every other round); each bar from its own "
             "pair (`hilbert`/`muon`, `hilbert_equi`/`muon_head`) interleaved A B B A, three times as many "
             "steps, so the two sides of a ratio always run next to each other."), "",
             (f"Head-step FLOPs are analytic, at V = {f['vocab']}, d = {f['width']} (n = V·d, equi_iters = "
             f"{f['equi_iters']}): `adamw`, `muon` (AdamW head) ≈ 11n; `sign` ≈ 9n; `rownorm` ≈ 10n; "
             "`hilbert` ≈ 15n; `muon_head` ≈ 10n + NS; `hilbert_equi` ≈ 10n + equi_iters·(7n + NS), plus "
             "2·S²·d for the `equi_ratio` it records on S ≤ 1024 rows; NS(V, d) = 5·(4·m²·M + 2·m³) with "
             "m = min(V, d), M = max(V, d) (torch.optim.Muon's 5-step quintic Newton–Schulz). The backward "
             "pass producing the gradient is common to all recipes and not counted."), ""]
    lines += _table(["recipe", "step s (median)", "vs muon", "optimizer step s", "head-step GFLOP", "monitoring GFLOP"], [
        [r, _num(section["timings"][r]["median_s"]), _num(section["vs_muon"][r]) + "×",
         _num(section["optimizer_step_median_s"][r]), _num(f["per_recipe"][r]["lmo"] / 1e9),
         _num(f["per_recipe"][r]["monitoring"] / 1e9)] for r in section["vs_muon"]])
    return lines + [""]


def _fanout_md(section: dict[str, Any]) -> list[str]:
    s = section["size"]
    lines = ["## Ray fan-out", "",
             (f"The fit stage's tasks (`stages.fit.fit_task`: read a layer pair from Parquet, fit, write) for "
             f"{s['n_layers']} layers × {len(s['classes'])} classes ({', '.join(s['classes'])}) on synthetic "
             f"activations (d = {s['d']}, {s['n_seq']} × {s['seq_len']} tokens, {s['anchors']} anchors), "
             "through `run_shards`, with an embedded Ray started by `ray.init(num_cpus=N)` for each N and "
             "shut down after. Timed: `run_shards` only, after every worker has imported the fit code."), ""]
    lines += _table(["workers", "seconds per run"], [[n, ", ".join(_num(t) for t in ts)] for n, ts in section["seconds"].items()])
    load = section["load_average"]
    lines += ["", (f"Outputs identical across every run: {'yes' if section['same_outputs'] else '**no**'}. "
              f"Load average (1 min) before / after this section: {load['before'][0]:.2f} / {load['after'][0]:.2f} "
              f"on {section['cores']} cores: a speed-up needs idle cores."), ""]
    return lines


def _gpu_md(section: dict[str, Any]) -> list[str]:
    lines = ["## GPU", ""]
    if not section.get("available"):
        return lines + [section.get("reason", "No CUDA device: the GPU benchmarks did not run."), ""]
    if "error" in section:
        return lines + [f"The GPU benchmarks failed: `{section['error']}`", ""]
    e, k = section["extraction"], section["knn"]
    lines += [f"Device: {section['device']}.", ""]
    lines += _table(["extraction path", "tokens/s", "TFLOP/s (Kaplan forward FLOPs)"], [
        [c, _num(e["tokens_per_s"][c], 4), _num(e["tflops"][c])] for c in e["tokens_per_s"]])
    lines += ["", f"Extract path / bare forward throughput: {_num(e['throughput_ratio'])}×.", ""]
    lines += _table(["kNN pool", "d", "anchors", "seconds", "TFLOP/s (fp64 distances)", "working memory"], [
        [str(r["pool"]), str(r["d"]), str(r["anchors"]), _num(r["seconds"]), _num(r["tflops_fp64"]), _mib(r["working_bytes"])]
        for r in k["runs"]])
    lines += ["", f"kNN memory accounting: {k['memory_accounting']}.", ""]
    lines += _table(["fit class", f"fit_layer s on the GPU ({section['fits']['scale']['label']})"],
                    [[fn, _num(t)] for fn, t in section["fits"]["seconds"].items()])
    return lines + [""]


def _machine_md(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    lines = ["## Machine and versions", "",
             f"- CPU: {m['cpu']}, {m['logical_cores']} logical / {m['physical_cores']} physical cores",
             f"- memory: {m['memory_bytes'] / 2**30:.1f} GiB",
             f"- GPU: {', '.join(m['gpu']) if m['gpu'] else 'none'}",
             f"- platform: {m['platform']}",
             (f"- load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in m['load_average_at_start'])}; "
             f"at end: {', '.join(f'{x:.2f}' for x in m['load_average_at_end'])}"),
             "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), ""]
    return lines
