"""The size of a model built from a config (used by training and by the tests' tiny models)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from lmgeo.core.config import Section


class ModelSize(Section):
    """The size of a trained model; the bounds are far above any model this study trains on one node (the
    largest a preset names is 768 wide): a mistyped exponent fails here, not while allocating the model."""

    d_model: Annotated[int, Field(ge=8, le=65536)] = 64
    n_layers: Annotated[int, Field(ge=1, le=1024)] = 2
    n_heads: Annotated[int, Field(ge=1, le=1024)] = 4  # transformers only
    d_state: Annotated[int, Field(ge=1, le=4096)] = 16  # Mamba only
    expand: Annotated[int, Field(ge=1, le=64)] = 2  # Mamba only

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSize:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self
