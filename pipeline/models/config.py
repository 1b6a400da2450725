"""The size of a model built from a config (used by training and by the tests' tiny models)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.core.config import PositiveInt, Section


class ModelSize(Section):
    d_model: Annotated[int, Field(ge=8)] = 64
    n_layers: PositiveInt = 2
    n_heads: PositiveInt = 4  # transformers only
    d_state: PositiveInt = 16  # Mamba only
    expand: PositiveInt = 2  # Mamba only

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSize:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self
