"""Sound, fine-grained code versions: a shard is keyed by exactly the code that can change its numbers (its
stage's, its own recipe's, family's or classes'), and dvc.yaml depends on the same files
(lmgeo/core/fingerprint.py, lmgeo/driver/deps.py)."""

from __future__ import annotations

import ast
import json
import re
import shutil
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from lmgeo.core import fingerprint
from lmgeo.core.contracts import parse_run_id
from lmgeo.core.fingerprint import INDEXES, INFRASTRUCTURE, NUMERIC_PACKAGES, closure, index_members
from lmgeo.driver.deps import DECIDING_FILES, STAGES, code_deps, is_code
from lmgeo.driver.layout import RECORDS, Layout
from lmgeo.driver.sharded import _version
from lmgeo.params import Params, load_params
from lmgeo.stages import aggregate, extract, fit, perturb, train

REPO = Path(__file__).resolve().parents[1]
SHARDED = ("train", "extract", "fit", "perturb")
RECIPES = ("adamw", "muon", "muon_head", "sign", "rownorm", "hilbert", "hilbert_equi")
CLASSES = ("diag_psd", "lowrank", "orthogonal", "mlp", "identity", "global_linear")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A copy of the project's code, which the tests edit; versions are computed from it first."""
    for package in ("lmgeo",):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def versions(workspace: Path) -> dict[str, str]:
    """The code version of every kind of shard, as the stages' plans compute them: a training run per
    recipe (on neox) and per family (with muon), a fit shard per class, extract, perturb, aggregate."""
    _version.cache_clear()  # the tests edit the sources between two calls
    layout = Layout(workspace)
    specs = {f"train:{r}": train.code_spec(layout, r, "neox") for r in RECIPES}
    specs |= {f"train:{a}:muon": train.code_spec(layout, "muon", a) for a in ("gpt2", "mamba")}
    specs |= {f"fit:{c}": fit.code_spec(layout, [c]) for c in CLASSES}
    specs |= {
        "extract": extract.code_spec(layout),
        "perturb": perturb.code_spec(layout),
        "aggregate": aggregate.code_spec(layout),
    }
    return {unit: _version(spec, workspace) for unit, spec in specs.items()}


def edit(workspace: Path, relative: str, old: str, new: str) -> None:
    path = workspace / relative
    source = path.read_text()
    assert old in source, f"{relative} no longer holds {old!r}: update this test"
    path.write_text(source.replace(old, new, 1))


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {unit for unit in before if before[unit] != after[unit]}


TRAIN = {f"train:{r}" for r in RECIPES} | {"train:gpt2:muon", "train:mamba:muon"}
FIT = {f"fit:{c}" for c in CLASSES}
EVERY = TRAIN | FIT | {"extract", "perturb", "aggregate"}


@pytest.mark.slow
def test_a_version_is_the_package_version_and_a_hash_of_the_sources_not_of_where_they_are(workspace: Path) -> None:
    here = versions(REPO)
    assert all(re.fullmatch(rf"{re.escape(metadata.version('lmgeo'))}\+[0-9a-f]{{16}}", v) for v in here.values())
    assert versions(workspace) == here  # another checkout of the same code: the same versions
    assert len(set(here.values())) == len(here)


def test_a_run_covers_its_stage_its_recipe_and_its_family_and_nothing_else() -> None:
    spec = train.code_spec(Layout(REPO), "hilbert", "neox")
    names = {entry.name for entry in closure([spec.module, *spec.members, *fingerprint.ALWAYS])}
    assert {
        "lmgeo.stages.train",
        "lmgeo.study_b.train",
        "lmgeo.study_b.recipes.hilbert",
        "lmgeo.study_b.recipes.base",
        "lmgeo.models.families.neox",
        "lmgeo.core.determinism",
    } <= names
    others = {f"lmgeo.study_b.recipes.{r}" for r in RECIPES if r != "hilbert"} | {
        "lmgeo.models.families.gpt2",
        "lmgeo.models.families.mamba",
    }
    assert not names & others
    assert not names & set(INFRASTRUCTURE + INDEXES)
    assert not {name for name in names if name.endswith(".config") or name == "lmgeo.params"}  # params hash
    assert not {name for name in names if name.startswith(("lmgeo.results", "lmgeo.stages.fit"))}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("relative", "old", "new", "expected"),
    [
        # science a stage runs, in the library and in the glue
        ("lmgeo/study_a/fits.py", "return np.arange(n)", "return np.arange(n).copy()", FIT),
        ("lmgeo/stages/fit.py", 'device = "cuda" if', 'device = "cuda"  if', set()),  # formatting only
        (
            "lmgeo/stages/fit.py",
            'ShardParts(metadata={"model": model})',
            "ShardParts(metadata=dict(model=model))",
            FIT,
        ),  # a stage's own module: all its shards
        ("lmgeo/study_a/patching.py", "clamp_min(0.0)", "clamp_min(0.0) * 1.0", {"perturb"}),
        # one recipe: exactly its runs (and the tables, which describe every recipe)
        ("lmgeo/study_b/recipes/hilbert.py", "return 0.5 * center_rows", "return 0.50 * center_rows", set()),
        (
            "lmgeo/study_b/recipes/hilbert.py",
            "return 0.5 * center_rows",
            "return 0.25 * center_rows",
            {"train:hilbert", "aggregate"},
        ),
        # one class: exactly the fit shards that fit it
        ("lmgeo/study_a/classes/lowrank.py", "def fit(", "def fit_(", {"fit:lowrank", "aggregate"}),
        # a family: its runs, and every analysis of a model (any model may take its overrides)
        (
            "lmgeo/models/families/mamba.py",
            "def make_config(",
            "def make_config_(",
            {"train:mamba:muon", "extract", "perturb", "aggregate"},
        ),
        # perturb verifies the model it opens, extraction's capture included (`lmgeo.study_a.verify`)
        ("lmgeo/study_a/extract.py", "def capture_states(", "def capture_states_(", {"extract", "perturb"}),
        # a dataset's declaration enters by its declared schema (see below), not as code; the contracts'
        # codecs and readers are code
        ("lmgeo/core/contracts.py", 'written_by="fit",', 'written_by="fit (tokenwise)",', set()),
        ("lmgeo/core/contracts.py", "def parse_run_id(", "def parse_run_id_(", EVERY),
        ("lmgeo/core/contracts.py", "return table.sort_by(order) if order else table", "return table", EVERY),
        # infrastructure cannot change a number: progress lines, the Ray loop, the runtime
        ("lmgeo/core/progress.py", 'unit: str = "shards"', 'unit: str = "items"', set()),
        ("lmgeo/core/execution.py", "WAIT_TIMEOUT_S = 1.0", "WAIT_TIMEOUT_S = 2.0", set()),
        ("lmgeo/driver/runtime.py", '"TRANSFORMERS_VERBOSITY": "error"', '"TRANSFORMERS_VERBOSITY": "info"', set()),
        # the pinned kernels decide every float
        ("lmgeo/core/determinism.py", '"OPENBLAS_CORETYPE": "Haswell"', '"OPENBLAS_CORETYPE": "Zen"', EVERY),
        # the report and the tools: no shard
        ("lmgeo/results/study_a/report.py", '"shuffled": "shuffled pairs"', '"shuffled": "permuted pairs"', set()),
        ("lmgeo/commands/bench/fits.py", "def knn_section(", "def knn_section_(", set()),
        # comments or docstrings anywhere: nothing
        ("lmgeo/core/store.py", "def file_sha256(", "# a comment\ndef file_sha256(", set()),
        ("lmgeo/study_a/knn.py", '"""Exact k-nearest', '"""Exact (really) k-nearest', set()),
        # configuration: values reach shards through their params hash, not through the code version
        (
            "lmgeo/study_a/config.py",
            "k: Annotated[int, Field(ge=2, le=MAX_COUNT)] = 32",
            "k: Annotated[int, Field(ge=2, le=MAX_COUNT)] = 16",
            set(),
        ),
    ],
)
def test_an_edit_changes_exactly_the_shards_that_run_it(workspace: Path, relative, old, new, expected) -> None:
    before = versions(workspace)
    edit(workspace, relative, old, new)
    assert changed(before, versions(workspace)) == expected


def test_a_contract_enters_by_the_schema_it_declares() -> None:
    import dataclasses

    import pyarrow as pa

    from lmgeo.core.contracts import FITS

    layout = Layout(REPO)
    spec = fit.code_spec(layout, ["lowrank"])
    assert spec.schemas == (FITS.declared_schema.to_string(),)
    fields = tuple(pa.field(f.name, pa.int64()) if f.name == "n_distinct" else f for f in FITS.fields)
    edited = dataclasses.replace(FITS, fields=fields).declared_schema.to_string()
    assert _version(dataclasses.replace(spec, schemas=(edited,)), REPO) != _version(spec, REPO)


@pytest.mark.slow
def test_adding_a_recipe_redoes_no_run_of_another(workspace: Path) -> None:
    before = versions(workspace)
    recipes = workspace / "lmgeo" / "study_b" / "recipes"
    source = (recipes / "sign.py").read_text().replace('name="sign"', 'name="sign2"')
    (recipes / "sign2.py").write_text(source)
    edit(workspace, "lmgeo/study_b/recipes/__init__.py", "rownorm, sign", "rownorm, sign, sign2")
    edit(workspace, "lmgeo/study_b/recipes/__init__.py", "sign.RECIPE,", "sign.RECIPE, sign2.RECIPE,")
    assert changed(before, versions(workspace)) == {"aggregate"}
    assert "lmgeo.study_b.recipes.sign2" in index_members("lmgeo.study_b.recipes", [workspace])


def run_keys(params: Params, workspace: Path) -> dict[str, tuple[str, str]]:
    """run → (params hash, code version) of the train plan."""
    tokens = workspace / "data" / "tokens"
    tokens.mkdir(parents=True, exist_ok=True)
    (tokens / "meta.json").write_text(json.dumps({"vocab_size": 64}))
    _version.cache_clear()
    return {shard.key: (key.params_hash, key.code_version) for shard, key in train.plan(params, Layout(workspace))}


@pytest.mark.slow
def test_a_run_is_keyed_by_the_params_it_reads(workspace: Path) -> None:
    from lmgeo.study_b.config import MatchedBudget

    default = load_params(REPO / "params.yaml")
    sweep = MatchedBudget(taus=[0.2, 0.8], seeds=default.train.seeds[:1])
    params = default.model_copy(update={"train": default.train.model_copy(update={"matched_budget": sweep})})
    before = run_keys(params, workspace)
    matched = {run for run in before if parse_run_id(run).matched}
    assert matched and len(matched) < len(before)

    def keys_after(train_update: dict) -> set[str]:
        after = run_keys(params.model_copy(update={"train": params.train.model_copy(update=train_update)}), workspace)
        assert after.keys() == before.keys()
        return {run for run in before if after[run] != before[run]}

    # another budget list: the runs of the budgets kept keep their keys
    fewer = run_keys(
        params.model_copy(
            update={
                "train": params.train.model_copy(
                    update={"matched_budget": sweep.model_copy(update={"taus": sweep.taus[1:]})}
                )
            }
        ),
        workspace,
    )
    assert fewer.keys() < before.keys() and all(fewer[run] == before[run] for run in fewer)
    hilbert = {"hilbert": params.train.recipe_overrides.get("hilbert") or _override(tau=0.3)}
    assert {run for run in before if "-hilbert-" in run} <= keys_after({"recipe_overrides": hilbert})
    assert keys_after({"steps": params.train.steps + 1}) >= matched  # the sweep runs at the study's horizon


def _override(**values: float):
    from lmgeo.study_b.config import RecipeConfig

    return RecipeConfig(**values)


def test_infrastructure_is_unreachable_from_the_science() -> None:
    """What a code version leaves out as infrastructure cannot change a number, because no science module
    imports it, however indirectly (lazy imports included)."""
    science = [module for package in NUMERIC_PACKAGES for module in _modules_under(package)]
    reached = _reachable(science)
    assert not reached & set(INFRASTRUCTURE), sorted(reached & set(INFRASTRUCTURE))


@pytest.mark.slow
def test_a_member_imported_by_another_member_is_part_of_its_code(workspace: Path) -> None:
    """A member reached by a real import (not through its index) is code like any other."""
    edit(
        workspace,
        "lmgeo/study_b/recipes/hilbert_equi.py",
        "from torch import Tensor\n",
        "from torch import Tensor\n\nfrom lmgeo.study_b.recipes import hilbert  # noqa: F401\n",
    )
    before = versions(workspace)
    edit(workspace, "lmgeo/study_b/recipes/hilbert.py", "return 0.5 * center_rows", "return 0.25 * center_rows")
    assert changed(before, versions(workspace)) == {"train:hilbert", "train:hilbert_equi", "aggregate"}


def test_the_control_recipes_code_covers_hilbert_and_hilbert_equi() -> None:
    """`hilbert_ctl` is `hilbert`'s step at `hilbert_equi`'s tau: a change to either retrains it."""
    spec = train.code_spec(Layout(REPO), "hilbert_ctl", "neox")
    names = {entry.name for entry in closure([spec.module, *spec.members, *fingerprint.ALWAYS])}
    recipes = {f"lmgeo.study_b.recipes.{r}" for r in ("hilbert_ctl", "hilbert", "hilbert_equi")}
    assert recipes <= names and "lmgeo.study_b.recipes.muon" not in names


@pytest.mark.parametrize("index", INDEXES)
def test_a_registry_index_holds_nothing_but_its_list(index: str) -> None:
    path = fingerprint.resolve(index, [REPO])
    body = [node for node in ast.parse(path.read_text()).body if not isinstance(node, ast.Expr)]
    assert all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in body[:-1])
    assert isinstance(body[-1], (ast.Assign, ast.AnnAssign)) and isinstance(body[-1].value, ast.Call)
    assert body[-1].value.func.id == "Registry"
    members = index_members(index, [REPO])
    assert members and all(fingerprint.resolve(m, [REPO]) for m in members)


def test_dvc_yaml_depends_on_exactly_the_code_of_each_stage() -> None:
    """Regenerate with `python -m scripts.dvc_deps --write` when this fails."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for stage in STAGES:
        listed = sorted(dep for dep in stages[stage]["deps"] if is_code(dep))
        assert listed == code_deps(stage, REPO), f"dvc.yaml deps of {stage}: run `python -m scripts.dvc_deps --write`"
        assert all((REPO / dep).is_file() for dep in stages[stage]["deps"] if is_code(dep))
        assert not {dep for dep in listed if dep.removesuffix(".py").replace("/", ".") in INFRASTRUCTURE}
    for stage in SHARDED:
        config = {dep for dep in stages[stage]["deps"] if dep.endswith("config.py")}
        assert config, f"{stage}: a config module changes defaults, so DVC must rerun the stage (shards decide)"


def test_the_report_stage_depends_on_every_record_the_report_states() -> None:
    """A record the report reads but DVC does not track would leave the report stale when the record changes;
    the same records are deciding files, so committed results are checked against them."""
    deps = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["report"]["deps"]
    for record in RECORDS:
        assert any(record == dep or record.startswith(f"{dep}/") for dep in deps), f"dvc.yaml report deps: {record}"
        assert record in DECIDING_FILES


def _modules_under(package: str) -> list[str]:
    root = REPO.joinpath(*package.split("."))
    return [
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for path in sorted(root.rglob("*.py"))
    ]


def _reachable(modules: list[str]) -> set[str]:
    seen: set[str] = set()
    pending = list(modules)
    while pending:
        name = pending.pop()
        path = fingerprint.resolve(name, [REPO])
        if name in seen or path is None:
            continue
        seen.add(name)
        pending.extend(fingerprint._imported(name, path))
    return seen
