"""Study A's two speed bars of SPEC §7: the exact kNN against FAISS's exact `IndexFlatL2` on one thread
(same data, same neighbours), and patching the suffix against a full forward (same KLs)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from tools.bench.measure import bar, interleaved
from tools.bench.sizes import KnnVsFaissSize, PatchingSize


def knn_vs_faiss(sizes: tuple[KnnVsFaissSize, ...], k: int, threads: int) -> dict[str, Any]:
    """`nearest_neighbours` (exact, ties to the lower index) against FAISS `IndexFlatL2` (float32, index
    built in the timed call, `k + 1` searched and the anchor itself dropped), interleaved, per size. The bar
    gives both the same float32 pool (FAISS's only input type); ours is also timed on the float64 pool of
    the same values, as the fits call it, which adds the float32 copy. Ours runs FAISS's own exact search
    for its float32 pass, so the ratio is what exactness costs on top of it: `k + slack` candidates and the
    float64 distances of those float32 cannot separate from the k-th."""
    import faiss
    import torch

    from pipeline.study_a.fits import choose_anchors
    from pipeline.study_a.knn import nearest_neighbours

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    out: dict[str, Any] = {"runs": [], "bars": []}
    for size in sizes:
        rng = np.random.default_rng(7)
        pool32 = rng.normal(size=(size.pool, size.d)).astype(np.float32)
        anchors = choose_anchors(size.pool, size.anchors, seed=0)
        pool32_t, pool64_t = torch.from_numpy(pool32), torch.from_numpy(pool32.astype(np.float64))
        anchors_t = torch.from_numpy(anchors)

        def theirs() -> np.ndarray:
            index = faiss.IndexFlatL2(size.d)
            index.add(pool32)
            _, found = index.search(pool32[anchors], k + 1)
            return np.array([[j for j in row if j != a][:k] for row, a in zip(found, anchors, strict=True)])

        cases = {"lmgeo": lambda: nearest_neighbours(pool32_t, anchors_t, k).numpy(),
                 "lmgeo_float64": lambda: nearest_neighbours(pool64_t, anchors_t, k).numpy(),
                 "faiss": theirs}  # fmt: skip
        timings = interleaved(cases, size.repeats)
        found = cases["lmgeo"]()
        same = float(np.mean([set(a) == set(b) for a, b in zip(found, theirs(), strict=True)]))
        identical = bool(np.array_equal(found, cases["lmgeo_float64"]()))
        speedup, speedup64 = timings.ratio("faiss", "lmgeo"), timings.ratio("faiss", "lmgeo_float64")
        out["runs"].append({"size": asdict(size), "speedup": speedup, "speedup_float64": speedup64,
                            "same_neighbours": same, "float64_identical": identical,
                            "timings": timings.summary()})  # fmt: skip
        label = f"kNN vs FAISS IndexFlatL2, pool {size.pool} × d {size.d}, {size.anchors} anchors (speed-up)"
        out["bars"].append(bar(label, speedup, ">=", 1.0, note=f"same neighbour sets for {same:.1%} of anchors; the "
                               f"float64 pool of the same values: {speedup64:.2f}×",
                               extra_ok=same == 1.0 and identical))  # fmt: skip
    return out


def suffix_vs_full(size: PatchingSize, threads: int) -> dict[str, Any]:
    """`patch_kl_anchors` in `suffix` mode (the default: blocks `l+1..` from the cached keys and values, on the
    positions from the anchor on) against `full` mode, and against `recompute` (the suffix of blocks on every
    position, the path before the cache), on a random-weight model, every layer, 3 patched copies per anchor
    (a real patch and two nulls share an anchor, as in the perturb stage)."""
    import torch

    from pipeline.models.config import ModelSize
    from pipeline.models.registry import build_model
    from pipeline.study_a.patching import patch_kl_anchors, suffix_path

    torch.set_num_threads(threads)
    model = build_model(size.arch, ModelSize(d_model=size.d_model, n_layers=size.n_layers, n_heads=4), size.vocab,
                        size.seq_len, seed=0).eval()  # fmt: skip
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, size.vocab, size=(size.n_seq, size.seq_len))
    rows = np.repeat(np.repeat(np.arange(size.n_seq), size.anchors_per_seq), 3)
    positions = np.repeat(rng.integers(0, size.seq_len, size=size.n_seq * size.anchors_per_seq), 3)
    vectors = rng.normal(size=(len(rows), size.d_model)).astype(np.float32)
    cases = {
        mode: lambda mode=mode: [
            patch_kl_anchors(model, tokens, rows, positions, layer, vectors, size.batch, mode=mode)
            for layer in range(size.n_layers)
        ]
        for mode in ("suffix", "recompute", "full")
    }
    timings = interleaved(cases, size.repeats)
    worst = 0.0
    for mode in ("suffix", "recompute"):
        for got, want in zip(timings.results[mode][-1], timings.results["full"][-1], strict=True):
            errors = [float(np.max(np.abs(g - w) / np.maximum(w, 1e-6))) for g, w in zip(got, want, strict=True)]
            worst = max([worst] + errors)
    speedup, over_recompute = timings.ratio("full", "suffix"), timings.ratio("recompute", "suffix")
    paths = sorted({suffix_path(model, layer)[0] for layer in range(size.n_layers)})
    return {
        "size": asdict(size), "speedup": speedup, "over_recompute": over_recompute, "paths": paths,
        "max_relative_kl_difference": worst, "timings": timings.summary(),
        "bars": [bar(f"patching: suffix vs full forward, {size.arch} {size.n_layers} blocks (speed-up)",
                     speedup, ">=", 1.5,
                     note=f"KLs agree to {worst:.1e} (relative); {over_recompute:.2f}× the recomputing suffix; "
                          f"path {', '.join(paths)}", extra_ok=worst <= 1e-3)],
    }  # fmt: skip
