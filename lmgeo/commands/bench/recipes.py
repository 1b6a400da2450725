"""Each head recipe's training-step time against `muon` on the same model and batch, and the head step
alone at GPT-2 scale for recipes whose cost grows faster than V·d (their `head_step_bar`, in
`lmgeo.commands.bench.recipe_costs`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from lmgeo.commands.bench.measure import bar, interleaved, profile_top, run_fresh
from lmgeo.commands.bench.recipe_costs import COSTS
from lmgeo.commands.bench.sizes import RecipeSize
from lmgeo.commands.bench.synthetic import token_ids
from lmgeo.models.config import ModelSize
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.config import TrainConfig
from lmgeo.study_b.recipes import RECIPES


def recipe_step_times(size: RecipeSize, train: TrainConfig, threads: int) -> dict[str, Any]:
    """Training-step time of every recipe on the same model and batch; only the head's optimizer differs."""
    import torch

    from lmgeo.models.registry import build_model, head_of
    from lmgeo.study_b.optim import build_optimizers, resolve_head_step

    torch.set_num_threads(threads)
    model_size = ModelSize(d_model=size.d_model, n_layers=size.n_layers, n_heads=size.n_heads)
    batch = torch.from_numpy(token_ids(size.batch, size.seq_len, size.vocab, seed=5))
    names = RECIPES.names()
    optimizer_s: dict[str, list[float]] = {r: [] for r in names}

    def training_step(recipe: str, model: Any, optimizer: Any) -> None:
        model(input_ids=batch, labels=batch).loss.backward()
        start = time.perf_counter()
        optimizer.step(radius=1.0)  # the radius only sets η for `tau` recipes; it does not change the cost
        optimizer_s[recipe].append(time.perf_counter() - start)
        optimizer.zero_grad()

    cases: dict[str, Callable[..., Any]] = {}
    for recipe in names:
        model = build_model(size.arch, model_size, size.vocab, size.seq_len, seed=0)
        optimizer = build_optimizers(model, head_of(model).weight, recipe, train)  # type: ignore[arg-type]
        cases[recipe] = lambda r=recipe, m=model, o=optimizer: training_step(r, m, o)
    timings = interleaved(cases, size.repeats, warmup=2)
    equi_iters = {r.name: resolve_head_step(r.name, train).knobs.equi_iters for r in RECIPES}
    flops = {r: COSTS[r].head_flops(size.flops_vocab, size.flops_width, equi_iters[r]) for r in names}
    # Each bar from its own pair, interleaved A B B A: adjacent steps share the machine's load.
    bars, profile = [], {}
    for name in names:
        step_time_bar = COSTS[name].step_time_bar
        if step_time_bar is None:
            continue
        base, threshold = step_time_bar
        pair = interleaved({name: cases[name], base: cases[base]}, 3 * size.repeats, warmup=0)
        bars.append(bar(f"recipes: {name} / {base} (training-step time)", pair.ratio(name, base), "<=", threshold))
        if not bars[-1].passed:
            profile[bars[-1].name] = profile_top(cases[name])
    head_steps = head_step_times(size, train)
    bars += head_steps.pop("bars")
    reference = baseline().name
    return {
        "model": asdict(size),
        "head_steps": head_steps,
        "baseline": reference,
        "vs_baseline": {r: timings.ratio(r, reference) for r in names},
        "optimizer_step_median_s": {r: statistics.median(optimizer_s[r]) for r in names},
        "timings": timings.summary(),
        "head_step_flops": {
            "vocab": size.flops_vocab,
            "width": size.flops_width,
            "equi_iters": equi_iters,
            "per_recipe": flops,
        },
        "bars": bars,
        "profile": profile,
    }


def muon_kernels(size: RecipeSize, train: TrainConfig, threads: int) -> dict[str, Any]:
    """`muon_vs_torch` in a fresh process with the kernels pinned as every stage pins them
    (`lmgeo.core.determinism`), and in one with this machine's own kernels."""
    from lmgeo.core.determinism import pinned_environment

    kernels = {"pinned as the stages run": pinned_environment(threads), "this machine's own": None}
    return {name: run_fresh(muon_vs_torch, threads, env=env, size=size, train=train) for name, env in kernels.items()}


def muon_vs_torch(size: RecipeSize, train: TrainConfig, threads: int) -> dict[str, Any]:
    """`lmgeo.study_b.muon.Muon` against `torch.optim.Muon` (its bf16 Newton–Schulz GEMMs) stepping the
    same (vocab, d_model) head, interleaved A B B A."""
    import torch

    from lmgeo.study_b.muon import Muon
    from lmgeo.study_b.optim import MOMENTUM

    torch.set_num_threads(threads)
    shape = (size.vocab, size.d_model)
    classes = {"Muon": Muon, "torch.optim.Muon": torch.optim.Muon}
    stepper = head_stepper(
        shape,
        8,
        lambda name, head: classes[name](
            [head], lr=0.03, weight_decay=train.weight_decay, momentum=MOMENTUM, nesterov=True
        ),
    )
    timings = interleaved({name: stepper(name) for name in classes}, size.head_repeats, warmup=1)
    return {"shape": list(shape), "ratio": timings.ratio("Muon", "torch.optim.Muon"), "timings": timings.summary()}


def head_step_times(size: RecipeSize, train: TrainConfig) -> dict[str, Any]:
    """For each recipe with a `head_step_bar`: its head optimizer's step against the bar's recipe's on the
    same (head_vocab, head_width) weight and gradient, interleaved A B B A after one untimed step each."""
    from lmgeo.study_b.optim import head_only_optimizer

    shape = (size.head_vocab, size.head_width)
    stepper = head_stepper(shape, 7, lambda recipe, head: head_only_optimizer(recipe, head, train))
    pairs: dict[str, dict[str, Any]] = {}
    bars = []
    for name in RECIPES.names():
        head_step_bar = COSTS[name].head_step_bar
        if head_step_bar is None:
            continue
        base, threshold = head_step_bar
        timings = interleaved({name: stepper(name), base: stepper(base)}, size.head_repeats, warmup=1)
        pairs[f"{name} / {base}"] = {"ratio": timings.ratio(name, base), "timings": timings.summary()}
        bars.append(
            bar(
                f"recipes: {name} / {base} (head step alone, V = {shape[0]}, d = {shape[1]})",
                pairs[f"{name} / {base}"]["ratio"],
                "<=",
                threshold,
            )
        )
    return {"shape": list(shape), "pairs": pairs, "bars": bars}


def head_stepper(shape: tuple[int, int], seed: int, build: Callable[[str, Any], Any]) -> Callable[[str], Any]:
    """`stepper(name)`: a step of the optimizer `build(name, head)` on its own copy of one random `shape` head,
    with one fixed gradient, the same weight and gradient for every name."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weight, grad = torch.randn(shape, generator=gen) * 0.02, torch.randn(shape, generator=gen) * 1e-3

    def stepper(name: str) -> Callable[[], None]:
        head = torch.nn.Parameter(weight.clone())
        optimizer = build(name, head)

        def step() -> None:
            head.grad = grad
            optimizer.step()

        return step

    return stepper
