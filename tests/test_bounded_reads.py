"""Issue #58, items 3 and 5: what a pull brings (result tables, manifests, plans) is read within bounds, and a
bomb among them is one error, in seconds, instead of gigabytes allocated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_integrity import fails

from lmgeo.core import contracts
from lmgeo.core.store import MANIFEST_DIR, PLAN_FILE, ManifestKey, ShardWriter, file_sha256, write_plan
from lmgeo.driver.layout import Layout
from lmgeo.results.query import QueryError, query_table

SOURCES = Layout(Path.cwd()).query_sources()
KEY = ManifestKey({}, "p1", "c1")
BIN = Path(sys.executable).parent


def tables_with(workspace: Path, runs: pa.Table | None = None, **write: object) -> Path:
    """A workspace whose `reports/tables` holds `runs` (written as `pq.write_table(**write)` would), its
    manifest agreeing with it: a forgery that passes every hash."""
    tables = workspace / "reports" / "tables"
    with ShardWriter(tables, "tables", KEY) as writer:
        writer.write({}, pa.table({"run": ["a"]}), name="runs.parquet")
    write_plan(tables, {"tables": KEY})
    if runs is not None:
        pq.write_table(runs, tables / "runs.parquet", **write)
        manifest = next((tables / MANIFEST_DIR).glob("*.json"))
        record = json.loads(manifest.read_text())
        record["files"][0].update(bytes=(tables / "runs.parquet").stat().st_size)
        record["files"][0].update(sha256=file_sha256(tables / "runs.parquet"))
        manifest.write_text(json.dumps(record))
    return tables


def dictionary_bomb() -> pa.Table:
    """One 1 MiB entry, repeated 400 times: KBs stored, 400 MiB decoded."""
    entry = pa.array(["x" * 2**20])
    return pa.table({"run": pa.DictionaryArray.from_arrays(pa.array([0] * 400, pa.int32()), entry)})


def refused(workspace: Path, *needles: str) -> None:
    start = time.monotonic()
    with pytest.raises(QueryError) as caught:
        query_table("SELECT count(*) FROM runs", None, workspace, SOURCES)
    assert time.monotonic() - start < 10
    assert "\n" not in str(caught.value)
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))


def test_a_dictionary_bomb_table_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    tables_with(tmp_path, dictionary_bomb(), store_schema=False, compression="zstd")
    assert (tmp_path / "reports" / "tables" / "runs.parquet").stat().st_size < 64 * 2**10
    refused(tmp_path, "cannot read reports/tables/runs.parquet", "the text of column 'run' take 419430400 bytes")


def test_a_dictionary_bomb_table_is_one_cli_error_exit_2_in_seconds_within_a_memory_cap(tmp_path: Path) -> None:
    tables_with(tmp_path, dictionary_bomb(), store_schema=False, compression="zstd")
    start = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", f'ulimit -v {4 * 2**20}; exec "{BIN / "lmgeo"}" query "SELECT count(*) FROM runs"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert time.monotonic() - start < 60
    fails(done, "reports/tables/runs.parquet", "more than a result table may (268435456)")


def test_a_table_whose_pages_decompress_past_the_cap_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(contracts, "MAX_TABLE_BYTES", 1000)
    tables_with(tmp_path, pa.table({"run": [f"{i:0500d}" for i in range(10)]}), compression="zstd")
    refused(tmp_path, "runs.parquet: its pages take", "more than a result table may (1000)")


def test_a_table_of_more_rows_than_the_cap_allows_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contracts, "MAX_TABLE_BYTES", 1000)
    tables_with(tmp_path, pa.table({"run": pa.nulls(200, pa.int64())}))
    refused(tmp_path, "runs.parquet: its 200 rows take 1600 bytes decoded")


def test_a_table_within_the_cap_is_read_as_written(tmp_path: Path) -> None:
    tables_with(tmp_path, pa.table({"run": ["a", None, "b"], "n": [1, 2, 3]}), store_schema=False)
    got = query_table("SELECT run, n FROM runs ORDER BY n", None, tmp_path, SOURCES)
    assert got["run"].to_pylist() == ["a", None, "b"] and got.schema.field("run").type == pa.string()


def manifest_of(tables: Path) -> Path:
    return next((tables / MANIFEST_DIR).glob("*.json"))


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_manifest_that_is_a_fifo_a_device_or_huge_is_refused_in_seconds(tmp_path: Path, kind: str) -> None:
    manifest = manifest_of(tables_with(tmp_path))
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "device":
        manifest.symlink_to("/dev/zero")
    else:
        with manifest.open("wb") as file:
            file.truncate(65 * 2**20)  # sparse: no disk, no memory
    refused(tmp_path, f"{manifest}: corrupt shard: unreadable manifest", "not a regular file of at most 67108864")


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_plan_that_is_a_fifo_a_device_or_huge_is_refused_in_seconds(tmp_path: Path, kind: str) -> None:
    plan = tables_with(tmp_path) / PLAN_FILE
    plan.unlink()
    if kind == "fifo":
        os.mkfifo(plan)
    elif kind == "device":
        plan.symlink_to("/dev/zero")
    else:
        with plan.open("wb") as file:
            file.truncate(65 * 2**20)
    refused(tmp_path, f"{plan}: unreadable record of the last plan", "not a regular file")
