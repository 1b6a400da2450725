"""The same measurements on CUDA, as absolute figures with the device's name."""

from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from lmgeo.commands.bench.extraction import _extraction_model, extract_to_parquet, forward_flops_per_token
from lmgeo.commands.bench.measure import interleaved
from lmgeo.commands.bench.sizes import BenchSizes, ExtractionSize, FitScale, KnnSize, fit_bench_classes, identifiable_k
from lmgeo.commands.bench.synthetic import synthetic_states, token_ids
from lmgeo.study_a.config import AnalysisConfig


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

    from lmgeo.study_a.knn import nearest_neighbours

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
        runs.append(
            {
                "pool": n_pool,
                "d": size.d,
                "anchors": size.anchors,
                "chunk": size.chunk,
                "seconds": seconds,
                "tflops_fp64": 2 * n_pool * size.anchors * size.d / seconds / 1e12,
                "working_bytes": torch.cuda.max_memory_allocated(device) - before,
            }
        )
        del pool, anchors
    return {"memory_accounting": "torch.cuda.max_memory_allocated − memory_allocated before", "runs": runs}


def _gpu_fits(scale: FitScale, cfg: AnalysisConfig, device: Any) -> dict[str, Any]:
    import torch

    from lmgeo.study_a.fits import choose_anchors, fit_layer

    states = synthetic_states(scale.n_seq, scale.seq_len, scale.d, n_layers=1, seed=3)
    seq = np.repeat(np.arange(scale.n_seq), scale.seq_len)
    anchors = choose_anchors(states.shape[1], scale.anchors, cfg.seed)
    cfg = cfg.model_copy(update={"k": identifiable_k(scale.d)})  # as the CPU section: every anchor identified
    seconds = {}
    for fn in fit_bench_classes():

        def fit(fn: str = fn) -> None:
            fit_layer(states[0], states[1], seq, seq, seq, anchors, [fn], cfg, device=device)
            torch.cuda.synchronize(device)

        seconds[fn] = interleaved({fn: fit}, 3).median(fn)
    return {"scale": asdict(scale), "seconds": seconds}
