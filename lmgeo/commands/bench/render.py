"""`bench.json` values and `bench.md`: how to read it, the ratio table, details and profiles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np


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


# Why no local class's fit reaches 20× its per-anchor reference as Study A now fits (docs/benchmarks.md).
_FITS_AT_K_ABOVE_D = (
    "Study A fits with k = 1.5·d neighbours (`identifiable_k`: every local class identified), so each anchor "
    "costs O(k·d² + d³) on both sides and the per-anchor reference runs the same LAPACK factorisations one at "
    "a time; with the fits at or near `torch.matmul`'s float64 rate (the FLOP/s row), batching cannot make "
    "the same work 20× faster. The bar was met (47–134× at d = 768) when k = 32 < d and the fits worked in a "
    "≤ 2k-dimensional span. At d = 64 the gap is per-call work (the kNN, the pool's fixed passes). "
)

# What the profile of a missed bar has pointed to so far, by benchmark; the profile printed next to it
# is this run's. Each names the function, why it costs, and the expected gain.
KNOWN_LEVERS = {
    "fits diag_psd": (
        _FITS_AT_K_ABOVE_D + "Already applied: identification takes the Gram's eigenvalues only (its "
        "eigenvectors where a neighbourhood lacks full rank); the class's own fit is O(k·d) per anchor, so "
        "the shared Gram (2·k·d²) and its eigenvalues are most of its cost."
    ),
    "fits lowrank": (
        _FITS_AT_K_ABOVE_D + "Already applied: the top-`rank` subspace comes from an `eigh` of the "
        "smaller Gram matrix, whose full decomposition it shares with identification."
    ),
    "fits orthogonal": (
        _FITS_AT_K_ABOVE_D + "Already applied: one `eigh` of `(Q + Qᵀ)/2` for the local subspace instead "
        "of an SVD. Left: a batched Newton iteration for the polar factor, which a timing comparison here did "
        "not show to be faster at these condition numbers."
    ),
    "recipes: hilbert_equi": (
        "`hilbert_equi`'s cost beyond `hilbert`'s is the candidate search for each row's nearest rows, "
        "2·V²·min(d, 64) FLOPs plus a top-k over V² similarities (a sketch of width 64 above d = 64), and "
        "`equi_iters` passes over V × 8 candidates; `muon_head` pays one Newton–Schulz, 5·(4·V·d² + 2·d³) in "
        "bfloat16. At small d the search dominates (its Gram matrices and top-k); at GPT-2 scale the "
        "iterations' two gathers of V × 8 candidate rows (their differences, then their weighted sum), which "
        "are memory-bound. Levers, each of which changes the step: fewer candidates or smaller buckets, fewer "
        "`equi_iters`, or softmax weights lagged one iteration so that one gather serves both. Already "
        "applied, the same step to the bit: the iterations' V × d products and candidate differences are "
        "formed a cache-sized chunk of rows at a time in one reused buffer (a fresh V × d tensor costs ~10× "
        "an in-place pass over it on CPU: the page faults of a new mapping)."
    ),
    "recipes: hilbert /": (
        "`hilbert_direction` is element-wise (two centrings and a row normalisation, ≈ 15·V·d FLOPs "
        "against AdamW's ≈ 11·V·d); a miss here points at memory traffic (each centring and "
        "`unit_rows` materialises a V × d temporary: `hilbert_equi` works in place with "
        "`unit_rows_`) or at load on the machine."
    ),
    "kNN vs FAISS": (
        "Both sides run FAISS's own float32 search; ours asks for `k + slack` candidates and adds the rounding "
        "bound, the chains and the float64 distances of the candidates contesting the k-th place. A miss at a "
        "small pool points at the fixed per-call cost of those few dozen tensor operations (a few hundred µs); "
        "at a large one, at the row norms of the pool and the exact distances (more contested candidates when "
        "distances crowd)."
    ),
    "patching: suffix's achieved FLOP/s": (
        "The suffix runs few positions per call (a group of copies from its earliest anchor on, batches of "
        "`copies × (T − start)` tokens), so its matrix products are smaller than a forward's over whole "
        "sequences; what is not the model's FLOPs at all is the KL over the vocabulary at every suffix position "
        "(`kl_per_position`: an exp, a difference, a product and a mask per logit, memory-bound: about half "
        "of the suffix's time in a cProfile at the bench's sizes, V = 2048, d = 64), the log-softmax of both "
        "passes, and copying the clean keys and values into each group's cache. Levers: the clean pass's "
        "probabilities once per sequence instead of once per group, and larger groups where anchors are close."
    ),
    "patching: suffix": (
        "The suffix runs blocks l+1..L−1 and the head on the positions from each group's earliest anchor on "
        "(about L/(L − l) on the blocks and T/(T − t) on both, averaged over layers and anchors); what it "
        "shares with the full forward is the clean pass and the KL over the vocabulary at every suffix "
        "position (`kl_per_position`, a large part of the profile at V = 2048 and d = 64). A `path` of "
        "`recompute` means the probe refused the cache: the positions before the anchor are recomputed."
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
    quick = " (quick smoke run: sizes too small to mean anything)" if report["quick"] else ""
    lines = [f"# lmgeo benchmarks{quick}", ""]
    lines += [f"Command: `{report['command']}` — started {report['started_utc']}, took {report['wall_s']:.0f} s.", ""]
    lines += ["## How to read this", "", _HOW_TO_READ, "## Ratios", ""]
    lines += _table(
        ["benchmark", "measured", "bar", "verdict", "note"],
        [
            [
                b["name"],
                _num(b["value"]) + b["unit"],
                f"{b['op']} {_num(b['threshold'])}{b['unit']}",
                "met" if b["passed"] else "**missed**",
                b["note"],
            ]
            for b in report["ratios"]
        ],
    )
    missed = [b for b in report["ratios"] if not b["passed"]]
    lines += ["", f"{len(report['ratios']) - len(missed)} of {len(report['ratios'])} bars met.", ""]
    sections: dict[str, Callable[[Any], list[str]]] = {
        "extraction": _extraction_md,
        "fits": _fits_md,
        "knn_memory": _knn_md,
        "knn_vs_faiss": _faiss_md,
        "patching": _patching_md,
        "recipes": _recipes_md,
        "fanout": _fanout_md,
        "gpu": _gpu_md,
    }
    for name, section_md in sections.items():
        lines += section_md(report[name]) if name in report else []  # `lmgeo bench --only` runs a subset
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
                lines += [
                    "cProfile of one call of the code under test, top entries by own time:",
                    "",
                    "```",
                    *report["profiles"][b["name"]],
                    "```",
                    "",
                ]
    lines += _machine_md(report)
    return "\n".join(lines) + "\n"


def _extraction_md(section: dict[str, Any]) -> list[str]:
    m = section["model"]
    lines = [
        "## Extraction",
        "",
        (
            f"A random-weight {m['arch']} (d = {m['d_model']}, {m['n_layers']} layers, V = {m['vocab']}, "
            f"{m['params'] / 1e6:.2g} M parameters), {section['tokens_per_repeat']} tokens per repetition "
            f"(one shard of {m['n_seq']} sequences × {m['seq_len']}), batch {section['batch_size']}. "
            "The extract path is `extract_batches` (forward with hooks on the blocks) streamed through "
            "`ShardWriter` into Parquet in a temporary directory (one writer thread per layer's file, hashed and "
            "flushed as it grows, overlapping the next forward); the baseline is the base model's "
            "forward with `output_hidden_states=True` on the same batches (no head, no KV cache)."
        ),
        "",
    ]
    lines += _table(["path", "tokens/s (median)"], [[c, _num(v, 4)] for c, v in section["tokens_per_s"].items()])
    lines += ["", "Peak RSS of a fresh process (model built, tokens extracted), nothing subtracted:", ""]
    lines += _table(
        ["tokens", "RSS after setup", "peak RSS"],
        [[str(r["tokens"]), _mib(r["rss_after_setup_bytes"]), _mib(r["peak_rss_bytes"])] for r in section["peak_rss"]],
    )
    v = section["vector_encodings"]
    lines += [
        "",
        (
            f"Vector encodings, the same {v['rows']} × {v['d']} float32 vectors with the activations' ids, "
            "written to and read from files in the page cache (no fsync), interleaved; GB/s of vector bytes "
            f"(same vectors read back: {'yes' if v['same_vectors'] else '**no**'}). Stored: format 2."
        ),
        "",
    ]
    lines += _table(
        ["encoding", "write GB/s", "read GB/s", "file MiB"],
        [
            [name, _num(e["write_gb_s"]), _num(e["read_gb_s"]), _num(e["file_bytes"] / 2**20)]
            for name, e in v["encodings"].items()
        ],
    )
    return lines + [""]


def _fits_md(scales: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Fits",
        "",
        (
            "`fit_layer` (batched, float64) against `lmgeo.study_a.reference` (one anchor at a time in NumPy: "
            "full sort of the distances, `lstsq` / SVD per anchor, full d × d SVD of each local operator), "
            "on the same synthetic layer (a tanh update plus a cross-token term, float32-rounded)."
        ),
        "",
    ]
    for scale in scales:
        s, t = scale["scale"], scale["threads"]
        lines += [
            (
                f"**{s['label']}**: pool {scale['pool']}, {s['anchors']} anchors, k = {scale['k']}, "
                f"{s['repeats']} repetitions; torch.matmul's float64 rate {_num(scale['matmul_flop_s'] / 1e9)} "
                f"GFLOP/s. Threads: torch {t['torch']} (the fits), "
                + ", ".join(
                    f"{name}={t[name]}" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
                )
                + f" (the reference's NumPy/OpenBLAS){'' if t['pinned'] else ': **not the same on both sides**'}."
            ),
            "",
        ]
        lines += _table(
            [
                "class",
                "fit_layer s",
                "reference s",
                "speed-up",
                "FLOP/s / matmul's",
                "identified",
                "max abs diff",
                "null mismatches",
            ],
            [
                [
                    fn,
                    _num(c["timings"]["fit_layer"]["median_s"]),
                    _num(c["timings"]["reference"]["median_s"]),
                    _num(c["speedup"]) + "×",
                    _num(c["flop_rate_ratio"]),
                    f"{c['identified']}/{s['anchors']}",
                    _num(c["max_abs_diff"]),
                    str(c["null_mismatches"]),
                ]
                for fn, c in scale["classes"].items()
            ],
        )
        lines += ["", _mlp_step_md(scale["mlp_step"]), ""]
    return lines


def _mlp_step_md(m: dict[str, Any]) -> str:
    t = m["timings"]
    return (
        f"`mlp` ({m['anchors']} anchors, k = {m['k']}, h = {m['hidden']}, {m['steps']} steps, every anchor "
        f"kept in the batch): the fit {_num(t['mlp fit']['median_s'])} s, plain batched Adam (autograd, "
        f"`torch.optim.Adam` on all four weights) {_num(t['plain Adam']['median_s'])} s: "
        f"{_num(m['ratio'])}× per step."
    )


def _knn_md(section: dict[str, Any]) -> list[str]:
    s = section["size"]
    lines = [
        "## kNN memory",
        "",
        (
            f"`nearest_neighbours` over a float64 pool (d = {s['d']}, k = {section['k']}, chunk = {s['chunk']}, "
            f"{s['anchors']} anchors) in a fresh process per pool size. Accounting: {section['memory_accounting']}. "
            f"One block = {_mib(section['block_bytes'])} (min(chunk, anchors) × (chunk + k) float64, the torch "
            "path's candidate matrix: the unit of account). The float32 copy of the pool (half the pool bytes) "
            "grows with the pool by design; what lies beyond it must not."
        ),
        "",
    ]
    lines += _table(
        ["pool", "pool bytes", "RSS with pool", "peak RSS", "working memory", "beyond the copy", "in blocks"],
        [
            [
                str(r["pool"]),
                _mib(r["pool_bytes"]),
                _mib(r["rss_with_pool_bytes"]),
                _mib(r["peak_rss_bytes"]),
                _mib(r["working_bytes"]),
                _mib(r["beyond_copy_bytes"]),
                _num(r["working_in_blocks"]),
            ]
            for r in section["runs"]
        ],
    )
    return lines + [""]


def _faiss_md(section: dict[str, Any]) -> list[str]:
    lines = [
        "## kNN against FAISS",
        "",
        (
            "`nearest_neighbours` (a float32 candidate pass that is FAISS's own exact search, then the float64 "
            "distances of the candidates float32 cannot separate from the k-th, ties to the lower index) against "
            "FAISS `IndexFlatL2` alone (exact, float32; the index is built inside the timed call and `k + 1` "
            "neighbours searched, the anchor dropped), both on one thread, on the same float32 Gaussian pool. "
            "Ours does strictly more work (`k + slack` candidates, the exact re-rank), so the ratio is the price "
            "of exact, reproducible neighbours. The float64 column times ours on the float64 pool of the same "
            "values, as the fits call it (it adds the float32 copy; the neighbours are identical)."
        ),
        "",
    ]
    lines += _table(
        [
            "pool",
            "d",
            "anchors",
            "lmgeo s",
            "FAISS s",
            "speed-up",
            "float64 pool: s",
            "speed-up",
            "same neighbour sets",
        ],
        [
            [
                str(r["size"]["pool"]),
                str(r["size"]["d"]),
                str(r["size"]["anchors"]),
                _num(r["timings"]["lmgeo"]["median_s"]),
                _num(r["timings"]["faiss"]["median_s"]),
                _num(r["speedup"]) + "×",
                _num(r["timings"]["lmgeo_float64"]["median_s"]),
                _num(r["speedup_float64"]) + "×",
                f"{r['same_neighbours']:.1%}",
            ]
            for r in section["runs"]
        ],
    )
    return lines + [""]


def _patching_md(section: dict[str, Any]) -> list[str]:
    s = section["size"]
    lines = [
        "## Patching: suffix against full forward",
        "",
        (
            f"`patch_kl_anchors` on a random-weight {s['arch']} (d = {s['d_model']}, {s['n_layers']} blocks, "
            f"V = {s['vocab']}, {s['n_seq']} sequences of {s['seq_len']}), {s['anchors_per_seq']} anchors per "
            "sequence with 3 patched copies each, at every layer. `suffix` (the default) skips the blocks before "
            "the patch and runs the later blocks and the head only on the positions from the anchor on, from the "
            "clean pass's keys and values; `recompute` runs the later blocks on every position (the path of a "
            "family whose cache cannot be cut, and the suffix before the cache); `full` is a whole forward with a "
            "hook."
        ),
        "",
    ]
    lines += _table(["mode", "seconds (median)"], [[m, _num(t["median_s"])] for m, t in section["timings"].items()])
    lines += [
        "",
        (
            f"`suffix` ran the `{'`, `'.join(section['paths'])}` path, "
            f"{_num(section['over_recompute'])}× as fast as `recompute`. "
            "Largest relative KL difference to `full`: "
            f"{_num(section['max_relative_kl_difference'])}."
        ),
        "",
    ]
    f = section["flops"]
    lines += [
        (
            f"Achieved FLOP/s: `suffix` {_num(f['suffix_per_s'] / 1e9)} GFLOP/s on its useful FLOPs (each "
            "sequence's clean pass, and blocks l+1.. and the head from each anchor on), the bare forward "
            f"(`bare`: the model's forward with its head on every copy's sequence, same batches) "
            f"{_num(f['bare_forward_per_s'] / 1e9)} GFLOP/s; FLOPs counted by `suffix_flops` (2 per "
            "multiply-add of the weight matrices and the head, 4·d per causal attention pair)."
        ),
        "",
    ]
    return lines


def _recipes_md(section: dict[str, Any]) -> list[str]:
    m, f, base = section["model"], section["head_step_flops"], section["baseline"]
    lines = [
        "## Head recipes",
        "",
        (
            f"One training step (forward, backward, `RecipeOptimizer.step`) of a random-weight `{m['arch']}` "
            f"(d = {m['d_model']}, {m['n_layers']} layers, V = {m['vocab']}, batch {m['batch']} × {m['seq_len']}) "
            f"per recipe, on the same batch; only the head's optimizer differs. The `vs {base}` column comes "
            "from rounds over every recipe (order reversed every other round); each bar from its own pair "
            "interleaved A B B A, three times as many steps, so the two sides of a ratio always run next to "
            "each other."
        ),
        "",
        (
            f"Head-step FLOPs are analytic (each recipe's `head_flops` in `lmgeo/commands/bench/recipe_costs.py`), at "
            f"V = {f['vocab']}, d = {f['width']}, "
            "counted from the code; NS(V, d) = 5·(4·m²·M + 2·m³) with m = min(V, d), M = max(V, d) is "
            "Muon's 5-step quintic Newton–Schulz. The backward pass producing the gradient is "
            "common to all recipes and not counted."
        ),
        "",
    ]
    lines += _table(
        ["recipe", "step s (median)", f"vs {base}", "optimizer step s", "head-step GFLOP"],
        [
            [
                r,
                _num(section["timings"][r]["median_s"]),
                _num(section["vs_baseline"][r]) + "×",
                _num(section["optimizer_step_median_s"][r]),
                _num(f["per_recipe"][r] / 1e9),
            ]
            for r in section["vs_baseline"]
        ],
    )
    head = section["head_steps"]
    lines += [
        "",
        (
            f"Head step alone (the head's optimizer on a V = {head['shape'][0]}, d = {head['shape'][1]} weight "
            "with a fixed gradient), for recipes whose cost grows faster than V·d:"
        ),
        "",
    ]
    lines += _table(
        ["pair", "ratio", "median s (each side)"],
        [
            [pair, _num(v["ratio"]) + "×", " / ".join(_num(t["median_s"]) for t in v["timings"].values())]
            for pair, v in head["pairs"].items()
        ],
    )
    muon = section["muon_kernels"]
    shape = next(iter(muon.values()))["shape"]
    lines += [
        "",
        (
            f"This project's Muon (`lmgeo/study_b/muon.py`: each Newton–Schulz product from bf16 operands "
            "in float32, rounded once) against torch.optim.Muon (bf16 GEMMs), the same step on a "
            f"V = {shape[0]}, d = {shape[1]} head, each in a fresh process. Under the pinned kernels, "
            "oneDNN has no bf16 GEMM and runs a reference loop; a machine's own kernels may have one "
            "(AVX-512 BF16, AMX), which the stages never use on CPU."
        ),
        "",
    ]
    lines += _table(
        ["kernels", "Muon / torch.optim.Muon", "median s (each side)"],
        [
            [kernels, _num(v["ratio"]) + "×", " / ".join(_num(t["median_s"]) for t in v["timings"].values())]
            for kernels, v in muon.items()
        ],
    )
    return lines + [""]


def _fanout_md(section: dict[str, Any]) -> list[str]:
    s = section["size"]
    lines = [
        "## Ray fan-out",
        "",
        (
            f"The fit stage's shards (`lmgeo.stages.fit.fit_shard`: the driver reads a layer pair into Ray's object "
            "store, the task searches its neighbours once and fits every class, the driver writes), one per "
            f"layer for {s['n_layers']} layers, classes {', '.join(s['classes'])}, "
            "on synthetic "
            f"activations (d = {s['d']}, {s['n_seq']} × {s['seq_len']} tokens, {s['anchors']} anchors), "
            "through `run_shards`, with an embedded Ray started by `ray.init(num_cpus=N)` for each N and "
            "shut down after. Timed: `run_shards` only, after every worker has imported the fit code."
        ),
        "",
    ]
    lines += _table(
        ["workers", "seconds per run"], [[n, ", ".join(_num(t) for t in ts)] for n, ts in section["seconds"].items()]
    )
    load = section["load_average"]
    lines += [
        "",
        (
            f"Outputs identical across every run: {'yes' if section['same_outputs'] else '**no**'}. "
            f"Load average (1 min) before / after this section: {load['before'][0]:.2f} / {load['after'][0]:.2f} "
            f"on {section['cores']} cores: a speed-up needs idle cores."
        ),
        "",
    ]
    return lines


def _gpu_md(section: dict[str, Any]) -> list[str]:
    lines = ["## GPU", ""]
    if not section.get("available"):
        return lines + [section.get("reason", "No CUDA device: the GPU benchmarks did not run."), ""]
    if "error" in section:
        return lines + [f"The GPU benchmarks failed: `{section['error']}`", ""]
    e, k = section["extraction"], section["knn"]
    lines += [f"Device: {section['device']}.", ""]
    lines += _table(
        ["extraction path", "tokens/s", "TFLOP/s (Kaplan forward FLOPs)"],
        [[c, _num(e["tokens_per_s"][c], 4), _num(e["tflops"][c])] for c in e["tokens_per_s"]],
    )
    lines += ["", f"Extract path / bare forward throughput: {_num(e['throughput_ratio'])}×.", ""]
    lines += _table(
        ["kNN pool", "d", "anchors", "seconds", "TFLOP/s (fp64 distances)", "working memory"],
        [
            [
                str(r["pool"]),
                str(r["d"]),
                str(r["anchors"]),
                _num(r["seconds"]),
                _num(r["tflops_fp64"]),
                _mib(r["working_bytes"]),
            ]
            for r in k["runs"]
        ],
    )
    lines += ["", f"kNN memory accounting: {k['memory_accounting']}.", ""]
    lines += _table(
        ["fit class", f"fit_layer s on the GPU ({section['fits']['scale']['label']})"],
        [[fn, _num(t)] for fn, t in section["fits"]["seconds"].items()],
    )
    return lines + [""]


def _machine_md(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    lines = [
        "## Machine and versions",
        "",
        f"- CPU: {m['cpu']}, {m['logical_cores']} logical / {m['physical_cores']} physical cores",
        f"- memory: {m['memory_gib']} GiB",
        f"- GPU: {', '.join(m['gpus']) if m['gpus'] else 'none'}",
        f"- platform: {m['platform']}",
        (
            f"- load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in m['load_average'])}; "
            f"at end: {', '.join(f'{x:.2f}' for x in report['load_average_at_end'])}"
        ),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
    ]
    return lines
