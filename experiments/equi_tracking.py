"""Does `hilbert_equi`'s warm-started step solve its problem inside training? `python -m experiments.equi_tracking`.

Trains the default study's first `hilbert_equi` run (neox, seed 0; its params, its schedule, the prepared
tokens in `data/tokens`) up to the last of the `--at` steps. At each of them it solves the step's problem again, cold,
for the same momentum: once from one start (`COLD_ITERS` iterations from `hilbert`'s rows plus noise, what a cold
solve does at the study's size) and once from `--starts` starts (the best kept, as on small problems), and prints
each solution's spread ρ (min/max pairwise row distance, all rows), its descent per unit diameter along the step's
own gradient (A_g), and the smallest of the three descents against the momentum the problem is stated for (A_m,
held ≥ c by all). A warm step whose ρ stays far below the best cold one's is not solving the problem, and a one-start
cold solve far below it means the solver is not robust either; `--warm-iters` (the run's `equi_iters`) and
`--warm-angle` (`equidistance.WARM_ANGLE`) try other trackings. This is how the warm solve's 0.005-rad tracking
was found wanting (SPEC §3.2).

Is the warm solve only in a poor basin, or can it not stay in a good one? `--from-best STEP` hands the run, at that
step, the best cold solution as its warm state (and step) and lets it go on warm: the later `--at` steps show how
much of the best spread the warm steps keep. The `turn` column is the weighted mean cosine between each measured
step's momentum rows and the previous step's (centred; weights: the earlier momentum's centred row norms): how far
the problem moves in one step.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

COLD_ITERS = 400
RUN = ("neox", "hilbert_equi", 0)


def cold_solve(m: Tensor, alignment: float, starts: int) -> Any:
    """A cold solve of `COLD_ITERS` iterations from `starts` starts, the best spread kept (the solver's own
    multi-start, which it runs only where V·d ≤ `MULTISTART_SIZE`): an `equidistance.Solution`."""
    from lmgeo.study_b import equidistance

    saved = equidistance.STARTS, equidistance.MULTISTART_SIZE
    equidistance.STARTS, equidistance.MULTISTART_SIZE = starts, m.numel() if starts > 1 else 0
    try:
        return equidistance.solve(m, alignment, COLD_ITERS)
    finally:
        equidistance.STARTS, equidistance.MULTISTART_SIZE = saved


class _Enough(Exception):
    """Raised by the observed step after the last step asked for: the run need not go on."""


def turn(previous: Tensor, m: Tensor) -> float:
    """The weighted mean cosine between two momenta's centred rows (weights: the earlier one's row norms)."""
    from lmgeo.study_b.hilbert import center_rows

    a, b = center_rows(previous.double()), center_rows(m.double())
    weights = a.norm(dim=1)
    return float((weights * torch.nn.functional.cosine_similarity(a, b, dim=1)).sum() / weights.sum())


def measure(args: argparse.Namespace, threads: int = 1) -> list[dict[str, Any]]:
    from experiments.frontier import spread_and_descent  # ρ and A (SPEC §3.3), as the frontier measures them
    from lmgeo.core.contracts import RunSpec
    from lmgeo.core.determinism import pin_torch
    from lmgeo.params import load_params
    from lmgeo.study_b import equidistance, optim
    from lmgeo.study_b.hilbert import center_rows
    from lmgeo.study_b.recipes.hilbert_equi import STATE_KEY
    from lmgeo.study_b.train import train_run
    from lmgeo.text.corpus import load_meta, load_tokens

    pin_torch(threads)  # as a stage's task sets up torch
    spec = RunSpec(*RUN)
    cfg = load_params(args.params).train.for_run(spec)  # the study's steps: its schedule, stopped early
    tokens = {split: load_tokens(args.tokens, split) for split in ("train", "val")}
    rows: list[dict[str, Any]] = []
    previous: list[Tensor] = []  # the last step's momentum
    build = optim.HeadLMO.__init__

    def observed(self: optim.HeadLMO, params: Any, direction: Any, **kw: Any) -> None:
        def step(m: Tensor, knobs: Any, state: dict[str, Any]) -> Tensor:
            knobs = knobs if args.warm_iters is None else dataclasses.replace(knobs, equi_iters=args.warm_iters)
            x = direction(m, knobs, state)
            # the momentum is lerp(grad, buf, β) with buf already updated: the step's own gradient from both
            grad = (m - optim.MOMENTUM * state["momentum_buffer"].float()) / (1 - optim.MOMENTUM)
            done = len(rows) + 1
            if done == args.from_best:  # the best cold solution becomes this step's and the warm solve's state
                state[STATE_KEY] = cold_solve(m, knobs.equi_alignment, args.starts)
                x = center_rows(state[STATE_KEY].rows).div_(state[STATE_KEY].diameter)
            if done in args.at:
                handed = done == args.from_best  # the best solution is the warm state already: not solved twice
                best = state[STATE_KEY] if handed else cold_solve(m, knobs.equi_alignment, args.starts)
                solutions = {"warm": x, "cold": cold_solve(m, knobs.equi_alignment, 1).rows, "best": best.rows}
                row: dict[str, Any] = {"step": done, "turn": turn(previous[0], m) if previous else float("nan")}
                for name, u in solutions.items():
                    row[f"{name}_spread"], row[f"{name}_A_m"] = spread_and_descent(u, m)
                    row[f"{name}_A_g"] = spread_and_descent(u, grad)[1]
                rows.append(row)
            else:
                rows.append({"step": done})
            previous[:] = [m.clone()]
            if done >= max(args.at):
                raise _Enough
            return x

        build(self, params, step, **kw)

    angle, equidistance.WARM_ANGLE = equidistance.WARM_ANGLE, args.warm_angle
    optim.HeadLMO.__init__ = observed  # type: ignore[method-assign]
    try:
        train_run(
            spec,
            cfg,
            tokens["train"],
            tokens["val"],
            load_meta(args.tokens)["vocab_size"],
            load_meta(args.tokens)["seq_len"],
            "tracking",
            lambda *_: None,
        )
    except _Enough:
        pass
    finally:
        optim.HeadLMO.__init__, equidistance.WARM_ANGLE = build, angle  # type: ignore[method-assign]
    return [row for row in rows if len(row) > 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--tokens", type=Path, default=Path("data/tokens"))
    parser.add_argument("--at", type=int, nargs="+", default=[20, 60, 100])
    parser.add_argument("--starts", type=int, default=8, help="the best-of cold reference's starts")
    parser.add_argument("--warm-iters", type=int, help="the run's equi_iters (default: the params')")
    parser.add_argument("--warm-angle", type=float, help="equidistance.WARM_ANGLE (default: the code's)")
    parser.add_argument("--from-best", type=int, help="at this step, hand the warm solve the best cold solution")
    args = parser.parse_args()
    if args.from_best is not None and not 1 <= args.from_best < max(args.at):
        parser.error(f"--from-best {args.from_best} must be a step before the last --at step ({max(args.at)})")
    if args.warm_angle is None:
        from lmgeo.study_b.equidistance import WARM_ANGLE

        args.warm_angle = WARM_ANGLE
    from lmgeo.commands.bench.measure import run_pinned

    best = f"cold, best of {args.starts}"
    seeded = f", the best cold solution handed over at step {args.from_best}" if args.from_best else ""
    print(
        f"| step | turn | ρ warm | ρ cold, 1 start | ρ {best} | A_g warm | A_g cold, 1 start | A_g {best} "
        f"| A_m (least) |  (warm angle {args.warm_angle}, iters {args.warm_iters or 'params'}{seeded})\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    for row in run_pinned(measure, args=args):  # the stages' kernels: the run trains as `dvc repro` trains it
        print(
            f"| {row['step']} | {row['turn']:.3f} | {row['warm_spread']:.3f} | {row['cold_spread']:.3f} | "
            f"{row['best_spread']:.3f} | {row['warm_A_g']:.3f} | {row['cold_A_g']:.3f} | {row['best_A_g']:.3f} | "
            f"{min(row[f'{name}_A_m'] for name in ('warm', 'cold', 'best')):.3f} |"
        )


if __name__ == "__main__":
    main()
