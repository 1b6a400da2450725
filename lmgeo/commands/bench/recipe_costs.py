"""What only the benchmark reads of each head recipe, keyed by recipe name: the analytic FLOPs of one head
step and the speed bars (SPEC §7). It lives here, not in the recipes, so a bar or a cost model changes no
recipe's code version and retrains nothing. Every registered recipe has an entry (tests/test_bench.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lmgeo.study_b.equidistance import BUCKET_ROWS, FAR, LIFT_BISECTIONS, NEAR
from lmgeo.study_b.lmo import SKETCH_WIDTH


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
    """A warm step of the equidistance solver (`lmgeo.study_b.equidistance`), per V·d: momentum 4, centring
    2, the final centring, scaling and update 5. A search: up to BUCKET_ROWS rows the Gram matrix 2·V²·d;
    above, the sketch 2·V·d·s (d > s = SKETCH_WIDTH), a sort per tree level (not counted) and the buckets'
    Gram 2·V·B·s (B ≈ BUCKET_ROWS rows a bucket); two searches a step (the feasibility check, and one more
    lift's). Per iteration: the candidates' differences and norms 3 per pair entry, their weighted sums 2 per
    pair entry (NEAR nearest and, up to BUCKET_ROWS rows, FAR farthest, each d wide), the tangent, momentum and
    renormalised step 12, and the lift 9 (its row scalars and the combination; its LIFT_BISECTIONS bisection
    steps are per row, not per entry)."""
    n = vocab * width
    exact = vocab <= BUCKET_ROWS
    sketch_width = width if exact else min(width, SKETCH_WIDTH)
    bucket = vocab if exact else BUCKET_ROWS
    search = 2.0 * vocab * bucket * sketch_width + (2.0 * n * SKETCH_WIDTH if width > SKETCH_WIDTH else 0.0)
    pairs = NEAR + (FAR if exact else 0)
    per_iter = 5 * pairs * n + 12 * n + 9 * n + 10 * LIFT_BISECTIONS * vocab
    return 11 * n + 2 * search + equi_iters * per_iter


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
    # At the bench's small model (V = 8192, d = 128, 512 tokens a step) the head's V-dependent work (the
    # bucketed search, twice a step) is as large as the forward and backward; the head step alone at GPT-2
    # scale is held to 1.5× `muon_head`'s (`lmgeo bench`; docs/benchmarks.md).
    "hilbert_equi": RecipeCost(hilbert_equi_flops, step_time_bar=("muon_head", 2.5), head_step_bar=("muon_head", 1.5)),
    # `hilbert`'s step at another tau: `hilbert`'s cost (its bar covers it)
    "hilbert_ctl": RecipeCost(lambda vocab, width, equi_iters: 15.0 * vocab * width),
}
