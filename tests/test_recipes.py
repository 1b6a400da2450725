"""The seven head-optimizer recipes (SPEC §3.2) on tiny untied models built from transformers configs."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)

from lmgeo.models.config import ModelSize
from lmgeo.models.family import GroupRule
from lmgeo.models.registry import FAMILIES, family_of
from lmgeo.study_b import hilbert, optim
from lmgeo.study_b.config import RecipeConfig, Schedule, TrainConfig
from lmgeo.study_b.muon import Muon, newton_schulz
from lmgeo.study_b.recipes import RECIPES
from lmgeo.study_b.recipes.base import HeadStepDefault, LMOKnobs

VOCAB, WIDTH, SEQ, BATCH = 256, 32, 16, 8
FLAT = Schedule(warmup_steps=0, decay="constant")


def neox(seed: int = 0) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return GPTNeoXForCausalLM(config)


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=WIDTH,
        n_layer=1,
        n_head=4,
        n_positions=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def mamba() -> MambaForCausalLM:
    return MambaForCausalLM(
        MambaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=1, state_size=8, tie_word_embeddings=False)
    )


def head_of(model: torch.nn.Module) -> torch.nn.Parameter:
    return model.get_output_embeddings().weight


def fixed_batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def train_cfg(**overrides) -> TrainConfig:
    return TrainConfig(steps=20, schedule=FLAT, **overrides)


def loss_and_hidden(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM loss and the head's inputs (the final hidden states), captured with a pre-hook."""
    captured = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    loss = model(input_ids=batch, labels=batch).loss
    handle.remove()
    return loss, captured[0].detach().flatten(0, -2)


# ---------------------------------------------------------------------------------- param groups
def test_groups_partition_the_trainable_parameters(tiny_model) -> None:
    """Every registered family's name patterns put each trainable parameter in exactly one group."""
    model = tiny_model
    head = head_of(model)
    groups = optim.partition_parameters(model, head, family_of(model).param_groups)
    assigned = [id(p) for params in groups.values() for p in params]
    assert sorted(assigned) == sorted(id(p) for p in model.parameters())  # each exactly once
    assert groups["head"] == [head]
    assert groups["hidden"] and all(p.ndim == 2 for p in groups["hidden"])
    assert all(p.ndim == 2 for p in groups["embed"])
    names = {id(p): n for n, p in model.named_parameters()}
    hidden_names = {names[id(p)] for p in groups["hidden"]}
    assert not any(re.search(r"norm|ln_|A_log|conv1d|bias", n) for n in hidden_names)


def test_a_bad_rule_set_names_every_offender() -> None:
    model = neox()
    rules = FAMILIES["neox"].param_groups
    overlapping = (*rules, GroupRule("scalar", r"\.dense\.weight$"))
    with pytest.raises(optim.ParamGroupError, match=r"attention\.dense\.weight \(32, 32\): hidden and scalar"):
        optim.partition_parameters(model, head_of(model), overlapping)
    no_embed = rules[1:]
    with pytest.raises(optim.ParamGroupError, match=r"embed_in\.weight \(256, 32\): no group"):
        optim.partition_parameters(model, head_of(model), no_embed)
    conv_as_hidden = (
        FAMILIES["mamba"].param_groups[0],
        GroupRule("hidden", r"\.mixer\.(?:\w+_proj|conv1d)\.weight$"),
        GroupRule("scalar", r"(?:\.bias|\.A_log|\.D|norm\w*\.weight)$"),
    )
    ssm = mamba()
    with pytest.raises(optim.ParamGroupError, match=r"conv1d\.weight \(64, 1, 4\): hidden takes 2-D"):
        optim.partition_parameters(ssm, head_of(ssm), conv_as_hidden)


def test_a_tied_head_is_refused() -> None:
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    model = GPTNeoXForCausalLM(config)
    with pytest.raises(optim.ParamGroupError, match="head and embed"):
        optim.build_optimizers(model, head_of(model), "hilbert", train_cfg())


# ------------------------------------------------------------------------------------ head LMOs
def gradients(seed: int) -> list[torch.Tensor]:
    """Random head-shaped gradients: dense, rank-2, and one with a large common row shift (as a soft-cap
    or z-loss produces)."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(300, 24, generator=gen)
    low_rank = torch.randn(300, 2, generator=gen) @ torch.randn(2, 24, generator=gen)
    shifted = dense + 10 * torch.randn(1, 24, generator=gen)
    return [dense, low_rank, shifted]


KNOBS = LMOKnobs(equi_iters=3, equi_alignment=0.5)


def lmo_step(
    recipe: str, grad: torch.Tensor, eta: float, knobs: LMOKnobs = KNOBS
) -> tuple[torch.Tensor, optim.HeadLMO]:
    """ΔW of one HeadLMO step (from zero momentum) on a parameter whose gradient is `grad`."""
    w = torch.nn.Parameter(torch.randn_like(grad))
    before = w.detach().clone()
    w.grad = grad.clone()
    optimizer = optim.HeadLMO([w], RECIPES[recipe].direction, lr=eta, knobs=knobs)
    optimizer.step()
    return w.detach() - before, optimizer


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["hilbert", "hilbert_equi"])
@pytest.mark.parametrize("seed", [0, 1])
def test_hilbert_steps_have_diameter_at_most_eta(recipe: str, seed: int) -> None:
    eta = 0.3
    for grad in gradients(seed):
        delta, _ = lmo_step(recipe, grad, eta)
        assert hilbert.diam(delta).value <= eta * (1 + 1e-5)
        np.testing.assert_allclose(delta.sum(0).numpy(), 0, atol=1e-5)  # no invisible common shift


def test_hilbert_step_is_the_centred_gradient_rows_on_the_sphere() -> None:
    grad = gradients(2)[2]
    delta, _ = lmo_step("hilbert", grad, eta=0.3)
    radial = -0.15 * hilbert.center_rows(grad) / hilbert.center_rows(grad).norm(dim=1, keepdim=True)
    np.testing.assert_allclose(delta.numpy(), hilbert.center_rows(radial).numpy(), atol=1e-6)
    assert hilbert.diam(delta).value > 0.8 * 0.3  # 300 random directions in 24-D: some far-apart pair
    alignment = (delta * hilbert.center_rows(grad)).sum()
    assert float(alignment) < 0  # a descent direction


def nearly_parallel(n_rows: int = 600, width: int = 24, seed: int = 7) -> torch.Tensor:
    """A planted head gradient whose centred rows are nearly parallel: one direction with random signed
    sizes, plus 1% noise (as rare tokens' rows are: all ≈ their probability times the mean hidden state)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randn(n_rows, 1, generator=gen)
    return sizes * torch.randn(1, width, generator=gen) + 0.01 * torch.randn(n_rows, width, generator=gen)


@pytest.mark.slow
def test_equidistance_step_spreads_nearly_parallel_rows_beyond_random_unit_rows() -> None:
    """Centred unit rows of a nearly parallel gradient sit on two antipodal clusters (hilbert's
    equi_ratio ≈ 0); the equidistance step spreads them beyond random unit rows of the same shape, the
    baseline of SPEC §3.2, below the Welch-type bound, with diam(ΔW) = η exactly."""
    grad = nearly_parallel()
    plain, _ = lmo_step("hilbert", grad, eta=1.0)
    spread, _ = lmo_step("hilbert_equi", grad, eta=1.0)
    baseline = hilbert.equi_ratio_random(*grad.shape)
    assert hilbert.equi_ratio(plain) < 0.05
    assert baseline < hilbert.equi_ratio(spread) <= hilbert.equi_ratio_bound(*grad.shape)
    assert hilbert.diam(spread).value == pytest.approx(1.0, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("alignment", [0.3, 0.5, 0.9])
def test_the_equidistance_step_keeps_its_share_of_hilberts_descent_per_unit_diameter(alignment: float) -> None:
    """⟨M, ΔW⟩ ≥ c·(η/2)·Σ‖m̃_i‖ (descent per unit diameter at least c of `hilbert`'s), diam(ΔW) = η: the
    problem's constraints, on a dense gradient and on a nearly parallel one."""
    for grad in (gradients(8)[0], nearly_parallel()):
        spread, _ = lmo_step("hilbert_equi", grad, eta=1.0, knobs=LMOKnobs(equi_iters=5, equi_alignment=alignment))
        share = float(-(grad * spread).sum() / (0.5 * hilbert.center_rows(grad).norm(dim=1).sum()))
        assert share >= alignment - 1e-5
        assert hilbert.diam(spread).value == pytest.approx(1.0, rel=1e-5)


@pytest.mark.slow
def test_the_equidistance_step_is_warm_started_from_the_previous_steps_rows() -> None:
    """The solver's solution is kept in the head's optimizer state; the next step starts from it (a warm
    solve of `equi_iters` iterations), and the same inputs give the same steps."""
    grad = gradients(9)[0]
    steps = []
    for _ in range(2):
        w = torch.nn.Parameter(torch.zeros_like(grad))
        optimizer = optim.HeadLMO([w], RECIPES["hilbert_equi"].direction, lr=1.0, knobs=KNOBS)
        taken = []
        for _ in range(3):
            before = w.detach().clone()
            w.grad = grad.clone()
            optimizer.step()
            taken.append(w.detach() - before)
        steps.append(taken)
        assert optimizer.state[w]["equi_solution"].rows.shape == grad.shape
    for first, again in zip(*steps, strict=True):
        torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(steps[0][0], steps[0][1])  # the iterations go on from the first step's rows


# ------------------------------------------------------------- the exact diameter-constrained optimum
JUNG = lambda d: math.sqrt((d + 1) / (2 * d))  # noqa: E731


def diameter_lmo_optimum(grad: np.ndarray, eta: float = 1.0, restarts: int = 4) -> float:
    """min ⟨G, X⟩ subject to ‖x_i − x_j‖ ≤ η for all pairs (and Σ x_i = 0, which fixes the translation
    that changes neither side): a convex program, so SLSQP's KKT point is the global optimum; the best of
    a few starts guards against an early stop."""
    from scipy.optimize import minimize

    n_rows, width = grad.shape
    pairs = [(i, j) for i in range(n_rows) for j in range(i + 1, n_rows)]

    def gaps(flat: np.ndarray) -> np.ndarray:
        x = flat.reshape(n_rows, width)
        return np.array([eta**2 - ((x[i] - x[j]) ** 2).sum() for i, j in pairs])

    def gaps_jacobian(flat: np.ndarray) -> np.ndarray:
        x = flat.reshape(n_rows, width)
        jac = np.zeros((len(pairs), n_rows, width))
        for k, (i, j) in enumerate(pairs):
            jac[k, i], jac[k, j] = -2 * (x[i] - x[j]), 2 * (x[i] - x[j])
        return jac.reshape(len(pairs), -1)

    translation = np.kron(np.ones((1, n_rows)), np.eye(width))
    constraints = [
        {"type": "ineq", "fun": gaps, "jac": gaps_jacobian},
        {"type": "eq", "fun": lambda f: translation @ f, "jac": lambda f: translation},
    ]
    rng = np.random.default_rng(0)
    best = math.inf
    for _ in range(restarts):
        found = minimize(
            lambda f: float(grad.ravel() @ f),
            0.01 * rng.standard_normal(grad.size),
            jac=lambda f: grad.ravel(),
            constraints=constraints,
            method="SLSQP",
            options={"maxiter": 2000, "ftol": 1e-12},
        )
        if found.success and gaps(found.x).min() >= -1e-7:
            best = min(best, found.fun)
    return best


def regular_simplex(width: int) -> np.ndarray:
    """d + 1 unit rows in R^d with pairwise inner products −1/d."""
    corners = np.eye(width + 1) - 1.0 / (width + 1)
    basis = np.linalg.svd(corners)[2][:width]
    rows = corners @ basis.T
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def lmo_value(recipe: str, grad: np.ndarray) -> float:
    """⟨G, ΔW⟩ of a step with η = 1 from zero momentum: ΔW is the LMO's answer X."""
    delta, _ = lmo_step(recipe, torch.from_numpy(grad), eta=1.0)
    return float((torch.from_numpy(grad) * delta).sum())


@pytest.mark.parametrize("width", [2, 3, 4])
def test_the_exact_solver_finds_the_known_optimum_of_a_simplex_gradient(width: int) -> None:
    """For G = a regular simplex the optimum is −η·(d+1)·√(d/(2(d+1))) (Jung's ball is attained), and
    `hilbert` reaches exactly the Jung factor of it (SPEC §3.1)."""
    grad = regular_simplex(width)
    optimum = diameter_lmo_optimum(grad)
    assert optimum == pytest.approx(-(width + 1) * math.sqrt(width / (2 * (width + 1))), rel=1e-6)
    assert lmo_value("hilbert", grad) / optimum == pytest.approx(JUNG(width), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("n_rows", "width", "seed"), [(6, 2, 0), (7, 3, 1), (8, 3, 2), (8, 4, 3)])
def test_hilbert_and_equidistance_steps_against_the_exact_optimum(n_rows: int, width: int, seed: int) -> None:
    """On small random gradients: `hilbert` reaches at least the Jung factor of the optimal ⟨G, X⟩, and the
    equidistance step at least c times `hilbert`'s (its descent condition at diam = η), never more than the optimum."""
    grad = np.random.default_rng(seed).standard_normal((n_rows, width))
    grad -= grad.mean(0)  # a cross-entropy head gradient's rows sum to zero
    optimum = diameter_lmo_optimum(grad)
    plain, spread = lmo_value("hilbert", grad), lmo_value("hilbert_equi", grad)
    assert JUNG(width) - 1e-6 <= plain / optimum <= 1 + 1e-6
    assert KNOBS.equi_alignment * plain / optimum - 1e-6 <= spread / optimum <= 1 + 1e-6


def test_head_alignment_is_one_for_the_hilbert_step_and_bounded_by_jung() -> None:
    """`head_alignment_hilbert` (descent per unit diameter, relative to `hilbert`'s) is η/diam(ΔW) for the
    `hilbert` step of G itself and at most 1/Jung for any step, reached by the optimum on a simplex."""
    from lmgeo.study_b.train import head_alignment

    grad = torch.from_numpy(nearly_parallel().numpy().astype(np.float64))
    delta, _ = lmo_step("hilbert", grad, eta=0.5)
    measured = head_alignment(grad, delta, hilbert.diam(delta).value)
    assert measured["head_alignment_hilbert"] == pytest.approx(0.5 / hilbert.diam(delta).value, rel=1e-6)
    cosine = float(-(grad * delta).sum() / (grad.norm() * delta.norm()))
    assert measured["head_alignment"] == pytest.approx(cosine, rel=1e-9)
    simplex = torch.from_numpy(regular_simplex(3))
    optimum = -math.sqrt(3 / 8) * simplex  # the optimal step for η = 1 (diameter 1)
    best = head_alignment(simplex, optimum, hilbert.diam(optimum).value)["head_alignment_hilbert"]
    assert best == pytest.approx(1 / JUNG(3), rel=1e-9)
    for seed in range(5):
        step = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        alignment = head_alignment(simplex, step, hilbert.diam(step).value)["head_alignment_hilbert"]
        assert abs(alignment) <= 1 / JUNG(3) + 1e-9


def test_sign_step_entries_are_plus_minus_eta_over_width() -> None:
    grad = gradients(4)[0]
    delta, _ = lmo_step("sign", grad, eta=0.5)
    np.testing.assert_allclose(delta.numpy(), -0.5 / 24 * np.sign(grad.numpy()), atol=1e-6)


def test_rownorm_step_rows_have_norm_eta_along_the_gradient_rows() -> None:
    grad = gradients(5)[2]
    delta, _ = lmo_step("rownorm", grad, eta=0.5)
    np.testing.assert_allclose(delta.norm(dim=1).numpy(), 0.5, rtol=1e-5)
    cosines = torch.nn.functional.cosine_similarity(delta, grad, dim=1)
    np.testing.assert_allclose(cosines.numpy(), -1, atol=1e-5)


def test_head_momentum_is_muons() -> None:
    """With Newton–Schulz as the direction, HeadLMO reproduces Muon step for step (Muon's
    own lr scaling √(V/d) folded into η): same EMA, same Nesterov read."""
    gen = torch.Generator().manual_seed(6)
    start = torch.randn(64, 16, generator=gen)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    head = optim.HeadLMO(
        [ours], lambda m, _k, _g: newton_schulz(m).to(m.dtype), lr=0.01 * math.sqrt(64 / 16), knobs=KNOBS
    )
    muon = Muon([theirs], lr=0.01, weight_decay=0.0)
    for _ in range(4):
        grad = torch.randn(64, 16, generator=gen)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        head.step()
        muon.step()
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)


# -------------------------------------------------------------------------- the recipe optimizer
def test_muon_head_steps_the_head_with_muon() -> None:
    cfg = TrainConfig(steps=6, schedule=Schedule(warmup_steps=2, decay="cosine", final_frac=0.2))
    model = neox()
    head = head_of(model)
    reference = torch.nn.Parameter(head.detach().clone())
    lr = RECIPES["muon_head"].default_step.head_lr
    muon = Muon([reference], lr=lr, weight_decay=cfg.weight_decay, momentum=0.95, nesterov=True)
    optimizer = optim.build_optimizers(model, head, "muon_head", cfg)
    batch = fixed_batch()
    for step in range(4):
        loss, _ = loss_and_hidden(model, batch)
        loss.backward()
        reference.grad = head.grad.clone()
        muon.param_groups[0]["lr"] = lr * optim.schedule_factor(step, cfg.steps, cfg.schedule)
        optimizer.step()
        optimizer.zero_grad()
        muon.step()
        torch.testing.assert_close(head.detach(), reference.detach(), rtol=0, atol=0)


def max_logprob_change(h: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> float:
    """The largest change of any token's log-probability between two heads, on the rows of `h` (float64)."""
    h = h.double()
    moved = torch.log_softmax(h @ after.double().T, -1) - torch.log_softmax(h @ before.double().T, -1)
    return float(moved.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["hilbert", "hilbert_equi"])
@pytest.mark.parametrize(("quantile", "weight_decay"), [(1.0, 0.0), (0.5, 0.0), (1.0, 0.1)])
def test_tau_is_a_hard_trust_region_on_the_batch(recipe: str, quantile: float, weight_decay: float) -> None:
    """No covered token's log-probability moves by more than tau, weight decay included: the head is
    first spread far apart (a trained head's rows are), where the decay alone would exceed tau."""
    tau = 0.4
    cfg = train_cfg(
        weight_decay=weight_decay, recipe_overrides={recipe: RecipeConfig(tau=tau, radius_quantile=quantile)}
    )
    model = neox()
    head = head_of(model)
    with torch.no_grad():
        head.mul_(30.0)
    optimizer = optim.build_optimizers(model, head, recipe, cfg)
    batch = fixed_batch()
    for _ in range(3):  # later steps carry momentum
        loss, h = loss_and_hidden(model, batch)
        loss.backward()
        norms = h.norm(dim=1)
        radius = float(torch.quantile(norms, quantile, interpolation="higher"))
        before = head.detach().clone()
        optimizer.step(radius=radius)
        optimizer.zero_grad()
        moved = max_logprob_change(h[norms <= radius], before, head.detach())
        assert 0.01 * tau < moved <= tau * (1 + 1e-5)
        if weight_decay:
            decay_alone = max_logprob_change(h, before, before * (1 - optimizer.head_lr() * weight_decay))
            assert decay_alone > 0.01 * tau  # the decay is a real part of the step, inside the region
        else:
            assert optimizer.lrs()["head"] == pytest.approx(tau / radius)
        assert optimizer.lrs()["head_tau"] == tau


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES.names())
@pytest.mark.parametrize("budget", [0.05, 50.0])
def test_a_head_budget_sets_every_recipes_step_in_hilbert_units(recipe: str, budget: float) -> None:
    """A matched budget: diam(ΔW)·max‖h‖ equals the budget at every step, for every recipe, whether that
    shrinks the recipe's own step (a small budget: factor < 1) or enlarges it (a large one: > 1); the budget
    follows the head's schedule."""
    schedule = Schedule(warmup_steps=2, decay="linear", final_frac=0.5)
    cfg = TrainConfig(steps=4, schedule=schedule)
    model = neox()
    head = head_of(model)
    optimizer = optim.build_optimizers(model, head, recipe, cfg, head_budget_tau=budget)
    assert optimizer.needs_radius and optimizer.radius_quantile == 1.0
    scales = []
    for step in range(4):
        loss, h = loss_and_hidden(model, fixed_batch())
        loss.backward()
        radius = float(h.norm(dim=1).max())
        before = head.detach().clone()
        optimizer.step(radius=radius)
        optimizer.zero_grad()
        allowed = budget * optim.schedule_factor(step, 4, schedule)
        assert hilbert.diam(head.detach() - before).value * radius == pytest.approx(allowed, rel=1e-4)
        scales.append(optimizer.last_head_scale)
    assert all(s < 1 for s in scales) if budget < 1 else all(s > 1 for s in scales)


def test_no_budget_leaves_the_step_alone() -> None:
    model = neox()
    optimizer = optim.build_optimizers(model, head_of(model), "adamw", train_cfg())
    loss_and_hidden(model, fixed_batch())[0].backward()
    optimizer.step()
    assert optimizer.last_head_scale is None and not optimizer.needs_radius


def test_a_tau_recipe_refuses_to_step_without_a_radius() -> None:
    model = neox()
    cfg = train_cfg(recipe_overrides={"hilbert": RecipeConfig(tau=0.5)})
    optimizer = optim.build_optimizers(model, head_of(model), "hilbert", cfg)
    assert optimizer.needs_radius
    loss_and_hidden(model, fixed_batch())[0].backward()
    with pytest.raises(ValueError, match="radius"):
        optimizer.step()


@pytest.mark.parametrize("recipe", RECIPES.names())
def test_every_recipe_lowers_the_loss_on_a_fixed_batch(recipe: str) -> None:
    model = neox()
    optimizer = optim.build_optimizers(model, head_of(model), recipe, train_cfg())
    batch = fixed_batch()
    losses = []
    for _ in range(20):
        loss, h = loss_and_hidden(model, batch)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step(radius=float(h.norm(dim=1).max()))
        optimizer.zero_grad()
    assert losses[-1] < losses[0] - 0.5, losses


def test_only_the_head_differs_between_recipes() -> None:
    """Same seed, same batch: after a step, every non-head parameter agrees across the Muon recipes."""
    after = {}
    for recipe in [r.name for r in RECIPES if r.hidden == "muon"]:
        model = neox()
        optimizer = optim.build_optimizers(model, head_of(model), recipe, train_cfg())
        loss_and_hidden(model, fixed_batch())[0].backward()
        optimizer.step(radius=1.0)
        after[recipe] = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = after.pop("muon")
    for recipe, params in after.items():
        for name, value in params.items():
            if name != "lm_head.weight":
                torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=f"{recipe}: {name}")
        assert not torch.equal(params["lm_head.weight"], reference["lm_head.weight"])


def test_gpt2_conv1d_matrices_step_like_the_same_matrices_stored_out_in() -> None:
    """torch.optim.Muon's shape scale √max(1, A/B) reads (out, in); GPT-2's Conv1D stores (in, out). Our
    step on each GPT-2 hidden matrix must equal plain Muon's step on the transposed matrix, transposed back,
    i.e. the step NeoX's equivalent matrix would take. Newton–Schulz commutes with transposition: exactly
    for a non-square matrix (torch transposes it to the same orientation), to its bfloat16 rounding (a few
    percent) for a square one (XXᵀ and XᵀX are rounded differently)."""
    from lmgeo.models.registry import build_model

    assert FAMILIES["gpt2"].hidden_stored_transposed and not FAMILIES["neox"].hidden_stored_transposed
    model = build_model("gpt2", ModelSize(d_model=32, n_layers=1, n_heads=4), VOCAB, SEQ, seed=0)
    cfg = train_cfg()
    optimizer = optim.build_optimizers(model, head_of(model), "muon", cfg)
    hidden = {n: p for n, p in model.named_parameters() if re.search(r"\.(c_attn|c_fc|c_proj)\.weight$", n)}
    assert {tuple(p.shape) for p in hidden.values()} == {(32, 96), (32, 128), (128, 32), (32, 32)}
    loss_and_hidden(model, fixed_batch())[0].backward()
    before = {name: p.detach().clone() for name, p in hidden.items()}
    expected = {}
    for name, p in hidden.items():
        stored_out_in = torch.nn.Parameter(p.detach().T.clone())
        stored_out_in.grad = p.grad.T.clone()
        Muon([stored_out_in], lr=cfg.hidden_lr, momentum=0.95, nesterov=True, weight_decay=0.0).step()
        expected[name] = stored_out_in.detach().T - before[name]
    optimizer.step()
    for name, p in hidden.items():
        step = p.detach() - before[name]
        if p.shape[0] == p.shape[1]:  # a wrong shape scale would be off by √3, 2 or ½, not by a few percent
            assert float((step - expected[name]).norm() / expected[name].norm()) < 0.05, name
        else:
            torch.testing.assert_close(step, expected[name], rtol=0, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
    assert optimizer.lrs()["hidden"] == pytest.approx(cfg.hidden_lr)
    assert optim.muon_transposed_scale((32, 96)) == pytest.approx(math.sqrt(3))  # c_attn: 1 → √3
    assert optim.muon_transposed_scale((128, 32)) == pytest.approx(0.5)  # mlp c_proj: 2 → 1


# ------------------------------------------------------------------- the control of hilbert_equi (issue #55)
def test_the_control_is_hilberts_step_at_hilbert_equis_tau() -> None:
    """`hilbert_ctl`: on random head gradients its step is `hilbert`'s direction function called directly;
    trained at its defaults it steps a model exactly as `hilbert` at `hilbert_equi`'s default tau."""
    from lmgeo.study_b.recipes import hilbert as hilbert_recipe

    tau = RECIPES["hilbert_equi"].default_step.tau
    assert tau is not None and RECIPES["hilbert_ctl"].control_of == "hilbert_equi"
    for grad in gradients(3):
        delta, _ = lmo_step("hilbert_ctl", grad, eta=0.3)
        expected = -0.3 * hilbert_recipe.direction(grad, KNOBS, {})  # from zero momentum: along the gradient
        np.testing.assert_allclose(delta.numpy(), expected.numpy(), atol=1e-6)
    assert optim.resolve_head_step("hilbert_ctl", TrainConfig()).describe() == f"tau={tau:g}"
    models = {"hilbert_ctl": neox(), "hilbert": neox()}
    cfg = train_cfg(recipe_overrides={"hilbert": RecipeConfig(tau=tau)})
    optimizers = {r: optim.build_optimizers(m, head_of(m), r, cfg) for r, m in models.items()}
    for _ in range(3):  # later steps carry momentum
        for recipe, model in models.items():
            loss, h = loss_and_hidden(model, fixed_batch())
            loss.backward()
            optimizers[recipe].step(radius=float(h.norm(dim=1).max()))
            optimizers[recipe].zero_grad()
            assert optimizers[recipe].lrs()["head_tau"] == tau
    for (name, a), b in zip(models["hilbert_ctl"].named_parameters(), models["hilbert"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_the_controls_tau_follows_hilbert_equis_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control's tau is read from `hilbert_equi`'s RECIPE, not copied: moving one moves the other."""
    import importlib

    from lmgeo.study_b.recipes import hilbert_ctl, hilbert_equi

    moved = dataclasses.replace(hilbert_equi.RECIPE.default_step, tau=0.123)
    monkeypatch.setattr(hilbert_equi, "RECIPE", dataclasses.replace(hilbert_equi.RECIPE, default_step=moved))
    try:
        assert importlib.reload(hilbert_ctl).RECIPE.default_step == HeadStepDefault(tau=0.123)
    finally:
        monkeypatch.undo()
        importlib.reload(hilbert_ctl)
    assert hilbert_ctl.RECIPE.default_step == HeadStepDefault(tau=RECIPES["hilbert_equi"].default_step.tau)


# ----------------------------------------------------------------------------- step sizes
def test_step_sizes_resolve_override_then_default_then_adamw_lr(monkeypatch) -> None:
    cfg = TrainConfig(
        adamw_lr=1e-3,
        recipe_overrides={
            "hilbert": RecipeConfig(tau=0.7, radius_quantile=0.9),
            "sign": RecipeConfig(head_lr=0.11, schedule=FLAT),
            "hilbert_equi": RecipeConfig(equi_iters=2, equi_alignment=0.7),
        },
    )
    hil = optim.resolve_head_step("hilbert", cfg)
    assert (hil.lr, hil.trust_region, hil.radius_quantile) == (0.7, True, 0.9)
    sign = optim.resolve_head_step("sign", cfg)
    assert (sign.lr, sign.trust_region, sign.schedule) == (0.11, False, FLAT)
    equi = optim.resolve_head_step("hilbert_equi", cfg)
    assert (equi.lr, equi.knobs, equi.schedule) == (
        RECIPES["hilbert_equi"].default_step.tau,
        LMOKnobs(2, 0.7),
        cfg.schedule,
    )
    assert equi.describe() == f"tau={RECIPES['hilbert_equi'].default_step.tau:g} equi_alignment=0.7"
    default_c = optim.resolve_head_step("hilbert_equi", TrainConfig()).knobs.equi_alignment
    assert default_c == RECIPES["hilbert_equi"].default_step.equi_alignment
    adamw = optim.resolve_head_step("adamw", TrainConfig(recipe_overrides={"adamw": RecipeConfig(hidden_lr=0.02)}))
    assert adamw.hidden_lr == 0.02 and adamw.describe().endswith("hidden_lr=0.02")
    with pytest.raises(ValueError, match="hidden_lr applies only"):
        optim.resolve_head_step("sign", TrainConfig(recipe_overrides={"sign": RecipeConfig(hidden_lr=0.02)}))
    assert optim.resolve_head_step("muon", cfg).lr == RECIPES["muon"].default_step.head_lr
    no_default = dataclasses.replace(RECIPES["muon"], default_step=HeadStepDefault())
    monkeypatch.setitem(RECIPES._members, "muon", no_default)
    assert optim.resolve_head_step("muon", cfg).lr == 1e-3  # no default: the run's AdamW lr
    with pytest.raises(ValueError, match="not both"):
        RecipeConfig(tau=0.7, head_lr=0.1)


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_schedule_matches_its_closed_form(decay: str) -> None:
    schedule = Schedule(warmup_steps=4, decay=decay, final_frac=0.1)
    total = 24
    got = [optim.schedule_factor(t, total, schedule) for t in range(total)]
    assert got[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    progress = np.arange(20) / 19
    shape = {"cosine": 0.5 * (1 + np.cos(np.pi * progress)), "linear": 1 - progress, "constant": np.ones(20)}[decay]
    expected = shape if decay == "constant" else 0.1 + 0.9 * shape
    np.testing.assert_allclose(got[4:], expected, rtol=1e-12)


def test_lrs_follow_the_schedule_on_every_group() -> None:
    schedule = Schedule(warmup_steps=3, decay="linear", final_frac=0.0)
    cfg = TrainConfig(steps=6, schedule=schedule, hidden_lr=0.02, adamw_lr=0.004)
    model = neox()
    optimizer = optim.build_optimizers(model, head_of(model), "sign", cfg)
    head_lr = RECIPES["sign"].default_step.head_lr
    for step in range(6):
        loss_and_hidden(model, fixed_batch())[0].backward()
        optimizer.step()
        optimizer.zero_grad()
        factor = optim.schedule_factor(step, 6, schedule)
        assert optimizer.lrs() == pytest.approx(
            {"hidden": 0.02 * factor, "embed": 0.004 * factor, "scalar": 0.004 * factor, "head": head_lr * factor}
        )
    assert optimizer.head_lr() == 0.0
