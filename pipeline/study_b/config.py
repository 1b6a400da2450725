"""The `train` section of params: the run grid (families × recipes × seeds), model size, step sizes,
schedules and what training records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, model_validator

from pipeline.core.config import (
    FamilyName,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    RecipeName,
    Section,
    Seed,
    unique_non_empty,
)
from pipeline.models.config import ModelSize

if TYPE_CHECKING:
    from pipeline.core.contracts import RunSpec


class Schedule(Section):
    """Linear warm-up, then a decay to `final_frac` of the peak."""

    warmup_steps: NonNegInt = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    final_frac: Annotated[float, Field(ge=0, le=1)] = 0.1


class RecipeConfig(Section):
    """Step sizes of one recipe. `head_lr` is the head's step size (η for the LMO recipes).

    `tau` (recipes with a Hilbert trust region only) replaces `head_lr` by a trust region in nats per
    step: η_t = tau_t / r_t, with r_t the `radius_quantile` of ‖h‖ over the batch's final hidden states.
    `equi_alignment` and `equi_iters` are the equidistance spreading's knobs (`hilbert_equi`): the share of
    `hilbert`'s alignment every row keeps, and the spreading iterations.
    """

    head_lr: PositiveFloat | None = None
    tau: PositiveFloat | None = None
    radius_quantile: Annotated[float, Field(gt=0, le=1)] = 1.0
    equi_iters: NonNegInt = 3
    equi_alignment: Annotated[float, Field(gt=0, le=1)] = 0.5
    schedule: Schedule | None = None

    @model_validator(mode="after")
    def _one_step_size(self) -> RecipeConfig:
        if self.head_lr is not None and self.tau is not None:
            raise ValueError("give either head_lr or tau, not both")
        return self


class MatchedBudget(Section):
    """The matched-budget sweep (SPEC §3.2): every recipe trained again on `seeds` at every budget of `taus`,
    its realised head step (decay included) scaled down where needed so that diam(ΔW) ≤ tau_t / r_t,
    r_t = max ‖h‖ over the batch and tau_t = tau on the head's schedule (runs
    `<arch>-<recipe>-s<seed>-cap<tau>`), and once uncapped as the sweep's reference (`...-uncapped`).
    Every sweep run takes `steps` steps (left out: `train.steps`), so the cap's effect compares equal
    horizons even when the sweep is shorter than the study's runs."""

    taus: list[PositiveFloat]
    seeds: list[Seed]
    steps: PositiveInt | None = None

    @model_validator(mode="after")
    def _lists(self) -> MatchedBudget:
        unique_non_empty("matched_budget.taus", self.taus)
        unique_non_empty("matched_budget.seeds", self.seeds)
        return self


class TrainConfig(Section):
    """Names are checked against their registries, and `archs` against the trainable families, by
    `pipeline.params`, which sees the registries; left out, `archs` (every trainable family) and `recipes`
    (every recipe) are filled in there too."""

    archs: list[FamilyName] = []
    recipes: list[RecipeName] = []
    seeds: list[Seed] = [0]
    model: ModelSize = ModelSize()
    steps: PositiveInt = 200
    batch_size: PositiveInt = 16
    hidden_lr: PositiveFloat = 0.02  # Muon on hidden 2-D matrices
    adamw_lr: PositiveFloat = 3e-3  # AdamW on embeddings, norms, biases (and everything for `adamw`)
    weight_decay: NonNegFloat = 0.0
    grad_clip: PositiveFloat | None = 1.0
    schedule: Schedule = Schedule()
    recipe_overrides: dict[RecipeName, RecipeConfig] = {}
    matched_budget: MatchedBudget | None = None  # null: no matched-budget runs
    eval_interval: PositiveInt = 50
    eval_batches: PositiveInt = 4  # val: curves, tuning and early decisions
    test_batches: PositiveInt = 16  # test: the final comparison (SPEC §3.2), once at the end of a run
    geometry_interval: PositiveInt = 10
    probe_sequences: PositiveInt = 8
    diam_exact_max_rows: PositiveInt = 16384  # above this V, head_diam is a row-sample estimate
    equi_sample_rows: Annotated[int, Field(ge=2, le=1024)] = 1024
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = False

    @model_validator(mode="after")
    def _grid(self) -> TrainConfig:
        for name in ("archs", "recipes", "seeds"):
            if name in self.model_fields_set:  # what is left out is filled in by `pipeline.params`
                unique_non_empty(name, getattr(self, name))
        return self

    def runs(self) -> list[str]:
        """Run ids of the grid, then of the matched-budget sweep (per run: uncapped, then each budget), in a
        stable order."""
        from pipeline.core.contracts import run_id  # pyarrow: not for `lmgeo --help`

        sweep = self.matched_budget
        caps = [None, *sweep.taus] if sweep else []
        seeds = sweep.seeds if sweep else []
        return [run_id(a, r, s) for a in self.archs for r in self.recipes for s in self.seeds] + [
            run_id(a, r, s, matched=True, cap=c) for a in self.archs for r in self.recipes for s in seeds for c in caps
        ]

    def for_run(self, spec: RunSpec) -> TrainConfig:
        """The settings run `spec` reads, and nothing else: the grid narrowed to the run, its own recipe's
        overrides, and for a sweep run the sweep's steps and its own cap (the uncapped reference: no budget).
        A run's shard is keyed by these, so a change elsewhere in the section (another recipe's step size,
        another budget) redoes no other run."""
        own = {spec.recipe: self.recipe_overrides[spec.recipe]} if spec.recipe in self.recipe_overrides else {}
        sweep = self.matched_budget if spec.matched else None
        steps = sweep.steps or self.steps if sweep else self.steps
        capped = sweep is not None and spec.cap is not None
        budget = sweep.model_copy(update={"taus": [spec.cap], "seeds": [spec.seed]}) if capped else None
        return self.model_copy(update={"archs": [spec.arch], "recipes": [spec.recipe], "seeds": [spec.seed],
                                       "recipe_overrides": own, "matched_budget": budget,
                                       "steps": steps})  # fmt: skip
