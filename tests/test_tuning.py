"""The head step-size sweep: equal budgets, selection rule, refinement, transfer, and a tiny real sweep."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from lmgeo.commands.tune import tuning
from lmgeo.commands.tune.tuning import render, transfer_summary, tuning_config
from lmgeo.core.contracts import RunSpec
from lmgeo.models.config import ModelSize
from lmgeo.models.registry import build_model, head_of
from lmgeo.study_b.config import RecipeConfig, TrainConfig
from lmgeo.study_b.optim import build_optimizers
from lmgeo.study_b.recipes import RECIPES
from lmgeo.study_b.recipes.base import HeadStepDefault
from lmgeo.study_b.train import train_run

TINY = ModelSize(d_model=16, n_layers=1, n_heads=2)
VOCAB, SEQ = 64, 16


def rows(recipe: str, entries: list[tuple[str, float, int, float | None]]) -> list[dict]:
    """Hand-made trial rows; a loss of None is a diverged run."""
    return [
        {
            "recipe": recipe,
            "arch": "neox",
            "knob": knob,
            "value": value,
            "seed": seed,
            "final_val_loss": loss,
            "diverged": loss is None,
            "steps_done": 10,
            "wall_time_s": 1.0,
        }
        for knob, value, seed, loss in entries
    ]


def table(recipe: str, entries: list[tuple[str, float, int, float | None]]):
    return tuning.results_table(rows(recipe, entries))


# ------------------------------------------------------------------------------------ selection
def test_best_step_is_the_lowest_mean_over_seeds() -> None:
    rng = np.random.default_rng(0)
    losses = {v: rng.uniform(3, 5, size=3) for v in (0.01, 0.02, 0.04, 0.08)}
    t = table("sign", [("head_lr", v, s, float(x)) for v, xs in losses.items() for s, x in enumerate(xs)])
    expected = min(losses, key=lambda v: losses[v].mean())
    choice = tuning.best_step(t)
    assert (choice.knob, choice.value) == ("head_lr", expected)
    assert choice.mean_val_loss == pytest.approx(losses[expected].mean(), rel=1e-12)


def test_a_step_that_diverges_on_any_seed_never_wins() -> None:
    # 0.4 has the best single run but diverged on seed 1: it counts as +inf, not as its finite mean.
    t = table(
        "hilbert",
        [
            ("head_lr", 0.1, 0, 3.6),
            ("head_lr", 0.1, 1, 3.7),
            ("head_lr", 0.4, 0, 3.0),
            ("head_lr", 0.4, 1, None),
        ],
    )
    assert tuning.best_step(t) == tuning.Choice("head_lr", 0.1, pytest.approx(3.65))
    scores = {s.value: s for s in tuning.step_scores(t)}
    assert math.isinf(scores[0.4].mean_val_loss) and scores[0.4].diverged == 1


def test_ties_go_to_the_smaller_step() -> None:
    t = table("hilbert", [("tau", 0.4, 0, 3.5), ("tau", 0.2, 0, 3.5)])
    assert tuning.best_step(t) == tuning.Choice("tau", 0.2, 3.5)


def test_best_step_refuses_mixed_recipes_or_archs_and_all_diverged() -> None:
    mixed = tuning.results_table(rows("sign", [("head_lr", 0.1, 0, 3.0)]) + rows("muon", [("head_lr", 0.1, 0, 3.0)]))
    with pytest.raises(ValueError, match="one recipe"):
        tuning.best_step(mixed)
    other_arch = [dict(r, arch="gpt2") for r in rows("sign", [("head_lr", 0.1, 0, 3.0)])]
    with pytest.raises(ValueError, match="one arch"):
        tuning.best_step(tuning.results_table(rows("sign", [("head_lr", 0.1, 0, 3.0)]) + other_arch))
    with pytest.raises(ValueError, match="every head step diverged"):
        tuning.best_step(table("sign", [("head_lr", 0.1, 0, None), ("head_lr", 0.2, 0, None)]))


# ------------------------------------------------------------------------------ grids and budget
def test_every_recipe_gets_the_same_budget_per_knob() -> None:
    """Equal budgets (SPEC §3.2): the same number of values, built the same way, for every recipe's step, the
    baselines included; trust-region recipes are tuned in nats, `adamw` in its hidden matrices' lr, the
    others in η; `hilbert_equi`'s descent share gets the same budget on its own grid."""
    cfg = TrainConfig(model=ModelSize(d_model=64), adamw_lr=2e-3)
    for recipe in RECIPES.names():
        step = tuning.knobs_of(recipe)[0]
        values = tuning.first_round(recipe, cfg)
        centre = tuning.default_value(recipe, cfg)
        np.testing.assert_allclose(values, centre * np.array(tuning.GRID_FACTORS), rtol=5e-3)  # 3 significant digits
        expected = "hidden_lr" if recipe == "adamw" else "tau" if RECIPES[recipe].trust_region else "head_lr"
        assert step == expected
        trials = tuning.trials_for(recipe, "neox", values + [1.0, 2.0], tuning.TUNING_SEEDS)
        assert len(trials) == (len(tuning.GRID_FACTORS) + tuning.REFINEMENTS) * len(tuning.TUNING_SEEDS)
        assert {t.knob for t in trials} == {step}
    assert tuning.knobs_of("hilbert_equi") == ("tau", "equi_alignment")
    assert tuning.first_round("hilbert_equi", cfg, "equi_alignment") == list(tuning.ALIGNMENT_GRID)
    assert len(tuning.ALIGNMENT_GRID) == len(tuning.GRID_FACTORS)


def test_the_descent_share_is_refined_inside_its_interval() -> None:
    def losses(best_at: float) -> list:
        return [("equi_alignment", v, 0, 3.0 + abs(v - best_at)) for v in tuning.ALIGNMENT_GRID]

    assert tuning.refinement(table("hilbert_equi", losses(0.6))) == [0.5, 0.7]
    assert tuning.refinement(table("hilbert_equi", losses(1.0))) == [0.9, 0.95]  # c cannot exceed 1
    assert tuning.refinement(table("hilbert_equi", losses(0.2))) == [0.1, 0.05]


def test_the_seed_noise_and_the_lead_of_a_tuning_curve() -> None:
    """Seed noise: the SD of a trial about its value's mean, pooled over values whose seeds all finished; the
    lead: the runner-up's mean minus the winner's."""
    t = table(
        "sign",
        [
            ("head_lr", 0.1, 0, 3.0),
            ("head_lr", 0.1, 1, 3.2),
            ("head_lr", 0.2, 0, 2.9),
            ("head_lr", 0.2, 1, 3.0),
            ("head_lr", 0.4, 0, 3.5),
            ("head_lr", 0.4, 1, None),
        ],
    )
    deviations = [0.1, 0.1, 0.05, 0.05]  # about 3.1 and 2.95; 0.4 diverged on a seed: left out
    assert tuning.seed_noise(t) == pytest.approx(math.sqrt(sum(d * d for d in deviations) / 2))
    assert tuning.margin(t) == pytest.approx(3.1 - 2.95)
    assert tuning.seed_noise(table("sign", [("head_lr", 0.1, 0, 3.0)])) is None


def test_a_default_that_follows_the_adamw_lr_or_is_an_eta_is_centred_on_it(monkeypatch) -> None:
    for recipe, step in (("muon", HeadStepDefault()), ("hilbert", HeadStepDefault(head_lr=0.05))):
        monkeypatch.setitem(RECIPES._members, recipe, dataclasses.replace(RECIPES[recipe], default_step=step))
    cfg = TrainConfig(model=ModelSize(d_model=16), adamw_lr=2e-3)
    assert tuning.default_value("muon", cfg) == 2e-3
    assert tuning.default_value("hilbert", cfg) == pytest.approx(0.2)  # η·‖h‖ with ‖h‖ ≈ √16


def test_refinement_halves_the_spacing_inside_and_extends_past_an_edge() -> None:
    def losses(best_at: float) -> list:
        return [("head_lr", v, 0, 3.0 + abs(math.log(v / best_at))) for v in (0.01, 0.02, 0.04, 0.08, 0.16)]

    inside = tuning.refinement(table("sign", losses(0.04)))
    assert inside == [pytest.approx(0.04 / math.sqrt(2), rel=1e-3), pytest.approx(0.04 * math.sqrt(2), rel=1e-3)]
    assert tuning.refinement(table("sign", losses(0.16))) == [0.32, 0.64]
    assert tuning.refinement(table("sign", losses(0.01))) == [0.005, 0.0025]
    all_diverged = table("sign", [("head_lr", v, 0, None) for v in (0.01, 0.02)])
    assert tuning.refinement(all_diverged) == [0.005, 0.0025]


def test_bracketing_and_transfer_values() -> None:
    t = table("sign", [("head_lr", v, 0, loss) for v, loss in ((0.1, 3.2), (0.2, 3.0), (0.4, 3.1))])
    assert tuning.bracketed(t, tuning.best_step(t))
    edge = table("sign", [("head_lr", v, 0, loss) for v, loss in ((0.1, 3.2), (0.2, 3.0))])
    assert not tuning.bracketed(edge, tuning.best_step(edge))
    assert tuning.transfer_values(tuning.Choice("tau", 0.8, 3.0)) == [0.4, 0.8, 1.6]


def test_a_trial_changes_only_its_recipe_head_step() -> None:
    base = TrainConfig(
        recipe_overrides={"hilbert_equi": RecipeConfig(head_lr=0.3, equi_iters=5), "sign": RecipeConfig(head_lr=0.7)}
    )
    trial = tuning.Trial("hilbert_equi", "neox", "tau", 0.25, 0)
    cfg = tuning.trial_config(base, trial)
    assert cfg.recipe_overrides["hilbert_equi"] == RecipeConfig(tau=0.25, equi_iters=5)
    share = tuning.trial_config(cfg, tuning.Trial("hilbert_equi", "neox", "equi_alignment", 0.6, 0))
    assert share.recipe_overrides["hilbert_equi"] == RecipeConfig(tau=0.25, equi_iters=5, equi_alignment=0.6)
    with pytest.raises(ValueError, match="has no knob equi_alignment"):
        tuning.Trial("hilbert", "neox", "equi_alignment", 0.5, 0)
    assert cfg.recipe_overrides["sign"] == base.recipe_overrides["sign"]
    assert cfg.model_dump(exclude={"recipe_overrides"}) == base.model_dump(exclude={"recipe_overrides"})
    with pytest.raises(ValueError, match="tau applies"):
        tuning.Trial("sign", "neox", "tau", 0.25, 0)


@pytest.mark.parametrize(("recipe", "group"), [("adamw", "hidden"), ("muon", "head"), ("sign", "head")])
def test_every_group_but_the_tuned_one_keeps_its_learning_rate(recipe: str, group: str) -> None:
    model = build_model("neox", TINY, VOCAB, SEQ, seed=0)
    base = TrainConfig(model=TINY)
    knob = tuning.knobs_of(recipe)[0]
    configs = [tuning.trial_config(base, tuning.Trial(recipe, "neox", knob, v, 0)) for v in (0.001, 0.1)]
    lrs = [build_optimizers(model, head_of(model).weight, recipe, cfg).lrs() for cfg in configs]
    assert {k: v for k, v in lrs[0].items() if k != group} == {k: v for k, v in lrs[1].items() if k != group}
    assert lrs[1][group] == pytest.approx(100 * lrs[0][group])


# ----------------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def tokens() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, VOCAB, 4000).astype(np.int32), rng.integers(0, VOCAB, 1000).astype(np.int32)


def tiny_cfg(**overrides) -> TrainConfig:
    return TrainConfig(
        model=TINY,
        steps=4,
        batch_size=4,
        eval_batches=1,
        probe_sequences=2,
        equi_sample_rows=32,
        device="cpu",
        **overrides,
    )


@pytest.mark.slow  # five training runs
def test_a_two_point_sweep_matches_direct_training_runs(tokens) -> None:
    train, val = tokens
    base = tiny_cfg()
    trials = tuning.trials_for("hilbert", "neox", [0.05, 1.5], [0, 1])
    t = tuning.results_table([tuning.run_trial(trial, base, train, val, VOCAB, SEQ) for trial in trials])
    assert t.schema == tuning.TRIAL_SCHEMA and t.num_rows == 4
    got = t.to_pylist()
    assert [(r["knob"], r["value"], r["seed"]) for r in got] == [
        ("tau", 0.05, 0),
        ("tau", 0.05, 1),
        ("tau", 1.5, 0),
        ("tau", 1.5, 1),
    ]
    assert all(r["recipe"] == "hilbert" and r["arch"] == "neox" and not r["diverged"] for r in got)
    assert all(r["steps_done"] == 4 for r in got)
    assert got[0]["final_val_loss"] != got[2]["final_val_loss"]  # the head step took effect
    direct, _ = train_run(
        RunSpec("neox", "hilbert", 1),
        tiny_cfg(recipe_overrides={"hilbert": RecipeConfig(tau=1.5)}),
        train,
        val,
        VOCAB,
        SEQ,
        "x",
        lambda *_: None,
    )
    assert got[3]["final_val_loss"] == direct.final_val_loss


@pytest.mark.slow
def test_final_only_measurements_do_not_change_the_trajectory(tokens) -> None:
    """`lmgeo tune` evaluates and measures geometry only at the end; the loss must not depend on it."""
    train, val = tokens
    every_step = tiny_cfg(eval_interval=1, geometry_interval=1)
    results = [
        train_run(RunSpec("neox", "hilbert_equi", 0), cfg, train, val, VOCAB, SEQ, "x", lambda *_: None)[0]
        for cfg in (every_step, tuning_config(every_step, every_step.steps))
    ]
    assert results[0].final_val_loss == results[1].final_val_loss


def test_a_trial_never_reads_the_test_split(tokens, monkeypatch) -> None:
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return train_run(*args, **kwargs)

    monkeypatch.setattr(tuning, "train_run", spy)
    train, val = tokens
    tuning.run_trial(tuning.Trial("muon", "neox", "head_lr", 0.01, 0), tiny_cfg(), train, val, VOCAB, SEQ)
    assert seen.get("test_tokens") is None


# --------------------------------------------------------------------------------------- report
PROTOCOL = {
    "arch": "neox",
    "transfer_archs": [],
    "transfer": None,
    "model": TINY.model_dump(),
    "n_params": 1234,
    "vocab_size": VOCAB,
    "seq_len": SEQ,
    "steps": 4,
    "batch_size": 4,
    "tokens_per_run": 256,
    "seeds": [1000],
    "hidden_lr": 0.02,
    "adamw_lr": 3e-3,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "schedule": TrainConfig().schedule.model_dump(),
    "eval_batches": 1,
    "grid": "a grid",
    "values_per_knob": 3,
    "defaults_at_sweep": {"sign": {"head_lr": 0.2}},
    "wall_time_s": 1.0,
    "threads_per_run": 1,
    "machine": "test",
}


def test_the_document_marks_the_choice_diverged_runs_and_bracketing() -> None:
    trial_rows = rows("sign", [("head_lr", 0.1, 1000, 3.5), ("head_lr", 0.2, 1000, 3.2), ("head_lr", 0.4, 1000, None)])
    choice = tuning.best_step(tuning.results_table(trial_rows))
    text = render(PROTOCOL, trial_rows, {"sign": {"head_lr": choice}})
    assert "| neox | `sign` | `head_lr` | 0.2 | 3.2000 | 3.2000 | ✔ |" in text
    assert "| neox | `sign` | `head_lr` | 0.4 | *diverged* | inf (diverged) |  |" in text
    assert "| `sign` | `head_lr` | 0.2 | 3.2000 | yes | 0.3000 | – | `head_lr` 0.2: 3.2000 |" in text
    assert "nothing to transfer" in text and "never evaluated by tuning" in text and "tuning.png" in text
    at_edge = rows("sign", [("head_lr", 0.1, 1000, 3.5), ("head_lr", 0.2, 1000, 3.2)])
    text = render(PROTOCOL, at_edge, {"sign": {"head_lr": tuning.best_step(tuning.results_table(at_edge))}})
    assert "| `sign` | `head_lr` | 0.2 | 3.2000 | no | 0.3000 | – | `head_lr` 0.2: 3.2000 |" in text


def test_transfer_is_checked_against_the_neighbours_on_the_other_arch() -> None:
    choice = tuning.Choice("head_lr", 0.2, 3.0)
    steps = [("head_lr", 0.1, 0, 3.3), ("head_lr", 0.2, 0, 3.4), ("head_lr", 0.4, 0, 3.6)]
    other = [dict(r, arch="gpt2") for r in rows("sign", steps)]
    summary = transfer_summary(other, {"sign": {"head_lr": choice}}, ["gpt2"])
    assert summary == "gpt2: the choice is also the best of ×½, ×1, ×2 for 0 of 1 recipes (not for sign)"
    assert transfer_summary([], {"sign": {"head_lr": choice}}, []) is None


# ---------------------------------------------------------------------------------------- command
def test_the_command_rejects_bad_input_before_any_work(tmp_path) -> None:
    from lmgeo.commands.tune import command as tune
    from lmgeo.core.errors import InputError
    from lmgeo.driver.layout import Layout
    from lmgeo.params import Params

    empty = Layout(tmp_path)  # an empty workspace: no data/tokens
    with pytest.raises(InputError, match="unknown arch 'llama'"):
        tune.run(Params(), empty, arch="llama")
    with pytest.raises(InputError, match="recipes must be distinct names"):
        tune.run(Params(), empty, recipes=["sign", "scion"])
    with pytest.raises(InputError, match="run the prepare stage"):
        tune.run(Params(), empty, recipes=["sign"])


def test_an_interrupted_sweep_resumes_from_its_finished_trials(tmp_path, monkeypatch) -> None:
    """The trial cache keeps a finished trial's row under a key of what decides it (its config, the tokens and
    its code version): read back by a new sweep, and not for another config."""
    from lmgeo.commands.tune.command import TrialCache
    from lmgeo.driver.layout import Layout

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    layout = Layout.here()
    path = tmp_path / ".tuning.trials.jsonl"
    trial = tuning.Trial("sign", "neox", "head_lr", 0.2, 1000)
    base = TrainConfig(model=TINY)
    cache = TrialCache(path, tokens="abc")
    key = cache.key(trial, tuning.trial_config(base, trial), SEQ, layout)
    row = rows("sign", [("head_lr", 0.2, 1000, 3.25)])[0]
    assert cache.add(key, row) == row
    again = TrialCache(path, tokens="abc")
    assert again.rows == {key: row}
    other = tuning.trial_config(base.model_copy(update={"steps": 7}), trial)
    assert again.key(trial, other, SEQ, layout) != key
    assert TrialCache(path, tokens="another").key(trial, tuning.trial_config(base, trial), SEQ, layout) != key


@pytest.mark.parametrize(("knobs", "size"), [(1, (3.2, 2.6)), (2, (6.4, 2.6)), (6, (12.8, 5.2))])
def test_the_tuning_figure_is_as_wide_as_its_panels(knobs, size):
    """A tune of one knob (`lmgeo tune --recipe adamw`) is one panel, not one panel beside three empty ones."""
    curve = {
        "recipe": "adamw",
        "knob": "hidden_lr",
        "chosen": 0.003,
        "points": [{"value": v, "mean": 4.2, "seeds": {"1000": 4.2}} for v in (0.0015, 0.003, 0.006)],
    }
    fig = tuning.figure([curve] * knobs)
    assert tuple(fig.get_size_inches()) == pytest.approx(size) and len(fig.axes) == knobs
