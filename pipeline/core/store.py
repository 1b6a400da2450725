"""Atomic, resumable Parquet shard store (SPEC §1).

A dataset is a directory ``root`` of hive partitions (``root/model=m/layer=3/part-<slug>.parquet``)
plus ``root/_manifests/<slug>.json``, one manifest per shard. A shard's files are written to hidden
temporary names, fsynced and renamed into place; its manifest (the inputs' hashes, the params hash,
the code version, and every file with its size and sha256) is written last, atomically. So:

- a shard is complete exactly when its manifest exists, matches, and its files match the manifest;
  a shard killed mid-write has no manifest and is redone by the next run (its leftovers are removed);
- readers take only the files that complete manifests list, never a stray or half-written file;
- temporary names do not end in ``.parquet``, so ``read_parquet('root/**/*.parquet')`` never sees them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import InputError

if TYPE_CHECKING:
    import duckdb

MANIFEST_DIR = "_manifests"
MANIFEST_FORMAT = 1

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


# ------------------------------------------------------------------------------ hashes, version
def file_sha256(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@functools.cache
def code_version() -> str:
    """``<package version>+<hash of the pipeline/ sources>``: the same on every machine for the same code.

    Paths are hashed relative to the package and line endings normalised, so neither the checkout
    location nor a Windows checkout changes it.
    """
    package_dir = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        source = path.read_bytes().replace(b"\r\n", b"\n")
        for part in (path.relative_to(package_dir).as_posix().encode(), source):
            digest.update(len(part).to_bytes(8, "little") + part)
    return f"{_package_version()}+{digest.hexdigest()[:16]}"


def _package_version() -> str:
    try:
        return metadata.version("lmgeo")
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "0+uninstalled"


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


def shard_slug(shard: str) -> str:
    """A filesystem-safe, unique file stem for a shard key (keys contain '/', '=', '@')."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", shard).strip("._")[:80]
    digest = hashlib.sha256(shard.encode()).hexdigest()[:10]  # two keys may share a readable form
    return f"{readable}-{digest}" if readable else digest


def manifest_path(root: Path, shard: str) -> Path:
    return Path(root) / MANIFEST_DIR / f"{shard_slug(shard)}.json"


def shard_complete(root: Path, shard: str, key: ManifestKey, *, verify: bool = True) -> bool:
    """True when the shard's manifest matches ``key`` and its files are intact (sha256 with ``verify``).

    A corrupt shard is reported in the log and counts as incomplete, so the caller redoes it.
    """
    try:
        manifest = _read_manifest(Path(root), shard)
        if _manifest_key(manifest) != key:
            return False
        _check_files(Path(root), manifest, verify)
    except FileNotFoundError:
        return False
    except CorruptShardError as err:
        log.warning("%s; redoing the shard", err)
        return False
    return True


def verify_shard(root: Path, shard: str) -> list[Path]:
    """The shard's files after checking their size and sha256; ``CorruptShardError`` names a bad one."""
    return _check_files(Path(root), _read_manifest(Path(root), shard), verify=True)


def complete_files(root: Path, verify: bool = True) -> list[Path]:
    """Every file of every complete shard under ``root``, in a stable order.

    Stray files (a shard killed mid-write, or before its manifest) are never included. Files are
    always checked for existence and size, and for their sha256 with ``verify``.
    """
    manifests = sorted((Path(root) / MANIFEST_DIR).glob("*.json"))
    return [path for m in manifests for path in _check_files(Path(root), _load_manifest(m), verify)]


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
    """Remove the shards whose key is not in ``keep`` and every file no manifest lists.

    A stage calls it before fanning out, so results of shards that are no longer planned (a model
    removed from params) never reach a reader, and leftovers of killed writes are swept. Returns the
    number of shards removed.
    """
    root = Path(root)
    removed = 0
    listed: set[Path] = set()
    for path in sorted((root / MANIFEST_DIR).glob("*.json")):
        try:
            manifest = _load_manifest(path)
        except CorruptShardError as err:  # its key is unknown; the stem names its files
            log.warning("%s; removing the shard", err)
            _remove_slug(root, path.stem)
            continue
        if manifest["shard"] in keep:
            listed.update(root / f["path"] for f in manifest["files"])
        else:
            _remove_slug(root, path.stem)
            removed += 1
    for path in _store_files_on_disk(root):
        if path not in listed:
            path.unlink(missing_ok=True)
    return removed


def remove_shard(root: Path, shard: str) -> None:
    """Delete a shard: its manifest first (so it stops counting as complete), then its files."""
    _remove_slug(Path(root), shard_slug(shard))


def _remove_slug(root: Path, slug: str) -> None:
    (root / MANIFEST_DIR / f"{slug}.json").unlink(missing_ok=True)
    for path in _files_on_disk(root, slug):
        path.unlink(missing_ok=True)


def _files_on_disk(root: Path, slug: str) -> list[Path]:
    """The shard's files and temporaries, found by name (a killed write left no manifest to list them)."""
    final = f"part-{slug}.parquet"
    temporaries = (f".{final}.tmp-", f".{slug}.json.tmp-")
    return [p for p in _walk_files(root) if p.name == final or p.name.startswith(temporaries)]


def _store_files_on_disk(root: Path) -> list[Path]:
    """Every data file and temporary this module may have written under ``root`` (not manifests)."""
    return [p for p in _walk_files(root) if _DATA_FILE.match(p.name) or _TEMPORARY.match(p.name)]


_DATA_FILE = re.compile(r"^part-.+\.parquet$")
_TEMPORARY = re.compile(r"^\..+\.tmp-\d+$")


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
        raise _corrupt(path, path, "not a manifest of this format")
    return manifest


def _manifest_key(manifest: dict[str, Any]) -> ManifestKey:
    return ManifestKey(manifest["inputs"], manifest["params_hash"], manifest["code_version"])


def _check_files(root: Path, manifest: dict[str, Any], verify: bool) -> list[Path]:
    own_manifest = manifest_path(root, manifest["shard"])
    paths = []
    for entry in manifest["files"]:
        path = root / entry["path"]
        if not path.is_file():
            raise _corrupt(path, own_manifest, f"missing file of shard {manifest['shard']!r}")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise _corrupt(path, own_manifest, f"{size} bytes where {entry['bytes']} were written (truncated?)")
        if verify and _sha256_cached(path) != entry["sha256"]:
            raise _corrupt(path, own_manifest, "content differs from what was written (sha256 mismatch)")
        paths.append(path)
    return paths


# sha256 of files this process has already hashed, keyed by what a rewrite changes. Tasks read the
# same dataset many times (each fit shard reads two layers of it); each file is hashed once. As in
# git's "racy clean" rule, a file modified within the last seconds is not cached: file times are
# coarse (a clock tick), so a rewrite right after hashing could keep the same mtime.
_hashed: dict[tuple[str, int, int, int], str] = {}
_RACY_NS = 2_000_000_000


def _sha256_cached(path: Path) -> str:
    st = path.stat()
    identity = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if identity in _hashed:
        return _hashed[identity]
    digest = file_sha256(path)
    if time.time_ns() - st.st_mtime_ns > _RACY_NS:
        _hashed[identity] = digest
    return digest


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


def partition_dir(partition: dict[str, str | int]) -> Path:
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


class ShardWriter:
    """Writes one shard of the dataset under ``root``; use as a context manager.

    Entering removes whatever an earlier attempt left of this shard. ``write`` streams record
    batches into one temporary Parquet file per partition (memory is bounded by the batch). A clean
    exit fsyncs and renames the files into place and then writes the manifest; an exception deletes
    everything of the shard and writes no manifest. ``metadata`` goes into every file's key-value
    metadata, with the shard key, params hash and code version.
    """

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
        self._entered = False

    def __enter__(self) -> ShardWriter:
        remove_shard(self.root, self.shard)
        self._entered = True
        return self

    def write(self, partition: dict[str, str | int], data: pa.Table | pa.RecordBatch) -> None:
        if not self._entered:
            raise RuntimeError("ShardWriter.write outside its `with` block")
        table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        final = self.root / partition_dir(partition) / f"part-{self._slug}.parquet"
        if final not in self._open:
            final.parent.mkdir(parents=True, exist_ok=True)
            temp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
            schema = table.schema.with_metadata({**(table.schema.metadata or {}), **self._metadata})
            # Dictionary-encoding float vectors only costs: it made extraction writes ~8x slower.
            scalars = [f.name for f in schema if not pa.types.is_fixed_size_list(f.type) and not pa.types.is_list(f.type)]
            self._open[final] = (temp, pq.ParquetWriter(temp, schema, use_dictionary=scalars))
            self._rows[final] = 0
        self._open[final][1].write_table(table)
        self._rows[final] += table.num_rows

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

    def _commit(self) -> None:
        for temp, writer in self._open.values():
            writer.close()
            _fsync_file(temp)
        for final, (temp, _) in self._open.items():
            os.replace(temp, final)
        for directory in {final.parent for final in self._open}:
            _fsync_dir(directory)
        files = [self._entry(final) for final in sorted(self._open)]
        self._open.clear()
        manifest = {
            "format": MANIFEST_FORMAT,
            "shard": self.shard,
            **asdict(self.key),
            "files": files,
        }
        _write_atomically(manifest_path(self.root, self.shard), json.dumps(manifest, indent=1, sort_keys=True))

    def _entry(self, final: Path) -> dict[str, Any]:
        return {
            "path": final.relative_to(self.root).as_posix(),
            "bytes": final.stat().st_size,
            "sha256": file_sha256(final),
            "rows": self._rows[final],
        }

    def _abort(self) -> None:
        for _, writer in self._open.values():
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the shard is being discarded; its files go next
                log.debug("closing a discarded Parquet writer failed", exc_info=True)
        self._open.clear()
        remove_shard(self.root, self.shard)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    _fsync_dir(path.parent)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write a file or a directory to.

    On success it replaces ``path`` (removing what was there); on an exception it is deleted, so
    ``path`` is only ever absent, old, or complete. The temporary name is hidden and does not end in
    ``.parquet``, so globs over a dataset never see it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _remove(temp)
    try:
        yield temp
        if not temp.exists():
            raise FileNotFoundError(f"{temp}: nothing was written for {path}")
        for file in [temp] if temp.is_file() else list(_walk_files(temp)):
            _fsync_file(file)
        if path.is_dir():
            _remove(path)  # os.replace cannot replace a non-empty directory
        os.replace(temp, path)
        _fsync_dir(path.parent)
    except BaseException:
        _remove(temp)
        raise


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


# ------------------------------------------------------------------------------------- reading
_SQL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SQL_TYPE = re.compile(r"^[A-Za-z][A-Za-z0-9_ ]*(\(\d+(,\s*\d+)?\))?$")


def read_dataset(
    root: Path,
    hive_types: dict[str, str],
    columns: str = "*",
    where: str | None = None,
    con: duckdb.DuckDBPyConnection | None = None,
    *,
    group_by: str | None = None,
    order_by: str | None = None,
    verify: bool = True,
) -> pa.Table:
    """Query the complete shards of ``root`` with DuckDB, partition columns typed by ``hive_types``.

    ``hive_types`` maps partition keys to SQL types (``{"layer": "INTEGER"}``); keys it omits are
    VARCHAR, never guessed. ``columns``, ``where``, ``group_by`` and ``order_by`` are SQL fragments
    from the calling code. A corrupt shard raises ``CorruptShardError`` before anything is read.
    """
    import duckdb

    files = complete_files(root, verify=verify)
    if not files:
        raise FileNotFoundError(f"{root}: no complete shards to read (has the stage that writes it run?)")
    options = "hive_partitioning = true, hive_types_autocast = false"
    if hive_types:
        types = ", ".join(
            f"'{_sql_checked(k, _SQL_NAME)}': '{_sql_checked(v, _SQL_TYPE)}'" for k, v in hive_types.items()
        )
        options += f", hive_types = {{{types}}}"
    sql = f"SELECT {columns} FROM read_parquet($files, {options})"
    for clause, fragment in (("WHERE", where), ("GROUP BY", group_by), ("ORDER BY", order_by)):
        if fragment:
            sql += f" {clause} {fragment}"
    con = con if con is not None else duckdb.connect()
    return con.sql(sql, params={"files": [str(f) for f in files]}).to_arrow_table()


def _sql_checked(text: str, pattern: re.Pattern[str]) -> str:
    if not pattern.match(text):
        raise ValueError(f"{text!r} is not a valid name or type for hive_types")
    return text
