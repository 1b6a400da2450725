"""A seed-scale rehearsal of Study A (`lmgeo rehearse`, `docs/scale.md`): the seed's model configurations
with random weights (built from their published hyper-parameters; nothing is downloaded), run through
extract → fit → perturb on a slice, with the time per unit of work and the peak resident memory of each
step, and the cost of the seed's full analysis extrapolated from them.

The slice runs the library code the stages run (`extract_batches`, `fit_layer`, `null_patches`,
`patch_kl_anchors`) on one model at a time: a few sequences, the middle layer's transition, a few anchors,
every class. `k` is the width `d`, the smallest that identifies every local class (`needs_rank`), so the
fits cost what the seed's own fits will. When the extracted tokens are fewer than the `k + 1` a neighbourhood
needs, the pool is topped up with extracted rows plus a little Gaussian noise (1% of each coordinate's
spread): the fits' cost depends on the pool's size, `k` and `d`, not on its values (the MLP's number of
steps aside, which is capped by `mlp_steps`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

GIB = 2**30


def _pythia_1_4b():
    from transformers import GPTNeoXConfig

    # EleutherAI/pythia-1.4b: 24 layers, d 2048, 16 heads, MLP 8192, rotary on 25% of each head, parallel
    # residual, untied head over a padded vocabulary of 50,304.
    return GPTNeoXConfig(
        vocab_size=50304, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192,
        rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True, tie_word_embeddings=False,
    )  # fmt: skip


def _mamba_370m():
    from transformers import MambaConfig

    # state-spaces/mamba-370m-hf: 48 blocks, d 1024, state 16, expand 2, conv 4, head tied to the embedding.
    return MambaConfig(
        vocab_size=50280, hidden_size=1024, num_hidden_layers=48, state_size=16, expand=2, conv_kernel=4,
        tie_word_embeddings=True,
    )  # fmt: skip


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

    n_seq: int = 4
    seq_len: int = 64
    batch_size: int = 2
    anchors: int = 4  # fitted per class at the middle layer
    perturb_anchors: int = 2  # of those, patched per class (each three copies: the fit and two nulls)


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
    fit_s_per_anchor: dict[str, float] = field(default_factory=dict)  # per class, neighbours included
    fit_peak_gib: float = 0.0
    pool: int = 0
    k: int = 0
    perturb_s_per_copy: float = 0.0  # one patched copy of seq_len tokens at the middle layer, suffix mode
    perturb_copies: int = 0
    perturb_peak_gib: float = 0.0


def _timed(run: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, seconds, peak resident GiB while it ran)."""
    from pipeline.tools.bench.measure import peak_rss_bytes, reset_peak_rss

    gc.collect()
    reset_peak_rss()
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start, peak_rss_bytes() / GIB


def rehearse(name: str, size: Slice, device: str = "cpu", seed: int = 0) -> Measured:
    """Build `name`'s configuration with random weights and run the slice through extract, fit, perturb."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.study_a.verify import verify_model

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return AutoModelForCausalLM.from_config(SEED_CONFIGS[name](), dtype=torch.float32).to(device).eval()

    model, build_s, _ = _timed(build)
    verified, verify_s, _ = _timed(lambda: verify_model(model))
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.get_input_embeddings().num_embeddings
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(size.n_seq, size.seq_len))
    layer = verified.n_blocks // 2
    (x, y), extract_s, extract_peak = _timed(lambda: _extract(model, tokens, layer, size.batch_size))
    measured = Measured(
        name, n_params, verified.width, verified.n_blocks, vocab, n_params * 4 / GIB, build_s, verify_s,
        extract_s / tokens.size, extract_peak, 0.0,
    )  # fmt: skip
    tables = _fit(measured, x, y, tokens.shape, size, device, seed)
    _perturb(measured, model, tokens, layer, y, tables, size, seed)
    del model
    gc.collect()
    return measured


def _extract(model, tokens: np.ndarray, layer: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Extraction of every layer (what the stage writes), keeping `h_layer` and `h_{layer+1}` (n, d)."""
    from pipeline.core.store import arrow_to_vectors
    from pipeline.study_a.extract import extract_batches

    kept: dict[int, list[np.ndarray]] = {layer: [], layer + 1: []}
    for index, batch in extract_batches(model, tokens, np.arange(len(tokens)), batch_size):
        if index in kept:
            kept[index].append(arrow_to_vectors(batch.column("h")))
    return np.concatenate(kept[layer]), np.concatenate(kept[layer + 1])


def _pool(x: np.ndarray, y: np.ndarray, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`rows` pairs: the extracted ones, then extracted ones plus 1% Gaussian noise (module docstring)."""
    if rows <= len(x):
        return x, y
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(x), rows - len(x))
    noisy = [v[pick] + 0.01 * v.std(axis=0) * rng.normal(size=(len(pick), v.shape[1])) for v in (x, y)]
    return np.concatenate([x, noisy[0]]).astype(np.float32), np.concatenate([y, noisy[1]]).astype(np.float32)


def _fit(measured: Measured, x, y, shape: tuple[int, int], size: Slice, device: str, seed: int) -> dict[str, Any]:
    """Every class fitted at the same anchors, timed one class at a time (each with its own neighbour
    search, which is also timed alone); the real pairs only (each null sample costs the same again)."""
    import torch

    from pipeline.study_a.classes import FIT_CLASSES
    from pipeline.study_a.config import AnalysisConfig
    from pipeline.study_a.fits import choose_anchors, fit_layer
    from pipeline.study_a.knn import nearest_neighbours

    d = x.shape[1]
    x, y = _pool(x, y, max(len(x), 2 * d), seed)
    n = len(x)
    seq, pos = np.arange(n) // shape[1], np.arange(n) % shape[1]
    cfg = AnalysisConfig(anchors=size.anchors, k=d, rank=16, p=16)
    anchors = choose_anchors(min(n, math.prod(shape)), size.anchors, seed)  # extracted tokens only
    pool64 = torch.as_tensor(x, dtype=torch.float64, device=device)
    _, knn_s, _ = _timed(lambda: nearest_neighbours(pool64, torch.as_tensor(anchors, device=device), cfg.k))
    measured.pool, measured.k, measured.knn_s_per_anchor = n, cfg.k, knn_s / len(anchors)
    tables, peak = {}, 0.0
    for fn in FIT_CLASSES.names():
        result, seconds, class_peak = _timed(lambda fn=fn: fit_layer(x, y, seq, pos, np.zeros(n), anchors, [fn], cfg, device))
        tables[fn] = result[0][fn]
        measured.fit_s_per_anchor[fn] = seconds / len(anchors)
        peak = max(peak, class_peak)
    measured.fit_peak_gib = peak
    return tables


def _perturb(measured: Measured, model, tokens: np.ndarray, layer: int, y: np.ndarray, tables: dict[str, Any], size: Slice, seed: int) -> None:
    """The perturb stage's patched copies for `perturb_anchors` anchors of every class (the fit and two
    null patches each), in one call as the stage makes it; seconds per patched copy."""
    from pipeline.study_a.nulls import null_patches
    from pipeline.study_a.patching import patch_kl_anchors

    clean = y[: tokens.size].reshape(*tokens.shape, -1)
    rng = np.random.default_rng(seed)
    parts = []
    for table in tables.values():
        fits = table.slice(0, size.perturb_anchors)
        rows, pos = fits["seq_id"].to_numpy(), fits["pos"].to_numpy()
        patches = null_patches(fits["patched"], clean[rows, pos], rng)
        parts += [(rows[patches.valid], pos[patches.valid], v) for v in (patches.real, patches.random, patches.other)]
    rows, pos, vectors = (np.concatenate(p) for p in zip(*parts, strict=True))
    _, seconds, peak = _timed(lambda: patch_kl_anchors(model, tokens, rows, pos, layer, vectors.astype(np.float32), size.batch_size))
    measured.perturb_s_per_copy, measured.perturb_copies, measured.perturb_peak_gib = seconds / len(rows), len(rows), peak


def rehearse_all(names: list[str], size: Slice, device: str = "cpu") -> list[Measured]:
    return [rehearse(name, size, device) for name in names]


def as_json(results: list[Measured], size: Slice) -> dict[str, Any]:
    return {"slice": asdict(size), "models": [asdict(r) for r in results]}
