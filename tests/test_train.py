"""What a training run records (SPEC §3.3): the head step's geometry on the probe and training batches,
its alignment with the gradient, the spread references, and the final test loss."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmgeo.core.contracts import STEPS, RunSpec
from lmgeo.models.config import ModelSize
from lmgeo.study_b import hilbert
from lmgeo.study_b.config import MatchedBudget, RecipeConfig, Schedule, TrainConfig
from lmgeo.study_b.optim import schedule_factor
from lmgeo.study_b.train import train_run

TINY = ModelSize(d_model=16, n_layers=1, n_heads=2)
VOCAB, SEQ = 64, 16


@pytest.fixture(scope="module")
def tokens() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    sizes = (("train", 4000), ("val", 800), ("test", 800))
    return {split: rng.integers(0, VOCAB, n).astype(np.int32) for split, n in sizes}


def run(tokens, recipe: str, with_test: bool = True, cap: float | None = None, **overrides):
    """A tiny run; with `cap`, a capped run of a matched-budget sweep at that budget."""
    if cap is not None:
        overrides["matched_budget"] = MatchedBudget(taus=[cap], seeds=[0])
    cfg = TrainConfig(
        model=TINY,
        steps=6,
        batch_size=4,
        eval_batches=1,
        test_batches=2,
        probe_sequences=2,
        geometry_interval=2,
        equi_sample_rows=32,
        device="cpu",
        **overrides,
    )
    record, steps = train_run(
        RunSpec("neox", recipe, 0, cap is not None, cap),
        cfg,
        tokens["train"],
        tokens["val"],
        VOCAB,
        SEQ,
        "x",
        lambda *_: None,
        test_tokens=tokens["test"] if with_test else None,
    )
    return cfg, record, steps.to_pylist()


def geometry_rows(steps: list[dict]) -> list[dict]:
    return [r for r in steps if r["hilbert_bound"] is not None]


@pytest.mark.slow
def test_a_tau_step_moves_no_training_token_by_more_than_tau(tokens) -> None:
    """With radius_quantile 1 the trust region covers every token of the batch the step came from, so the
    realised d_H on that batch (`hilbert_realized_train`) stays within tau_t, and is a real fraction of it."""
    schedule = Schedule(warmup_steps=2, decay="cosine", final_frac=0.1)
    cfg, _, steps = run(tokens, "hilbert", schedule=schedule, recipe_overrides={"hilbert": RecipeConfig(tau=0.5)})
    rows = geometry_rows(steps)
    assert len(rows) == 4  # steps 1, 2, 4, 6
    for r in rows:
        tau_t = 0.5 * schedule_factor(r["step"] - 1, cfg.steps, schedule)
        assert 0.2 * tau_t < r["hilbert_realized_train"] <= tau_t * (1 + 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["adamw", "hilbert_equi"])
def test_geometry_rows_carry_alignment_and_the_spread_references(tokens, recipe: str) -> None:
    _, record, steps = run(tokens, recipe)
    rows = geometry_rows(steps)
    assert set(rows[0]) == {f.name for f in STEPS.fields}
    for r in rows:
        assert -1 <= r["head_alignment"] <= 1
        assert abs(r["head_alignment_hilbert"]) <= math.sqrt(2 * TINY.d_model / (TINY.d_model + 1)) + 1e-9
        assert r["hilbert_realized_train"] <= r["head_diam"] * 1e3  # finite, measured
        assert r["equi_ratio_random"] == hilbert.equi_ratio_random(32, TINY.d_model, seed=r["step"])  # a fresh draw
        assert r["equi_ratio_bound"] == hilbert.equi_ratio_bound(32, TINY.d_model)
        assert r["head_step_scale"] is None  # no head budget in this run
    assert all(r["head_alignment"] is None for r in steps if r["hilbert_bound"] is None)
    assert rows[0]["head_alignment"] > 0  # the first step descends along its own gradient
    assert record.final_test_loss is not None and math.isfinite(record.final_test_loss)
    assert record.final_test_loss != record.final_val_loss  # another split


@pytest.mark.slow
def test_runs_without_test_tokens_never_measure_test(tokens) -> None:
    _, with_test, _ = run(tokens, "muon")
    _, without, _ = run(tokens, "muon", with_test=False)
    assert without.final_test_loss is None
    assert without.final_val_loss == with_test.final_val_loss  # reading test changes nothing else


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.01, 100.0])
def test_a_matched_run_takes_its_budget_exactly_every_step_and_records_the_factor(tokens, budget: float) -> None:
    """The head step is rescaled to the budget, down (a small budget) or up (a large one): on the batch it was
    computed from, the realised d_H is at most the budget (tau_t ≤ tau) and the factor is logged every step."""
    _, record, steps = run(tokens, "adamw", cap=budget)
    assert record.run == {0.01: "neox-adamw-s0-cap0.01", 100.0: "neox-adamw-s0-cap100.0"}[budget]
    assert record.head_budget_tau == budget
    assert all((r["head_step_scale"] < 1) if budget < 1 else (r["head_step_scale"] > 1) for r in steps)
    for r in geometry_rows(steps):
        assert r["hilbert_realized_train"] <= budget * (1 + 1e-5)
        assert r["hilbert_bound"] > 0


@pytest.mark.slow
def test_under_a_matched_budget_rownorm_trains_the_model_hilbert_does(tokens) -> None:
    """Cross-entropy head gradients have rows summing to zero, so `hilbert`'s direction is `rownorm`'s halved
    minus a common row shift; the budget (on diam, blind to shifts) rescales both to the same rows, and softmax
    is blind to the shift: the same losses up to float rounding (SPEC §3.2), whatever each one's own step."""
    # Below both recipes' own steps, and far above: at 5 nats a step the training amplifies the float32 rounding of
    # the two weights (which differ by the shift) several-fold a step, so the same model is read more loosely.
    for budget, rounding in ((0.02, 1e-5), (5.0, 1e-3)):
        _, rownorm, rownorm_steps = run(tokens, "rownorm", cap=budget)
        _, hilbert_run, hilbert_steps = run(
            tokens, "hilbert", cap=budget, recipe_overrides={"hilbert": RecipeConfig(tau=1.0)}
        )
        gaps = [abs(a["train_loss"] - b["train_loss"]) for a, b in zip(rownorm_steps, hilbert_steps, strict=True)]
        assert max(gaps) < rounding
        assert rownorm.final_test_loss == pytest.approx(hilbert_run.final_test_loss, abs=rounding)
    _, free_rownorm, _ = run(tokens, "rownorm")  # at rownorm's own step: another model
    assert abs(free_rownorm.final_test_loss - rownorm.final_test_loss) > 10 * rounding
