"""How closely a result on the device must match the same call on the CPU, and why that much.

Every tolerance is `|device − cpu| ≤ atol + rtol·|cpu|`, element by element, and a non-finite value must be
matched by the same non-finite value (a NaN metric is NaN on both devices or the fit differs). Where a
quantity has no natural unit its values are first divided by a scale (the largest |cpu| value), so that
`atol` reads as a fraction of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    why: str


@dataclass(frozen=True)
class Agreement:
    passed: bool
    max_abs_diff: float  # over the finite pairs (after scaling, when scaled)
    worst_ratio: float  # max |Δ| / (atol + rtol·|cpu|): at most 1 when it passes
    nonfinite_mismatches: int  # positions where exactly one side, or both differently, are non-finite
    size: int

    def describe(self) -> str:
        extra = f", {self.nonfinite_mismatches} NaN/Inf mismatches" if self.nonfinite_mismatches else ""
        return f"max |Δ| {self.max_abs_diff:.2e} ({self.worst_ratio:.2g} of the tolerance{extra})"


TOLERANCES = {
    "activations": Tolerance(
        atol=1e-5,
        rtol=0.0,
        why="|Δh| as a fraction of the layer's largest |h|. Both devices run the forward in float32 and differ "
        "only in summation order: float32 activations of a GPT-2-width model were 5e-7 of the largest |h| "
        "away from a float64 forward on the CPU, so 1e-5 leaves 20×; TF32 matmuls (10-bit mantissa, ~1e-3) "
        "would fail it.",
    ),
    "knn": Tolerance(
        atol=0.0,
        rtol=1e-9,
        why="Neighbour distances rank by rank, float64 on both devices. A neighbour index may differ only where "
        "two candidates tie to within this tolerance (then either is a nearest neighbour).",
    ),
    "fits": Tolerance(
        atol=1e-4,
        rtol=1e-4,
        why="Every fit metric and the patched vector, on the same float32 activations (fitted in float64). The "
        "bar a batched fit must meet against its per-anchor reference (SPEC §7, tests/test_fits.py), so a "
        "device difference the size of an implementation difference would show.",
    ),
    "kl": Tolerance(
        atol=1e-5,
        rtol=1e-4,
        why="kl and kl_seq of the same patches. Float32 forwards: against a float64 forward on the CPU the KL "
        "was off by 1.3e-6 absolute, 1.1e-5 relative (GPT-2 width, V = 50,304); the tolerance leaves ~8×.",
    ),
    "bf16 loss": Tolerance(
        atol=0.0,
        rtol=1e-2,
        why="Training loss at every step and the final validation loss, CUDA (bf16 autocast) against the CPU "
        "(float32, as train_run runs there), same weights and batches. bf16 keeps 8 significant bits (unit "
        "roundoff 2^-9 ≈ 2e-3) on each matmul input; the loss averages that out over the batch's tokens, "
        "but every update is computed from slightly different gradients, so the runs drift apart step by "
        "step (and the sign/LMO heads flip entries whose momentum is near zero). CPU bf16 autocast showed "
        "≤ 1.2e-3 relative over 3–5 steps; 1e-2 bounds a few steps only, not a whole run.",
    ),
}


def agree(device: np.ndarray, cpu: np.ndarray, tolerance: Tolerance, scale: float = 1.0) -> Agreement:
    """Compare element by element, after dividing both sides by `scale` (> 0)."""
    a = np.asarray(device, dtype=np.float64) / scale
    b = np.asarray(cpu, dtype=np.float64) / scale
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: device {a.shape}, cpu {b.shape}")
    finite = np.isfinite(a) & np.isfinite(b)
    same_nonfinite = ~np.isfinite(a) & ~np.isfinite(b) & ((a == b) | (np.isnan(a) & np.isnan(b)))
    mismatches = int((~finite & ~same_nonfinite).sum())
    diff = np.abs(a[finite] - b[finite])
    allowed = tolerance.atol + tolerance.rtol * np.abs(b[finite])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(diff == 0, 0.0, diff / allowed)
    worst = float(ratios.max()) if ratios.size else 0.0
    max_diff = float(diff.max()) if diff.size else 0.0
    return Agreement(bool(worst <= 1.0 and mismatches == 0), max_diff, worst, mismatches, int(a.size))


def largest(values: np.ndarray) -> float:
    """The scale for `agree`: the largest finite |value|, or 1 when there is none."""
    finite = np.abs(np.asarray(values, dtype=np.float64))
    finite = finite[np.isfinite(finite)]
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def combine(parts: dict[str, Agreement]) -> Agreement:
    """One agreement for several compared quantities: the worst of each figure."""
    values = list(parts.values())
    return Agreement(
        passed=all(p.passed for p in values),
        max_abs_diff=max(p.max_abs_diff for p in values),
        worst_ratio=max(p.worst_ratio for p in values),
        nonfinite_mismatches=sum(p.nonfinite_mismatches for p in values),
        size=sum(p.size for p in values),
    )
