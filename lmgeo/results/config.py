"""The `report` section of params: bootstrap size, confidence level and seed of every interval."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from lmgeo.core.config import Fraction, Section, Seed


class ReportConfig(Section):
    bootstrap: Annotated[int, Field(ge=10, le=10**7)] = 1000
    ci: Fraction = 0.95
    seed: Seed = 0
