"""What only the benchmark reads of each head recipe, keyed by recipe name: the analytic FLOPs of one head
step and the speed bars (SPEC §7). It lives here, not in the recipes, so a bar or a cost model changes no
recipe's code version and retrains nothing. Every registered recipe has an entry (tests/test_bench.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.study_b.recipes.hilbert_equi import CANDIDATES


@dataclass(frozen=True)
class RecipeCost:
    # FLOPs of one head step on a (vocab, width) head with `equi_iters`, counted from the code
    # (multiply-adds as 2), element-wise work per head entry as commented below.
    head_flops: Callable[[int, int, int], float]
    # This recipe's training step takes at most `ratio` × that of `recipe` (at the bench's model size), and
    # its head step alone at GPT-2 scale (V = 50,304, d = 768) at most `ratio` × `recipe`'s.
    step_time_bar: tuple[str, float] | None = None
    head_step_bar: tuple[str, float] | None = None


def newton_schulz_flops(vocab: int, width: int, steps: int = 5) -> float:
    """torch.optim.Muon's quintic Newton–Schulz on an `m × M` matrix (m = min side): per step
    `A = XXᵀ` (2m²M), `B = bA + cA²` (2m³), `X ← aX + BX` (2m²M)."""
    m, big = min(vocab, width), max(vocab, width)
    return steps * (4 * m * m * big + 2 * m**3)


def hilbert_equi_flops(vocab: int, width: int, equi_iters: int) -> float:
    """Per V·d: momentum 4, centring and unit axes 5, random start and tangent 8, centre, scale, decay,
    update 6; per iteration push, renormalise, project 16. With s = min(d, 64) the sketch width and
    B = min(V, 2048) the bucket size: the search 2·V·(V/B + B)·s, and per iteration the sketch 2·V·d·s
    (when d > 64) and the candidate distances 3·k·V·s."""
    n, s, bucket = vocab * width, min(width, 64), min(vocab, 2048)
    search = 2.0 * vocab * (vocab / bucket + bucket) * s
    per_iter = 16 * n + (2 * n * s if width > 64 else 0) + 3 * CANDIDATES * vocab * s
    return (4 + 5 + 8 + 6) * n + (search + equi_iters * per_iter if equi_iters else 0)


COSTS: dict[str, RecipeCost] = {
    # AdamW's moments, bias-corrected step and decay
    "adamw": RecipeCost(lambda vocab, width, equi_iters: 11.0 * vocab * width),
    # the head stepped by AdamW too (its hidden matrices by Muon)
    "muon": RecipeCost(lambda vocab, width, equi_iters: 11.0 * vocab * width),
    # momentum 4, decay 1, scaling 1, update 2, the Newton–Schulz input normalisation 2, and Newton–Schulz
    "muon_head": RecipeCost(lambda vocab, width, equi_iters: 12.0 * vocab * width + newton_schulz_flops(vocab, width)),
    # momentum 4, sign and scaling 2, decay 1, update 2
    "sign": RecipeCost(lambda vocab, width, equi_iters: 9.0 * vocab * width),
    # momentum 4, row normalisation 3, scaling 1, update 2
    "rownorm": RecipeCost(lambda vocab, width, equi_iters: 10.0 * vocab * width),
    # momentum 4, centring 2, row normalisation 3, re-centring 2, scaling 1, decay 1, update 2
    "hilbert": RecipeCost(lambda vocab, width, equi_iters: 15.0 * vocab * width, step_time_bar=("muon", 1.1)),
    # At the bench's small model (V = 8192, d = 128, 512 tokens a step) the head's V-dependent work is as
    # large as the forward and backward, so the training step costs ~2×; the head step alone at GPT-2 scale,
    # where the model dwarfs it, ~1.2× `muon_head`'s (`lmgeo bench`; docs/benchmarks.md).
    "hilbert_equi": RecipeCost(hilbert_equi_flops, step_time_bar=("muon_head", 2.5), head_step_bar=("muon_head", 1.5)),
}
