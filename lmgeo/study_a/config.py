"""The `analysis` section of params: which models Study A analyses, on which tokens, with which fits."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from lmgeo.core.config import (
    MAX_COUNT,
    FamilyName,
    FitClassName,
    NonNegFloat,
    PositiveInt,
    RecipeName,
    Section,
    Seed,
    unique_non_empty,
)


class ExternalModel(Section):
    id: str  # hub id or local path
    revision: str | None = None
    # How the tables and the report name it (default: its id), e.g. a folder's name rather than `../models/x`:
    # its table id is `external_table_id(name or id)`.
    name: str | None = None

    @model_validator(mode="after")
    def _usable_id(self) -> ExternalModel:
        from lmgeo.core.contracts import check_external_id  # pyarrow: not for `lmgeo --help`

        check_external_id(self.id)
        if self.name is not None:
            check_external_id(self.name)
        return self


class RunSelection(Section):
    """Which runs Study A analyses: the grid of these archs, recipes and seeds (null: `train`'s values).
    Runs outside `train`'s grid are trained too, with `train`'s settings (`Params.trained_runs`)."""

    archs: list[FamilyName] | None = None
    recipes: list[RecipeName] | None = None
    seeds: list[Seed] | None = None

    @model_validator(mode="after")
    def _non_empty(self) -> RunSelection:
        for name in ("archs", "recipes", "seeds"):
            if getattr(self, name) is not None:
                unique_non_empty(f"runs.{name}", getattr(self, name))
        return self


class AnalysisConfig(Section):
    # null: no trained run, only `external_models` (`lmgeo analyse`, Study A on one model without training)
    runs: RunSelection | None = RunSelection()
    checkpoints: list[Literal["init", "final"]] = ["init", "final"]
    external_models: list[ExternalModel] = []
    eval_sequences: PositiveInt = 32  # sequences of prepare.seq_len tokens from the val split
    sequences_per_shard: PositiveInt = 16
    batch_size: PositiveInt = 8
    vector_dtype: Literal["float32", "float16"] = "float32"
    anchors: PositiveInt = 256
    # The transitions l -> l+1 fitted and patched (null: every one of each model), e.g. a few layers of a big model.
    layers: list[Annotated[int, Field(ge=0)]] | None = None
    pool_size: PositiveInt | None = None  # null = every stored token
    k: Annotated[int, Field(ge=2, le=MAX_COUNT)] = 32
    distance: Literal["euclidean", "cosine"] = "euclidean"
    exclude_same_sequence: bool = False
    # Checked against the registry (and each class's constraints on this section) by `lmgeo.params`, which
    # also fills in every registered class when left out: the classes import this module.
    classes: list[FitClassName] = []
    rank: PositiveInt = 4  # lowrank
    ridge: NonNegFloat = 1e-6
    mlp_hidden: PositiveInt = 8
    mlp_steps: PositiveInt = 300  # at most; training stops earlier once every anchor meets mlp_tol
    mlp_tol: Annotated[float, Field(gt=0, lt=1)] = 1e-3  # relative decrease of the objective over 20 steps
    # Null samples fitted beside the real pairs (SPEC §4.5); the claims are tested against them.
    nulls: list[Literal["shuffled", "gaussian"]] = ["shuffled", "gaussian"]
    # Random directions per anchor whose mean KL is the functional claim's random null (`kl_random`): one
    # direction is a noisy, skewed null, so at least 8.
    null_directions: Annotated[int, Field(ge=8, le=MAX_COUNT)] = 8
    p: PositiveInt = 4  # dominant tokenwise subspace dimension
    knn_chunk: PositiveInt = 4096
    seed: Seed = 0

    @model_validator(mode="after")
    def _classes(self) -> AnalysisConfig:
        if "classes" in self.model_fields_set:  # left out, it is filled in by `lmgeo.params`
            unique_non_empty("classes", self.classes)
        unique_non_empty("checkpoints", self.checkpoints)
        if self.layers is not None:
            unique_non_empty("layers", self.layers)
        if len(set(self.nulls)) != len(self.nulls):
            raise ValueError("nulls: each null sample at most once")
        return self
