"""A paper-scale rehearsal of Study A (`lmgeo rehearse`, `docs/scale.md`): the Study A paper's model configurations
with random weights (built from their published hyper-parameters; nothing is downloaded), run through
extract → fit → perturb on a slice, with the time per unit of work and the peak resident memory of each
step, and the cost of the paper's full analysis extrapolated from them.

The slice runs the library code the stages run (`extract_batches`, `fit_layer`, `null_patches`,
`patch_kl_anchors`) on one model at a time: a few sequences, the middle layer's transition, a few anchors,
every class. `k` is the width `d`, the smallest that identifies every local class (`needs_rank`), so the
fits cost what the paper's own fits will. When the extracted tokens are fewer than the `k + 1` a neighbourhood
needs, the pool is topped up with extracted rows plus Gaussian noise of each coordinate's spread (less
noise leaves the Procrustes cross-covariance of a neighbourhood of near-copies rank-deficient, so the
orthogonal fits would be degenerate and not patched): the fits' cost depends on the pool's size, `k` and
`d`, not on its values (the MLP's number of steps aside, which is capped by `mlp_steps`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np

GIB = 2**30
NULL_DIRECTIONS = 8  # random-direction null copies per anchor, as the default study (`analysis.null_directions`)


def _pythia_1_4b():
    from transformers import GPTNeoXConfig

    # EleutherAI/pythia-1.4b: 24 layers, d 2048, 16 heads, MLP 8192, rotary on 25% of each head, parallel
    # residual, untied head over a padded vocabulary of 50,304.
    return GPTNeoXConfig(  # type: ignore[call-arg]  # its legacy kwargs are read from **kwargs
        vocab_size=50304,
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=8192,
        rotary_pct=0.25,
        max_position_embeddings=2048,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )


def _mamba_370m():
    from transformers import MambaConfig

    # state-spaces/mamba-370m-hf: 48 blocks, d 1024, state 16, expand 2, conv 4, head tied to the embedding.
    return MambaConfig(
        vocab_size=50280,
        hidden_size=1024,
        num_hidden_layers=48,
        state_size=16,
        expand=2,
        conv_kernel=4,
        tie_word_embeddings=True,
    )


def _gpt2_small():
    from transformers import GPT2Config

    return GPT2Config()  # openai-community/gpt2: 12 layers, d 768, 12 heads, vocabulary 50,257, tied head


SEED_CONFIGS: dict[str, Callable[[], Any]] = {
    "pythia-1.4b": _pythia_1_4b,
    "mamba-370m": _mamba_370m,
    "gpt2": _gpt2_small,
}


@dataclass(frozen=True)
class Slice:
    """What of the analysis the rehearsal runs per model."""

    n_seq: int = 2
    seq_len: int = 64
    batch_size: int = 2
    # Anchors fitted per class at the middle layer: the fits cost O(d³) per anchor at k = d, so fewer at a
    # larger width (4 at d = 768, 3 at 1024, 1 at 2048), to keep the rehearsal to minutes.
    anchor_budget: float = 4e9
    max_anchors: int = 4
    perturb_anchors: int = 1  # of those, patched per class (each with its null copies, as the stage)

    def anchors(self, d: int) -> int:
        return max(1, min(self.max_anchors, int(self.anchor_budget / d**3)))


@dataclass
class Measured:
    """Per-unit costs of one model on this machine (seconds; GiB)."""

    model: str
    n_params: int
    width: int
    n_blocks: int
    vocab: int
    weights_gib: float
    build_s: float
    verify_s: float
    extract_s_per_token: float
    extract_peak_gib: float
    knn_s_per_anchor: float
    # Per local class: seconds per anchor, each with its own neighbour search and rank check; per layer-wide
    # class: seconds per layer; all local classes in one call, as the fit stage makes it: seconds per anchor.
    fit_s_per_anchor: dict[str, float] = field(default_factory=dict)
    fit_s_per_layer: dict[str, float] = field(default_factory=dict)
    fit_local_s_per_anchor: float = 0.0
    fit_anchors: int = 0
    fit_peak_gib: float = 0.0
    pool: int = 0
    k: int = 0
    perturb_s_per_copy: float = 0.0  # one patched copy of seq_len tokens at the middle layer, suffix mode
    perturb_copies: int = 0
    perturb_peak_gib: float = 0.0


def _timed(run: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, seconds, peak resident GiB while it ran)."""
    from lmgeo.commands.bench.measure import peak_rss_bytes, reset_peak_rss

    gc.collect()
    reset_peak_rss()
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start, peak_rss_bytes() / GIB


def rehearse(name: str, size: Slice, device: str = "cpu", seed: int = 0, threads: int = 1) -> Measured:
    """Build `name`'s configuration with random weights and run the slice through extract, fit, perturb
    (run it in a fresh process: peak memory is this process's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmgeo.study_a.verify import verify_model

    torch.set_num_threads(threads)

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return AutoModelForCausalLM.from_config(SEED_CONFIGS[name](), dtype=torch.float32).to(device).eval()

    model, build_s, _ = _timed(build)
    verified, verify_s, _ = _timed(partial(verify_model, model))
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.get_input_embeddings().num_embeddings
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(size.n_seq, size.seq_len))
    layer = verified.n_blocks // 2
    (x, y), extract_s, extract_peak = _timed(partial(_extract, model, tokens, layer, size.batch_size))
    measured = Measured(
        name,
        n_params,
        verified.width,
        verified.n_blocks,
        vocab,
        n_params * 4 / GIB,
        build_s,
        verify_s,
        extract_s / tokens.size,
        extract_peak,
        0.0,
    )
    tables = _fit(measured, x, y, tokens.shape, size, device, seed)
    _perturb(measured, model, tokens, layer, y, tables, size, seed)
    del model
    gc.collect()
    return measured


def _extract(model, tokens: np.ndarray, layer: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Extraction of every layer (what the stage writes), keeping `h_layer` and `h_{layer+1}` (n, d)."""
    from lmgeo.core.contracts import arrow_to_vectors
    from lmgeo.study_a.extract import extract_batches

    kept: dict[int, list[np.ndarray]] = {layer: [], layer + 1: []}
    for index, batch in extract_batches(model, tokens, np.arange(len(tokens)), batch_size):
        if index in kept:
            kept[index].append(arrow_to_vectors(batch.column("h")))
    return np.concatenate(kept[layer]), np.concatenate(kept[layer + 1])


def _pool(x: np.ndarray, y: np.ndarray, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`rows` pairs: the extracted ones, then extracted ones plus Gaussian noise of each coordinate's spread
    (module docstring)."""
    if rows <= len(x):
        return x, y
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(x), rows - len(x))
    noisy = [v[pick] + v.std(axis=0) * rng.normal(size=(len(pick), v.shape[1])) for v in (x, y)]
    return np.concatenate([x, noisy[0]]).astype(np.float32), np.concatenate([y, noisy[1]]).astype(np.float32)


def _fit(measured: Measured, x, y, shape: tuple[int, int], size: Slice, device: str, seed: int) -> dict[str, Any]:
    """Every class at the same anchors, one class at a time (for the per-class costs), then the local classes
    in one call as the fit stage makes it (neighbours and rank check shared); the neighbour search alone at
    more anchors. The real pairs only: each null sample costs the same again."""
    import torch

    from lmgeo.study_a.classes import FIT_CLASSES
    from lmgeo.study_a.config import AnalysisConfig
    from lmgeo.study_a.fits import choose_anchors, fit_layer
    from lmgeo.study_a.knn import nearest_neighbours

    d = x.shape[1]
    x, y = _pool(x, y, max(len(x), 2 * d), seed)
    n = len(x)
    seq, pos = np.arange(n) // shape[1], np.arange(n) % shape[1]
    cfg = AnalysisConfig(anchors=size.anchors(d), k=d, rank=16, p=16)
    anchors = choose_anchors(min(n, math.prod(shape)), cfg.anchors, seed)  # extracted tokens only
    pool64 = torch.as_tensor(x, dtype=torch.float64, device=device)
    searched = torch.as_tensor(choose_anchors(n, 64, seed), device=device)
    _, knn_s, _ = _timed(lambda: nearest_neighbours(pool64, searched, cfg.k))
    measured.pool, measured.k, measured.knn_s_per_anchor = n, cfg.k, knn_s / len(searched)
    measured.fit_anchors = len(anchors)

    def fit(classes: list[str]) -> tuple[dict[str, Any], float]:
        result, seconds, peak = _timed(lambda: fit_layer(x, y, seq, pos, np.zeros(n), anchors, classes, cfg, device))
        measured.fit_peak_gib = max(measured.fit_peak_gib, peak)
        return result[0], seconds

    tables: dict[str, Any] = {}
    for fn in FIT_CLASSES.names():
        table, seconds = fit([fn])
        tables |= table
        if FIT_CLASSES[fn].local:
            measured.fit_s_per_anchor[fn] = seconds / len(anchors)
        else:
            measured.fit_s_per_layer[fn] = seconds
    _, seconds = fit([fn for fn in FIT_CLASSES.names() if FIT_CLASSES[fn].local])
    measured.fit_local_s_per_anchor = seconds / len(anchors)
    return tables


def _perturb(
    measured: Measured,
    model,
    tokens: np.ndarray,
    layer: int,
    y: np.ndarray,
    tables: dict[str, Any],
    size: Slice,
    seed: int,
) -> None:
    """The perturb stage's patched copies for `perturb_anchors` anchors of every class (the fit, run to the
    sequence's end, and the nulls, which stop at their anchor: `NULL_DIRECTIONS` random directions and another
    anchor's residual), in one call as the stage makes it; seconds per patched copy, the mix as in the study."""
    from lmgeo.study_a.nulls import null_patches
    from lmgeo.study_a.patching import patch_kl_anchors

    clean = y[: tokens.size].reshape(*tokens.shape, -1)
    rng = np.random.default_rng(seed)
    parts = []
    for table in tables.values():
        fits = table.slice(0, size.perturb_anchors)
        rows, pos = fits["seq_id"].to_numpy(), fits["pos"].to_numpy()
        patches = null_patches(fits["patched"], clean[rows, pos], rng, NULL_DIRECTIONS)
        rows, pos = rows[patches.valid], pos[patches.valid]
        parts.append((rows, pos, patches.real, True))
        randoms = patches.random.reshape(-1, patches.random.shape[-1])
        parts.append((np.repeat(rows, NULL_DIRECTIONS), np.repeat(pos, NULL_DIRECTIONS), randoms, False))
        if patches.other is not None:
            parts.append((rows, pos, patches.other, False))
    rows, pos, vectors = (np.concatenate([p[i] for p in parts]) for i in range(3))
    to_end = np.concatenate([np.full(len(p[0]), p[3]) for p in parts])
    _, seconds, peak = _timed(
        lambda: patch_kl_anchors(
            model, tokens, rows, pos, layer, vectors.astype(np.float32), size.batch_size, to_end=to_end
        )
    )
    measured.perturb_s_per_copy, measured.perturb_copies = seconds / len(rows), len(rows)
    measured.perturb_peak_gib = peak


def rehearse_all(names: list[str], size: Slice, device: str = "cpu", threads: int = 1) -> list[Measured]:
    """Each model in a fresh process, so that its peak memory is its own."""
    from lmgeo.commands.bench.measure import run_fresh

    return [run_fresh(rehearse, threads, name=name, size=size, device=device) for name in names]


def as_json(results: list[Measured], size: Slice, header: dict[str, Any]) -> dict[str, Any]:
    """The measurements and what the report's header states about them (`header`: command, machine, threads),
    so that `lmgeo rehearse --render` can write the report again without measuring."""
    return {**header, "slice": asdict(size), "models": [asdict(r) for r in results]}


def from_json(document: dict[str, Any]) -> tuple[list[Measured], Slice]:
    return [Measured(**m) for m in document["models"]], Slice(**document["slice"])


# ------------------------------------------------------------------------------------------ extrapolation
def _neox(d: int, layers: int, heads: int):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(  # type: ignore[call-arg]  # its legacy kwargs are read from **kwargs
        vocab_size=50304,
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * d,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )


def _mamba(d: int, layers: int):
    from transformers import MambaConfig

    return MambaConfig(
        vocab_size=50280, hidden_size=d, num_hidden_layers=layers, state_size=16, expand=2, tie_word_embeddings=True
    )


def _distilgpt2():
    from transformers import GPT2Config

    return GPT2Config(n_layer=6)


# The Study A paper's own study (`presets/seed.yaml`): each model's published hyper-parameters, and the rehearsed
# configuration whose measured costs it is scaled from.
SEED_STUDY: dict[str, tuple[Callable[[], Any], str]] = {
    "EleutherAI/pythia-70m": (lambda: _neox(512, 6, 8), "pythia-1.4b"),
    "EleutherAI/pythia-160m": (lambda: _neox(768, 12, 12), "pythia-1.4b"),
    "EleutherAI/pythia-410m": (lambda: _neox(1024, 24, 16), "pythia-1.4b"),
    "EleutherAI/pythia-1.4b": (_pythia_1_4b, "pythia-1.4b"),
    "state-spaces/mamba-130m-hf": (lambda: _mamba(768, 24), "mamba-370m"),
    "state-spaces/mamba-370m-hf": (_mamba_370m, "mamba-370m"),
    "distilbert/distilgpt2": (_distilgpt2, "gpt2"),
}


@dataclass(frozen=True)
class Study:
    """The analysis sizes of a study (`presets/seed.yaml`'s, applied to params.yaml)."""

    models: tuple[str, ...]  # external models' ids
    eval_sequences: int
    seq_len: int
    anchors: int
    k: int
    samples: int  # the real pairs and the null samples
    classes: int
    copies: int  # patched copies per anchor and class: the fit and its null patches

    @classmethod
    def of(cls, params: Any) -> Study:
        a = params.analysis
        return cls(
            tuple(m.id for m in a.external_models),
            a.eval_sequences,
            params.prepare.seq_len,
            a.anchors,
            a.k,
            1 + len(a.nulls),
            len(a.classes),
            2 + a.null_directions,
        )


@dataclass(frozen=True)
class GpuCosts:
    """Per-unit costs the GPU check measured on one GPU (`python -m scripts.gpucheck`, its `gpu.json` committed as
    `reports/gpu.json`), at GPT-2 small (d = 768): the GPU column is built from these alone, scaled to each
    model as the CPU's are. Without them the column says it is not measured."""

    device: str
    started_utc: str
    commit: str
    extract_s_per_token: float  # the extract path (float32, to disk), GPT-2 small
    fit_s_per_anchor: float  # the local classes fitted in closed form, each alone (its own kNN), summed
    fit_k: int
    fit_width: int
    fit_s_per_layer: float  # the layer-wide classes, summed, on a pool of `fit_pool`
    fit_pool: int
    knn_s_per_anchor: float  # on a pool of `knn_pool` × `fit_width`
    knn_pool: int
    perturb_s_per_copy: float  # one patched copy of `perturb_seq_len` tokens at the middle block
    perturb_seq_len: int
    train_tokens_per_s: dict[str, float]  # a training step of GPT-2 small per recipe (reported only)

    @classmethod
    def from_check(cls, document: dict[str, Any]) -> GpuCosts | None:
        """The costs in a CUDA run's `gpu.json`, or None (a CPU stand-in, or an item that did not run)."""
        if not str(document.get("mode", "")).startswith("CUDA"):
            return None
        found = {
            r["name"]: r["detail"]
            for r in document.get("results", [])
            if r["section"].startswith("measurements") and r["status"] in ("pass", "FAIL", "measured")
        }
        needed = ("extraction vs bare forward", "fits, device vs cpu", "patching", "kNN, device vs cpu")
        if not all(name in found for name in needed):
            return None
        extraction, fits, patching, knn = (found[name] for name in needed)
        per_class = {row[0]: row[1] / 1e3 for row in fits["tables"]["fit_layer per class"]["rows"]}
        local = [fn for fn in per_class if _local(fn) and not _iterative(fn)]
        layer_wide = [fn for fn in per_class if not _local(fn)]
        run = fits["run"]
        steps = found.get("training step per recipe", {}).get("per_recipe", {})
        tokens = found.get("training step per recipe", {}).get("run", {})
        return cls(
            str(document.get("device")),
            str(document.get("started_utc")),
            str(document.get("commit", "unknown")),
            1 / extraction["tokens_per_s"]["extract_path"],
            sum(per_class[fn] for fn in local),
            run["k"],
            run["d"],
            sum(per_class[fn] * run["anchors"] for fn in layer_wide),
            run["n_seq"] * run["seq_len"],
            knn["timings"]["device"]["median_s"] / knn["run"]["anchors"],
            knn["run"]["pool"],
            patching["seconds"] / patching["copies"],
            patching["run"]["seq_len"],
            {r: tokens.get("batch", 0) * tokens.get("seq_len", 0) / v["median_s"] for r, v in steps.items()},
        )


def _local(fn: str) -> bool:
    from lmgeo.study_a.classes import FIT_CLASSES

    return FIT_CLASSES[fn].local


def _iterative(fn: str) -> bool:
    from lmgeo.study_a.classes import FIT_CLASSES

    return FIT_CLASSES[fn].iterative


def _shape(config) -> dict[str, float]:
    """Parameters, width, blocks, vocabulary and forward FLOPs per token of a config (on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    d, vocab = model.get_input_embeddings().embedding_dim, model.get_input_embeddings().num_embeddings
    # Every weight is used once per token, except the input embedding (a lookup), which a tied head reuses.
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    flops = 2 * (n_params if tied else n_params - vocab * d)
    return {"n_params": n_params, "d": d, "layers": config.num_hidden_layers, "vocab": vocab, "flops": flops}


def extrapolate(measured: list[Measured], study: Study, gpu: GpuCosts | None = None) -> list[dict[str, Any]]:
    """Each of the paper's models' cost, in core-seconds of this machine and (with `gpu`) in hours of one GPU
    node, scaled from the configuration measured: extraction and patching by forward FLOPs (and tokens per copy),
    the local classes' fits per anchor by `k·d² + d³` (products with the neighbourhood and d × d
    factorisations), the layer-wide ones per layer by `pool·d² + d³`, a neighbour search per anchor by pool × d.
    The GPU's costs were measured on GPT-2 small and carry over to the attention families only; a Mamba's GPU
    hours are not measured (its forward on the device is not one the check times)."""
    by_name = {m.model: m for m in measured}
    rows = []
    for hub_id in study.models:
        make, rehearsed = SEED_STUDY.get(hub_id, (None, ""))
        if make is None or rehearsed not in by_name:
            continue  # not a configuration this rehearsal knows, or its kind was not rehearsed
        ref, shape = by_name[rehearsed], _shape(make())
        here = _stage_seconds(study, shape, _Units.of(ref), _shape(SEED_CONFIGS[rehearsed]())["flops"])
        row = {
            "model": hub_id,
            "rehearsed as": rehearsed,
            "params": shape["n_params"],
            "d": shape["d"],
            "layers": shape["layers"],
            **{f"{stage} core-h": seconds / 3600 for stage, seconds in here.items()},
        }
        on_gpu = (
            None
            if gpu is None or rehearsed == "mamba-370m"
            else _stage_seconds(study, shape, _Units.on_gpu(gpu), _shape(SEED_CONFIGS["gpt2"]())["flops"])
        )
        for stage in STAGES:
            row[f"{stage} node-h"] = None if on_gpu is None else on_gpu[stage] / 3600
        row["GPU-node h"] = None if on_gpu is None else sum(on_gpu.values()) / 3600
        rows.append(row)
    return rows


class _Units(NamedTuple):
    """Per-unit costs measured on one configuration (`width`, `k`, `pool`, its forward's `flops`), in seconds."""

    extract_s_per_token: float
    fit_s_per_anchor: float  # every local class
    fit_s_per_layer: float  # every layer-wide class
    knn_s_per_anchor: float
    perturb_s_per_copy: float  # one patched copy of `seq_len` tokens
    width: int
    k: int
    pool: int  # of the layer-wide fits
    knn_pool: int
    seq_len: int

    @classmethod
    def of(cls, ref: Measured) -> _Units:
        return cls(
            ref.extract_s_per_token,
            ref.fit_local_s_per_anchor,
            sum(ref.fit_s_per_layer.values()),
            ref.knn_s_per_anchor,
            ref.perturb_s_per_copy,
            ref.width,
            ref.k,
            ref.pool,
            ref.pool,
            Slice().seq_len,
        )

    @classmethod
    def on_gpu(cls, gpu: GpuCosts) -> _Units:
        return cls(
            gpu.extract_s_per_token,
            gpu.fit_s_per_anchor,
            gpu.fit_s_per_layer,
            gpu.knn_s_per_anchor,
            gpu.perturb_s_per_copy,
            gpu.fit_width,
            gpu.fit_k,
            gpu.fit_pool,
            gpu.knn_pool,
            gpu.perturb_seq_len,
        )


def _stage_seconds(study: Study, shape: dict[str, float], units: _Units, unit_flops: float) -> dict[str, float]:
    """Seconds of each stage for one model of `shape`, from per-unit costs measured on a model of forward FLOPs
    `unit_flops` per token."""
    fwd = shape["flops"] / unit_flops
    d, layers, pool = shape["d"], shape["layers"], study.eval_sequences * study.seq_len
    per_anchor = (study.k * d**2 + d**3) / (units.k * units.width**2 + units.width**3)
    per_layer = (pool * d**2 + d**3) / (units.pool * units.width**2 + units.width**3)
    extract = pool * units.extract_s_per_token * fwd
    local = study.anchors * units.fit_s_per_anchor * per_anchor
    layer_wide = units.fit_s_per_layer * per_layer
    knn = 2 * study.anchors * units.knn_s_per_anchor * (pool / units.knn_pool) * (d / units.width)  # real, gaussian
    fit = layers * (study.samples * (local + layer_wide) + knn)
    copies = layers * study.anchors * study.classes * study.copies
    perturb = copies * units.perturb_s_per_copy * fwd * study.seq_len / units.seq_len
    return {"extract": extract, "fit": fit, "perturb": perturb}


STAGES = ("extract", "fit", "perturb")


def stage_shares(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each stage's share of the study's total, in core-hours here (`core-h`) and on one GPU node (`node-h`,
    over the rows whose GPU hours were measured; absent when none was)."""
    shares = {}
    for unit in ("core-h", "node-h"):
        counted = [r for r in rows if r.get(f"{STAGES[0]} {unit}") is not None]
        if not counted:
            continue
        totals = {stage: sum(r[f"{stage} {unit}"] for r in counted) for stage in STAGES}
        whole = sum(totals.values())
        shares[unit] = {stage: total / whole if whole else math.nan for stage, total in totals.items()}
    return shares


def _shares_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The per-stage shares and the stage that dominates, as a table."""
    if not rows:
        return []
    lines = [
        "Where the time goes (share of the total; the stage that dominates in bold):",
        "",
        "| cost | " + " | ".join(STAGES) + " | dominates |",
        "|---|" + "---|" * (len(STAGES) + 1),
    ]
    shares = stage_shares(rows)
    for unit, label in (("core-h", "core-hours here"), ("node-h", "one GPU node, hours (measured rows)")):
        if unit not in shares:
            continue
        share = shares[unit]
        top = max(STAGES, key=lambda stage: share[stage])
        cells = [f"**{share[s]:.0%}**" if s == top else f"{share[s]:.0%}" for s in STAGES]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | **{top}** |")
    return [*lines, ""]


# ------------------------------------------------------------------------------------------ the report
def _g(value: float) -> str:
    return f"{value:.3g}"


_FINDINGS = (
    "## What did not scale, and what was done",
    "",
    "- **The neighbours' identification check** was a batched SVD of every (k × d) neighbourhood, then an "
    "eigensolve per class: at k = d = 768 it took most of every local class's time on CPU. It is now one "
    "eigensolve of the smaller Gram matrix per neighbourhood, shared by every class "
    "(`lmgeo/study_a/identification.py`, tested against NumPy's SVD).",
    "- **The fits held every anchor's neighbourhood at once**: (anchors, k, d) float64 inputs and outputs, and "
    "the classes' (anchors, d, d) operators — 8.6 GiB per tensor at 256 anchors and k = d = 2048. Anchors are "
    "now fitted in chunks of at most `fits.CHUNK_VALUES` (2²⁵) values per tensor (8 anchors at d = 2048), "
    "with the same rows whatever the chunking (the MLP's start is drawn per anchor; tested).",
    "- **A full forward per patched copy** and **neighbours per class** were fixed before this rehearsal "
    "(issue 11): a patched copy recomputes only blocks l+1.. and the head from the anchor on, and the "
    "neighbours are searched once per (model, layer) for every class.",
    "- **Still growing with the pool**: a fit task holds its layer's pool (h_l and h_{l+1} in float64, and the "
    "two null samples': about 4 × pool × d × 8 B, 4.3 GB at 65,536 tokens × d 2048), and a perturb task "
    "reads layer l+1 whole (pool × d float32). Both fit a GPU node at the paper's sizes; `analysis.pool_size` "
    "caps the pool when they would not. At k = d the fits cost O(k·d² + d³) per anchor and class, which makes "
    "them most of the paper's cost; the MLP (300 Adam steps on the neighbourhood) and the two d × d "
    "factorisations (orthogonal, lowrank) dominate.",
    "",
)


def _gpu_lines(gpu: GpuCosts | None) -> list[str]:
    """Where the GPU column comes from: the GPU check's measured costs, or a plain statement that it has none."""
    if gpu is None:
        return [
            "**The GPU column is not measured.** It is built only from per-unit costs the GPU check measures on the "
            "device (`python -m scripts.gpucheck` on a CUDA machine, its `gpu.json` committed as `reports/gpu.json`: "
            "extraction, fits per anchor and per layer, the neighbour search, patching; training steps beside "
            "them), and no such run has been committed. An earlier version assumed the fits ran 50× faster on "
            "one GPU than on one core here; the first check on an H200 measured about 3× for the Procrustes "
            "classes (torch 2.11 runs batched `svd`/`eigh` above 32 × 32 as one solver call per matrix, issue 38), "
            "so that assumption is withdrawn rather than replaced by another."
        ]
    trained = ", ".join(f"{recipe} {rate:,.0f}" for recipe, rate in gpu.train_tokens_per_s.items())
    return [
        f"GPU column: per-unit costs measured by the GPU check on {gpu.device}, {gpu.started_utc}, at commit "
        f"`{gpu.commit}` (`reports/gpu.json`), on GPT-2 small (d = {gpu.fit_width}) and scaled to each model as the "
        f"CPU's are: extraction {gpu.extract_s_per_token * 1e6:.3g} µs per token (float32, written and fsynced), "
        f"the closed-form local classes {gpu.fit_s_per_anchor * 1e3:.3g} ms per anchor at k = {gpu.fit_k} (each "
        f"class alone with its own neighbour search, summed; the `mlp` class is not in it), the layer-wide classes "
        f"{gpu.fit_s_per_layer:.3g} s per layer at a pool of {gpu.fit_pool:,}, the neighbour search "
        f"{gpu.knn_s_per_anchor * 1e6:.3g} µs per anchor in a pool of {gpu.knn_pool:,}, patching "
        f"{gpu.perturb_s_per_copy * 1e3:.3g} ms per copy of {gpu.perturb_seq_len} tokens"
        + (f"; training steps (tokens/s) {trained}" if trained else "")
        + ". The attention families only: a "
        "Mamba's forward on the device is not measured (without the `mamba-ssm` kernels transformers runs a "
        "sequential scan), so its GPU hours are not given. Stages run one after another; Ray and reading "
        "Parquet are not counted."
    ]


def _hours(value: float | None, gpu: GpuCosts | None) -> str:
    return _g(value) if value is not None else ("not measured" if gpu is None else "not measured (Mamba)")


def _total_hours(rows: list[dict[str, Any]], gpu: GpuCosts | None) -> str:
    measured = [r["GPU-node h"] for r in rows if r["GPU-node h"] is not None]
    if not measured:
        return "not measured"
    return _g(sum(measured)) + ("" if len(measured) == len(rows) else " (measured rows)")


def render_markdown(
    results: list[Measured],
    size: Slice,
    study: Study,
    gpu: GpuCosts | None,
    command: str,
    machine: dict[str, Any],
    threads: int,
    rendered_by: str | None = None,
) -> str:
    local = list(results[0].fit_s_per_anchor) if results else []
    layer_wide = list(results[0].fit_s_per_layer) if results else []
    rows = extrapolate(results, study, gpu)
    lines = [
        "# Paper-scale rehearsal: what Study A costs at the Study A paper's sizes",
        "",
        f"Generated by `{command}` (`lmgeo/commands/rehearse/rehearsal.py`)"
        + (f", written again from its JSON by `{rendered_by}`" if rendered_by else "")
        + "; do not edit by hand. Measured on "
        f"{machine.get('cpu')} ({machine.get('logical_cores')} logical cores, {machine.get('memory_gib')} GiB; "
        f"load average {machine.get('load_average')} at the end), with {threads} torch thread(s). **This machine is "
        "shared with other jobs and noisy**: repeated runs differ by up to 2–3×, so read the numbers as orders "
        "of magnitude. The GPU column comes from the GPU check's own measurements (below), never from this machine.",
        "",
        "## What ran",
        "",
        "The Study A paper's configurations with random weights, built from their published hyper-parameters (nothing "
        "is downloaded): Pythia-1.4B (GPT-NeoX, 24 blocks, d 2048, vocabulary 50,304), Mamba-370M (48 blocks, "
        "d 1024) and GPT-2 small (12 blocks, d 768). Each is verified (`lmgeo/study_a/verify.py`), then the "
        "library code of the three stages runs on a slice:",
        "",
        f"- **extract**: {size.n_seq} sequences × {size.seq_len} tokens, batch {size.batch_size}, every layer "
        "(`extract_batches`); cost per token;",
        "- **fit**: the middle layer's transition, every class, `k = d` (the smallest `k` that identifies every "
        "local class: `needs_rank`), `rank = p = 16`, the real pairs only (each null sample costs the same "
        f"again); {size.max_anchors} anchors at d = 768, fewer at larger widths (the cost is O(d³) per anchor). "
        "The pool is the extracted tokens, topped up to 2d rows with extracted rows plus Gaussian noise of each "
        "coordinate's spread (the "
        "cost depends on the pool's size, k and d, not its values). Each class alone (a local class per anchor, "
        "its own neighbour search and rank check included; a layer-wide class per layer), then the local "
        "classes in one call as the fit stage makes it (per anchor); the neighbour search alone at 64 anchors;",
        f"- **perturb**: for {size.perturb_anchors} anchor(s) per class, the stage's patched copies (the fit, "
        f"run to the sequence's end, and its nulls, which stop at the anchor: {NULL_DIRECTIONS} random directions "
        "and another anchor's residual) in one `patch_kl_anchors` call, suffix patching (blocks l+1.. only); "
        "cost per patched copy (the study's mix of the two kinds) of "
        f"{size.seq_len} tokens at the middle layer. The clean pass (one per sequence) is included: here 2 "
        "sequences for the copies, in the study 128 for thousands of copies per layer, so the figure is high "
        "by up to ~20%.",
        "",
        "Peak memory is the process's resident set (VmHWM, reset before each step), so it includes the model's "
        "weights (float32).",
        "",
        "## Measured per-unit costs",
        "",
        "| model | params | d | blocks | weights GiB | verify s | extract s/token | extract peak GiB "
        "| kNN s/anchor (pool, k) | fit s/anchor, local classes (anchors) | fit s/layer, layer-wide classes "
        "| fit peak GiB | perturb s/copy | perturb peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | {r.n_params / 1e6:.0f}M | {r.width} | {r.n_blocks} | {_g(r.weights_gib)} | "
            f"{_g(r.verify_s)} | {_g(r.extract_s_per_token)} | {_g(r.extract_peak_gib)} | "
            f"{_g(r.knn_s_per_anchor)} ({r.pool}, {r.k}) | {_g(r.fit_local_s_per_anchor)} ({r.fit_anchors}) | "
            f"{_g(sum(r.fit_s_per_layer.values()))} | {_g(r.fit_peak_gib)} | "
            f"{_g(r.perturb_s_per_copy)} ({r.perturb_copies} copies) | {_g(r.perturb_peak_gib)} |"
        )
    lines += [
        "",
        "Fit seconds by class, each alone: per anchor for the local classes (each with its own neighbour search "
        "and rank check, which the stage shares), per layer for the layer-wide ones:",
        "",
        "| model | "
        + " | ".join(f"{c} s/anchor" for c in local)
        + " | "
        + " | ".join(f"{c} s/layer" for c in layer_wide)
        + " |",
        "|---|" + "---|" * (len(local) + len(layer_wide)),
        *(
            f"| {r.model} | "
            + " | ".join(_g(r.fit_s_per_anchor[c]) for c in local)
            + " | "
            + " | ".join(_g(r.fit_s_per_layer[c]) for c in layer_wide)
            + " |"
            for r in results
        ),
        "",
        "## The paper's full analysis, extrapolated",
        "",
        f"Sizes (the preset's): {study.eval_sequences} sequences × {study.seq_len} tokens per model (the "
        f"pool: {study.eval_sequences * study.seq_len:,} tokens per layer), {study.anchors} anchors per layer, "
        f"k = {study.k}, {study.classes} classes, {study.samples} samples (the real pairs and the nulls), "
        f"{study.copies} patched copies per anchor and class, every layer of every model.",
        "",
        "Scaling from the rehearsed configuration of the same kind: extraction and patching by forward FLOPs "
        "(2 × parameters used per token) and tokens per copy; the local classes' fits per anchor by `k·d² + d³` "
        "(the products with the neighbourhood and the d × d factorisations); the layer-wide classes per layer by "
        "`pool·d² + d³`; a neighbour search per anchor by pool × d (searched for the real and the Gaussian pool; "
        "the shuffled pairs share the real neighbours).",
        "",
        *_gpu_lines(gpu),
        "",
        "| model | rehearsed as | params | d | layers | extract core-h | fit core-h | perturb core-h "
        "| one GPU node, h |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['model']} | {r['rehearsed as']} | {r['params'] / 1e6:.0f}M | {r['d']} | {r['layers']} | "
            f"{_g(r['extract core-h'])} | {_g(r['fit core-h'])} | {_g(r['perturb core-h'])} | "
            f"{_hours(r['GPU-node h'], gpu)} |"
            for r in rows
        ),
        f"| **total** | | | | | {_g(sum(r['extract core-h'] for r in rows))} | "
        f"{_g(sum(r['fit core-h'] for r in rows))} | "
        f"{_g(sum(r['perturb core-h'] for r in rows))} | **{_total_hours(rows, gpu)}** |",
        "",
        *_shares_lines(rows),
        *_FINDINGS,
    ]
    return "\n".join(lines)
