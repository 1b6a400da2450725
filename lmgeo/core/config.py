"""The shared pieces of typed, validated configuration (SPEC §5): the section base, value types, the YAML
loader, hashing, and the sections that belong to no study (`ray`, `security`).

Each study's section lives with the study (`lmgeo/text/config.py`, `lmgeo/study_b/config.py`, ...);
`lmgeo/params.py` assembles them. Every section forbids unknown keys and checks types and ranges, so a
bad ``params.yaml`` fails before any work starts. This module imports neither torch nor ray.

Names of registered things (model families, recipes, fit classes) are typed here with a `RegisteredName`
marker only: their registries live in later layers, so `lmgeo/params.py`, which sees both, checks them
(and imports the registries only then, so that `lmgeo --help` never loads torch).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from lmgeo.core.errors import InputError

# Every count and size has an upper bound: a mistyped exponent must fail validation, not allocate. Counts are
# stored as int32 (ids, ranks, sizes in the datasets), so that is the widest any can be.
MAX_COUNT = 2**31 - 1
PositiveInt = Annotated[int, Field(ge=1, le=MAX_COUNT)]
NonNegInt = Annotated[int, Field(ge=0, le=MAX_COUNT)]
# Seeds feed numpy and torch generators, which take at most 64 bits (numpy's SeedSequence takes more, torch
# does not): a larger value must fail validation, not the task that uses it.
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
# Step sizes (and grad_clip) scale float32 weights: torch refuses a step size beyond float32's range with
# an overflow error, which would fail the whole stage instead of marking one run diverged.
FLOAT32_MAX = 3.4028234663852886e38
PositiveFloat = Annotated[float, Field(gt=0, le=FLOAT32_MAX)]
NonNegFloat = Annotated[float, Field(ge=0, le=FLOAT32_MAX)]
Fraction = Annotated[float, Field(gt=0, lt=1)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # a hex digest, as `sha256sum` prints it
# CPUs, GPUs or a custom resource of one Ray task: no node has more.
TaskAmount = Annotated[float, Field(ge=0, le=4096)]


class Section(BaseModel):
    """Base of every params section: unknown keys, type coercion and non-finite numbers are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class RegisteredName:
    """Marks a `str` as the name of a registered `kind` of thing; `lmgeo.params` checks it against the
    registry of that kind wherever it occurs in params (a field, a list item, a mapping's key)."""

    kind: Literal["family", "recipe", "fit class"]


FamilyName = Annotated[str, RegisteredName("family")]
RecipeName = Annotated[str, RegisteredName("recipe")]
FitClassName = Annotated[str, RegisteredName("fit class")]


def unique_non_empty(name: str, values: list[Any]) -> None:
    if not values:
        raise ValueError(f"{name} must not be empty")
    if len(set(values)) != len(values):
        twice = sorted({value for value in values if values.count(value) > 1}, key=str)
        raise ValueError(f"{name} has duplicates: {twice}")


# ------------------------------------------------------------------------------------------- ray
StageName = Literal["train", "extract", "fit", "perturb"]


class TaskResources(Section):
    num_cpus: TaskAmount = 1.0
    num_gpus: TaskAmount = 0.0
    resources: dict[str, TaskAmount] = {}

    @property
    def threads(self) -> int:
        """Threads a task uses (torch, BLAS): its CPUs, at least one; parallelism comes from Ray."""
        return max(1, int(self.num_cpus))


class RayConfig(Section):
    address: str | None = None  # null = embedded local Ray (RAY_ADDRESS or --ray-address override)
    num_cpus: PositiveInt | None = None  # embedded Ray only; null = all cores
    num_gpus: NonNegInt | None = None  # embedded Ray only; null = autodetect
    max_in_flight: PositiveInt = 8
    max_retries: NonNegInt = 2
    # Consecutive shards run one after another in one task (CPU tasks only), so small shards share a
    # task's fixed cost: scheduling, reading inputs, loading a model.
    shards_per_task: PositiveInt = 8
    connect_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0  # joining a cluster gives up after this
    tasks: dict[StageName, TaskResources] = {}

    def resources_for(self, stage: str) -> TaskResources:
        return self.tasks.get(stage, TaskResources())  # type: ignore[call-overload]


class SecurityConfig(Section):
    trust_remote_code: bool = False
    allow_outside_paths: bool = False  # paths in params must stay inside the workspace unless true
    # A model whose config describes more parameters is refused before anything is allocated.
    max_model_parameters: Annotated[int, Field(ge=1, le=10**14)] = 10_000_000_000


# --------------------------------------------------------------------------------------- hashing
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


# ------------------------------------------------------------------------------------------ YAML
class ParamsError(InputError):
    """A params file that cannot be used; the message names the key and what was expected."""


# PyYAML follows YAML 1.1, where `1e-3` is a string; researchers write learning rates that way.
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")
# DVC reads params and presets as YAML 1.2 (ruamel), PyYAML as YAML 1.1. Where the two read a plain scalar
# differently (`0100`: 64 or 100; `yes`, `on`: true or text; `1:30`: 90 or text; `0o17`: text or 15), lmgeo
# refuses it rather than pick a reading: the value it validates must be the one `dvc.lock` records.
_READ_TWO_WAYS = re.compile(
    r"[-+]?0[0-9_]+|[-+]?0o[0-7_]+|[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?"
    r"|yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF"
)
# Params nest a few levels; far deeper YAML would exhaust Python's recursion while it is composed.
MAX_YAML_DEPTH = 32


class _Loader(yaml.SafeLoader):
    """YAML as params are written: no anchors or aliases (`&a`, `*a`, `<<: *a`: a few lines of them expand to
    billions of values, and a value named twice is easy to miss), and no key twice in one mapping (YAML keeps
    the last silently), no scalar that YAML 1.1 and 1.2 read differently, no nesting deeper than
    `MAX_YAML_DEPTH`."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None, None, "anchors and aliases (&name, *name) are not allowed: write each value out", event.start_mark
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", event.start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_scalar(self, node: Any) -> Any:
        if node.style is None and _READ_TWO_WAYS.fullmatch(node.value):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{node.value!r} reads differently in YAML 1.1 and YAML 1.2 (as DVC reads it): quote it for text, "
                "or write the number (in decimal) or true/false it means",
                node.start_mark,
            )
        return super().construct_scalar(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_yaml(path: str | Path) -> Any:
    path = Path(path)
    try:
        return parse_yaml(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ParamsError(f"{path}: unreadable ({err})") from None
    except yaml.MarkedYAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {_one_line(err)}") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None


def _one_line(err: yaml.MarkedYAMLError) -> str:
    """The error where it is found, on one line (PyYAML's own message quotes the line under it)."""
    mark = err.problem_mark or err.context_mark
    text = ", ".join(part for part in (err.context, err.problem) if part)
    return f"line {mark.line + 1}, column {mark.column + 1}: {text}" if mark else text


# A preset's key as DVC's `-S key=value` takes it: a name (never an index, a number or a dotted key).
_PRESET_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def preset_overrides(raw: Any) -> dict[str, str]:
    """A preset as DVC `-S` pairs, after refusing what DVC would apply otherwise than lmgeo validates it."""
    if not isinstance(raw, dict):
        raise ParamsError("a preset must be a mapping of params sections")
    _refuse_unapplicable(raw, "")
    return flatten_overrides(raw)


def _refuse_unapplicable(raw: Any, where: str) -> None:
    """An interpolation (`${...}`) anywhere, key or value: DVC resolves it when it applies the preset (an
    environment variable's value would land in params.yaml), lmgeo would validate it as text. A key that is
    not a name: `-S` cannot address it."""
    if isinstance(raw, str) and "${" in raw:
        raise ParamsError(f"{where}: {raw!r} is an interpolation, which DVC would resolve: write the value itself")
    if isinstance(raw, list):
        for index, item in enumerate(raw):
            _refuse_unapplicable(item, f"{where}[{index}]")
    if isinstance(raw, dict):
        for key, value in raw.items():
            inner = f"{where}.{key}" if where else str(key)
            _refuse_unapplicable(key, inner)
            if not isinstance(key, str) or not _PRESET_KEY.fullmatch(key):
                raise ParamsError(f"{inner}: the key {key!r} is not a name (letters, digits, _ and -)")
            _refuse_unapplicable(value, inner)


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
            flat[dotted] = override_value(value)
    return flat


def override_value(value: Any) -> str:
    """`value` as DVC's `-S` reads it (Hydra's override grammar), without spaces, since the shell splits
    `$(lmgeo preset ...)` on them: JSON, except that a mapping's keys are bare (Hydra takes no quoted key),
    e.g. a list of external models `[{id:"EleutherAI/pythia-70m",revision:"step143000"}]`."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{override_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(override_value(item) for item in value) + "]"
    return json.dumps(value)


def parse_override_value(dotted: str, value: str) -> Any:
    """A `-S` value as DVC parses it (Hydra's override grammar, which DVC uses: what `lmgeo preset` prints
    must mean the same here and there). A value that grammar rejects, such as JSON with quoted keys, which
    Python callers pass, is read as YAML."""
    try:  # Hydra comes with DVC; where DVC is absent (the GPU check's machine), YAML reads what Python passes
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException
    except ImportError:
        return parse_yaml(value)
    try:
        return OverridesParser.create().parse_override(f"{dotted}={value}").value()
    except HydraException:
        return parse_yaml(value)
