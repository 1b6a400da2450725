"""The trust anchor covers the plan (issue #58): where `dvc.lock` records a dataset, a reader compares the
dataset's `_plan.json` with the one recorded there, so that a shard forged together with its manifest and the
plan, under another params hash, is refused, not served as "redone since"."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_attacks import KEY, write_fits
from typer.testing import CliRunner

from lmgeo import cli
from lmgeo.core.committed import committed
from lmgeo.core.store import PLAN_FILE, ManifestKey, StaleShardError, files_so_far, verified_files, write_plan

SHARDS = ("m/layer=0", "m/layer=1")
FORGED = ManifestKey({"activations": "a1"}, "forged-params", "c1")


def dvc_workspace(tmp_path: Path) -> Path:
    """A DVC repo whose `dvc.lock` records `data/fits` (two shards and their finished plan) as it is now, its
    listing and files in the DVC cache, as `dvc repro` leaves them."""
    from dvc.repo import Repo

    workspace = tmp_path / "ws"
    fits = workspace / "data" / "fits"
    for layer, shard in enumerate(SHARDS):
        write_fits(fits, shard, layer, 0.5)
    write_plan(fits, dict.fromkeys(SHARDS, KEY))
    Repo.init(str(workspace), no_scm=True).close()
    cache = workspace / ".dvc" / "cache" / "files" / "md5"

    def store(data: bytes, suffix: str = "") -> str:
        md5 = hashlib.md5(data).hexdigest() + suffix  # noqa: S324 - DVC's hash
        (cache / md5[:2]).mkdir(parents=True, exist_ok=True)
        (cache / md5[:2] / md5[2:]).write_bytes(data)
        return md5

    files = sorted(p for p in fits.rglob("*") if p.is_file())
    listing = [{"md5": store(p.read_bytes()), "relpath": p.relative_to(fits).as_posix()} for p in files]
    digest = store(json.dumps(listing).encode(), ".dir")
    (workspace / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  fit:\n    cmd: lmgeo fit\n    outs:\n    - path: data/fits\n      hash: md5\n"
        f"      md5: {digest}\n"
    )
    return workspace


def forge_with_plan(fits: Path, *, complete: bool = True) -> None:
    """Rewrite every shard and the plan under another params hash: each manifest and the plan vouch for them."""
    for layer, shard in enumerate(SHARDS):
        write_fits(fits, shard, layer, 0.125, FORGED)
    write_plan(fits, dict.fromkeys(SHARDS, FORGED), complete=complete)


def refusal(workspace: Path) -> str:
    fits = workspace / "data" / "fits"
    digest = (workspace / "dvc.lock").read_text().split("md5: ")[1].strip()
    return (
        f"{fits / PLAN_FILE}: {{}} the plan dvc.lock (data/fits: {digest}) records for the dataset (its shards were "
        f"computed with other keys than those committed); run `dvc checkout {fits}` to get the committed one back, "
        "or `dvc repro` to recompute it and commit the result"
    )


def query(workspace: Path, monkeypatch: pytest.MonkeyPatch, sql: str):  # noqa: ANN201
    monkeypatch.chdir(workspace)
    return CliRunner().invoke(cli.app, ["query", "--format", "csv", sql])


def test_a_forged_plan_and_its_shards_are_refused_by_query_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = dvc_workspace(tmp_path)
    fits = workspace / "data" / "fits"
    forge_with_plan(fits)
    assert len(verified_files(fits)) == 4  # self-consistent: its manifests and plan vouch for it
    done = query(workspace, monkeypatch, "SELECT max(rel_err) FROM fits")
    assert done.exit_code == 2, done.output
    expected = f"lmgeo: error: {workspace}: cannot read data/fits: {refusal(workspace).format('differs from')}"
    assert done.stderr.strip().splitlines() == [expected]
    assert done.stdout == ""


def test_a_removed_plan_is_refused_where_dvc_lock_records_one(tmp_path: Path) -> None:
    workspace = dvc_workspace(tmp_path)
    fits = workspace / "data" / "fits"
    forge_with_plan(fits)
    (fits / PLAN_FILE).unlink()  # without a plan, the shards of one forged key are read with a warning
    with pytest.raises(StaleShardError) as refused:
        verified_files(fits, committed=committed(workspace, fits))
    assert str(refused.value) == refusal(workspace).format("missing, unlike")


def test_a_forged_plan_in_progress_is_refused_by_a_reader_of_what_is_there(tmp_path: Path) -> None:
    workspace = dvc_workspace(tmp_path)
    fits = workspace / "data" / "fits"
    forge_with_plan(fits, complete=False)
    assert len(files_so_far(fits)[0]) == 4
    with pytest.raises(StaleShardError) as refused:
        files_so_far(fits, committed=committed(workspace, fits))
    assert str(refused.value) == refusal(workspace).format("differs from")


def test_the_committed_plan_and_shards_are_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workspace = dvc_workspace(tmp_path)
    done = query(workspace, monkeypatch, "SELECT count(*) AS n, max(rel_err) AS worst FROM fits")
    assert done.exit_code == 0, done.output
    assert done.stdout.split() == ["n,worst", "8,0.5"]


def test_a_dataset_dvc_lock_does_not_record_is_read_by_its_own_plan(tmp_path: Path) -> None:
    workspace = dvc_workspace(tmp_path)
    fits = workspace / "data" / "fits"
    forge_with_plan(fits)
    (workspace / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    assert committed(workspace, fits) is None
    assert len(verified_files(fits, committed=committed(workspace, fits))) == 4
