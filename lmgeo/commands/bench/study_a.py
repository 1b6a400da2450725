"""Study A's two speed bars of SPEC §7: the exact kNN against FAISS's exact `IndexFlatL2` on one thread
(same data, same neighbours), and patching the suffix against a full forward (same KLs)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from lmgeo.commands.bench.measure import bar, interleaved
from lmgeo.commands.bench.sizes import KnnVsFaissSize, PatchingSize


def knn_vs_faiss(sizes: tuple[KnnVsFaissSize, ...], k: int, threads: int) -> dict[str, Any]:
    """`nearest_neighbours` (exact, ties to the lower index) against FAISS `IndexFlatL2` (float32, index
    built in the timed call, `k + 1` searched and the anchor itself dropped), interleaved, per size. The bar
    gives both the same float32 pool (FAISS's only input type); ours is also timed on the float64 pool of
    the same values, as the fits call it, which adds the float32 copy. Ours runs FAISS's own exact search
    for its float32 pass, so the ratio is what exactness costs on top of it: `k + slack` candidates and the
    float64 distances of those float32 cannot separate from the k-th."""
    import faiss
    import torch

    from lmgeo.study_a.fits import choose_anchors
    from lmgeo.study_a.knn import nearest_neighbours

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

        cases = {
            "lmgeo": lambda: nearest_neighbours(pool32_t, anchors_t, k).numpy(),
            "lmgeo_float64": lambda: nearest_neighbours(pool64_t, anchors_t, k).numpy(),
            "faiss": theirs,
        }
        timings = interleaved(cases, size.repeats)
        found = cases["lmgeo"]()
        same = float(np.mean([set(a) == set(b) for a, b in zip(found, theirs(), strict=True)]))
        identical = bool(np.array_equal(found, cases["lmgeo_float64"]()))
        speedup, speedup64 = timings.ratio("faiss", "lmgeo"), timings.ratio("faiss", "lmgeo_float64")
        out["runs"].append(
            {
                "size": asdict(size),
                "speedup": speedup,
                "speedup_float64": speedup64,
                "same_neighbours": same,
                "float64_identical": identical,
                "timings": timings.summary(),
            }
        )
        label = f"kNN vs FAISS IndexFlatL2, pool {size.pool} × d {size.d}, {size.anchors} anchors (speed-up)"
        out["bars"].append(
            bar(
                label,
                speedup,
                ">=",
                1.0,
                note=f"same neighbour sets for {same:.1%} of anchors; the "
                f"float64 pool of the same values: {speedup64:.2f}×",
                extra_ok=same == 1.0 and identical,
            )
        )
    return out


def suffix_vs_full(size: PatchingSize, threads: int) -> dict[str, Any]:
    """`patch_kl_anchors` in `suffix` mode (the default: blocks `l+1..` from the cached keys and values, on the
    positions from the anchor on) against `full` mode, and against `recompute` (the suffix of blocks on every
    position, the path before the cache), on a random-weight model, every layer, 3 patched copies per anchor
    (a real patch and two nulls share an anchor, as in the perturb stage). And the suffix's achieved FLOP/s
    against the bare forward's (`model(input_ids)` on the copies' sequences, same batches) on the same slice."""
    import torch

    from lmgeo.models.config import ModelSize
    from lmgeo.models.registry import build_model
    from lmgeo.study_a.patching import patch_kl_anchors, suffix_path

    torch.set_num_threads(threads)
    model = build_model(
        size.arch, ModelSize(d_model=size.d_model, n_layers=size.n_layers, n_heads=4), size.vocab, size.seq_len, seed=0
    ).eval()
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, size.vocab, size=(size.n_seq, size.seq_len))
    rows = np.repeat(np.repeat(np.arange(size.n_seq), size.anchors_per_seq), 3)
    positions = np.repeat(rng.integers(0, size.seq_len, size=size.n_seq * size.anchors_per_seq), 3)
    vectors = rng.normal(size=(len(rows), size.d_model)).astype(np.float32)
    cases: dict[str, Any] = {
        mode: lambda mode=mode: [
            patch_kl_anchors(model, tokens, rows, positions, layer, vectors, size.batch, mode=mode)
            for layer in range(size.n_layers)
        ]
        for mode in ("suffix", "recompute", "full")
    }
    cases["bare"] = lambda: [bare_forward(model, tokens[rows], size.batch) for _ in range(size.n_layers)]
    timings = interleaved(cases, size.repeats)
    worst = 0.0
    for mode in ("suffix", "recompute"):
        for got, want in zip(timings.results[mode][-1], timings.results["full"][-1], strict=True):
            errors = [float(np.max(np.abs(g - w) / np.maximum(w, 1e-6))) for g, w in zip(got, want, strict=True)]
            worst = max([worst] + errors)
    speedup, over_recompute = timings.ratio("full", "suffix"), timings.ratio("recompute", "suffix")
    suffix_paths = [suffix_path(model, layer) for layer in range(size.n_layers)]
    assert all(p is not None for p in suffix_paths)  # the suffix case ran at every layer
    paths = sorted({p[0] for p in suffix_paths if p is not None})
    n_blocks = size.n_layers
    suffix_work = sum(
        suffix_flops(model, n_blocks, np.zeros(size.n_seq, dtype=int), size.seq_len)  # each sequence's clean pass
        + suffix_flops(model, n_blocks - 1 - layer, positions, size.seq_len)  # blocks l+1.. from each anchor on
        for layer in range(n_blocks)
    )
    bare_work = n_blocks * suffix_flops(model, n_blocks, np.zeros(len(rows), dtype=int), size.seq_len)
    # (suffix FLOPs / suffix s) / (bare FLOPs / bare s), from each round's adjacent pair of runs
    flops_ratio = suffix_work / bare_work * timings.ratio("bare", "suffix")
    return {
        "size": asdict(size),
        "speedup": speedup,
        "over_recompute": over_recompute,
        "paths": paths,
        "max_relative_kl_difference": worst,
        "timings": timings.summary(),
        "flops": {
            "suffix": suffix_work,
            "bare_forward": bare_work,
            "ratio": flops_ratio,
            "suffix_per_s": suffix_work / timings.median("suffix"),
            "bare_forward_per_s": bare_work / timings.median("bare"),
        },
        "bars": [
            bar(
                f"patching: suffix vs full forward, {size.arch} {size.n_layers} blocks (speed-up)",
                speedup,
                ">=",
                1.5,
                note=f"KLs agree to {worst:.1e} (relative); {over_recompute:.2f}× the recomputing suffix; "
                f"path {', '.join(paths)}",
                extra_ok=worst <= 1e-3,
            ),
            bar(
                f"patching: suffix's achieved FLOP/s / the bare forward's, {size.arch} {size.n_layers} blocks",
                flops_ratio,
                ">=",
                SUFFIX_FLOPS_BAR,
                note=f"useful FLOPs: each sequence's clean pass and blocks l+1.. and the head from each "
                f"anchor on, {suffix_work / bare_work:.2f}× the bare forwards' of every copy",
            ),
        ],
    }


# The suffix runs few positions per call (a group of copies from its earliest anchor on), so its FLOP rate is
# below a forward's over whole sequences; below half of it, overheads per call (cache copies, the KL over
# the vocabulary, grouping) rather than the model's FLOPs would dominate the perturb stage.
SUFFIX_FLOPS_BAR = 0.5


def bare_forward(model: Any, tokens: np.ndarray, batch_size: int) -> int:
    """transformers' forward with its head (logits), no cache, in batches: what a FLOP rate is measured against."""
    import torch

    with torch.inference_mode():
        for start in range(0, len(tokens), batch_size):
            model(input_ids=torch.as_tensor(tokens[start : start + batch_size], dtype=torch.long), use_cache=False)
    return len(tokens)


def suffix_flops(model: Any, blocks_run: int, first: np.ndarray, seq_len: int) -> float:
    """FLOPs of the last `blocks_run` blocks and the head on positions `first[i]..seq_len − 1` of sequence i,
    each position attending to itself and every earlier one: 2 per multiply-add of the blocks' weight
    matrices (every parameter of ≥ 2 dimensions, used once per token) and of the head, and 4·d per
    (query, key) pair and block (the scores and the weighted sum). For attention blocks (the bench's neox)."""
    from lmgeo.models.registry import blocks_of

    every = list(blocks_of(model))
    blocks = every[len(every) - blocks_run :]
    head = model.get_output_embeddings().weight
    per_token = 2 * sum(p.numel() for block in blocks for p in block.parameters() if p.ndim >= 2) + 2 * head.numel()
    first = np.asarray(first, dtype=np.float64)
    pairs = (seq_len * (seq_len + 1) - first * (first + 1)) / 2  # Σ (t + 1) over t = first .. seq_len − 1
    return float(np.sum((seq_len - first) * per_token + 4 * head.shape[1] * blocks_run * pairs))
