"""`params.yaml` as one validated object: every section of SPEC §5, and the checks that span sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from pipeline.core.config import (
    ParamsError,
    RayConfig,
    Section,
    SecurityConfig,
    digest,
    load_yaml,
    parse_override_value,
)
from pipeline.results.config import ReportConfig
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_b.config import TrainConfig
from pipeline.text.config import PrepareConfig


class Params(Section):
    # Factories, not instances: a default section is built (and its registered names checked) only when
    # params are validated, so importing this module loads no registry (and no torch).
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @model_validator(mode="after")
    def _fits_the_pool(self) -> Params:
        pool = self.analysis.eval_sequences * self.prepare.seq_len
        if self.analysis.pool_size is not None:
            pool = min(pool, self.analysis.pool_size)
        if self.analysis.k >= pool:
            raise ValueError(f"analysis.k ({self.analysis.k}) must be smaller than the pool ({pool} tokens)")
        if self.analysis.anchors > pool:
            raise ValueError(f"analysis.anchors ({self.analysis.anchors}) exceeds the pool ({pool} tokens)")
        # Excluding the anchor's own sequence can remove up to one whole sequence from its candidates.
        if self.analysis.exclude_same_sequence and self.analysis.k > pool - self.prepare.seq_len:
            raise ValueError(
                f"analysis.k ({self.analysis.k}) leaves too few neighbours once an anchor's own sequence "
                f"({self.prepare.seq_len} tokens) is excluded from a pool of {pool} tokens"
            )
        return self

    @model_validator(mode="after")
    def _analysed_runs_are_trainable(self) -> Params:
        from pipeline.models.registry import FAMILIES  # loaded only once params are validated

        untrainable = [arch for arch in self.analysis.runs.archs or [] if not FAMILIES[arch].trainable]
        if untrainable:
            raise ValueError(f"analysis.runs.archs: {untrainable} are analysed only, not trained")
        return self

    def analysed_runs(self) -> list[str]:
        """The runs Study A analyses: the grid `analysis.runs` names (train's values where it names none)."""
        from pipeline.core.contracts import run_id  # pyarrow: not for `lmgeo --help`

        chosen, grid = self.analysis.runs, self.train
        return [
            run_id(arch, recipe, seed)
            for arch in chosen.archs or grid.archs
            for recipe in chosen.recipes or grid.recipes
            for seed in chosen.seeds or grid.seeds
        ]

    def trained_runs(self) -> list[str]:
        """The runs only Study A analyses (trained with the same settings, so that Study A can cover
        architectures the optimizer comparison leaves out), then Study B's grid. Study A's runs go first
        because they include the slowest (Mamba's scan): started last, one of them would run alone at the
        end while the other workers idle."""
        grid = self.train.runs()
        return [run for run in self.analysed_runs() if run not in grid] + grid

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections, for shard manifests."""
        return digest({name: getattr(self, name) for name in sections})


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: expected a mapping of sections at the top level")
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(_describe(err, source)) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    return parse_params(load_yaml(path), str(path))


def apply_overrides(params: Params, overrides: dict[str, str]) -> Params:
    """`params` with dotted overrides applied (values parsed as `dvc exp run -S` parses them), validated."""
    raw = params.model_dump(mode="json")
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = raw
        for part in parents:
            if node.get(part) is None:  # a section that is null (off) gets its first key
                node[part] = {}
            node = node[part]
        node[leaf] = parse_override_value(dotted, value)
    return parse_params(raw, "overrides")


def _describe(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key {loc!r}")
        elif not loc:  # a cross-field check, whose message names its keys
            lines.append(f"{source}: {message}")
        else:
            lines.append(f"{source}: {loc}: {message}{shown}")
    return "\n".join(lines)
