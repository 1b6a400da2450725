"""Atomic, resumable, verified shard store (SPEC §1, §7).

A dataset is a folder ``root`` of files plus ``root/_manifests/<slug>.json``, one manifest per shard. A
shard's files (hive-partitioned Parquet parts, or whole folders such as a checkpoint) are written under
hidden temporary names, fsynced and renamed into place; its manifest (the shard's key — the inputs'
hashes, the params hash, the code version — and every file with its size and sha256) is written last,
atomically. So:

- a shard is complete exactly when its manifest exists, has the planned key, and its files match it;
  a shard killed mid-write has no manifest and is redone by the next run (its leftovers are removed);
- readers take only the files that manifests list, checked (size and sha256) on every read, never a
  stray or half-written file, and never the shards of two different keys mixed together;
- temporary names are hidden and never end in ``.parquet``, so no glob over a dataset sees them.

Every other file the pipeline writes (tables, reports, token files) goes through ``atomic_path`` or
``atomic_write``: the one atomic-write helper, with fsync.

Tasks never write to the workspace: a task records a shard's output in ``ShardParts`` (the calls a
``ShardWriter`` takes), which travels through Ray to the driver, whose ``ShardParts.commit`` writes it
with a ``ShardWriter`` (SPEC §1).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import InputError

MANIFEST_DIR = "_manifests"
MANIFEST_FORMAT = 2
# The keys of the last plan a stage completed, `root/_plan.json`: what a reader without a plan of its own
# (a query, or a result at an old revision) checks every shard against. Shards of one plan may hold
# different keys (each holds the code and params it reads), so "one key for all" cannot tell a complete
# dataset from one a stage left half-redone.
PLAN_FILE = "_plan.json"

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ vectors
def vector_type(d: int, half: bool = False) -> pa.DataType:
    """``fixed_size_list<float32>[d]`` (``float16`` with ``half``), the type of every stored vector."""
    if d < 1:
        raise ValueError(f"vector dimension must be >= 1, got {d}")
    return pa.list_(pa.float16() if half else pa.float32(), d)


def vectors_to_arrow(x: np.ndarray, half: bool = False) -> pa.FixedSizeListArray:
    """An ``(n, d)`` array as a column of ``vector_type(d, half)``."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"expected an (n, d) array with d >= 1, got shape {x.shape}")
    flat = np.ascontiguousarray(x, dtype=np.float16 if half else np.float32).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), x.shape[1])


def arrow_to_vectors(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A vector column as an ``(n, d)`` float32 array.

    Besides ``fixed_size_list`` it takes the plain ``list`` that DuckDB returns for such a column
    (Parquet has no fixed-size list), as long as every row has the same length. A single float32
    chunk is returned without copying, as a read-only view of the Arrow buffer.
    """
    t = col.type
    if not (pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise TypeError(f"expected a list column of vectors, got {col.type}")
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = [_chunk_to_vectors(chunk) for chunk in chunks if len(chunk)]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        d = col.type.list_size if pa.types.is_fixed_size_list(col.type) else 0
        return np.empty((0, d), dtype=np.float32)
    if len({p.shape[1] for p in parts}) > 1:
        raise ValueError(f"vector column mixes lengths {sorted({p.shape[1] for p in parts})}")
    return np.concatenate(parts)


def _chunk_to_vectors(chunk: pa.Array) -> np.ndarray:
    if chunk.null_count:
        raise ValueError(f"vector column has {chunk.null_count} null rows")
    if pa.types.is_fixed_size_list(chunk.type):
        d = chunk.type.list_size
    else:
        lengths = np.unique(chunk.value_lengths().to_numpy())
        if len(lengths) != 1:
            raise ValueError(f"vector column has rows of different lengths {lengths.tolist()}")
        d = int(lengths[0])
    values = chunk.flatten()  # honours the chunk's offset when it is a slice
    return values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, d)



# ------------------------------------------------------------------------------------- hashes
def file_sha256(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# sha256 of files this process has already hashed, keyed by what a rewrite changes. Tasks read the
# same dataset many times (each fit shard reads two layers of it); each file is hashed once. As in
# git's "racy clean" rule, a file modified within the last seconds is not cached: file times are
# coarse (a clock tick), so a rewrite right after hashing could keep the same mtime.
_hashed: dict[tuple[str, int, int, int], str] = {}
_RACY_NS = 2_000_000_000


def sha256_cached(path: Path) -> str:
    st = path.stat()
    identity = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if identity in _hashed:
        return _hashed[identity]
    digest = file_sha256(path)
    if time.time_ns() - st.st_mtime_ns > _RACY_NS:
        _hashed[identity] = digest
    return digest


def folder_digest(path: Path) -> str:
    """A hash of every file under a folder (names and contents): it changes when any file does."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{sha256_cached(file)}\n".encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------- manifests
@dataclass(frozen=True)
class ManifestKey:
    """What a shard's output depends on; a re-run redoes the shard when any of it changes."""

    inputs: dict[str, str]  # input name -> content hash
    params_hash: str
    code_version: str


class CorruptShardError(InputError):
    """A shard whose manifest or files do not match what was written. The message names the file and
    how to rebuild it; the CLI reports it like any bad input (one message, exit code 2)."""


class StaleShardError(InputError):
    """A dataset whose shards do not match the plan that reads them (missing, stale or mixed keys)."""


def shard_slug(shard: str) -> str:
    """A filesystem-safe, unique file stem for a shard key (keys contain '/', '=', '@')."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", shard).strip("._")[:80]
    digest = hashlib.sha256(shard.encode()).hexdigest()[:10]  # two keys may share a readable form
    return f"{readable}-{digest}" if readable else digest


def manifest_path(root: Path, shard: str) -> Path:
    return Path(root) / MANIFEST_DIR / f"{shard_slug(shard)}.json"


def shard_complete(root: Path, shard: str, key: ManifestKey) -> bool:
    """True when the shard's manifest has ``key`` and its files are intact (size and sha256).

    A corrupt shard is reported in the log and counts as incomplete, so the caller redoes it.
    """
    try:
        if manifest_key(_read_manifest(Path(root), shard)) != key:
            return False
        verify_shard(root, shard)
    except FileNotFoundError:
        return False
    except CorruptShardError as err:
        log.warning("%s; redoing the shard", err)
        return False
    return True


def verify_shard(root: Path, shard: str) -> list[Path]:
    """The shard's files after checking their size and sha256; ``CorruptShardError`` names a bad one."""
    return _check_files(Path(root), _read_manifest(Path(root), shard))


def verified_files(
    root: Path, expected: Mapping[str, ManifestKey] | None = None, *, rebuild: str = "its stage"
) -> list[Path]:
    """The files of the dataset under ``root`` that a reader may use, each checked (size and sha256).

    With ``expected`` (shard → the key the current plan gives it), exactly those shards are read: a
    planned shard without a manifest, or whose manifest has another key, is an error naming the command
    that rebuilds it (``rebuild``); shards outside the plan are never read. Without it (reading a
    result as it was written, e.g. at an old revision), the shards of the plan its stage last completed
    (``write_plan``) are read, each with the key that plan gave it, so a dataset a stage left half-redone
    is an error; a dataset without such a record must have one params hash and one code version.
    """
    root = Path(root)
    manifests = {m["shard"]: m for m in map(_load_manifest, sorted((root / MANIFEST_DIR).glob("*.json")))}
    if expected is None and (root / PLAN_FILE).is_file():
        expected = read_plan(root)
    if expected is None:
        _check_unmixed(root, manifests.values(), rebuild)
        chosen = list(manifests.values())
    else:
        chosen = [_planned(root, manifests.get(shard), shard, key, rebuild) for shard, key in expected.items()]
    return [path for manifest in chosen for path in _check_files(root, manifest)]


def write_plan(root: Path, planned: Mapping[str, ManifestKey], *, complete: bool = True) -> None:
    """Record the plan (shard → key) a stage runs in `root`: before its fan-out with `complete=False` (so that
    a reader of a stage stopped half-way knows which shards are still to come), and again once every shard is
    complete (then without the `in_progress` key, as the record always was)."""
    keys = {shard: asdict(key) for shard, key in sorted(planned.items())}
    record = {"format": MANIFEST_FORMAT, "shards": keys, **({} if complete else {"in_progress": True})}
    atomic_write(Path(root) / PLAN_FILE, json.dumps(record, indent=1, sort_keys=True))


def read_plan(root: Path) -> dict[str, ManifestKey]:
    return _read_plan(Path(root))[0]


def _read_plan(root: Path) -> tuple[dict[str, ManifestKey], bool]:
    """The plan's keys (shard → key) and whether the stage is still running it."""
    path = root / PLAN_FILE
    try:
        record = json.loads(path.read_text())
        return {shard: ManifestKey(**key) for shard, key in record["shards"].items()}, bool(record.get("in_progress"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptShardError(
            f"{path}: unreadable record of the last plan of the stage that writes {root} ({err}); re-run that "
            "stage (`dvc repro`, or its `lmgeo` command)"
        ) from None


def files_so_far(root: Path, *, rebuild: str = "its stage") -> tuple[list[Path], list[str]]:
    """For a reader that takes what is there (a query of a study still training): while the stage's plan is in
    progress (`write_plan(complete=False)`: the stage stopped or is running), the verified files of its shards
    complete so far and the shards still missing; otherwise `verified_files(root)` and none missing."""
    root = Path(root)
    planned, in_progress = _read_plan(root) if (root / PLAN_FILE).is_file() else ({}, False)
    if not in_progress:
        return verified_files(root, rebuild=rebuild), []
    manifests = {m["shard"]: m for m in map(_load_manifest, sorted((root / MANIFEST_DIR).glob("*.json")))}
    done, missing = [], []
    for shard, key in planned.items():
        manifest = manifests.get(shard)
        if manifest is not None and manifest_key(manifest) == key:
            done.append(manifest)
        else:
            missing.append(shard)
    return [path for manifest in done for path in _check_files(root, manifest)], missing


def _planned(root: Path, manifest: dict[str, Any] | None, shard: str, key: ManifestKey, rebuild: str) -> dict[str, Any]:
    if manifest is None:
        raise StaleShardError(
            f"{root}: shard {shard!r} is missing (no {manifest_path(root, shard)}); run {rebuild} first"
        )
    if manifest_key(manifest) != key:
        changed = [name for name, old, new in _key_parts(manifest_key(manifest), key) if old != new]
        raise StaleShardError(
            f"{root}: shard {shard!r} is stale (its {', '.join(changed)} in {manifest_path(root, shard)} differ "
            f"from the current plan's); run {rebuild} to recompute it"
        )
    return manifest


def _key_parts(old: ManifestKey, new: ManifestKey) -> list[tuple[str, Any, Any]]:
    parts = [("params hash", old.params_hash, new.params_hash), ("code version", old.code_version, new.code_version)]
    names = sorted(set(old.inputs) | set(new.inputs))
    return parts + [(f"input {n!r}", old.inputs.get(n), new.inputs.get(n)) for n in names]


def _check_unmixed(root: Path, manifests: Any, rebuild: str) -> None:
    for field, plural in (("params_hash", "params hashes"), ("code_version", "code versions")):
        holders: dict[str, list[str]] = {}
        for m in manifests:
            holders.setdefault(m[field], []).append(m["shard"])
        values = sorted(holders)
        if len(values) > 1:
            # Name a manifest of each value, so the shards of one run of the stage can be told from the other's.
            named = ", ".join(
                f"{value} ({manifest_path(root, min(holders[value]))}"
                f"{f' and {len(holders[value]) - 1} more' if len(holders[value]) > 1 else ''})"
                for value in values
            )
            raise StaleShardError(
                f"{root}: its shards were written with {len(values)} different {plural} "
                f"({named}): a stage was interrupted after a change; run {rebuild} to finish it"
            )


def dataset_digest(root: Path, prefix: str = "") -> str:
    """A hash of the shards whose key starts with ``prefix``: it changes when any of them is redone.

    Downstream shards put it in their ``ManifestKey.inputs``. It is computed from the manifests
    (each file's recorded sha256), so no data file is read.
    """
    shards = []
    for path in sorted((Path(root) / MANIFEST_DIR).glob("*.json")):
        manifest = _load_manifest(path)
        if manifest["shard"].startswith(prefix):
            shards.append([manifest["shard"], [[f["path"], f["sha256"]] for f in manifest["files"]]])
    return hashlib.sha256(json.dumps(sorted(shards)).encode()).hexdigest()[:16]


def prune_shards(root: Path, keep: set[str]) -> int:
    """Remove the shards whose key is not in ``keep``, every file no kept manifest lists, and the
    folders that leaves empty.

    A stage calls it before fanning out (after its plan validated), so results of shards that are no
    longer planned (a model removed from params) never reach a reader, and leftovers of killed writes
    and stray files are swept. Returns the number of shards removed.
    """
    root = Path(root)
    removed = 0
    listed: set[Path] = set()
    for path in sorted((root / MANIFEST_DIR).glob("*.json")):
        try:
            manifest = _load_manifest(path)
        except CorruptShardError as err:  # its key is unknown: its files are unlisted and go below
            log.warning("%s; removing the shard", err)
            path.unlink()
            continue
        if manifest["shard"] in keep:
            listed.update(root / f["path"] for f in manifest["files"])
        else:
            path.unlink()
            removed += 1
    for path in _data_files_on_disk(root):
        if path not in listed:
            path.unlink(missing_ok=True)
    _remove_empty_dirs(root)
    return removed


def remove_shard(root: Path, shard: str) -> None:
    """Delete a shard: its manifest first (so it stops counting as complete), then the files it lists
    and any temporaries of a killed attempt. Emptied folders stay: tasks of the same stage run
    concurrently and may be about to write into one (`prune_shards`, before the fan-out, sweeps them)."""
    root = Path(root)
    path = manifest_path(root, shard)
    listed: list[Path] = []
    if path.exists():
        try:
            listed = [root / f["path"] for f in _load_manifest(path)["files"]]
        except CorruptShardError:
            listed = []
        path.unlink()
    for file in listed:
        file.unlink(missing_ok=True)
    # Temporaries of a killed attempt, by name (no manifest lists them); a killed checkpoint folder has no
    # name of the shard's, and goes with the stage's prune of every unlisted file.
    slug = shard_slug(shard)
    for temp in _walk_files(root):
        if temp.name.startswith((f".{slug}.json.tmp-", f".part-{slug}.parquet.tmp-")):
            temp.unlink(missing_ok=True)


def _data_files_on_disk(root: Path) -> list[Path]:
    """Every file under ``root`` except the manifests, temporaries of writes in progress included."""
    manifests = root / MANIFEST_DIR
    return [p for p in _walk_files(root) if p.parent != manifests and p != root / PLAN_FILE]


def _remove_empty_dirs(root: Path) -> None:
    for directory, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        path = Path(directory)
        if path != root and path.name != MANIFEST_DIR and not any(path.iterdir()):
            path.rmdir()


def _walk_files(root: Path) -> Iterator[Path]:
    for directory, _, names in os.walk(root):
        for name in names:
            yield Path(directory) / name


def _read_manifest(root: Path, shard: str) -> dict[str, Any]:
    path = manifest_path(root, shard)
    if not path.exists():
        raise FileNotFoundError(f"{path}: shard {shard!r} has no manifest (never completed)")
    return _load_manifest(path)


def _load_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(path, path, f"unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise _corrupt(path, path, "not a manifest of this format (written by another lmgeo version?)")
    if not _well_formed(manifest):  # readers index these fields: a KeyError would name no file
        raise _corrupt(path, path, "a manifest without its shard, key or list of files (edited by hand?)")
    return manifest


def _well_formed(manifest: dict[str, Any]) -> bool:
    files = manifest.get("files")
    return (
        isinstance(manifest.get("shard"), str)
        and isinstance(manifest.get("inputs"), dict)
        and isinstance(manifest.get("params_hash"), str)
        and isinstance(manifest.get("code_version"), str)
        and isinstance(files, list)
        and all(isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("bytes"), int)
                and isinstance(f.get("sha256"), str) for f in files)
    )


def manifest_key(manifest: dict[str, Any]) -> ManifestKey:
    return ManifestKey(manifest["inputs"], manifest["params_hash"], manifest["code_version"])


def _check_files(root: Path, manifest: dict[str, Any]) -> list[Path]:
    own_manifest = manifest_path(root, manifest["shard"])
    paths = []
    for entry in manifest["files"]:
        path = root / entry["path"]
        if path.is_symlink() or not path.is_file():
            raise _corrupt(path, own_manifest, f"missing file of shard {manifest['shard']!r}")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise _corrupt(path, own_manifest, f"{size} bytes where {entry['bytes']} were written (truncated?)")
        if sha256_cached(path) != entry["sha256"]:
            raise _corrupt(path, own_manifest, "content differs from what was written (sha256 mismatch)")
        paths.append(path)
    return paths


def _corrupt(path: Path, manifest: Path, reason: str) -> CorruptShardError:
    # Name the dataset: the reader that hits this is a later stage, not the one that rebuilds the shard.
    dataset = manifest.parent.parent
    return CorruptShardError(
        f"{path}: corrupt shard: {reason}. To rebuild it, re-run the stage that writes {dataset} (`dvc repro`, "
        f"or its `lmgeo` command): it redoes every shard whose files do not match its manifest (here {manifest}) "
        "and keeps the others; `dvc repro -f <stage>` rebuilds the whole stage."
    )


# ------------------------------------------------------------------------------------- writing
_PARTITION_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNSAFE_VALUE = re.compile(r"[/\\=%\x00]")  # path separators, and what hive readers decode or split on


def partition_dir(partition: Mapping[str, str | int]) -> Path:
    """``{"model": "m", "layer": 3}`` -> ``model=m/layer=3``, refusing values that would break the path."""
    parts = []
    for name, value in partition.items():
        text = str(value)
        if not _PARTITION_KEY.match(name):
            raise ValueError(f"partition key {name!r} is not an identifier")
        if not text or text in (".", "..") or _UNSAFE_VALUE.search(text):
            raise ValueError(f"partition value {name}={text!r} is not usable in a path")
        parts.append(f"{name}={text}")
    return Path(*parts)


def _encoding(schema: pa.Schema) -> dict[str, Any]:
    """Parquet options per column: dictionaries, compression and page statistics for the scalar columns only.
    Float vectors neither repeat nor compress nor get filtered by value: dictionaries made extraction writes ~8x
    slower; snappy and statistics took 9% of a shard's write (25.5 → 23.3 ms for 5 layers of 2048 × 256
    float32) and snappy saved 0.45% of its bytes."""
    scalars = [f.name for f in schema if not pa.types.is_fixed_size_list(f.type) and not pa.types.is_list(f.type)]
    vectors = [f.name for f in schema if f.name not in scalars]
    return {"use_dictionary": scalars, "write_statistics": scalars,
            "compression": {**dict.fromkeys(scalars, "snappy"), **dict.fromkeys(vectors, "none")}}


def _temporary(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


class ShardWriter:
    """Writes one shard of the dataset under ``root``; use as a context manager.

    Entering removes whatever an earlier attempt left of this shard. ``write`` streams record batches
    into one temporary Parquet file per partition; the encoding and writing run on a background thread,
    in order, off the caller's critical path (a forward overlaps the previous batch's write), with at most
    ``WRITES_IN_FLIGHT`` batches queued so memory is bounded by them. ``directory`` gives a temporary
    folder to fill (a checkpoint). A clean exit waits for the writes, fsyncs and hashes the files (in
    parallel: the fsyncs share the journal's commits), renames everything into place and then writes the
    manifest; an exception (the caller's or a write's) deletes everything of the shard and writes no
    manifest. ``metadata`` goes into every Parquet file's key-value metadata, with the shard key, params
    hash and code version.
    """

    WRITES_IN_FLIGHT = 8

    def __init__(self, root: Path, shard: str, key: ManifestKey, metadata: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self.shard = shard
        self.key = key
        self._slug = shard_slug(shard)
        self._metadata = {
            "lmgeo.shard": shard,
            "lmgeo.params_hash": key.params_hash,
            "lmgeo.code_version": key.code_version,
            **(metadata or {}),
        }
        self._open: dict[Path, tuple[Path, pq.ParquetWriter]] = {}  # final path -> (temp path, writer)
        self._rows: dict[Path, int] = {}
        self._folders: dict[Path, Path] = {}  # final folder -> filled temporary folder
        self._writes: ThreadPoolExecutor | None = None  # one thread: the writes run in the order given
        self._in_flight: deque[Future[None]] = deque()

    def __enter__(self) -> ShardWriter:
        remove_shard(self.root, self.shard)
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="lmgeo-shard-writer")
        return self

    def write(
        self, partition: Mapping[str, str | int], data: pa.Table | pa.RecordBatch, name: str | None = None
    ) -> None:
        """Append ``data`` to the shard's file in ``partition`` (named ``part-<slug>.parquet`` unless ``name``).
        Returns once the write is queued; a failed write raises here, at a later ``write``, or on exit."""
        if self._writes is None:
            raise RuntimeError("ShardWriter.write outside its `with` block")
        table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        final = self.root / partition_dir(partition) / (name or f"part-{self._slug}.parquet")
        if final not in self._open:
            final.parent.mkdir(parents=True, exist_ok=True)
            temp = _temporary(final)
            schema = table.schema.with_metadata({**(table.schema.metadata or {}), **self._metadata})
            self._open[final] = (temp, pq.ParquetWriter(temp, schema, **_encoding(schema)))
            self._rows[final] = 0
        self._rows[final] += table.num_rows
        while len(self._in_flight) >= self.WRITES_IN_FLIGHT:
            self._in_flight.popleft().result()
        self._in_flight.append(self._writes.submit(self._open[final][1].write_table, table))

    @contextmanager
    def directory(self, relative: str) -> Iterator[Path]:
        """A temporary folder to fill; it becomes ``root/relative`` when the shard commits."""
        if self._writes is None:
            raise RuntimeError("ShardWriter.directory outside its `with` block")
        final = self.root / relative
        temp = _temporary(final)
        _remove(temp)
        temp.mkdir(parents=True)
        try:
            yield temp
        except BaseException:
            _remove(temp)
            raise
        self._folders[final] = temp

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._abort()
            return
        try:
            self._commit()
        except BaseException:
            self._abort()
            raise

    def _stop_writes(self) -> None:
        """Wait for the queued writes (cancelling those not started when aborting) and end the thread."""
        if self._writes is not None:
            self._writes.shutdown(wait=True, cancel_futures=True)
            self._writes = None

    def _commit(self) -> None:
        while self._in_flight:
            self._in_flight.popleft().result()  # the first failed write, if any, aborts the shard
        self._stop_writes()
        for _, writer in self._open.values():
            writer.close()
        # Every file as (temporary path, final path); a filled folder's files keep their relative paths.
        files = {temp: final for final, (temp, _) in self._open.items()} | {
            file: final / file.relative_to(temp) for final, temp in self._folders.items() for file in _walk_files(temp)
        }
        with ThreadPoolExecutor(min(8, len(files) or 1)) as pool:
            synced = dict(zip(files.values(), pool.map(_synced_size_and_sha256, files), strict=True))
        renames = {final: temp for final, (temp, _) in self._open.items()} | self._folders
        for final, temp in renames.items():
            _remove(final)  # a leftover of a killed attempt; os.replace cannot replace a folder
            os.replace(temp, final)
        with ThreadPoolExecutor(min(8, len(renames) or 1)) as pool:
            list(pool.map(_fsync_dir, {final.parent for final in renames}))
        self._open.clear()
        self._folders.clear()
        manifest = {"format": MANIFEST_FORMAT, "shard": self.shard, **asdict(self.key),
                    "files": [self._entry(path, *synced[path]) for path in sorted(synced)]}  # fmt: skip
        atomic_write(manifest_path(self.root, self.shard), json.dumps(manifest, indent=1, sort_keys=True))

    def _entry(self, path: Path, size: int, sha256: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": path.relative_to(self.root).as_posix(), "bytes": size, "sha256": sha256}
        if path in self._rows:
            entry["rows"] = self._rows[path]
        return entry

    def _abort(self) -> None:
        self._in_flight.clear()
        self._stop_writes()
        for _, writer in self._open.values():
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the shard is being discarded; its files go next
                log.debug("closing a discarded Parquet writer failed", exc_info=True)
        for temp, _ in self._open.values():
            temp.unlink(missing_ok=True)
        for temp in self._folders.values():
            _remove(temp)
        self._open.clear()
        self._folders.clear()
        remove_shard(self.root, self.shard)


def _synced_size_and_sha256(path: Path) -> tuple[int, str]:
    """Flush a written file to disk; its size and sha256 (read back, as a reader will)."""
    _fsync_file(path)
    return path.stat().st_size, file_sha256(path)


@dataclass
class ShardParts:
    """One shard's output as a task computed it, for the driver to write (``commit``): the calls of a
    ``ShardWriter`` (``write``, ``directory``), recorded in order, so the files the driver writes have the
    bytes a ``ShardWriter`` in the task would have written. Picklable: it travels through Ray's object
    store, so a task needs no filesystem that the driver sees."""

    metadata: dict[str, str] = dataclass_field(default_factory=dict)
    tables: list[tuple[dict[str, str | int], pa.Table, str | None]] = dataclass_field(default_factory=list)
    folders: dict[str, dict[str, bytes]] = dataclass_field(default_factory=dict)

    def write(
        self, partition: Mapping[str, str | int], data: pa.Table | pa.RecordBatch, name: str | None = None
    ) -> None:
        """As ``ShardWriter.write``."""
        table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        self.tables.append((dict(partition), table, name))

    @contextmanager
    def directory(self, relative: str) -> Iterator[Path]:
        """As ``ShardWriter.directory``: a scratch folder of the task's node to fill; its files are kept."""
        with tempfile.TemporaryDirectory(prefix="lmgeo-shard-") as scratch:
            yield Path(scratch)
            self.folders[relative] = read_folder(Path(scratch))

    def commit(self, root: Path, shard: str, key: ManifestKey) -> None:
        """Write the shard under ``root`` (atomically, its manifest last)."""
        with ShardWriter(root, shard, key, metadata=self.metadata) as writer:
            for partition, table, name in self.tables:
                writer.write(partition, table, name)
            for relative, files in self.folders.items():
                with writer.directory(relative) as folder:
                    write_folder(folder, files)


def read_folder(path: Path) -> dict[str, bytes]:
    """Every file under ``path``: relative POSIX path → content, sorted by path (a folder to send)."""
    path = Path(path)
    return {file.relative_to(path).as_posix(): file.read_bytes() for file in sorted(_walk_files(path))}


def write_folder(path: Path, files: Mapping[str, bytes]) -> None:
    """Recreate under ``path`` the files that ``read_folder`` read."""
    for relative, content in files.items():
        target = Path(path) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


# ------------------------------------------------------------------------------- atomic writes
@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write a file or a directory to.

    On success it replaces ``path`` (removing what was there); on an exception it is deleted, so
    ``path`` is only ever absent, old, or complete. The temporary name is hidden and does not end in
    ``.parquet``, so globs over a dataset never see it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = _temporary(path)
    _remove(temp)
    try:
        yield temp
        if not temp.exists():
            raise FileNotFoundError(f"{temp}: nothing was written for {path}")
        for file in [temp] if temp.is_file() else list(_walk_files(temp)):
            _fsync_file(file)
        if path.is_dir() and not path.is_symlink():
            _remove(path)  # os.replace cannot replace a non-empty directory
        os.replace(temp, path)
        _fsync_dir(path.parent)
    except BaseException:
        _remove(temp)
        raise


def atomic_write(path: Path, content: str | bytes) -> None:
    """Write ``content`` to ``path`` atomically (see ``atomic_path``)."""
    with atomic_path(path) as temp:
        if isinstance(content, bytes):
            temp.write_bytes(content)
        else:
            temp.write_text(content)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: on POSIX the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
