"""Typed, validated configuration: one model per ``params.yaml`` section (SPEC §5).

Every section forbids unknown keys and checks types and ranges, so a bad ``params.yaml`` fails
before any work starts. This module imports neither torch nor ray: the CLI loads params first.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.core.errors import InputError

ARCHS = ("gpt2", "neox", "mamba")
RECIPES = ("adamw", "muon", "muon_head", "sign", "rownorm", "hilbert", "hilbert_equi")
FIT_CLASSES = ("diag_psd", "lowrank", "orthogonal", "mlp", "identity", "global_linear")

Arch = Literal["gpt2", "neox", "mamba"]
Recipe = Literal["adamw", "muon", "muon_head", "sign", "rownorm", "hilbert", "hilbert_equi"]
FitClass = Literal["diag_psd", "lowrank", "orthogonal", "mlp", "identity", "global_linear"]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
# Step sizes (and grad_clip) scale float32 weights: torch refuses a step size beyond float32's range with
# an overflow error, which would fail the whole stage instead of marking one run diverged.
FLOAT32_MAX = 3.4028234663852886e38
PositiveFloat = Annotated[float, Field(gt=0, le=FLOAT32_MAX)]
Fraction = Annotated[float, Field(gt=0, lt=1)]


class Section(BaseModel):
    """Base of every params section: unknown keys and type coercion are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --------------------------------------------------------------------------------------- prepare
class CorpusConfig(Section):
    source: Literal["shakespeare", "files", "parquet"] = "shakespeare"
    # `files`: glob patterns of text files; `parquet`: a directory of Parquet files (or a saved
    # HF-datasets directory) with a text column.
    paths: list[str] = []
    text_column: str = "text"
    # sha256 of the corpus text as read (after normalisation); null = do not check.
    sha256: str | None = None
    max_chars: PositiveInt | None = None

    @model_validator(mode="after")
    def _paths_match_source(self) -> CorpusConfig:
        if self.source in ("files", "parquet") and not self.paths:
            raise ValueError(f"corpus.paths must name at least one path when source is {self.source!r}")
        return self


class TokenizerConfig(Section):
    kind: Literal["bpe", "gpt2", "local"] = "bpe"
    vocab_size: Annotated[int, Field(ge=256, le=262144)] = 4096  # used by `bpe` only
    path: str | None = None  # used by `local` only

    @model_validator(mode="after")
    def _path_for_local(self) -> TokenizerConfig:
        if self.kind == "local" and not self.path:
            raise ValueError("tokenizer.path is required when kind is 'local'")
        return self


class PrepareConfig(Section):
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    seq_len: Annotated[int, Field(ge=8, le=65536)] = 128
    val_fraction: Fraction = 0.1
    seed: NonNegInt = 0


# ----------------------------------------------------------------------------------------- train
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


class Schedule(Section):
    """Linear warm-up, then a decay to `final_frac` of the peak."""

    warmup_steps: NonNegInt = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    final_frac: Annotated[float, Field(ge=0, le=1)] = 0.1


class RecipeConfig(Section):
    """Step sizes of one recipe. `head_lr` is the head's step size (η for the LMO recipes).

    `tau` (Hilbert recipes only) replaces `head_lr` by a trust region in nats per step:
    η_t = tau_t / r_t, with r_t the `radius_quantile` of ‖h‖ over the batch's final hidden states.
    """

    head_lr: PositiveFloat | None = None
    tau: PositiveFloat | None = None
    radius_quantile: Annotated[float, Field(gt=0, le=1)] = 1.0
    equi_iters: PositiveInt = 3
    schedule: Schedule | None = None

    @model_validator(mode="after")
    def _one_step_size(self) -> RecipeConfig:
        if self.head_lr is not None and self.tau is not None:
            raise ValueError("give either head_lr or tau, not both")
        return self


class TrainConfig(Section):
    archs: list[Arch] = list(ARCHS)
    recipes: list[Recipe] = ["adamw", "muon", "muon_head", "hilbert", "hilbert_equi"]
    seeds: list[NonNegInt] = [0]
    model: ModelSize = ModelSize()
    steps: PositiveInt = 200
    batch_size: PositiveInt = 16
    hidden_lr: PositiveFloat = 0.02  # Muon on hidden 2-D matrices
    adamw_lr: PositiveFloat = 3e-3  # AdamW on embeddings, norms, biases (and everything for `adamw`)
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    grad_clip: PositiveFloat | None = 1.0
    schedule: Schedule = Schedule()
    recipe_overrides: dict[Recipe, RecipeConfig] = {}
    eval_interval: PositiveInt = 50
    eval_batches: PositiveInt = 4
    geometry_interval: PositiveInt = 10
    probe_sequences: PositiveInt = 8
    diam_exact_max_rows: PositiveInt = 16384  # above this V, head_diam is a row-sample estimate
    equi_sample_rows: Annotated[int, Field(ge=2, le=1024)] = 1024
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = False

    @model_validator(mode="after")
    def _non_empty_unique(self) -> TrainConfig:
        for name in ("archs", "recipes", "seeds"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name} must not be empty")
            if len(set(values)) != len(values):
                raise ValueError(f"{name} has duplicates: {values}")
        for recipe, override in self.recipe_overrides.items():
            if override.tau is not None and recipe not in ("hilbert", "hilbert_equi"):
                raise ValueError(f"recipe_overrides.{recipe}.tau: tau applies to hilbert recipes only")
        return self

    def runs(self) -> list[str]:
        """Run ids `<arch>-<recipe>-s<seed>` of the grid, in a stable order."""
        return [f"{a}-{r}-s{s}" for a in self.archs for r in self.recipes for s in self.seeds]


# -------------------------------------------------------------------------------------- analysis
class ExternalModel(Section):
    id: str  # hub id or local path
    revision: str | None = None


class AnalysisConfig(Section):
    checkpoints: list[Literal["init", "final"]] = ["init", "final"]
    external_models: list[ExternalModel] = []
    eval_sequences: PositiveInt = 32  # sequences of prepare.seq_len tokens from the val split
    sequences_per_shard: PositiveInt = 16
    batch_size: PositiveInt = 8
    vector_dtype: Literal["float32", "float16"] = "float32"
    anchors: PositiveInt = 256
    pool_size: PositiveInt | None = None  # null = every stored token
    k: Annotated[int, Field(ge=2)] = 32
    distance: Literal["euclidean", "cosine"] = "euclidean"
    exclude_same_sequence: bool = False
    classes: list[FitClass] = list(FIT_CLASSES)
    rank: PositiveInt = 4  # lowrank
    ridge: Annotated[float, Field(ge=0)] = 1e-3
    mlp_hidden: PositiveInt = 16
    mlp_steps: PositiveInt = 200
    orthogonal_scale: bool = False
    p: PositiveInt = 4  # dominant tokenwise subspace dimension
    knn_chunk: PositiveInt = 4096
    seed: NonNegInt = 0

    @model_validator(mode="after")
    def _classes_non_empty(self) -> AnalysisConfig:
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"classes must be non-empty and unique: {self.classes}")
        if "orthogonal" in self.classes and self.ridge <= 0:
            raise ValueError("ridge must be > 0 for the orthogonal class (it picks the map closest to I)")
        return self


# ------------------------------------------------------------------------------------------- ray
class TaskResources(Section):
    num_cpus: Annotated[float, Field(ge=0)] = 1.0
    num_gpus: Annotated[float, Field(ge=0)] = 0.0
    resources: dict[str, Annotated[float, Field(ge=0)]] = {}


class RayConfig(Section):
    address: str | None = None  # null = embedded local Ray (RAY_ADDRESS or --ray-address override)
    num_cpus: PositiveInt | None = None  # embedded Ray only; null = all cores
    num_gpus: NonNegInt | None = None  # embedded Ray only; null = autodetect
    max_in_flight: PositiveInt = 8
    max_retries: NonNegInt = 2
    tasks: dict[Literal["train", "extract", "fit", "perturb"], TaskResources] = {}

    def resources_for(self, stage: str) -> TaskResources:
        return self.tasks.get(stage, TaskResources())  # type: ignore[call-overload]


# ---------------------------------------------------------------------------------------- report
class ReportConfig(Section):
    bootstrap: Annotated[int, Field(ge=10)] = 1000
    ci: Fraction = 0.95
    seed: NonNegInt = 0
    html: bool = False


class SecurityConfig(Section):
    trust_remote_code: bool = False
    allow_outside_paths: bool = False  # paths in params must stay inside the workspace unless true


# ---------------------------------------------------------------------------------------- params
class Params(Section):
    prepare: PrepareConfig = PrepareConfig()
    train: TrainConfig = TrainConfig()
    analysis: AnalysisConfig = AnalysisConfig()
    ray: RayConfig = RayConfig()
    report: ReportConfig = ReportConfig()
    security: SecurityConfig = SecurityConfig()

    @model_validator(mode="after")
    def _fits_the_pool(self) -> Params:
        pool = self.analysis.eval_sequences * self.prepare.seq_len
        if self.analysis.pool_size is not None:
            pool = min(pool, self.analysis.pool_size)
        if self.analysis.k >= pool:
            raise ValueError(f"analysis.k ({self.analysis.k}) must be smaller than the pool ({pool} tokens)")
        if self.analysis.anchors > pool:
            raise ValueError(f"analysis.anchors ({self.analysis.anchors}) exceeds the pool ({pool} tokens)")
        return self

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections, for shard manifests."""
        return digest({name: getattr(self, name) for name in sections})


def digest(payload: Any) -> str:
    """Stable short hash of params (models, dicts, lists, scalars), for shard manifests."""

    def plain(value: Any) -> Any:
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json")
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return hashlib.sha256(json.dumps(plain(payload), sort_keys=True).encode()).hexdigest()[:16]


class ParamsError(InputError):
    """A params file that cannot be used; the message names the key and what was expected."""


# PyYAML follows YAML 1.1, where `1e-3` is a string; researchers write learning rates that way.
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: expected a mapping of sections at the top level")
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(_describe(err, source)) from None


def load_yaml(path: str | Path) -> Any:
    path = Path(path)
    try:
        return yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None


def load_params(path: str | Path = "params.yaml") -> Params:
    return parse_params(load_yaml(path), str(path))


def flatten_overrides(raw: Any, prefix: str = "") -> dict[str, str]:
    """A nested overrides mapping as DVC `-S` pairs: dotted key → compact YAML/JSON value (no spaces)."""
    if not isinstance(raw, dict):
        raise ParamsError("a preset must be a mapping of params sections")
    flat: dict[str, str] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flatten_overrides(value, f"{dotted}.")
        else:
            flat[dotted] = json.dumps(value, separators=(",", ":"))
    return flat


def apply_overrides(params: Params, overrides: dict[str, str]) -> Params:
    """`params` with dotted overrides applied (values parsed as YAML, like `dvc exp run -S`), validated."""
    raw = params.model_dump(mode="json")
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.load(value, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    return parse_params(raw, "overrides")


def _describe(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key {loc!r}")
        elif not loc:  # a cross-field check, whose message names its keys
            lines.append(f"{source}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"{source}: {loc}: {e['msg']}{shown}")
    return "\n".join(lines)
