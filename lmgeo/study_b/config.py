"""The `train` section of params: the run grid (families × recipes × seeds), model size, step sizes,
schedules and what training records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, model_validator

from lmgeo.core.config import (
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
from lmgeo.models.config import ModelSize

if TYPE_CHECKING:
    from lmgeo.core.contracts import RunSpec


class Schedule(Section):
    """Linear warm-up, then a decay to `final_frac` of the peak."""

    warmup_steps: NonNegInt = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    final_frac: Annotated[float, Field(ge=0, le=1)] = 0.1


class RecipeConfig(Section):
    """Step sizes of one recipe (left out: the recipe's tuned default). `head_lr` is the head's step size
    (η for the LMO recipes).

    `tau` (recipes with a Hilbert trust region only) replaces `head_lr` by a trust region in nats per
    step: η_t = tau_t / r_t, with r_t the `radius_quantile` of ‖h‖ over the batch's final hidden states.
    `hidden_lr` (`adamw` only) is the lr of its AdamW hidden matrices. `equi_alignment` and `equi_iters` are
    the equidistance step's knobs (`hilbert_equi`): the share c of `hilbert`'s descent per unit diameter it
    keeps, and its solver's warm-started iterations per step.
    """

    head_lr: PositiveFloat | None = None
    tau: PositiveFloat | None = None
    hidden_lr: PositiveFloat | None = None
    radius_quantile: Annotated[float, Field(gt=0, le=1)] = 1.0
    equi_iters: NonNegInt = 5
    equi_alignment: Annotated[float, Field(gt=0, le=1)] | None = None
    schedule: Schedule | None = None

    @model_validator(mode="after")
    def _one_step_size(self) -> RecipeConfig:
        if self.head_lr is not None and self.tau is not None:
            raise ValueError("give either head_lr or tau, not both")
        return self


class MatchedBudget(Section):
    """The matched-budget sweep (SPEC §3.2): every recipe trained again on `seeds` (a subset of the study's)
    at every budget of `taus`, at the study's horizon, its realised head step (decay included) rescaled, up or
    down, so that diam(ΔW) = tau_t / r_t, r_t = max ‖h‖ over the batch and tau_t = tau on the head's schedule
    (runs `<arch>-<recipe>-s<seed>-cap<tau>`): only the direction differs between recipes. The study's own
    run of the same seed is the sweep's unmatched reference (the same training: not trained twice), and a
    recipe whose matched training is another's (`HeadRecipe.matched_as`: `rownorm` is `hilbert`'s) is
    trained once, as that one."""

    taus: list[PositiveFloat]
    seeds: list[Seed]

    @model_validator(mode="after")
    def _lists(self) -> MatchedBudget:
        unique_non_empty("matched_budget.taus", self.taus)
        unique_non_empty("matched_budget.seeds", self.seeds)
        return self


class Protocol(Section):
    """A training length of its own: steps and batch size (everything else is the study's)."""

    steps: PositiveInt
    batch_size: PositiveInt


class TrainConfig(Section):
    """Names are checked against their registries, and `archs` against the trainable families, by
    `lmgeo.params`, which sees the registries; left out, `archs` (every trainable family) and `recipes`
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
    # Runs on a family Study B does not compare (not in `archs`: Study A's other architectures) train for
    # these steps and batch instead; null: the study's. Study B's own families keep the study's length, so no
    # family mixes two lengths.
    other_archs: Protocol | None = None
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
            if name in self.model_fields_set:  # what is left out is filled in by `lmgeo.params`
                unique_non_empty(name, getattr(self, name))
        outside = sorted(set(self.matched_budget.seeds) - set(self.seeds)) if self.matched_budget else []
        if outside:
            raise ValueError(
                f"matched_budget.seeds {outside} are not among train.seeds: the study's run of the "
                "same seed is the sweep's unmatched reference"
            )
        return self

    def runs(self) -> list[RunSpec]:
        """The runs of the grid, then of the matched-budget sweep (per recipe and seed, each budget), in a
        stable order; the sweep trains each distinct training once (`swept_recipes`)."""
        from lmgeo.core.contracts import RunSpec  # pyarrow: not for `lmgeo --help`

        sweep = self.matched_budget
        grid = [RunSpec(a, r, s) for a in self.archs for r in self.recipes for s in self.seeds]
        if sweep is None:
            return grid
        swept = self.swept_recipes()
        return grid + [
            RunSpec(a, r, s, matched=True, cap=c)
            for a in self.archs
            for r in swept
            for s in sweep.seeds
            for c in sweep.taus
        ]

    def swept_recipes(self) -> list[str]:
        """The recipes the sweep trains: each of the grid's, except one whose matched training is another's
        of the grid (`HeadRecipe.matched_as`): that training is the other's, reported once."""
        from lmgeo.study_b.recipes import RECIPES  # torch: not for `lmgeo --help`

        return [r for r in self.recipes if RECIPES[r].matched_as not in self.recipes]

    def for_run(self, spec: RunSpec) -> TrainConfig:
        """The settings run `spec` reads, and nothing else: the grid narrowed to the run, its own recipe's
        overrides, for a sweep run its own budget, and its length (`other_archs`' for a family outside the
        grid). A run's shard is keyed by these, so a change elsewhere in the section (another recipe's step
        size, another budget) redoes no other run."""
        own = {spec.recipe: self.recipe_overrides[spec.recipe]} if spec.recipe in self.recipe_overrides else {}
        sweep = self.matched_budget if spec.matched else None
        budget = sweep.model_copy(update={"taus": [spec.cap], "seeds": [spec.seed]}) if sweep else None
        length = self.other_archs if self.other_archs and spec.arch not in self.archs else self
        return self.model_copy(
            update={
                "archs": [spec.arch],
                "recipes": [spec.recipe],
                "seeds": [spec.seed],
                "recipe_overrides": own,
                "matched_budget": budget,
                "other_archs": None,
                "steps": length.steps,
                "batch_size": length.batch_size,
            }
        )
