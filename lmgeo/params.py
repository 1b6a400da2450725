"""`params.yaml` as one validated object: every section of SPEC §5, and the checks that span sections.

It is also where registered names are checked: the sections type them with a `RegisteredName` marker only,
since their registries (model families, recipes, fit classes) live in later layers that import the sections;
this module sees both. The registries load torch, so they are imported only when params are validated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError, model_validator

from lmgeo.core.config import (
    ParamsError,
    RayConfig,
    RegisteredName,
    Section,
    SecurityConfig,
    digest,
    load_yaml,
    parse_override_value,
)
from lmgeo.core.registry import UnknownName
from lmgeo.results.config import ReportConfig
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_b.config import TrainConfig
from lmgeo.text.config import PrepareConfig

if TYPE_CHECKING:
    from lmgeo.core.contracts import RunSpec
    from lmgeo.core.registry import Registry

KeyPath = tuple[str | int, ...]


# The params sections that decide the results: the report's provenance records their hash (`Params.section_hash`).
RESULT_SECTIONS = ("prepare", "train", "analysis", "report")


class Params(Section):
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @model_validator(mode="before")
    @classmethod
    def _fill_in_registered(cls, data: Any) -> Any:
        """The lists of names a section leaves out: every registered one (every trainable family)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for (section, key), every in REGISTERED_DEFAULTS.items():
            given = data.get(section, {})
            if isinstance(given, dict) and key not in given:
                data[section] = {**given, key: every()}
            elif isinstance(given, Section) and key not in given.model_fields_set:
                data[section] = given.model_copy(update={key: every()})
        return data

    @model_validator(mode="after")
    def _registered(self) -> Params:
        """Every registered name, wherever a section holds one; then what the registries say of them."""
        registries = _registries()
        unknown = [
            f"{_dotted(path)}: {problem} (got {name!r})"
            for path, kind, name in registered_names(self)
            if (problem := _unknown(registries[kind], name))
        ]
        if unknown:
            raise ValueError("\n".join(unknown))
        problems = [*_untrainable(self), *_misplaced_tau(self), *_class_constraints(self)]
        if problems:
            raise ValueError("\n".join(problems))
        return self

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

    def analysed_runs(self) -> list[RunSpec]:
        """The runs Study A analyses: the grid `analysis.runs` names (train's values where it names none; none
        when `analysis.runs` is null)."""
        from lmgeo.core.contracts import RunSpec  # pyarrow: not for `lmgeo --help`

        chosen, grid = self.analysis.runs, self.train
        if chosen is None:
            return []
        return [
            RunSpec(arch, recipe, seed)
            for arch in chosen.archs or grid.archs
            for recipe in chosen.recipes or grid.recipes
            for seed in chosen.seeds or grid.seeds
        ]

    def trained_runs(self) -> list[RunSpec]:
        """The runs only Study A analyses (trained with the same settings, so that Study A can cover
        architectures the optimizer comparison leaves out), then Study B's grid. Study A's runs go first
        because they include the slowest (Mamba's scan): started last, one of them would run alone at the
        end while the other workers idle."""
        grid = self.train.runs()
        return [run for run in self.analysed_runs() if run not in grid] + grid

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections, for shard manifests."""
        return digest({name: getattr(self, name) for name in sections})


def _registries() -> dict[str, Registry[Any]]:
    """The registry of each kind `RegisteredName` names."""
    from lmgeo.models.registry import FAMILIES
    from lmgeo.study_a.classes import FIT_CLASSES
    from lmgeo.study_b.recipes import RECIPES

    return {"family": FAMILIES, "recipe": RECIPES, "fit class": FIT_CLASSES}


def _unknown(registry: Registry[Any], name: str) -> str | None:
    """The registry's own message for a name it lacks."""
    try:
        registry[name]
    except UnknownName as err:
        return str(err)
    return None


def _trainable_families() -> list[str]:
    return [family.name for family in _registries()["family"] if family.trainable]


def _every(kind: str) -> Callable[[], list[str]]:
    return lambda: list(_registries()[kind].names())


# What a params file that leaves these out gets (`Params._fill_in_registered`).
REGISTERED_DEFAULTS: dict[tuple[str, str], Callable[[], list[str]]] = {
    ("train", "archs"): _trainable_families,
    ("train", "recipes"): _every("recipe"),
    ("analysis", "classes"): _every("fit class"),
}


def registered_names(value: Any, annotation: Any = None, path: KeyPath = ()) -> Iterator[tuple[KeyPath, str, str]]:
    """(key path, kind, name) of every `RegisteredName` in `value`, found from the types its models declare:
    in a field, a list's items, a mapping's keys (path ending in `[key]`, as pydantic writes it) or values,
    an optional value, a nested section."""
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            declared = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            yield from registered_names(getattr(value, name), declared, (*path, name))
    elif origin is Annotated:
        marker = next((m for m in args[1:] if isinstance(m, RegisteredName)), None)
        if marker is None:
            yield from registered_names(value, args[0], path)
        elif isinstance(value, str):
            yield path, marker.kind, value
    elif origin in (Union, UnionType):
        for member in args:
            yield from registered_names(value, member, path)
    elif origin is list and isinstance(value, list):
        for index, item in enumerate(value):
            yield from registered_names(item, args[0], (*path, index))
    elif origin is dict and isinstance(value, dict):
        for key, item in value.items():
            yield from registered_names(key, args[0], (*path, key, "[key]"))
            yield from registered_names(item, args[1], (*path, key))


def _untrainable(params: Params) -> Iterator[str]:
    families = _registries()["family"]
    trainable = ", ".join(_trainable_families())
    analysed = params.analysis.runs.archs if params.analysis.runs is not None else None
    for section, archs in (("train", params.train.archs), ("analysis.runs", analysed or [])):
        for index, arch in enumerate(archs):
            if not families[arch].trainable:
                yield f"{section}.archs.{index}: {arch!r} is analysed only, not trained; trainable: {trainable}"


def _misplaced_tau(params: Params) -> Iterator[str]:
    recipes = _registries()["recipe"]
    allowed = ", ".join(recipe.name for recipe in recipes if recipe.trust_region)
    for recipe, override in params.train.recipe_overrides.items():
        if override.tau is not None and not recipes[recipe].trust_region:
            yield f"train.recipe_overrides.{recipe}.tau: tau applies to {allowed} only"


def _class_constraints(params: Params) -> Iterator[str]:
    classes = _registries()["fit class"]
    for index, name in enumerate(params.analysis.classes):
        problem = classes[name].check_config(params.analysis)
        if problem:
            yield f"analysis.classes.{index}: {name}: {problem}"


def _dotted(path: KeyPath) -> str:
    return ".".join(str(part) for part in path)


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
    raw = load_yaml(path)
    if raw is None:  # an empty file (or comments only) would silently be every default
        raise ParamsError(
            f"{path}: empty: it names no params section; write the study's params (the repository's params.yaml is "
            "the default study), or `{}` for every default"
        )
    return parse_params(raw, str(path))


# The default study, shipped with the package: what `lmgeo analyse` runs with wherever it is started (not the
# `params.yaml` of the folder it is started in, which an applied experiment changes), and the only params whose
# report `lmgeo findings --write` puts into README. The repository's params.yaml is the same study.
DEFAULT_STUDY = Path(__file__).with_name("default_study.yaml")


def default_study() -> Params:
    return load_params(DEFAULT_STUDY)


def apply_overrides(params: Params, overrides: dict[str, str]) -> Params:
    """`params` with dotted overrides applied (values parsed as `dvc exp run -S` parses them), validated."""
    raw = params.model_dump(mode="json")
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = raw
        for depth, part in enumerate(parents, 1):
            node = _section(node, part, dotted, ".".join(parents[:depth]))
        node[leaf] = parse_override_value(dotted, value)
    return parse_params(raw, "overrides")


def _section(node: dict[str, Any], part: str, dotted: str, within: str) -> dict[str, Any]:
    """The mapping under `part` that the override `dotted` goes into; a null one (a section that is off) gets
    its first key. A list or a value there is an error: an override replaces a whole list or value."""
    if node.get(part) is None:
        node[part] = {}
    child = node[part]
    if isinstance(child, list):
        raise ParamsError(f"overrides: {dotted}: {within} is a list: give the whole list, not one item by index")
    if not isinstance(child, dict):
        raise ParamsError(f"overrides: {dotted}: {within} is a value ({_shown(child)}), not a section with keys")
    return child


def security_changes(before: Params, after: Params) -> list[str]:
    """`security.KEY: OLD -> NEW` for each security setting that `after` changes."""
    old, new = before.security.model_dump(), after.security.model_dump()
    return [f"security.{key}: {old[key]!r} -> {new[key]!r}" for key in old if old[key] != new[key]]


def _shown(value: Any, limit: int = 80) -> str:
    """A value as an error names it: its repr, cut short (a long list must not flood the message)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _describe(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {_shown(got)})"
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key {loc!r}")
        elif not loc:  # a cross-field check, whose message names its keys: one line per problem
            lines.extend(f"{source}: {line}" for line in message.splitlines())
        else:
            lines.append(f"{source}: {loc}: {message}{shown}")
    return "\n".join(lines)
