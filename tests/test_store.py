"""The shard store: vectors, atomic writes, manifests and resume, corruption, reading with DuckDB.

The kill tests run a real writer in a subprocess and SIGKILL it: once in the middle of writing,
once between renaming its files into place and writing its manifest (the worst moment).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmgeo.core import store
from lmgeo.core.contracts import (
    VECTOR,
    Dataset,
    OldVectorFormat,
    arrow_to_vectors,
    is_vector_type,
    read,
    stored_vector_dtype,
    vector_shape,
    vector_type,
    vectors_as_lists,
    vectors_to_arrow,
)
from lmgeo.core.errors import InputError
from lmgeo.core.store import (
    PLAN_FILE,
    CorruptShardError,
    ManifestKey,
    ShardWriter,
    StaleShardError,
    atomic_path,
    dataset_digest,
    file_sha256,
    partition_dir,
    prune_shards,
    shard_complete,
    shard_slug,
    verified_files,
    verify_shard,
    write_plan,
)

KEY = ManifestKey(inputs={"activations": "abc123"}, params_hash="p1", code_version="c1")
ROWS = Dataset(
    "rows",
    fields=(pa.field("seq_id", pa.int32()), pa.field("pos", pa.int32()), pa.field("h", VECTOR)),
    partitions=(pa.field("model", pa.string()), pa.field("layer", pa.int32())),
    written_by="extract",
    order=("seq_id", "pos"),
)


def read_all(root: Path) -> pa.Table:
    """Every row of the verified shards, with the partition columns, in (layer, seq_id, pos) order."""
    files = verified_files(root)
    parts = [
        pq.read_table(f).append_column(
            "layer",
            pa.array([ROWS.partition_values(f.relative_to(root))["layer"]] * pq.read_metadata(f).num_rows, pa.int32()),
        )
        for f in files
    ]
    return pa.concat_tables(parts).sort_by([("layer", "ascending"), ("seq_id", "ascending"), ("pos", "ascending")])


def rows(seq: int, n: int = 4, d: int = 3) -> pa.Table:
    rng = np.random.default_rng(seq)
    return pa.table(
        {
            "seq_id": pa.array([seq] * n, pa.int32()),
            "pos": pa.array(range(n), pa.int32()),
            "h": vectors_to_arrow(rng.standard_normal((n, d))),
        }
    )


def write_shard(root: Path, shard: str, key: ManifestKey = KEY, seq: int = 0, layers: tuple = (0, 1)) -> None:
    with ShardWriter(root, shard, key, metadata={"model": "m"}) as writer:
        for layer in layers:
            writer.write({"model": "m", "layer": layer}, rows(seq))


def data_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and MANIFESTS not in p.parts)


MANIFESTS = store.MANIFEST_DIR


# ------------------------------------------------------------------------------------- vectors
def test_vector_types_are_fixed_width_bytes_naming_their_element_type() -> None:
    assert vector_type(8).storage_type == pa.binary(32) and vector_shape(vector_type(8)) == (8, "float32")
    half = vector_type(8, half=True)
    assert half.storage_type == pa.binary(16) and vector_shape(half) == (8, "float16")
    assert is_vector_type(vector_type(8)) and not is_vector_type(pa.binary(32))
    assert vector_type(8) != vector_type(8, half=True) and vector_type(8) != vector_type(4)
    with pytest.raises(ValueError):
        vector_type(0)


@pytest.mark.parametrize("half", [False, True])
def test_vectors_round_trip_through_parquet_and_duckdb(tmp_path: Path, half: bool) -> None:
    x = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    expected = x.astype(np.float16).astype(np.float32) if half else x
    column = vectors_to_arrow(x, half=half)
    assert column.type == vector_type(5, half)
    # The documented encoding: each row's values as little-endian bytes, nothing else.
    little_endian = x.astype("<f2" if half else "<f4")
    assert [v.as_py() for v in column.storage] == [row.tobytes() for row in little_endian]
    assert np.array_equal(arrow_to_vectors(column), expected)
    pq.write_table(pa.table({"h": column}), tmp_path / "v.parquet")
    assert pq.read_schema(tmp_path / "v.parquet").field("h").type == vector_type(5, half)  # self-describing
    assert np.array_equal(arrow_to_vectors(pq.read_table(tmp_path / "v.parquet")["h"]), expected)
    # DuckDB sees the raw bytes (BLOB); the views of `lmgeo query` decode them to FLOAT[], which converts back.
    blobs = duckdb.sql(f"SELECT h FROM '{tmp_path / 'v.parquet'}'").to_arrow_table()["h"]
    lists = vectors_as_lists(blobs, "float16" if half else "float32")
    assert pa.types.is_list(lists.type) and lists.to_pylist() == expected.tolist()
    out = arrow_to_vectors(lists)
    assert out.dtype == np.float32 and np.array_equal(out, expected)


def test_null_vectors_stay_null_through_every_decoder() -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    column = vectors_to_arrow(x, null=np.array([False, True, False, False]))
    assert column.is_null().to_pylist() == [False, True, False, False]
    with pytest.raises(ValueError, match="1 null rows"):
        arrow_to_vectors(column)
    assert np.array_equal(arrow_to_vectors(column.filter(column.is_valid())), x[[0, 2, 3]])
    blobs = pa.array([b.as_py() for b in column.storage], pa.binary())  # as DuckDB hands them over
    assert vectors_as_lists(blobs.slice(1), "float32").to_pylist() == [None, [6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]


def test_arrow_to_vectors_is_zero_copy_for_one_float32_chunk_and_honours_slices() -> None:
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    column = vectors_to_arrow(x)
    out = arrow_to_vectors(column)
    assert np.shares_memory(out, x)  # neither the encoder nor the decoder copied
    assert np.array_equal(arrow_to_vectors(column.slice(2, 3)), x[2:5])
    chunked = pa.chunked_array([column.slice(0, 3), column.slice(3, 5)])
    assert np.array_equal(arrow_to_vectors(chunked), x)
    assert arrow_to_vectors(pa.chunked_array([], vector_type(3))).shape == (0, 3)


def test_arrow_to_vectors_refuses_ragged_lists_and_non_vectors() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        arrow_to_vectors(pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32())))
    with pytest.raises(TypeError, match="vector column"):
        arrow_to_vectors(pa.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\(n, d\)"):
        vectors_to_arrow(np.zeros(3))


def test_vectors_survive_pickling_as_through_rays_object_store() -> None:
    table = pa.table({"h": vectors_to_arrow(np.eye(3), half=True)})
    back = pickle.loads(pickle.dumps(table))
    assert back.schema.field("h").type == vector_type(3, half=True) and np.array_equal(
        arrow_to_vectors(back["h"]), np.eye(3)
    )


def test_vectors_in_the_old_list_format_are_refused_naming_the_command_that_rewrites_them(tmp_path: Path) -> None:
    old = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(6, np.float32)), 3)
    with pytest.raises(OldVectorFormat, match=r"before vector format 2.*`lmgeo extract`"):
        arrow_to_vectors(old)
    with ShardWriter(tmp_path, "s", KEY) as writer:
        writer.write(
            {"model": "m", "layer": 0},
            pa.table({"seq_id": pa.array([0, 1], pa.int32()), "pos": pa.array([0, 0], pa.int32()), "h": old}),
        )
    files = verified_files(tmp_path)
    with pytest.raises(OldVectorFormat, match=r"part-.*\.parquet: vectors stored as fixed_size_list.*`lmgeo extract`"):
        read(tmp_path, ROWS, files, {"layer": 0})
    with pytest.raises(OldVectorFormat, match="`lmgeo extract`"):
        stored_vector_dtype(files, ROWS, "h")
    assert str(read(tmp_path, ROWS, files, {"layer": 0}, columns=["seq_id"])["seq_id"].type) == "int32"  # scalars


# ---------------------------------------------------------------------------------------- hashes
def test_file_sha256_matches_hashlib(tmp_path: Path) -> None:
    data = os.urandom(3 * 2**20 + 17)  # spans several read chunks
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_shard_slugs_are_safe_and_distinct() -> None:
    keys = [
        "gpt2-adamw-s0.final/layer=1/fn=diag_psd",
        "gpt2-adamw-s0.final_layer_1_fn_diag_psd",
        "gpt2-adamw-s0@final",
        "EleutherAI--pythia-70m/seq=16",
        "../../etc",
        "a b",
    ]
    slugs = [shard_slug(k) for k in keys]
    assert len(set(slugs)) == len(keys)
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", s) for s in slugs), slugs
    assert shard_slug(keys[0]) == shard_slug(keys[0])


def test_partition_values_that_would_break_paths_are_refused() -> None:
    expected = Path("model=EleutherAI--pythia-70m/layer=3")
    assert partition_dir({"model": "EleutherAI--pythia-70m", "layer": 3}) == expected
    for bad in ({"model": "a/b"}, {"model": ".."}, {"model": ""}, {"model": "a=b"}, {"bad key": "x"}):
        with pytest.raises(ValueError):
            partition_dir(bad)


# -------------------------------------------------------------------------------------- writing
def test_a_shard_is_written_atomically_with_its_manifest_last(tmp_path: Path) -> None:
    root = tmp_path / "acts"
    with ShardWriter(root, "m/seq=0", KEY, metadata={"model": "m@final"}) as writer:
        writer.write({"model": "m", "layer": 0}, rows(0))
        writer.write({"model": "m", "layer": 0}, rows(1).to_batches()[0])  # appended, streamed
        writer.write({"model": "m", "layer": 1}, rows(0))
        # inside the block: only hidden temporaries, no manifest, nothing a reader would take
        assert not list(root.rglob("*.parquet")) and not shard_complete(root, "m/seq=0", KEY)
    slug = shard_slug("m/seq=0")
    assert data_files(root) == [f"model=m/layer=0/part-{slug}.parquet", f"model=m/layer=1/part-{slug}.parquet"]
    manifest = json.loads((root / MANIFESTS / f"{slug}.json").read_text())
    assert manifest["shard"] == "m/seq=0" and manifest["inputs"] == KEY.inputs
    assert manifest["params_hash"] == "p1" and manifest["code_version"] == "c1"
    for entry in manifest["files"]:
        path = root / entry["path"]
        assert entry["bytes"] == path.stat().st_size and entry["sha256"] == file_sha256(path)
    assert [e["rows"] for e in manifest["files"]] == [8, 4]
    meta = pq.read_schema(root / manifest["files"][0]["path"]).metadata
    assert meta[b"model"] == b"m@final" and meta[b"lmgeo.shard"] == b"m/seq=0"
    assert meta[b"lmgeo.params_hash"] == b"p1" and meta[b"lmgeo.code_version"] == b"c1"
    assert shard_complete(root, "m/seq=0", KEY)


@pytest.mark.parametrize(
    "changed",
    [
        {"inputs": {"activations": "other"}},
        {"params_hash": "p2"},
        {"code_version": "c2"},
    ],
)
def test_a_shard_is_complete_only_for_the_same_key(tmp_path: Path, changed: dict) -> None:
    write_shard(tmp_path, "s")
    assert shard_complete(tmp_path, "s", KEY)
    assert not shard_complete(tmp_path, "s", ManifestKey(**{**KEY.__dict__, **changed}))
    assert not shard_complete(tmp_path, "never-written", KEY)


def test_an_exception_while_writing_leaves_nothing(tmp_path: Path) -> None:
    write_shard(tmp_path, "s", layers=(0,))
    with pytest.raises(RuntimeError, match="model crashed"), ShardWriter(tmp_path, "s", KEY) as writer:
        writer.write({"model": "m", "layer": 0}, rows(0))
        raise RuntimeError("model crashed")
    # the old version is gone too; empty partition directories stay (another shard may be using one)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert not shard_complete(tmp_path, "s", KEY)


def test_a_write_that_fails_on_the_writer_thread_aborts_the_shard(tmp_path: Path) -> None:
    """Writes run on a background thread: a failed one (here a batch whose schema differs from its
    file's) still raises in the caller, and the shard is discarded as after the caller's own exception."""
    bad = rows(1).append_column("extra", pa.array(range(4), pa.int32()))
    with pytest.raises(ValueError, match="schema"), ShardWriter(tmp_path, "s", KEY) as writer:
        writer.write({"model": "m", "layer": 0}, rows(0))
        writer.write({"model": "m", "layer": 0}, bad)
        writer.write({"model": "m", "layer": 1}, rows(0))
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert not shard_complete(tmp_path, "s", KEY)


def test_queued_writes_land_in_order_whatever_the_queue_depth(tmp_path: Path, monkeypatch) -> None:
    """More batches than `WRITES_IN_FLIGHT` to one file: every row, in the order written."""
    monkeypatch.setattr(ShardWriter, "WRITES_IN_FLIGHT", 2)
    with ShardWriter(tmp_path, "s", KEY) as writer:
        for seq in range(7):
            writer.write({"model": "m", "layer": 0}, rows(seq))
    table = pq.read_table(verified_files(tmp_path)[0])
    assert table["seq_id"].to_pylist() == [seq for seq in range(7) for _ in range(4)]
    want = np.concatenate([arrow_to_vectors(rows(seq)["h"]) for seq in range(7)])
    assert np.array_equal(arrow_to_vectors(table["h"]), want)


def test_parallel_partition_files_have_the_bytes_of_one_sequential_writer_and_their_hashes(tmp_path: Path) -> None:
    """Each partition's file is written on its own thread and hashed while it grows: the bytes are those a
    plain sequential `ParquetWriter` writes from the same batches, and the manifest holds their sha256."""
    with ShardWriter(tmp_path / "threads", "s", KEY) as writer:
        for seq in range(5):
            for layer in range(3):
                writer.write({"model": "m", "layer": layer}, rows(10 * seq + layer, n=50, d=16))
    manifest = json.loads(store.manifest_path(tmp_path / "threads", "s").read_text())
    for entry in manifest["files"]:
        written = tmp_path / "threads" / entry["path"]
        layer = ROWS.partition_values(Path(entry["path"]))["layer"]
        assert entry["sha256"] == hashlib.sha256(written.read_bytes()).hexdigest() and entry["rows"] == 250
        batches = [rows(10 * seq + layer, n=50, d=16) for seq in range(5)]
        schema = batches[0].schema.with_metadata(pq.read_schema(written).metadata)
        plain = tmp_path / f"plain-{layer}.parquet"
        with pq.ParquetWriter(plain, schema, **store._encoding(schema)) as sequential:
            for batch in batches:
                sequential.write_table(batch)
        assert plain.read_bytes() == written.read_bytes()


def test_rewriting_a_shard_replaces_all_of_its_old_files(tmp_path: Path) -> None:
    write_shard(tmp_path, "s", layers=(0, 1))
    write_shard(tmp_path, "other", layers=(0,))
    write_shard(tmp_path, "s", layers=(2,))
    assert data_files(tmp_path) == [
        f"model=m/layer=0/part-{shard_slug('other')}.parquet",
        f"model=m/layer=2/part-{shard_slug('s')}.parquet",
    ]
    assert verified_files(tmp_path) == [tmp_path / f for f in data_files(tmp_path)]


# ------------------------------------------------------------------------------ killed writers
WRITER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np, pyarrow as pa
    from lmgeo.core import store
    from lmgeo.core.contracts import vectors_to_arrow
    root, shard, moment = sys.argv[1], sys.argv[2], sys.argv[3]
    key = store.ManifestKey({"activations": "abc123"}, "p1", "c1")
    if moment == "before-manifest":  # die after the renames, before the manifest
        store.atomic_write = lambda path, text: os.kill(os.getpid(), signal.SIGKILL)
    with store.ShardWriter(root, shard, key) as writer:
        for i in range(10 if moment == "before-manifest" else 10**9):
            table = pa.table({"seq_id": pa.array([i] * 4, pa.int32()), "pos": pa.array(range(4), pa.int32()),
                              "h": vectors_to_arrow(np.ones((4, 3)))})
            writer.write({"model": "m", "layer": i % 2}, table)
            if i == 20:
                print("writing", flush=True)
""")


def kill_writer(root: Path, shard: str, moment: str) -> None:
    command = [sys.executable, "-c", WRITER, str(root), shard, moment]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    if moment == "mid-write":
        assert child.stdout.readline() == "writing\n"
        os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL


def resume(root: Path, shards: dict[str, int]) -> list[str]:
    """A stage re-run: skip complete shards, redo the others; returns the shards it wrote."""
    redone = []
    for shard, seq in shards.items():
        if not shard_complete(root, shard, KEY):
            write_shard(root, shard, seq=seq)
            redone.append(shard)
    return redone


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid-write", "before-manifest"])
def test_a_killed_shard_is_redone_and_complete_shards_are_skipped(tmp_path: Path, moment: str) -> None:
    write_shard(tmp_path, "done", seq=1)
    done_file = verified_files(tmp_path)[0]
    before = done_file.stat()
    kill_writer(tmp_path, "killed", moment)

    leftovers = [p.name for p in tmp_path.rglob("*") if shard_slug("killed") in p.name]
    assert leftovers, "the killed writer left nothing to clean up"
    if moment == "mid-write":
        assert all(name.startswith(".") and ".tmp-" in name for name in leftovers), leftovers
    assert not shard_complete(tmp_path, "killed", KEY)
    assert all(shard_slug("done") in p.name for p in verified_files(tmp_path))
    assert set(read_all(tmp_path)["seq_id"].to_pylist()) == {1}

    assert resume(tmp_path, {"done": 1, "killed": 2}) == ["killed"]
    assert done_file.stat().st_ino == before.st_ino and done_file.stat().st_mtime_ns == before.st_mtime_ns
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    seq_ids = read_all(tmp_path)["seq_id"].to_pylist()
    assert (seq_ids.count(1), seq_ids.count(2), len(seq_ids)) == (8, 8, 16)  # 4 rows x 2 layers each, nothing partial
    assert resume(tmp_path, {"done": 1, "killed": 2}) == []


# ---------------------------------------------------------------------------------- corruption
def corrupt(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    else:  # same size, different bytes: only the hash can tell
        path.write_bytes(os.urandom(size))


@pytest.mark.parametrize(("how", "reason"), [("truncate", "truncated"), ("garbage", "sha256")])
def test_a_corrupted_shard_is_named_with_how_to_rebuild_it(tmp_path: Path, how: str, reason: str) -> None:
    write_shard(tmp_path, "good", seq=1)
    write_shard(tmp_path, "bad", seq=2)
    hour_ago = os.stat(tmp_path).st_mtime - 3600
    for path in tmp_path.rglob("*.parquet"):
        os.utime(path, (hour_ago, hour_ago))  # old enough for the hash cache to keep
    verified_files(tmp_path)  # hashes every file once; the rewrite below must not hit the cache
    victim = tmp_path / f"model=m/layer=1/part-{shard_slug('bad')}.parquet"
    corrupt(victim, how)

    for reader in (
        lambda: verify_shard(tmp_path, "bad"),
        lambda: verified_files(tmp_path),
        lambda: verified_files(tmp_path, {"bad": KEY}),
    ):
        with pytest.raises(CorruptShardError) as err:
            reader()
        message = str(err.value)
        assert message.startswith(f"{victim}: corrupt shard") and reason in message
        assert str(store.manifest_path(tmp_path, "bad")) in message and "dvc repro -f" in message
    assert verify_shard(tmp_path, "good")

    assert resume(tmp_path, {"good": 1, "bad": 2}) == ["bad"]  # a re-run redoes just that shard
    assert read_all(tmp_path).num_rows == 16


def test_a_corrupted_manifest_is_named_and_the_shard_redone(tmp_path: Path) -> None:
    write_shard(tmp_path, "s")
    manifest = store.manifest_path(tmp_path, "s")
    corrupt(manifest, "garbage")
    with pytest.raises(CorruptShardError, match=re.escape(f"{manifest}: corrupt shard: unreadable manifest")):
        verified_files(tmp_path)
    assert resume(tmp_path, {"s": 0}) == ["s"]
    assert verify_shard(tmp_path, "s")


@pytest.mark.parametrize("damage", ["no shard", "no key", "entry without bytes", "files not a list"])
def test_a_manifest_without_its_fields_is_named_not_a_key_error(tmp_path: Path, damage: str) -> None:
    """Valid JSON of the right format but missing a field readers index: the manifest is named (it was a
    KeyError naming no file), and a re-run or a prune treats the shard like any corrupt one."""
    write_shard(tmp_path, "s")
    write_shard(tmp_path, "other", seq=1)
    manifest = store.manifest_path(tmp_path, "s")
    record = json.loads(manifest.read_text())
    if damage == "no shard":
        del record["shard"]
    elif damage == "no key":
        del record["params_hash"]
    elif damage == "entry without bytes":
        del record["files"][0]["bytes"]
    else:
        record["files"] = "model=m"
    manifest.write_text(json.dumps(record))
    for reader in (
        lambda: verified_files(tmp_path),
        lambda: verified_files(tmp_path, {"s": KEY}),
        lambda: verify_shard(tmp_path, "s"),
        lambda: dataset_digest(tmp_path),
    ):
        with pytest.raises(CorruptShardError, match=re.escape(f"{manifest}: corrupt shard: a manifest without")):
            reader()
    assert resume(tmp_path, {"s": 0, "other": 1}) == ["s"]
    manifest.write_text(json.dumps(record))
    prune_shards(tmp_path, {"s", "other"})
    assert not manifest.exists()
    assert {p.name for p in verified_files(tmp_path)} == {f"part-{shard_slug('other')}.parquet"}


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    write_shard(tmp_path, "s")
    victim = verified_files(tmp_path)[0]
    victim.unlink()
    with pytest.raises(CorruptShardError, match=re.escape(f"{victim}: corrupt shard: missing file")):
        verify_shard(tmp_path, "s")


# ------------------------------------------------------------------------------------- reading
def test_read_takes_one_partition_in_row_order_and_agrees_with_a_plain_glob(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", seq=1, layers=(0, 1, 10))
    write_shard(tmp_path, "b", seq=0, layers=(0, 1, 10))
    files = verified_files(tmp_path)
    assert [ROWS.partition_values(f.relative_to(tmp_path))["layer"] for f in files].count(10) == 2  # typed: int
    table = read(tmp_path, ROWS, files, {"model": "m", "layer": 10})
    assert table["seq_id"].to_pylist() == [0] * 4 + [1] * 4  # the dataset's order, whatever the shards'
    expected = np.concatenate([arrow_to_vectors(rows(0)["h"]), arrow_to_vectors(rows(1)["h"])])
    assert np.array_equal(arrow_to_vectors(table["h"]), expected)
    glob = duckdb.sql(f"SELECT count(*) FROM read_parquet('{tmp_path}/**/*.parquet', hive_partitioning = true)")
    assert glob.fetchall()[0][0] == read_all(tmp_path).num_rows == 24


def test_reading_a_partition_that_has_no_data_says_so(tmp_path: Path) -> None:
    write_shard(tmp_path, "a")
    with pytest.raises(InputError, match="no data for"):
        read(tmp_path, ROWS, verified_files(tmp_path), {"model": "m", "layer": 7})


def test_a_reader_takes_only_the_planned_shards_with_their_keys(tmp_path: Path) -> None:
    write_shard(tmp_path, "planned", seq=0)
    write_shard(tmp_path, "unplanned", seq=1)
    assert {p.name for p in verified_files(tmp_path, {"planned": KEY})} == {f"part-{shard_slug('planned')}.parquet"}
    stale = ManifestKey(KEY.inputs, "p2", KEY.code_version)
    planned = store.manifest_path(tmp_path, "planned")
    with pytest.raises(
        StaleShardError, match=re.escape(f"shard 'planned' is stale (its params hash in {planned} differ")
    ):
        verified_files(tmp_path, {"planned": stale}, rebuild="`lmgeo extract`")
    missing = store.manifest_path(tmp_path, "missing")
    with pytest.raises(StaleShardError, match=re.escape(f"'missing' is missing (no {missing}); run `lmgeo extract`")):
        verified_files(tmp_path, {"missing": KEY}, rebuild="`lmgeo extract`")


def test_a_dataset_mixing_two_keys_is_refused_without_a_plan(tmp_path: Path) -> None:
    write_shard(tmp_path, "a")
    write_shard(tmp_path, "b", key=ManifestKey(KEY.inputs, "p2", KEY.code_version))
    write_shard(tmp_path, "c", key=ManifestKey(KEY.inputs, "p2", KEY.code_version))
    with pytest.raises(StaleShardError, match="2 different params hashes") as err:
        verified_files(tmp_path)
    # A manifest of each side is named, so the shards of the interrupted run can be found.
    a, b = store.manifest_path(tmp_path, "a"), store.manifest_path(tmp_path, "b")
    assert f"2 different params hashes (p1 ({a}), p2 ({b} and 1 more))" in str(err.value)


def test_a_completed_plan_lets_shards_hold_their_own_keys_and_catches_a_half_redone_stage(tmp_path: Path) -> None:
    """Each shard holds the code and params it reads, so keys differ within a dataset; the record of the
    plan its stage last completed is what a reader without a plan checks them against."""
    own = ManifestKey(KEY.inputs, "p2", "c2")
    write_shard(tmp_path, "a")
    write_shard(tmp_path, "b", key=own, seq=1)
    write_plan(tmp_path, {"a": KEY, "b": own})
    assert len(verified_files(tmp_path)) == 4  # two layers of each shard
    assert prune_shards(tmp_path, {"a", "b"}) == 0 and (tmp_path / PLAN_FILE).is_file()  # not a stray file
    write_shard(tmp_path, "b", key=ManifestKey(KEY.inputs, "p3", "c2"), seq=1)  # redone by a run killed later
    with pytest.raises(StaleShardError, match="shard 'b' is stale"):
        verified_files(tmp_path)


def test_dataset_digest_follows_the_shards_under_its_prefix(tmp_path: Path) -> None:
    write_shard(tmp_path, "m1/seq=0", seq=0)
    write_shard(tmp_path, "m2/seq=0", seq=5)
    digest = dataset_digest(tmp_path, prefix="m1/")
    write_shard(tmp_path, "m2/seq=0", seq=6)
    assert dataset_digest(tmp_path, prefix="m1/") == digest
    write_shard(tmp_path, "m1/seq=0", seq=0)  # the same bytes again
    assert dataset_digest(tmp_path, prefix="m1/") == digest
    write_shard(tmp_path, "m1/seq=0", seq=1)
    assert dataset_digest(tmp_path, prefix="m1/") != digest


def test_prune_removes_unplanned_shards_and_leftovers_only(tmp_path: Path) -> None:
    for shard in ("keep-1", "keep-2", "stale"):
        write_shard(tmp_path, shard)
    stray_final = tmp_path / "model=m/layer=0/part-ghost-0123456789.parquet"
    stray_temp = tmp_path / "model=m/layer=5/.part-x.parquet.tmp-4242"
    for stray in (stray_final, stray_temp):
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_bytes(b"leftover")
    (tmp_path / "notes.txt").write_text("a stray file in a stage's output")
    assert prune_shards(tmp_path, keep={"keep-1", "keep-2", "planned-but-not-written"}) == 1
    assert not stray_final.exists() and not stray_temp.exists() and not (tmp_path / "notes.txt").exists()
    assert not (tmp_path / "model=m" / "layer=5").exists()  # emptied folders go too
    kept = {f"part-{shard_slug(s)}.parquet" for s in ("keep-1", "keep-2")}
    assert {p.name for p in verified_files(tmp_path)} == kept
    assert not shard_complete(tmp_path, "stale", KEY)


# ----------------------------------------------------------------------------------- atomic_path
def test_atomic_path_replaces_files_and_directories_only_on_success(tmp_path: Path) -> None:
    target = tmp_path / "run" / "steps.parquet"
    with atomic_path(target) as tmp:
        assert not tmp.name.endswith(".parquet")
        tmp.write_text("v1")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert target.read_text() == "v1" and os.listdir(target.parent) == ["steps.parquet"]

    checkpoint = tmp_path / "run" / "final"
    for name in ("old.safetensors", "new.safetensors"):
        with atomic_path(checkpoint) as tmp:
            tmp.mkdir()
            (tmp / name).write_text(name)
    assert os.listdir(checkpoint) == ["new.safetensors"]
    with pytest.raises(FileNotFoundError, match="nothing was written"), atomic_path(checkpoint):
        pass
