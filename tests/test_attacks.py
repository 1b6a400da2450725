"""Integrity and security, second round (issue #35): every case tried as an attacker and as a careless user
would, each asserting its exact outcome — refused as corrupt naming the file, recomputed, answered, or one
`lmgeo: error:` line — and, where files outside a dataset are at stake, that they are untouched.

The fast cases run on datasets written through the store and on tiny models; the slow ones (marked) on a
tiny study: `lmgeo` stages, `dvc repro` in a git + DVC repo of its own, Ray.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import inspect
import json
import logging
import os
import pickle
import pkgutil
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SEQ_LEN, VOCAB, tiny_size
from test_integrity import fails

from lmgeo.core.store import (
    MANIFEST_DIR,
    CorruptShardError,
    ManifestKey,
    ShardParts,
    ShardWriter,
    manifest_path,
    prune_shards,
    remove_shard,
    shard_complete,
    verified_files,
    write_plan,
)
from lmgeo.driver.layout import Layout
from lmgeo.results.query import QueryError
from lmgeo.results.query import query_table as query_in
from lmgeo.results.query import run_query as run_in

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SOURCES = Layout(Path.cwd()).query_sources()
KEY = ManifestKey({"activations": "a1"}, "p1", "c1")


def query_table(sql: str, workspace: Path, revs: list[str] | None = None) -> pa.Table:
    return query_in(sql, revs, workspace, SOURCES)


def run_query(sql: str, workspace: Path, fmt: str = "table") -> str:
    return run_in(sql, None, workspace, SOURCES, fmt)  # type: ignore[arg-type]


def state(path: Path) -> tuple[int, bytes]:
    """What a file outside the dataset is: its modification time and bytes (an untouched file keeps both)."""
    return path.stat().st_mtime_ns, path.read_bytes()


def write_fits(
    root: Path,
    shard: str,
    layer: int,
    rel_err: float,
    key: ManifestKey = KEY,
    classes: tuple[str, ...] = ("diag_psd", "identity"),
) -> None:
    """A fit shard of one layer: one Parquet part per class (its partitions), as the fit stage writes them."""
    with ShardWriter(root, shard, key) as writer:
        for fn in classes:
            table = pa.table(
                {
                    "sample": ["real", "real"],
                    "seq_id": pa.array([0, 1], pa.int32()),
                    "pos": pa.array([1, 2], pa.int32()),
                    "rel_err": [rel_err, rel_err],
                }
            )
            writer.write({"model": "m", "layer": layer, "fn": fn}, table)


def edit_manifest(root: Path, shard: str, edit) -> Path:  # noqa: ANN001
    path = manifest_path(root, shard)
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    return path


def entry_for(manifest: dict, victim: Path) -> dict:
    """A manifest entry with the victim's true size and sha256: only the path can give it away."""
    return {"path": None, "bytes": victim.stat().st_size, "sha256": hashlib.sha256(victim.read_bytes()).hexdigest()}


# ============================================ 1. a manifest can make lmgeo delete any file the user can write
OUTSIDE_SHAPES = ("parent", "absolute", "symlinked folder", "symlinked file")


def plant_outside_path(fits: Path, shard: str, victim: Path, shape: str) -> Path:
    """Point the shard's first manifest entry at `victim` (outside the dataset), in the given shape."""
    if shape == "parent":
        name = os.path.relpath(victim, fits)
    elif shape == "absolute":
        name = str(victim)
    elif shape == "symlinked folder":
        name = f"model=m/escape/{victim.name}"
        link(fits / "model=m" / "escape", victim.parent)
    else:
        name = "model=m/linked.parquet"
        link(fits / name, victim)

    def point(manifest: dict) -> None:
        manifest["files"][0] = {**entry_for(manifest, victim), "path": name}

    return edit_manifest(fits, shard, point)


def link(path: Path, target: Path) -> None:
    if not path.is_symlink():
        path.symlink_to(target, target_is_directory=target.is_dir())


@pytest.fixture
def victim_and_fits(tmp_path: Path) -> tuple[Path, Path]:
    """A dataset of two fit shards and, outside it, a victim Parquet file of rows of the same shape."""
    fits = tmp_path / "ws" / "data" / "fits"
    write_fits(fits, "m/layer=0", 0, 0.5)
    write_fits(fits, "m/layer=1", 1, 0.5)
    write_plan(fits, {"m/layer=0": KEY, "m/layer=1": KEY})
    victim = tmp_path / "home" / "victim.parquet"
    victim.parent.mkdir()
    pq.write_table(pa.table({"sample": ["real"] * 96, "rel_err": [974.8] * 96}), victim)
    (tmp_path / "home" / "notes.txt").write_text("the user's other file\n")
    return fits, victim


@pytest.mark.parametrize("shape", OUTSIDE_SHAPES)
def test_1_a_manifest_naming_a_path_outside_its_dataset_deletes_nothing_outside_and_is_refused_as_corrupt(
    victim_and_fits: tuple[Path, Path], shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    fits, victim = victim_and_fits
    outside = {p: state(p) for p in victim.parent.iterdir()}
    manifest = plant_outside_path(fits, "m/layer=0", victim, shape)
    # every reader refuses it, naming the manifest, before opening, hashing or serving the outside file
    with pytest.raises(CorruptShardError, match=re.escape(str(manifest))):
        verified_files(fits)
    with pytest.raises(QueryError, match=re.escape(str(manifest))):
        query_table("SELECT count(*) AS n, max(rel_err) AS worst FROM fits", fits.parents[1])
    # the stage's checks call it corrupt (it is redone), and every writer's deletion stays inside the dataset
    with caplog.at_level(logging.WARNING):
        assert not shard_complete(fits, "m/layer=0", KEY)
    assert "corrupt shard" in caplog.text and str(manifest) in caplog.text
    remove_shard(fits, "m/layer=0")
    write_fits(fits, "m/layer=0", 0, 0.5)  # the redone shard (its writer removes the old one first)
    plant_outside_path(fits, "m/layer=1", victim, shape)
    assert prune_shards(fits, {"m/layer=0", "m/layer=1"}) == 0
    assert {p: state(p) for p in victim.parent.iterdir()} == outside
    assert not manifest_path(fits, "m/layer=1").exists()  # the corrupt manifest went, without its files' namesakes


def test_1_a_manifest_naming_the_datasets_own_records_is_refused(victim_and_fits: tuple[Path, Path]) -> None:
    fits, _ = victim_and_fits
    other = manifest_path(fits, "m/layer=1").relative_to(fits).as_posix()

    def point(manifest: dict) -> None:
        manifest["files"][0]["path"] = other

    edit_manifest(fits, "m/layer=0", point)
    remove_shard(fits, "m/layer=0")
    assert manifest_path(fits, "m/layer=1").is_file()  # the other shard's manifest was not deleted as a "file"


def test_1_a_manifest_folder_that_is_a_symlink_out_is_refused_before_any_manifest_is_deleted(tmp_path: Path) -> None:
    fits = tmp_path / "fits"
    write_fits(fits, "m/layer=0", 0, 0.5)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(fits / MANIFEST_DIR, elsewhere)
    (elsewhere / "other.json").write_text('{"not": "a manifest"}')
    (fits / MANIFEST_DIR).symlink_to(elsewhere, target_is_directory=True)
    before = {p: state(p) for p in elsewhere.iterdir()}
    with pytest.raises(CorruptShardError, match="a symlink"):
        prune_shards(fits, set())
    assert {p: state(p) for p in elsewhere.iterdir()} == before


# ==================================================== 2. a model folder's weights index can point outside it
def save_sharded(path: Path) -> Path:
    """A tiny model saved as a sharded checkpoint: its weights index names each weight file."""
    from lmgeo.models.registry import build_model

    model = build_model("neox", tiny_size(), VOCAB, SEQ_LEN, seed=0)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


# With security.allow_outside_paths: false the folder's own symlinks are refused already (the folder's files
# are walked); the index's names are not among them. A symlinked folder is tried where links are allowed.
@pytest.mark.parametrize(("shape", "allowed"), [("absolute", False), ("parent", False), ("symlinked folder", True)])
def test_2_a_weights_index_naming_a_file_outside_the_model_folder_is_refused_by_every_reader(
    tmp_path: Path, shape: str, allowed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmgeo.models.loading import ModelLoadError, check_model
    from lmgeo.params import Params, apply_overrides

    workspace = tmp_path / "ws"
    folder = save_sharded(workspace / "models" / "ext")
    index = folder / "model.safetensors.index.json"
    record = json.loads(index.read_text())
    first = sorted(set(record["weight_map"].values()))[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(folder / first, outside / first)
    name = {
        "absolute": str(outside / first),
        "parent": f"../../../outside/{first}",
        "symlinked folder": f"linked/{first}",
    }[shape]
    if shape == "symlinked folder":
        (folder / "linked").symlink_to(outside, target_is_directory=True)
    record["weight_map"] = {k: (name if v == first else v) for k, v in record["weight_map"].items()}
    index.write_text(json.dumps(record))
    # `check-model` and every stage that opens the model
    with pytest.raises(ModelLoadError, match=re.escape(f"{index}: names a weight file outside the model folder")):
        check_model("./models/ext", workspace=workspace, allow_outside_paths=allowed)
    # the `external` stage's hashing: it records nothing that would leave extract's results "complete"
    monkeypatch.chdir(workspace)
    (workspace / "params.yaml").write_text("{}\n")
    from lmgeo.stages import external

    params = apply_overrides(
        Params(),
        {"analysis.external_models": '[{"id": "./models/ext"}]', "security.allow_outside_paths": str(allowed).lower()},
    )
    with pytest.raises(ModelLoadError, match=re.escape(str(index))):
        external.run(params, Layout(workspace))
    assert not (workspace / "data" / "external.json").exists()


# ===================================================== 3. forged, self-consistent shards are never kept
def committed_record(root: Path):  # noqa: ANN201
    """What a dvc.lock would record of `root` as it is now (md5 of each file, and each file's content)."""
    from lmgeo.core.store import Committed

    contents = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    md5s = {rel: hashlib.md5(data).hexdigest() for rel, data in contents.items()}  # noqa: S324 - DVC's hash
    by_md5 = {md5s[rel]: data for rel, data in contents.items()}
    return Committed("dvc.lock (fits: test.dir)", md5s, by_md5.get)


def forge(fits: Path, shard: str, factor: float) -> None:
    """Rewrite a shard as an attacker would: its rows changed, its manifest rewritten to match (same key)."""
    manifest = json.loads(manifest_path(fits, shard).read_text())
    key = ManifestKey(manifest["inputs"], manifest["params_hash"], manifest["code_version"])
    layer = int(shard.rsplit("=", 1)[1])
    rel = pq.read_table(fits / manifest["files"][0]["path"])["rel_err"][0].as_py()
    write_fits(fits, shard, layer, rel * factor, key)


def test_3_a_forged_self_consistent_shard_is_redone_where_dvc_lock_records_the_dataset(tmp_path: Path) -> None:
    from lmgeo.core.store import incomplete_shards

    fits = tmp_path / "fits"
    write_fits(fits, "m/layer=0", 0, 0.5)
    write_fits(fits, "m/layer=1", 1, 0.5)
    write_plan(fits, {"m/layer=0": KEY, "m/layer=1": KEY})
    committed = committed_record(fits)
    forge(fits, "m/layer=0", 0.5)  # rel_err halved, manifest rewritten: it verifies against itself
    planned = {"m/layer=0": KEY, "m/layer=1": KEY}
    assert incomplete_shards(fits, planned) == []  # its own manifest vouches for it
    assert incomplete_shards(fits, planned, committed) == ["m/layer=0"]  # what was committed does not
    with pytest.raises(CorruptShardError, match=r"differs from the manifest dvc\.lock \(fits: test\.dir\) records"):
        verified_files(fits, committed=committed)
    # a shard redone for another key since the record (params changed) is the stage's own: kept
    other = ManifestKey({"activations": "a2"}, "p1", "c1")
    write_fits(fits, "m/layer=1", 1, 0.25, other)
    assert incomplete_shards(fits, {"m/layer=1": other}, committed) == []
    # and one the record cannot be read for (the cache lacks the committed manifest) is redone
    blind = type(committed)(committed.source, committed.listing, lambda md5: None)
    assert incomplete_shards(fits, {"m/layer=1": other}, blind) == ["m/layer=1"]


def test_3_the_record_is_read_from_dvc_lock_and_the_dvc_cache(tmp_path: Path) -> None:
    from lmgeo.core.committed import committed

    workspace = tmp_path / "ws"
    fits = workspace / "data" / "fits"
    write_fits(fits, "m/layer=0", 0, 0.5)
    subprocess.run(["git", "init", "-q"], cwd=workspace, check=True)
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=workspace, check=True)
    record = committed_record(fits)
    listing = [{"md5": md5, "relpath": rel} for rel, md5 in sorted(record.listing.items())]
    text = json.dumps(listing).encode()
    digest = hashlib.md5(text).hexdigest()  # noqa: S324 - DVC's hash
    cache = workspace / ".dvc" / "cache" / "files" / "md5"
    for md5, data in [(f"{digest}.dir", text), *((m, record.content(m)) for m in record.listing.values())]:
        (cache / md5[:2]).mkdir(parents=True, exist_ok=True)
        (cache / md5[:2] / md5[2:]).write_bytes(data)
    (workspace / "dvc.lock").write_text(
        f"schema: '2.0'\nstages:\n  fit:\n    cmd: lmgeo fit\n    outs:\n    - path: data/fits\n      hash: md5\n"
        f"      md5: {digest}.dir\n"
    )
    found = committed(workspace, fits)
    assert found is not None and found.listing == record.listing
    own = manifest_path(fits, "m/layer=0").relative_to(fits).as_posix()
    assert found.content(record.listing[own]) == manifest_path(fits, "m/layer=0").read_bytes()
    assert committed(workspace, workspace / "data" / "perturb") is None  # an output dvc.lock does not record


# ======================================================= 4. a manifest that drops one planned file
def test_4_a_manifest_dropping_a_planned_partition_is_incomplete_and_refused_by_readers(tmp_path: Path) -> None:
    fits = tmp_path / "fits"
    write_fits(fits, "m/layer=0", 0, 0.5)
    write_fits(fits, "m/layer=1", 1, 0.5)
    write_plan(fits, {"m/layer=0": KEY, "m/layer=1": KEY})

    def drop_identity(manifest: dict) -> None:
        manifest["files"] = [f for f in manifest["files"] if "fn=identity" not in f["path"]]

    manifest = edit_manifest(fits, "m/layer=0", drop_identity)
    message = re.escape(str(manifest)) + r".*lacks model=m/layer=0/fn=identity/"
    with pytest.raises(CorruptShardError, match=message):
        verified_files(fits)  # a query, a result at an old revision
    with pytest.raises(CorruptShardError, match=message):
        verified_files(fits, {"m/layer=0": KEY, "m/layer=1": KEY})  # perturb reading its planned fits
    from lmgeo.core.store import incomplete_shards

    prune_shards(fits, {"m/layer=0", "m/layer=1"})  # the stage sweeps the now unlisted file...
    assert incomplete_shards(fits, {"m/layer=0": KEY, "m/layer=1": KEY}) == ["m/layer=0"]  # ...and redoes the shard


def test_4_a_dataset_without_a_finished_plan_is_served_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fits = tmp_path / "data" / "fits"
    write_fits(fits, "m/layer=0", 0, 0.5)  # an interrupted first run: one shard, no plan record
    with caplog.at_level(logging.WARNING):
        rows = query_table("SELECT count(*) AS n FROM fits", tmp_path)
    assert rows["n"].to_pylist() == [4]
    assert f"no record of a finished run of its stage ({fits / '_plan.json'} is missing" in caplog.text
    assert "reading the 1 complete shard(s) found, which may be fewer than planned" in caplog.text


# ============================================================ 5. `lmgeo analyse --out` inside a study
def test_5_analyse_refuses_to_write_into_a_study_or_a_folder_it_did_not_make(tmp_path: Path) -> None:
    from lmgeo.commands import analyse
    from lmgeo.core.errors import InputError

    source = analyse.ModelSource(str(tmp_path / "model"), "model")
    study = tmp_path / "study"
    (study / "reports" / "tables").mkdir(parents=True)
    (study / "dvc.yaml").write_text("stages: {}\n")
    (study / "params.yaml").write_text("security: {allow_outside_paths: false}\n")
    before = {p: state(p) for p in study.rglob("*") if p.is_file()}
    with pytest.raises(InputError, match=r"holds a study \(params\.yaml, dvc\.yaml\) that `lmgeo analyse` did not"):
        analyse.output_folder(study, source)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "draft.md").write_text("mine\n")
    with pytest.raises(InputError, match="not empty, and not a folder `lmgeo analyse` wrote"):
        analyse.output_folder(other, source)
    assert {p: state(p) for p in study.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in other.iterdir()) == ["draft.md"]
    fresh = tmp_path / "fresh"
    assert analyse.output_folder(fresh, source) == fresh and not fresh.exists()  # made only when the run starts


# ========================================== 6. queries never join datasets from two runs of the pipeline
def readme_join() -> str:
    """docs/query.md's join of the fits with their KLs, as written."""
    lines = [line for line in (REPO / "docs" / "query.md").read_text().splitlines() if "kl_vs_random" in line]
    assert len(lines) == 1, lines
    return re.match(r'^lmgeo query "(.*)"$', lines[0].strip())[1]


def two_stage_workspace(root: Path) -> tuple[Path, Path]:
    """fits, and perturb computed from them (its plan's lineage records the fits it read)."""
    from lmgeo.core.store import lineage_of

    fits, perturb = root / "data" / "fits", root / "data" / "perturb"
    write_fits(fits, "m/layer=0", 0, 0.5)
    write_plan(fits, {"m/layer=0": KEY}, lineage_of([]))
    with ShardWriter(perturb, "m/layer=0", KEY) as writer:
        for fn in ("diag_psd", "identity"):
            table = pa.table(
                {
                    "seq_id": pa.array([0, 1], pa.int32()),
                    "pos": pa.array([1, 2], pa.int32()),
                    "kl": [0.2, 0.4],
                    "kl_random": [0.1, 0.1],
                }
            )
            writer.write({"model": "m", "layer": 0, "fn": fn}, table)
    write_plan(perturb, {"m/layer=0": KEY}, lineage_of([fits]))
    return fits, perturb


def test_6_the_readmes_join_answers_for_one_run_and_is_refused_across_two(tmp_path: Path) -> None:
    fits, _ = two_stage_workspace(tmp_path)
    answer = query_table(readme_join(), tmp_path)
    assert answer.to_pylist() == [{"layer": 0, "kl_vs_random": pytest.approx(3.0)}]
    # fit re-run with other params (a `dvc repro` interrupted before perturb): new fits, KLs of the old ones
    other = ManifestKey({"activations": "a1"}, "p2", "c1")
    write_fits(fits, "m/layer=0", 0, 0.25, other)
    write_plan(fits, {"m/layer=0": other})
    with pytest.raises(
        QueryError,
        match=r"fits \(.*\) and perturb \(.*\) come from different runs of the pipeline: "
        r"they were computed from different versions of fits",
    ):
        query_table(readme_join(), tmp_path)
    assert query_table("SELECT avg(rel_err) AS e FROM fits", tmp_path)["e"].to_pylist() == [0.25]  # one at a time
    assert query_table("SELECT avg(kl) AS kl FROM perturb", tmp_path)["kl"].to_pylist() == [pytest.approx(0.3)]


# ======================================================================== 7. every failure one line
def project_errors() -> list[type[BaseException]]:
    """Every exception type the project defines (lmgeo/)."""
    found = []
    for package in ("lmgeo",):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            found += [
                c
                for _, c in inspect.getmembers(module, inspect.isclass)
                if issubclass(c, BaseException) and c.__module__ == info.name
            ]
    return sorted(set(found), key=lambda c: f"{c.__module__}.{c.__qualname__}")


def example(error: type[BaseException]) -> BaseException:
    """An instance built from its constructor's signature: text for text, an error for a cause."""
    arguments = []
    for parameter in list(inspect.signature(error.__init__).parameters.values())[1:]:
        optional = parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        if optional or parameter.default is not parameter.empty:
            continue
        annotation = str(parameter.annotation)
        arguments.append(ValueError("the cause") if "Exception" in annotation else f"<{parameter.name}>")
    return error(*arguments) if arguments else error("the message")


def test_7_every_error_type_the_project_defines_survives_pickling_as_ray_sends_it() -> None:
    errors = project_errors()
    names = {e.__name__ for e in errors}
    assert {"VerificationFailed", "CorruptShardError", "ShardFailed", "ShardError", "QueryError"} <= names, names
    for error in errors:
        original = example(error)
        copy = pickle.loads(pickle.dumps(original))
        assert type(copy) is error and str(copy) == str(original), error
        assert vars(copy) == vars(original) or error.__name__ in ("ShardError", "ShardFailed"), error
        if hasattr(original, "cause"):
            assert type(copy.cause) is type(original.cause) and str(copy.cause) == str(original.cause)


def test_7_a_shard_error_whose_cause_cannot_travel_keeps_its_message_and_kind() -> None:
    from lmgeo.core.errors import InputError
    from lmgeo.core.execution import ShardError

    class Stubborn(InputError):  # as a third party's exception may be: its constructor takes other arguments
        def __init__(self, code: int) -> None:
            super().__init__(f"code {code}")

    travelled = pickle.loads(pickle.dumps(ShardError("m/layer=0", Stubborn(7))))
    assert isinstance(travelled.cause, InputError) and str(travelled.cause) == "code 7"


def test_7_disk_full_names_the_folder_and_the_space_needed_and_keeps_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmgeo.core.errors import InputError
    from lmgeo.core.store import atomic_write

    def full(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    parts = ShardParts()
    parts.write({"model": "m", "layer": 0}, pa.table({"x": list(range(100_000))}))
    monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    with pytest.raises(
        InputError,
        match=re.escape(
            f"{tmp_path / 'fits'}: no space left on the device for shard 'm/seq=0' (about 0.8 MiB needed, "
        ),
    ):
        parts.commit(tmp_path / "fits", "m/seq=0", KEY)
    assert not [p for p in (tmp_path / "fits").rglob("*") if p.is_file()]
    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(
        InputError, match=re.escape(f"{tmp_path}: no space left on the device for metrics.json (about 0.0 MiB needed")
    ):
        atomic_write(tmp_path / "metrics.json", "{}")
    assert not list(tmp_path.glob("*metrics.json*"))


def test_7_a_ray_that_does_not_start_is_one_error_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from lmgeo.core.config import RayConfig
    from lmgeo.core.errors import InputError
    from lmgeo.driver import runtime

    def timed_out(**kwargs):  # noqa: ANN003, ANN202 - what Ray raises when its node does not come up
        raise Exception(
            "The current node timed out during startup. This could happen because some of the raylet "  # noqa: TRY002
            "failed to startup or the GCS has become overloaded."
        )

    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.setattr(runtime, "_reap_when_gone", lambda: None, raising=False)  # no reaper for no Ray
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(
        InputError,
        match=r"^the embedded Ray did not start \(Exception: The current node timed out "
        r"during startup.*\); .*`ray stop`.*--ray-address$",
    ):
        runtime.start_ray(RayConfig(num_cpus=1, num_gpus=0))


def test_7_a_step_size_that_blows_up_marks_the_run_diverged_and_training_goes_on() -> None:
    import numpy as np

    from lmgeo.core.contracts import parse_run_id
    from lmgeo.params import Params, apply_overrides
    from lmgeo.study_b.train import train_run

    params = apply_overrides(
        Params(),
        {
            "train.archs": '["gpt2"]',
            "train.recipes": '["adamw"]',
            "train.steps": "6",
            "train.batch_size": "4",
            "train.model": '{"d_model": 32, "n_layers": 1, "n_heads": 2}',
            "train.geometry_interval": "2",
            "train.recipe_overrides": '{"adamw": {"head_lr": 1e38}}',
            "prepare.seq_len": "16",
            "train.probe_sequences": "2",
            "train.eval_batches": "1",
            "train.test_batches": "1",
        },
    )
    spec = parse_run_id("gpt2-adamw-s0")
    tokens = np.random.default_rng(0).integers(0, 300, 4000).astype(np.int32)
    saved = []
    record, steps = train_run(
        spec,
        params.train.for_run(spec),
        tokens,
        tokens[:1500],
        300,
        16,
        "h",
        lambda model, checkpoint, meta: saved.append(checkpoint),
    )
    assert (record.diverged, record.diverged_at_step, record.steps_done) == (True, 1, 0)
    assert saved == ["init", "final"] and steps.num_rows == 0


def test_7_rev_values_that_name_no_commit_are_one_error(tmp_path: Path) -> None:
    with pytest.raises(QueryError, match=r"^--rev 'a{40}'…: a revision is 1 to 255 characters"):
        query_table("SELECT 1", tmp_path, ["a" * 5000])
    with pytest.raises(QueryError, match=r"not a revision name"):
        query_table("SELECT 1", tmp_path, ["HEAD\x1b[2J"])
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("a file: its blob is no commit\n")
    for command in (
        ["init", "-q"],
        ["add", "README.md"],
        ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one"],
    ):
        subprocess.run(["git", *command], cwd=repo, check=True)
    for rev in ("HEAD^{tree}", "HEAD:README.md"):
        with pytest.raises(
            QueryError,
            match=rf"^revision {re.escape(repr(rev))} does not name a commit \(.*\); give a "
            r"commit, branch, tag, DVC experiment, or `workspace`$",
        ):
            query_table("SELECT 1", repo, [rev])


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT 'infinity'::DATE AS d, 'infinity'::TIMESTAMP AS t", "\ninfinity  infinity\n"),
        ("SELECT '2000-01-01 00:00:00.123456789'::TIMESTAMP_NS AS n", "2000-01-01 00:00:00.123456789"),
        ("SELECT 1 AS a, 2 AS a", "a  a\n-  -\n1  2"),
        ("SELECT TIME '24:00:00' AS t, INTERVAL 1 DAY AS i, '1010'::BIT AS b", "24:00:00  1 day  1010"),
    ],
)
def test_7_query_results_python_cannot_hold_are_printed_exactly(tmp_path: Path, sql: str, expected: str) -> None:
    assert expected in run_query(sql, tmp_path)


def test_7_sql_that_is_not_text_or_not_a_statement_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(QueryError, match=r"^the SQL is not UTF-8 text \(b'\\xff' at character 8\)$"):
        run_query("SELECT '\udcff'", tmp_path)  # an argv byte the locale could not decode
    with pytest.raises(QueryError, match="^SQL does not parse"):
        run_query("EXPLAIN ANALYZE (", tmp_path)


def test_7_a_corrupt_table_fails_only_the_queries_that_read_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tables = tmp_path / "reports" / "tables"
    with ShardWriter(tables, "tables", KEY) as writer:
        writer.write({}, pa.table({"run": ["a", "b"]}), name="runs.parquet")
        writer.write({}, pa.table({"claim": ["c"]}), name="claims.parquet")
    write_plan(tables, {"tables": KEY})
    claims = tables / "claims.parquet"
    claims.write_bytes(claims.read_bytes()[:-8] + b"\0" * 8)
    (tmp_path / "params.yaml").write_text("- not: a mapping\n")
    with caplog.at_level(logging.WARNING):
        assert query_table("SELECT count(*) AS n FROM runs", tmp_path)["n"].to_pylist() == [2]
    assert "reports/tables/claims.parquet left out of this query, which does not name it" in caplog.text
    refused = f"cannot read reports/tables/claims.parquet: {claims}: corrupt shard"
    with pytest.raises(QueryError, match=re.escape(refused)):
        query_table("SELECT * FROM claims", tmp_path)
    with pytest.raises(QueryError, match="cannot read params.yaml"):
        query_table("SELECT * FROM params", tmp_path)


# ====================================================================================== 8. lower
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train: {weight_decay: .inf}", "train.weight_decay: Input should be a finite number"),
        ("train: {hidden_lr: .nan}", "train.hidden_lr: Input should be a finite number"),
        ("train: {steps: 100000000000}", "train.steps: Input should be less than or equal to 2147483647"),
        ("train: {model: {d_model: 10000000}}", "train.model.d_model: Input should be less than or equal to 65536"),
        (
            "ray: {tasks: {fit: {num_cpus: 1.0e+300}}}",
            "ray.tasks.fit.num_cpus: Input should be less than or equal to 4096",
        ),
        ("", "empty: it names no params section"),
        ("# nothing but a comment\n", "empty: it names no params section"),
        ("train: {steps: 10}\ntrain: {steps: 20}\n", "the key 'train' is given twice in one mapping"),
        ("train: {steps: 10, steps: 20}\n", "the key 'steps' is given twice in one mapping"),
        ("prepare: {corpus: {sha256: abc}}", r"prepare.corpus.sha256: String should match pattern '^[0-9a-f]{64}$'"),
        ("a: &a [1, 1]\ntrain: {seeds: *a}\n", "anchors and aliases (&name, *name) are not allowed"),
    ],
)
def test_8_params_refuse_non_finite_unbounded_empty_duplicated_malformed_and_aliased_values(
    tmp_path: Path, text: str, message: str
) -> None:
    from lmgeo.core.config import ParamsError
    from lmgeo.params import load_params

    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ParamsError, match=re.escape(message)):
        load_params(tmp_path / "params.yaml")


def test_8_an_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path: Path) -> None:
    from lmgeo.core.config import ParamsError
    from lmgeo.params import load_params

    bomb = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    # a million values from six lines (three more would be a billion: the message that named them all, as the
    # starting code's did, would not fit in memory)
    bomb += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 6)]
    (tmp_path / "params.yaml").write_text("\n".join(bomb) + "\ntrain: {archs: *a5}\n")
    started = time.monotonic()
    with pytest.raises(ParamsError) as refused:
        load_params(tmp_path / "params.yaml")
    assert time.monotonic() - started < 5 and len(str(refused.value)) < 400, str(refused.value)[:400]


def test_8_query_output_escapes_control_characters_and_prints_128_bit_integers_exactly(tmp_path: Path) -> None:
    sql = (
        "SELECT chr(27) || '[2J' || chr(8238) AS \"name" + "\x1b" + '", '
        "340282366920938463463374607431768211455::UHUGEINT AS u, "
        "(-170141183460469231731687303715884105728)::HUGEINT AS h"
    )
    table = run_query(sql, tmp_path).splitlines()
    assert table[0].split() == ["name\\x1b", "u", "h"]
    assert table[2].split() == [
        "\\x1b[2J\\u202e",
        "340282366920938463463374607431768211455",
        "-170141183460469231731687303715884105728",
    ]
    csv_text = run_query(sql, tmp_path, "csv")
    assert "\x1b" not in csv_text and "\u202e" not in csv_text and "340282366920938463463374607431768211455" in csv_text
    assert json.loads(run_query(sql, tmp_path, "json"))[0]["name\x1b"] == "\x1b[2J\u202e"  # JSON escapes them


def test_8_a_query_has_a_memory_and_a_temp_disk_limit_and_a_time_out_by_default(tmp_path: Path) -> None:
    import psutil

    from lmgeo.results.query import Limits, query_table

    settings = query_table(
        "SELECT current_setting('memory_limit') AS m, current_setting('max_temp_directory_size') AS t",
        None,
        tmp_path,
        SOURCES,
    ).to_pylist()[0]
    assert settings["m"] != "" and settings["t"] not in ("", "90% of available disk space")
    quarter = psutil.virtual_memory().total / 4 / 2**30
    assert float(settings["m"].split()[0]) == pytest.approx(quarter, rel=0.1), settings
    hungry = "SELECT list(range) FROM range(30000000)"
    with pytest.raises(
        QueryError,
        match=r"^query failed: Out of Memory Error: [^\n]*\(the query's limits stopped it: "
        r"narrow the query, or raise --memory-limit\)$",
    ):
        query_table(hungry, None, tmp_path, SOURCES, Limits(memory="64MB", temp_disk="64MB"))
    from typer.testing import CliRunner

    from lmgeo import cli

    seen = []
    import lmgeo.results.query as query_module

    original = query_module.run_query
    query_module.run_query = lambda *args: seen.append(args[-1]) or ""
    try:
        CliRunner().invoke(cli.app, ["query", "SELECT 1"])
    finally:
        query_module.run_query = original
    assert seen == [Limits(None, None, cli.DEFAULT_QUERY_TIMEOUT_S)] and cli.DEFAULT_QUERY_TIMEOUT_S == 600


# ================================================================ slow: a tiny study, `lmgeo`, `dvc`, Ray
STUDY = {
    "train.matched_budget": "null",
    "train.archs": '["neox"]',
    "train.recipes": '["adamw"]',
    "analysis.classes": '["diag_psd","identity"]',
}


@pytest.fixture(scope="module")
def dvc_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny study in a git + DVC repo of its own, reproduced with `dvc repro` up to perturb (the cases need no
    report) and committed."""
    from reliability_helpers import preset_overrides
    from study_helpers import commit, new_study, sh, write_params

    study = new_study(tmp_path_factory.mktemp("attacks"))
    write_params(study, {**preset_overrides("tiny"), **STUDY})
    sh("dvc", "repro", "perturb", cwd=study)
    commit(study, "the tiny study, reproduced")
    return study


@pytest.fixture
def study(dvc_study: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "study"
    shutil.copytree(dvc_study, copy, symlinks=True)
    return copy


def sh(*cmd: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    from study_helpers import sh as study_sh

    return study_sh(*cmd, cwd=cwd, check=check)


def fit_shards(study: Path) -> list[str]:
    fits = study / "data" / "fits"
    return sorted(json.loads(p.read_text())["shard"] for p in (fits / MANIFEST_DIR).glob("*.json"))


@pytest.mark.slow
def test_1_lmgeo_fit_redoes_a_shard_whose_manifest_names_an_outside_file_and_deletes_nothing_outside(
    study: Path, tmp_path: Path
) -> None:
    fits = study / "data" / "fits"
    victim = tmp_path / "home" / "victim.parquet"
    victim.parent.mkdir()
    first = json.loads(next((fits / MANIFEST_DIR).glob("*.json")).read_text())
    shutil.copy(fits / first["files"][0]["path"], victim)  # rows of the dataset's shape, outside it
    (tmp_path / "home" / "notes.txt").write_text("the user's other file\n")
    outside = {p: state(p) for p in victim.parent.iterdir()}
    manifest = plant_outside_path(fits, first["shard"], victim, "parent")
    fails(sh("lmgeo", "query", "SELECT count(*) FROM fits", cwd=study, check=False), str(manifest))
    done = sh("lmgeo", "fit", cwd=study)
    assert "fit: 1/2 shards complete, 1 to do" in done.stdout, done.stdout
    assert {p: state(p) for p in victim.parent.iterdir()} == outside
    sh("dvc", "repro", "perturb", cwd=study)
    assert "victim" not in (study / "dvc.lock").read_text()
    assert sh("git", "status", "--porcelain", "dvc.lock", cwd=study).stdout == ""  # the same dataset as committed


@pytest.mark.slow
def test_3_a_forged_shard_is_refused_by_query_and_recomputed_by_dvc_repro_never_recorded(study: Path) -> None:
    from reliability_helpers import rewrite_shard

    fits = study / "data" / "fits"
    shard = fit_shards(study)[0]
    manifest = manifest_path(fits, shard)
    before = {p: p.read_bytes() for p in fits.rglob("*") if p.is_file()}
    rewrite_shard(
        fits,
        shard,
        lambda partition, table: table.set_column(
            table.schema.get_field_index("rel_err"), "rel_err", pa.compute.divide(table["rel_err"], 2.0)
        ),
    )
    assert {p: p.read_bytes() for p in fits.rglob("*") if p.is_file()} != before
    verified_files(fits)  # self-consistent: its own manifest vouches for it
    fails(
        sh("lmgeo", "query", "SELECT max(rel_err) FROM fits", cwd=study, check=False),
        str(manifest),
        "differs from the manifest dvc.lock (data/fits: ",
    )
    done = sh("dvc", "repro", "perturb", cwd=study)
    assert "Running stage 'fit'" in done.stdout and "fit: 1/2 shards complete, 1 to do" in done.stdout, done.stdout
    assert {p: p.read_bytes() for p in fits.rglob("*") if p.is_file()} == before
    assert sh("git", "status", "--porcelain", "dvc.lock", cwd=study).stdout == ""


@pytest.mark.slow
def test_4_a_manifest_dropping_a_planned_file_is_refused_by_query_and_redone_by_dvc_repro(study: Path) -> None:
    fits = study / "data" / "fits"
    shard = fit_shards(study)[0]
    before = {p: p.read_bytes() for p in fits.rglob("*") if p.is_file()}

    def drop_identity(manifest: dict) -> None:
        manifest["files"] = [f for f in manifest["files"] if "/fn=identity/" not in f["path"]]

    manifest = edit_manifest(fits, shard, drop_identity)
    fails(sh("lmgeo", "query", "SELECT count(*) FROM fits", cwd=study, check=False), str(manifest), "fn=identity/")
    done = sh("dvc", "repro", "perturb", cwd=study)
    assert "fit: 1/2 shards complete, 1 to do" in done.stdout, done.stdout
    assert {p: p.read_bytes() for p in fits.rglob("*") if p.is_file()} == before
    assert sh("git", "status", "--porcelain", "dvc.lock", cwd=study).stdout == ""
    sh("lmgeo", "perturb", cwd=study)  # and the next stage finds every fit it plans


@pytest.mark.slow
def test_6_after_an_interrupted_repro_the_readmes_join_is_refused_until_the_pipeline_is_finished(study: Path) -> None:
    from study_helpers import write_params

    k = json.loads(
        sh("lmgeo", "query", "SELECT value FROM params WHERE key = 'analysis.k'", "--format", "json", cwd=study).stdout
    )[0]["value"]
    write_params(study, {"analysis.k": str(int(k) - 2)})
    sh("lmgeo", "fit", cwd=study)  # `dvc repro` stopped after fit: the KLs are of the old fits
    # The new fits' plan is not the one dvc.lock records: refused before any join, naming the fix.
    fails(
        sh("lmgeo", "query", readme_join(), cwd=study, check=False),
        "data/fits",
        "_plan.json: differs from the plan",
        "`dvc repro`",
    )
    sh("dvc", "repro", "perturb", cwd=study)
    answer = json.loads(sh("lmgeo", "query", readme_join(), "--format", "json", cwd=study).stdout)
    assert [row["layer"] for row in answer] == [0, 1] and all(row["kl_vs_random"] > 0 for row in answer)


def fail_verification() -> None:
    from lmgeo.study_a.verify import VerificationFailed

    raise VerificationFailed("readout", "the head does not read the final norm's output")


@pytest.mark.slow
def test_7_a_verification_failure_inside_a_ray_task_reaches_the_driver_as_itself(ray_local) -> None:
    from lmgeo.core.config import TaskResources
    from lmgeo.core.execution import Shard, ShardFailed, run_shards
    from lmgeo.study_a.verify import VerificationFailed

    with pytest.raises(ShardFailed) as failed:
        run_shards(
            [Shard("m/seq=0", fail_verification)], TaskResources(), max_in_flight=1, max_retries=0, label="extract"
        )
    assert type(failed.value.cause) is VerificationFailed and failed.value.key == "m/seq=0"
    assert str(failed.value.cause) == "verification failed: readout: the head does not read the final norm's output"


@pytest.mark.slow
def test_7_a_full_disk_is_one_line_naming_the_dataset_and_the_space_needed(study: Path) -> None:
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no user namespaces here to mount a small file system in")
    fits = study / "data" / "fits"
    shutil.rmtree(fits)
    fits.mkdir()
    done = sh(
        "unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=48k tmpfs {fits} && lmgeo fit", cwd=study, check=False
    )
    fails(done, f"{fits}: no space left on the device for shard", "needed", "free some space")


@pytest.mark.slow
def test_8_no_ray_process_outlives_a_killed_driver(study: Path) -> None:
    import psutil
    from reliability_helpers import alive, busy_worker, env, kill_all, wait_for

    shard = fit_shards(study)[0]
    manifest_path(study / "data" / "fits", shard).unlink()  # fit has a shard to do
    driver = subprocess.Popen(
        [str(BIN / "lmgeo"), "fit"],
        cwd=study,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    family: list[psutil.Process] = []
    try:
        wait_for(busy_worker(driver.pid, "ray::fit_task", 0.5), 240, "a fit task running")
        family = psutil.Process(driver.pid).children(recursive=True)
        assert any("Agent" in " ".join(p.cmdline()) for p in alive(family)), [p.cmdline() for p in family]
        os.kill(driver.pid, signal.SIGKILL)  # the driver alone, as the OOM killer would
        driver.wait(timeout=30)
        wait_for(lambda: not alive(family), 30, "every process of the killed driver's Ray to end")
    finally:
        kill_all(alive(family))  # a failed test leaves nothing running
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
