"""Sound code versions: a stage's shards are keyed by exactly the code that can change them, and dvc.yaml
depends on the same files (pipeline/core/fingerprint.py, stages/deps.py)."""

from __future__ import annotations

import re
import shutil
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from pipeline.core.fingerprint import closure, code_version
from stages.deps import STAGES, code_deps, is_code

REPO = Path(__file__).resolve().parents[1]
SHARDED = ("train", "extract", "fit", "perturb")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A copy of the project's code, which the tests edit; versions are computed from it first."""
    for package in ("pipeline", "stages", "tools"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def versions(workspace: Path) -> dict[str, str]:
    return {stage: code_version(f"stages.{stage}", roots=[workspace]) for stage in STAGES}


def edit(workspace: Path, relative: str, old: str, new: str) -> None:
    path = workspace / relative
    source = path.read_text()
    assert old in source, f"{relative} no longer holds {old!r}: update this test"
    path.write_text(source.replace(old, new, 1))


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {stage for stage in before if before[stage] != after[stage]}


def test_a_version_is_the_package_version_and_a_hash_of_the_sources_not_of_where_they_are(workspace: Path) -> None:
    here = versions(REPO)
    assert all(re.fullmatch(rf"{re.escape(metadata.version('lmgeo'))}\+[0-9a-f]{{16}}", v) for v in here.values())
    assert versions(workspace) == here  # another checkout of the same code: the same versions
    assert len(set(here.values())) == len(STAGES)


def test_a_stage_covers_its_own_module_and_every_module_it_imports_and_nothing_else() -> None:
    fit = {entry.name for entry in closure("stages.fit")}
    assert {"stages.fit", "pipeline.study_a.fits", "pipeline.study_a.knn", "pipeline.study_a.classes.mlp"} <= fit
    assert "pipeline.core.store" in fit  # imported at any depth
    assert not {name for name in fit if name.startswith(("tools", "pipeline.results"))}  # bench, report
    assert not {name for name in fit if name.endswith(".config") or name == "pipeline.params"}  # values: params hash
    assert "pipeline.study_b.train" not in fit and "stages.train" not in fit


@pytest.mark.parametrize(
    ("relative", "old", "new", "expected"),
    [
        # science a stage runs, in the library and in the glue
        ("pipeline/study_a/fits.py", "return np.arange(n)", "return np.arange(n).copy()", {"fit"}),
        ("stages/fit.py", 'device = "cuda" if', 'device = "cuda"  if', set()),  # formatting only
        ("stages/fit.py", "return sum(table.num_rows for table in tables.values())",
         "return int(sum(table.num_rows for table in tables.values()))", {"fit"}),
        ("pipeline/study_a/patching.py", "clamp_min(0.0)", "clamp_min(0.0) * 1.0", {"perturb"}),
        ("pipeline/study_b/recipes/hilbert.py", "return 0.5 * center_rows", "return 0.50 * center_rows", set()),
        ("pipeline/study_b/recipes/hilbert.py", "return 0.5 * center_rows", "return 0.25 * center_rows",
         {"train", "aggregate", "report"}),
        # perturb verifies the model it opens, extraction's capture included (`pipeline.study_a.verify`)
        ("pipeline/study_a/extract.py", "def capture_states(", "def capture_states_(", {"extract", "perturb"}),
        # the report, the bench and comments or docstrings anywhere: no sharded stage
        ("pipeline/results/study_a/report.py", '"shuffled": "shuffled pairs"', '"shuffled": "permuted pairs"', {"report"}),
        ("tools/bench/fits.py", "def knn_section(", "def knn_section_(", set()),
        ("pipeline/core/store.py", "def file_sha256(", "# a comment\ndef file_sha256(", set()),
        ("pipeline/study_a/knn.py", '"""Exact k-nearest', '"""Exact (really) k-nearest', set()),
        # configuration: values reach shards through their params hash, not through the code version
        ("pipeline/study_a/config.py", "k: Annotated[int, Field(ge=2)] = 32", "k: Annotated[int, Field(ge=2)] = 16", set()),
    ],
)
def test_an_edit_changes_exactly_the_stages_that_run_it(workspace: Path, relative, old, new, expected) -> None:
    before = versions(workspace)
    edit(workspace, relative, old, new)
    assert changed(before, versions(workspace)) == expected


def test_dvc_yaml_depends_on_exactly_the_code_of_each_stage() -> None:
    """Regenerate with `python -m stages.deps --write` when this fails."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for stage in STAGES:
        listed = sorted(dep for dep in stages[stage]["deps"] if is_code(dep))
        assert listed == code_deps(stage, REPO), f"dvc.yaml deps of {stage}: run `python -m stages.deps --write`"
        assert all((REPO / dep).is_file() for dep in stages[stage]["deps"] if is_code(dep))
    for stage in SHARDED:
        config = {dep for dep in stages[stage]["deps"] if dep.endswith("config.py")}
        assert config, f"{stage}: a config module changes defaults, so DVC must rerun the stage (shards decide)"
