"""The descent–spread frontier of the equidistance step (`docs/frontier.md`, `docs/frontier.png`):
`python -m experiments.frontier --write docs/frontier.md`.

At the study's head size (V = 2048, d = 64), on a cross-entropy head gradient with Zipf-distributed labels
(frequent tokens have large gradient rows, the rest small, nearly parallel ones), the step is solved cold
(`SOLVE_ITERS` iterations) at each descent share c of `SHARES`: its spread ρ (min/max pairwise row
distance, all rows) against its descent per unit diameter A (`head_alignment_hilbert`: 1 is `hilbert`'s
step), with `hilbert`'s own point, random unit rows' spread and the Welch-type bound of SPEC §3.1 for
reference. The curve is what the knob `equi_alignment` costs in spread, solved cold.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

SHARES = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
SOLVE_ITERS = 300
SHAPE, TOKENS, SEED = (2048, 64), 1024, 0


def zipf_gradient(n_rows: int, width: int, tokens: int, seed: int) -> torch.Tensor:
    """(P − Y)ᵀH/T for random logits, labels drawn with probability ∝ 1/rank."""
    gen = torch.Generator().manual_seed(seed)
    w, h = (
        0.5 * torch.randn(n_rows, width, generator=gen, dtype=torch.float64),
        torch.randn(tokens, width, generator=gen, dtype=torch.float64),
    )
    ranks = 1.0 / torch.arange(1, n_rows + 1, dtype=torch.float64)
    labels = torch.multinomial(ranks / ranks.sum(), tokens, replacement=True, generator=gen)
    p = torch.softmax(h @ w.T, dim=1)
    p[torch.arange(tokens), labels] -= 1
    return (p.T @ h / tokens).float()


def spread_and_descent(x: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    """ρ over all rows and A (G centred), in float64."""
    from lmgeo.study_b.hilbert import center_rows

    x, g = x.double(), center_rows(grad.double())
    dist = torch.pdist(x)
    return float(dist.min() / dist.max()), float((g * x).sum() / (0.5 * dist.max() * g.norm(dim=1).sum()))


def measure(threads: int = 1) -> dict[str, Any]:
    """The frontier's points, in this process (`main` runs it in a fresh one under the stages' kernel pins), and
    what the bits depend on besides the code: the CPU model and the numeric packages."""
    from lmgeo.core.determinism import pin_torch
    from lmgeo.core.provenance import cpu_model, versions
    from lmgeo.study_b import equidistance
    from lmgeo.study_b.hilbert import equi_ratio_bound, equi_ratio_random
    from lmgeo.study_b.lmo import unit_rows

    pin_torch(threads)
    grad = zipf_gradient(*SHAPE, TOKENS, SEED)
    points = []
    for share in SHARES:
        started = time.process_time()
        solution = equidistance.solve(grad, share, SOLVE_ITERS)
        spread, descent = spread_and_descent(solution.rows / solution.diameter, grad)
        points.append(
            {"share": share, "spread": spread, "descent": descent, "cpu_s": round(time.process_time() - started, 1)}
        )
    hilbert = spread_and_descent(unit_rows(grad - grad.mean(0)), grad)
    return {
        "shape": list(SHAPE),
        "tokens": TOKENS,
        "seed": SEED,
        "iters": SOLVE_ITERS,
        "points": points,
        "hilbert": {"spread": hilbert[0], "descent": hilbert[1]},
        "random_rows": equi_ratio_random(*SHAPE, seed=0),
        "bound": equi_ratio_bound(*SHAPE),
        "cpu": cpu_model(),
        "packages": versions(("torch", "numpy")),
    }


def figure(result: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    pts = result["points"]
    ax.plot([p["descent"] for p in pts], [p["spread"] for p in pts], "o-", color="tab:green", label="hilbert_equi")
    same_point: dict[tuple[float, float], list[float]] = {}  # shares whose constraint is inactive coincide
    for p in pts:
        same_point.setdefault((round(p["descent"], 3), round(p["spread"], 3)), []).append(p["share"])
    for (descent, spread), shares in same_point.items():
        ax.annotate(
            "c=" + ", ".join(f"{c:g}" for c in shares),
            (descent, spread),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=7,
        )
    ax.plot([result["hilbert"]["descent"]], [result["hilbert"]["spread"]], "s", color="tab:red", label="hilbert")
    ax.axhline(result["random_rows"], color="gray", linestyle=":", label="random unit rows")
    ax.axhline(result["bound"], color="black", linestyle="--", label="Welch-type bound")
    ax.set_xlabel("descent per unit diameter, A (hilbert's step: 1)")
    ax.set_ylabel("spread ρ = min / max row distance")
    ax.set_title(f"V = {result['shape'][0]}, d = {result['shape'][1]}: the descent–spread frontier", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    return fig


def render(result: dict[str, Any]) -> str:
    bound = result["bound"]
    rows = "\n".join(
        f"| {p['share']:g} | {p['descent']:.3f} | {p['spread']:.3f} | {bound - p['spread']:.3f} | {p['cpu_s']:g} |"
        for p in result["points"]
    )
    return "\n".join(
        [
            "# The equidistance step's descent–spread frontier",
            "",
            "Generated by `python -m experiments.frontier --write docs/frontier.md` (`experiments/frontier.py`). "
            "The problem and",
            "the solver: SPEC §3.2, `lmgeo/study_b/equidistance.py`.",
            "",
            f"A cross-entropy head gradient at V = {result['shape'][0]}, d = {result['shape'][1]} ({result['tokens']} "
            f"tokens, labels ∝ 1/rank, seed {result['seed']}); each share c solved cold, {result['iters']} iterations, "
            f"one thread, the kernels pinned as the stages pin them ({result['cpu']}). "
            "*A*: descent per unit diameter relative to `hilbert`'s step (its rows, at A = "
            f"{result['hilbert']['descent']:.3f}, have spread {result['hilbert']['spread']:.3f}); *ρ*: min/max "
            f"pairwise distance over all rows; random unit rows of the same shape reach {result['random_rows']:.3f}, "
            f"and no configuration exceeds the Welch-type bound {result['bound']:.3f} (SPEC §3.1).",
            "",
            "| share c | A | ρ | gap to the bound | CPU s |",
            "|---|---|---|---|---|",
            rows,
            "",
            "![frontier](frontier.png)",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, required=True, help="the markdown to write (its .png and .json beside)")
    out = parser.parse_args(argv).write
    from lmgeo.commands.bench.measure import run_pinned

    result = run_pinned(measure)  # the stages' kernels: the points reproduce elsewhere as theirs do
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    figure(result).savefig(out.with_suffix(".png"), dpi=110, metadata={"Software": None})
    out.write_text(render(result))
    print(f"frontier: wrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
