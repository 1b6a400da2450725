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

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lmgeo.core.errors import InputError
from lmgeo.core.paths import OutsidePath, contained, unsafe_name, writable

MANIFEST_DIR = "_manifests"
MANIFEST_FORMAT = 2
# The keys of the last plan a stage completed, `root/_plan.json`: what a reader without a plan of its own
# (a query, or a result at an old revision) checks every shard against. Shards of one plan may hold
# different keys (each holds the code and params it reads), so "one key for all" cannot tell a complete
# dataset from one a stage left half-redone.
PLAN_FILE = "_plan.json"

log = logging.getLogger(__name__)


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


def shard_complete(root: Path, shard: str, key: ManifestKey, committed: Committed | None = None) -> bool:
    """True when the shard is complete (``incomplete_shards``)."""
    return not incomplete_shards(root, {shard: key}, committed)


def incomplete_shards(root: Path, planned: Mapping[str, ManifestKey], committed: Committed | None = None) -> list[str]:
    """The shards of ``planned`` (shard → key) that are not complete under ``root``, in order. A shard is
    complete when its manifest has the planned key, lists every file the last finished plan recorded for it
    (a manifest that drops a planned partition is not), its files are intact (size and sha256), and it is
    what ``committed`` (what dvc.lock records of the dataset, when known) says it was.

    A corrupt shard is reported in the log and counts as incomplete, so the caller redoes it.
    """
    root = Path(root)
    record = _finished_plan(root)
    todo = []
    for shard, key in planned.items():
        try:
            manifest = _read_manifest(root, shard)
            if manifest_key(manifest) != key:
                todo.append(shard)
                continue
            _check_planned_files(root, manifest, record)
            _check_files(root, manifest)
            if committed is not None:
                _check_committed(root, manifest, committed)
        except FileNotFoundError:
            todo.append(shard)
        except CorruptShardError as err:
            log.warning("%s; redoing the shard", err)
            todo.append(shard)
    return todo


def verify_shard(root: Path, shard: str) -> list[Path]:
    """The shard's files after checking their size and sha256; ``CorruptShardError`` names a bad one."""
    return _check_files(Path(root), _read_manifest(Path(root), shard))


def verified_files(
    root: Path,
    expected: Mapping[str, ManifestKey] | None = None,
    *,
    rebuild: str = "its stage",
    committed: Committed | None = None,
    bad: dict[Path, Exception] | None = None,
) -> list[Path]:
    """The files of the dataset under ``root`` that a reader may use, each checked (size and sha256).

    With ``expected`` (shard → the key the current plan gives it), exactly those shards are read: a
    planned shard without a manifest, or whose manifest has another key, is an error naming the command
    that rebuilds it (``rebuild``); shards outside the plan are never read. Without it (reading a
    result as it was written, e.g. at an old revision), the shards of the plan its stage last completed
    (``write_plan``) are read, each with the key that plan gave it, so a dataset a stage left half-redone
    is an error. Either way a shard must list every file that plan recorded for it, and be what
    ``committed`` records of it, when given. A dataset without such a record (its stage never finished)
    must have one params hash and one code version, and is read with a warning saying so. With ``bad``, a
    file that fails its check is recorded there and left out (a reader of independent files, such as the
    result tables), instead of failing the whole read.
    """
    root = Path(root)
    manifests = {m["shard"]: m for m in map(_load_manifest, _manifest_files(root))}
    record = _finished_plan(root)
    if expected is None and record is not None:
        expected = record.keys
    if expected is None:
        _check_unmixed(root, manifests.values(), rebuild)
        if manifests:
            log.warning(
                "%s: no record of a finished run of its stage (%s is missing: the stage was interrupted or is "
                "running); reading the %d complete shard(s) found, which may be fewer than planned; run %s to "
                "finish it",
                root,
                root / PLAN_FILE,
                len(manifests),
                rebuild,
            )
        chosen = list(manifests.values())
    else:
        chosen = [_planned(root, manifests.get(shard), shard, key, rebuild) for shard, key in expected.items()]
    if committed is not None:
        _check_committed_plan(root, committed)
    for manifest in chosen:
        _check_planned_files(root, manifest, record)
        if committed is not None:
            _check_committed(root, manifest, committed)
    return [path for manifest in chosen for path in _check_files(root, manifest, bad)]


@dataclass(frozen=True)
class PlanRecord:
    """``root/_plan.json``: the plan a stage last completed in ``root`` — each shard's key (``keys``) and the
    files its manifest listed then (``files``) — and the dataset's ``lineage``: the ``dataset_digest`` of
    every dataset it was computed from, directly or further up, and of those its stage wrote beside it,
    by folder name (``lineage``), so that a reader can tell datasets of two runs apart."""

    keys: dict[str, ManifestKey]
    files: dict[str, list[str]]
    lineage: dict[str, str]
    in_progress: bool = False  # recorded before the fan-out: the stage stopped or is running; no files, no lineage


def write_plan(
    root: Path, planned: Mapping[str, ManifestKey], lineage: Mapping[str, str] | None = None, *, complete: bool = True
) -> None:
    """Record that every shard of `planned` (shard → key) is complete in `root` (call it after they are),
    with the files each one's manifest lists and the dataset's `lineage` (`lineage_of`); or, with
    `complete=False`, before the stage's fan-out, that it runs that plan (so that a reader of a stage stopped
    half-way knows which shards are still to come: `files_so_far`)."""
    root = Path(root)
    files = (
        {shard: sorted(f["path"] for f in _read_manifest(root, shard)["files"]) for shard in sorted(planned)}
        if complete
        else {}
    )
    record = {
        "format": MANIFEST_FORMAT,
        "shards": {shard: asdict(key) for shard, key in sorted(planned.items())},
        "files": files,
        "lineage": dict(sorted((lineage or {}).items())),
        **({} if complete else {"in_progress": True}),
    }
    atomic_write(root / PLAN_FILE, json.dumps(record, indent=1, sort_keys=True))


def read_plan(root: Path) -> PlanRecord:
    """The record ``write_plan`` wrote (one written before it recorded files and lineage has none of either)."""
    path = Path(root) / PLAN_FILE
    try:
        record = json.loads(read_record(path))
        keys = {shard: ManifestKey(**key) for shard, key in record["shards"].items()}
        files = record.get("files", {})
        lineage = record.get("lineage", {})
        if not (
            _str_map(lineage)
            and isinstance(files, dict)
            and all(isinstance(v, list) and all(isinstance(f, str) for f in v) for v in files.values())
            and all(isinstance(v, str) for key in keys.values() for v in (key.params_hash, key.code_version))
        ):
            raise ValueError("its files or lineage are not lists and maps of strings")
        return PlanRecord(keys, files, lineage, bool(record.get("in_progress")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptShardError(
            f"{path}: unreadable record of the last plan of the stage that writes {root} ({err}); re-run that "
            "stage (`dvc repro`, or its `lmgeo` command)"
        ) from None


def lineage_of(read: Sequence[Path]) -> dict[str, str]:
    """The lineage of a dataset computed from the datasets ``read``: each one's digest, by folder name, and
    the lineage each one's plan records."""
    lineage: dict[str, str] = {}
    for root in map(Path, read):
        record = _finished_plan(root)
        lineage |= record.lineage if record is not None else {}
        lineage[root.name] = dataset_digest(root)
    return lineage


def check_one_run(roots: Sequence[Path]) -> None:
    """Refuse datasets that come from different runs of the pipeline: for every two of ``roots``, each
    dataset either names (in its lineage) is the same for both, the datasets themselves as they are now
    included. (A dataset without a finished plan has no lineage: it is read with the warning
    ``verified_files`` gives.)"""
    lineages = {}
    for root in map(Path, roots):
        record = _finished_plan(root)
        lineages[root] = {**(record.lineage if record is not None else {}), root.name: dataset_digest(root)}
    ordered = list(lineages)
    for i, first in enumerate(ordered):
        for second in ordered[i + 1 :]:
            differ = sorted(
                name
                for name in lineages[first].keys() & lineages[second].keys()
                if lineages[first][name] != lineages[second][name]
            )
            if differ:
                raise StaleShardError(
                    f"{first.name} ({first}) and {second.name} ({second}) come from different runs of the pipeline: "
                    f"they were computed from different versions of {', '.join(differ)} (a `dvc repro` was "
                    "interrupted or is running, or a stage was run alone); run `dvc repro` to bring them up to "
                    "date, or query them one at a time"
                )


def _finished_plan(root: Path) -> PlanRecord | None:
    # Any plan there is read (a FIFO or device in its place is refused), never taken for no plan.
    record = read_plan(root) if os.path.lexists(root / PLAN_FILE) else None
    return None if record is None or record.in_progress else record


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _check_planned_files(root: Path, manifest: dict[str, Any], record: PlanRecord | None) -> None:
    """A shard of the same key as the last finished plan gave it lists every file that plan recorded for it."""
    shard = manifest["shard"]
    if record is None or record.keys.get(shard) != manifest_key(manifest):
        return  # a shard redone since (its stage's next plan records its files)
    missing = sorted(set(record.files.get(shard, ())) - {f["path"] for f in manifest["files"]})
    if missing:
        own = manifest_path(root, shard)
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise _corrupt(
            own,
            own,
            f"shard {shard!r} lacks {shown}, which its stage's finished plan ({root / PLAN_FILE}) "
            "recorded (a manifest edited by hand?)",
        )


@dataclass(frozen=True)
class Committed:
    """What version control records of a dataset: DVC's own listing of the output in dvc.lock (``listing``:
    relative path → md5) and ``content(md5)``, a recorded file's bytes from the DVC cache (None where the
    cache lacks it). ``source`` names the record in messages (``dvc.lock (data/fits: <md5>.dir)``)."""

    source: str
    listing: Mapping[str, str]
    content: Callable[[str], bytes | None]


def _check_committed(root: Path, manifest: dict[str, Any], committed: Committed) -> None:
    """The shard is what ``committed`` records of it, when it records this shard with this key.

    Its manifest is compared (md5, as DVC lists it); its files were checked against the manifest (sha256).
    A shard that the record lacks was written since (a run DVC has not recorded yet), and one the record
    holds with another key was redone since for a change of params or code: for both the verified content
    is all there is to check. The same key with other content is a shard rewritten outside its stage."""
    own = manifest_path(root, manifest["shard"])
    recorded = committed.listing.get(own.relative_to(root).as_posix())
    if recorded is None or file_md5(own) == recorded:
        return
    old = committed.content(recorded)
    try:
        old_key = manifest_key(json.loads(old)) if old is not None else None
    except (ValueError, KeyError, TypeError):
        old_key = None
    if old_key is not None and old_key != manifest_key(manifest):
        return
    raise _corrupt(
        own,
        own,
        f"differs from the manifest {committed.source} records for it, with the same key "
        "(a shard rewritten outside its stage)",
    )


def _check_committed_plan(root: Path, committed: Committed) -> None:
    """The dataset's plan (or its absence) is the one ``committed`` records: the plan picks the keys its shards
    are checked against, and ``_check_committed`` takes a shard of another key for one redone since, so a plan
    rewritten with the shards it names would vouch for them."""
    plan = root / PLAN_FILE
    # read_record: a FIFO or device in the plan's place is refused, never opened to hash it
    current = hashlib.md5(read_record(plan).encode()).hexdigest() if os.path.lexists(plan) else None  # noqa: S324 - DVC's hash
    if current != committed.listing.get(PLAN_FILE):
        raise StaleShardError(
            f"{plan}: {'differs from' if current else 'missing, unlike'} the plan {committed.source} records for "
            f"the dataset (its shards were computed with other keys than those committed); run `dvc checkout {root}` "
            "to get the committed one back, or `dvc repro` to recompute it and commit the result"
        )


def file_md5(path: Path) -> str:
    """The md5 DVC lists a file with."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def files_so_far(
    root: Path, *, rebuild: str = "its stage", committed: Committed | None = None
) -> tuple[list[Path], list[str]]:
    """For a reader that takes what is there (a query of a study still training): while the stage's plan is in
    progress (`write_plan(complete=False)`: the stage stopped or is running), the verified files of its shards
    complete so far (each also what ``committed`` records, when given) and the shards still missing; otherwise
    `verified_files(root)` and none missing."""
    root = Path(root)
    record = read_plan(root) if (root / PLAN_FILE).is_file() else None
    if record is None or not record.in_progress:
        return verified_files(root, rebuild=rebuild, committed=committed), []
    if committed is not None:
        _check_committed_plan(root, committed)
    manifests = {m["shard"]: m for m in map(_load_manifest, _manifest_files(root))}
    done, missing = [], []
    for shard, key in record.keys.items():
        manifest = manifests.get(shard)
        if manifest is not None and manifest_key(manifest) == key:
            done.append(manifest)
            if committed is not None:
                _check_committed(root, manifest, committed)
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
    for path in _manifest_files(Path(root)):
        manifest = _load_manifest(path)
        if manifest["shard"].startswith(prefix):
            shards.append([manifest["shard"], [[f["path"], f["sha256"]] for f in manifest["files"]]])
    return hashlib.sha256(json.dumps(sorted(shards)).encode()).hexdigest()[:16]


def prune_shards(root: Path, keep: set[str]) -> int:
    """Remove the shards whose key is not in ``keep``, every file no kept manifest lists, and the
    folders that leaves empty.

    A stage calls it before fanning out (after its plan validated), so results of shards that are no
    longer planned (a model removed from params) never reach a reader, and leftovers of killed writes
    and stray files are swept. Only files inside ``root`` are ever removed: a manifest naming a path that
    leads out is corrupt, and goes without its files. Returns the number of shards removed.
    """
    root = writable(Path(root))
    removed = 0
    listed: set[Path] = set()
    for path in _manifest_files(root):
        try:
            manifest = _load_manifest(path)
            files = _files_of(root, manifest)
        except CorruptShardError as err:  # its key is unknown: its files are unlisted and go below
            log.warning("%s; removing the shard", err)
            path.unlink()
            continue
        if manifest["shard"] in keep:
            listed.update(files)
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
    concurrently and may be about to write into one (`prune_shards`, before the fan-out, sweeps them).
    A corrupt manifest goes without its files (they may not be the shard's: `prune_shards` sweeps what
    no manifest lists)."""
    root = Path(root)
    path = manifest_path(root, shard)
    listed: list[Path] = []
    if path.exists():
        try:
            listed = _files_of(root, _load_manifest(path))
        except CorruptShardError as err:
            log.warning("%s; removing the manifest only", err)
        path.unlink()
    for file in listed:
        file.unlink(missing_ok=True)
    # Temporaries of a killed attempt, by name (no manifest lists them); a killed checkpoint folder has no
    # name of the shard's, and goes with the stage's prune of every unlisted file.
    slug = shard_slug(shard)
    for temp in _walk_files(root):
        if temp.name.startswith((f".{slug}.json.tmp-", f".part-{slug}.parquet.tmp-")):
            temp.unlink(missing_ok=True)


def _manifest_files(root: Path) -> list[Path]:
    """The manifests of the dataset under ``root``; its manifest folder must be a folder inside it."""
    folder = root / MANIFEST_DIR
    if folder.is_symlink():
        raise CorruptShardError(
            f"{folder}: a symlink (to {folder.resolve()}), not the dataset's manifest folder; remove it and re-run "
            f"the stage that writes {root} (`dvc repro`, or its `lmgeo` command)"
        )
    return sorted(folder.glob("*.json"))


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
    manifest = _load_manifest(path)
    if manifest["shard"] != shard:
        raise _corrupt(path, path, f"the manifest of shard {manifest['shard']!r}, under the name of {shard!r}")
    return manifest


# The most a manifest or a plan may hold: the real ones take kilobytes (a plan lists every shard's files).
# One past this, or one that is not a regular file (a FIFO, a device), arrived with a pull: it is refused
# before it is read, so that it cannot make a reader block or exhaust memory.
MAX_RECORD_BYTES = 64 * 2**20


def read_record(path: Path) -> str:
    """The text of the manifest or plan at `path`, a regular file of at most `MAX_RECORD_BYTES`; else `OSError`."""
    if not _is_record(os.stat(path)):  # before opening: opening a FIFO blocks, opening a device may act
        raise _not_a_record(path)
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
        if not _is_record(os.fstat(file.fileno())):  # what was opened, should the path have been swapped since
            raise _not_a_record(path)
        data = file.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:  # grown since
        raise _not_a_record(path)
    return data.decode()


def _is_record(info: os.stat_result) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_size <= MAX_RECORD_BYTES


def _not_a_record(path: Path) -> OSError:
    return OSError(f"{path}: not a regular file of at most {MAX_RECORD_BYTES} bytes")


def _load_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(read_record(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(path, path, f"unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise _corrupt(path, path, "not a manifest of this format (written by another lmgeo version?)")
    if not _well_formed(manifest):  # readers index these fields: a KeyError would name no file
        raise _corrupt(path, path, "a manifest without its shard, key or list of files (edited by hand?)")
    for entry in manifest["files"]:  # containment (lmgeo.core.paths), before any file is touched
        problem = unsafe_name(entry["path"]) or _reserved(entry["path"])
        if problem:
            raise _corrupt(path, path, f"it lists {entry['path']!r}, {problem}, not a file of the shard")
    return manifest


def _reserved(name: str) -> str | None:
    if name == PLAN_FILE or name.split("/")[0] == MANIFEST_DIR:
        return "the dataset's own record"
    return None


def _well_formed(manifest: dict[str, Any]) -> bool:
    files = manifest.get("files")
    return (
        isinstance(manifest.get("shard"), str)
        and _str_map(manifest.get("inputs"))
        and isinstance(manifest.get("params_hash"), str)
        and isinstance(manifest.get("code_version"), str)
        and isinstance(files, list)
        and all(
            isinstance(f, dict)
            and isinstance(f.get("path"), str)
            and type(f.get("bytes")) is int
            and isinstance(f.get("sha256"), str)
            for f in files
        )
    )


def manifest_key(manifest: dict[str, Any]) -> ManifestKey:
    return ManifestKey(manifest["inputs"], manifest["params_hash"], manifest["code_version"])


def _files_of(root: Path, manifest: dict[str, Any]) -> list[Path]:
    """The paths of the files a manifest lists, each inside ``root`` (``lmgeo.core.paths.contained``)."""
    paths = []
    for entry in manifest["files"]:
        try:
            paths.append(contained(root, entry["path"]))
        except OutsidePath as err:
            own = manifest_path(root, manifest["shard"])
            raise _corrupt(own, own, f"it lists a path that is not a file of the shard: {err}") from None
    return paths


def _check_files(root: Path, manifest: dict[str, Any], bad: dict[Path, Exception] | None = None) -> list[Path]:
    """The shard's files, each checked against its manifest entry; a bad one raises, or with ``bad`` is
    recorded there and left out."""
    own_manifest = manifest_path(root, manifest["shard"])
    paths = []
    for path, entry in zip(_files_of(root, manifest), manifest["files"], strict=True):
        problem = None
        if not path.is_file():
            problem = f"missing file of shard {manifest['shard']!r}"
        elif (size := path.stat().st_size) != entry["bytes"]:
            problem = f"{size} bytes where {entry['bytes']} were written (truncated?)"
        elif sha256_cached(path) != entry["sha256"]:
            problem = "content differs from what was written (sha256 mismatch)"
        if problem is None:
            paths.append(path)
        elif bad is None:
            raise _corrupt(path, own_manifest, problem)
        else:
            bad[path] = _corrupt(path, own_manifest, problem)
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
    Vectors (fixed-width binary, `lmgeo.core.contracts.vectors_to_arrow`) neither repeat nor compress nor get
    filtered by value: dictionaries made extraction writes ~8x slower; snappy and statistics took 9% of a
    shard's write (25.5 → 23.3 ms for 5 layers of 2048 × 256 float32) and snappy saved 0.45% of its bytes."""
    vectors = [f.name for f in schema if pa.types.is_fixed_size_binary(getattr(f.type, "storage_type", f.type))]
    scalars = [f.name for f in schema if f.name not in vectors]
    return {
        "use_dictionary": scalars,
        "write_statistics": scalars,
        "compression": {**dict.fromkeys(scalars, "snappy"), **dict.fromkeys(vectors, "none")},
    }


def _temporary(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


class _PartFile:
    """One Parquet file of a shard being written, with its own writer thread: the files of a shard (one per
    partition: an extract shard's layers) are encoded and written in parallel, each in the order its batches
    were given. After each batch the thread reads the new bytes back into the file's sha256 (as a reader
    will read them), and once `SYNC_BYTES` have gathered it flushes them to disk, so hashing and the disk's
    work overlap the caller's next batches instead of all waiting for the commit (a small file is flushed
    once, when it is finished)."""

    SYNC_BYTES = 64 << 20

    def __init__(self, temp: Path, schema: pa.Schema) -> None:
        self.temp = temp
        self.writer = pq.ParquetWriter(temp, schema, **_encoding(schema))
        self.rows = 0
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="lmgeo-shard-writer")
        self.in_flight: deque[Future[None]] = deque()
        self._readback = open(temp, "rb")  # closed by `finish` or `discard`
        self._sha256 = hashlib.sha256()
        self._unsynced = 0

    def submit(self, table: pa.Table, limit: int) -> None:
        """Queue `table`, first waiting while `limit` batches of this file are queued (memory stays bounded)."""
        while len(self.in_flight) >= limit:
            self.in_flight.popleft().result()
        self.rows += table.num_rows
        self.in_flight.append(self.thread.submit(self._write, table))

    def _write(self, table: pa.Table) -> None:
        self.writer.write_table(table)
        self._absorb(sync=False)

    def _absorb(self, sync: bool) -> None:
        """Hash the bytes written since the last call, read back from the file; flush them to disk with `sync`
        or once `SYNC_BYTES` are waiting."""
        while chunk := self._readback.read(1 << 24):
            self._sha256.update(chunk)
            self._unsynced += len(chunk)
        if sync or self._unsynced >= self.SYNC_BYTES:
            os.fdatasync(self._readback.fileno())
            self._unsynced = 0

    def finish(self) -> Future[tuple[int, str]]:
        """Wait for the queued batches (the first failure raises), then write the footer and flush it on the
        file's own thread (the files of a shard finish in parallel): the file's size and sha256, to come."""
        while self.in_flight:
            self.in_flight.popleft().result()
        return self.thread.submit(self._close)

    def _close(self) -> tuple[int, str]:
        self.writer.close()
        self._absorb(sync=True)
        self._readback.close()
        self.thread.shutdown(wait=False)
        return self.temp.stat().st_size, self._sha256.hexdigest()

    def discard(self) -> None:
        """Cancel what is queued, close everything and delete the file."""
        self.in_flight.clear()
        self.thread.shutdown(wait=True, cancel_futures=True)
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - the shard is being discarded; its file goes next
            log.debug("closing a discarded Parquet writer failed", exc_info=True)
        self._readback.close()
        self.temp.unlink(missing_ok=True)


class ShardWriter:
    """Writes one shard of the dataset under ``root``; use as a context manager.

    Entering removes whatever an earlier attempt left of this shard. ``write`` streams record batches
    into one temporary Parquet file per partition, each file on its own background thread (`_PartFile`:
    encoding, writing, hashing and flushing run off the caller's critical path, so a forward overlaps the
    previous batch's writes, and the partitions' files are written in parallel), with at most
    ``WRITES_IN_FLIGHT`` batches queued per file so memory is bounded by them. ``directory`` gives a
    temporary folder to fill (a checkpoint). A clean exit waits for the writes, finishes every file (footer,
    hash, fsync) and hashes the folders' files, renames everything into place and then writes the manifest;
    an exception (the caller's or a write's) deletes everything of the shard and writes no manifest.
    ``metadata`` goes into every Parquet file's key-value metadata, with the shard key, params hash and
    code version.
    """

    WRITES_IN_FLIGHT = 2  # per file: the batch being written and the next

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
        self._open: dict[Path, _PartFile] = {}  # final path -> the file being written
        self._folders: dict[Path, Path] = {}  # final folder -> filled temporary folder
        self._entered = False

    def __enter__(self) -> ShardWriter:
        writable(self.root)
        remove_shard(self.root, self.shard)
        self._entered = True
        return self

    def write(
        self, partition: Mapping[str, str | int], data: pa.Table | pa.RecordBatch, name: str | None = None
    ) -> None:
        """Append ``data`` to the shard's file in ``partition`` (named ``part-<slug>.parquet`` unless ``name``).
        Returns once the write is queued; a failed write raises here, at a later ``write``, or on exit."""
        if not self._entered:
            raise RuntimeError("ShardWriter.write outside its `with` block")
        table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        final = self.root / partition_dir(partition) / (name or f"part-{self._slug}.parquet")
        if final not in self._open:
            writable(final, self.root)  # a symlinked partition folder would lead into another dataset
            final.parent.mkdir(parents=True, exist_ok=True)
            schema = table.schema.with_metadata({**(table.schema.metadata or {}), **self._metadata})
            self._open[final] = _PartFile(_temporary(final), schema)
        self._open[final].submit(table, self.WRITES_IN_FLIGHT)

    @contextmanager
    def directory(self, relative: str) -> Iterator[Path]:
        """A temporary folder to fill; it becomes ``root/relative`` when the shard commits."""
        if not self._entered:
            raise RuntimeError("ShardWriter.directory outside its `with` block")
        final = writable(self.root / relative, self.root)
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
        self._entered = False
        if exc_type is not None:
            self._abort()
            return
        try:
            self._commit()
        except BaseException:
            self._abort()
            raise

    def _commit(self) -> None:
        finished = {final: part.finish() for final, part in self._open.items()}  # the first failed write aborts
        synced = {final: done.result() for final, done in finished.items()}
        # A filled folder's files keep their relative paths.
        files = {
            file: final / file.relative_to(temp) for final, temp in self._folders.items() for file in _walk_files(temp)
        }
        with ThreadPoolExecutor(min(8, len(files) or 1)) as pool:
            synced |= dict(zip(files.values(), pool.map(_synced_size_and_sha256, files), strict=True))
        renames = {final: part.temp for final, part in self._open.items()} | self._folders
        for final, temp in renames.items():
            _remove(final)  # a leftover of a killed attempt; os.replace cannot replace a folder
            os.replace(temp, final)
        with ThreadPoolExecutor(min(8, len(renames) or 1)) as pool:
            list(pool.map(_fsync_dir, {final.parent for final in renames}))
        rows = {final: part.rows for final, part in self._open.items()}
        self._open.clear()
        self._folders.clear()
        manifest = {
            "format": MANIFEST_FORMAT,
            "shard": self.shard,
            **asdict(self.key),
            "files": [self._entry(path, *synced[path], rows.get(path)) for path in sorted(synced)],
        }
        atomic_write(manifest_path(self.root, self.shard), json.dumps(manifest, indent=1, sort_keys=True))

    def _entry(self, path: Path, size: int, sha256: str, rows: int | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": path.relative_to(self.root).as_posix(), "bytes": size, "sha256": sha256}
        if rows is not None:
            entry["rows"] = rows
        return entry

    def _abort(self) -> None:
        for part in self._open.values():
            part.discard()
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
        """Write the shard under ``root`` (atomically, its manifest last); a full disk is a ``DiskFull`` naming
        the dataset and the shard's size (the writer has removed what it wrote)."""
        try:
            with ShardWriter(root, shard, key, metadata=self.metadata) as writer:
                for partition, table, name in self.tables:
                    writer.write(partition, table, name)
                for relative, files in self.folders.items():
                    with writer.directory(relative) as folder:
                        write_folder(folder, files)
        except OSError as err:
            if not is_disk_full(err):
                raise
            raise disk_full(Path(root), f"shard {shard!r}", self.size()) from None

    def size(self) -> int:
        """The shard's bytes as computed (its tables in memory, its folders' files): about what it takes on disk."""
        return sum(table.nbytes for _, table, _ in self.tables) + sum(
            len(content) for files in self.folders.values() for content in files.values()
        )


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
    writable(path)
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
    """Write ``content`` to ``path`` atomically (see ``atomic_path``); a full disk is a ``DiskFull``."""
    data = content if isinstance(content, bytes) else content.encode()
    try:
        with atomic_path(path) as temp:
            temp.write_bytes(data)
    except OSError as err:
        if not is_disk_full(err):
            raise
        raise disk_full(Path(path).parent, Path(path).name, len(data)) from None


class DiskFull(InputError):
    """No space left on the device a write went to; the message names the folder and the space needed."""


def is_disk_full(err: BaseException) -> bool:
    """An error of a write to a full device: errno ENOSPC (or EDQUOT), as Python raises it, or in the text of
    an ``OSError`` that Arrow raises for a failed write."""
    if not isinstance(err, OSError):
        return False
    return err.errno in (errno.ENOSPC, errno.EDQUOT) or "[errno 28]" in str(err).lower()


def disk_full(folder: Path, what: str, needed: int) -> DiskFull:
    """The error for `what` (about `needed` bytes) that did not fit in `folder` (nothing of it was kept)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    return DiskFull(
        f"{folder}: no space left on the device for {what} (about {_size(needed)} needed, {_size(free)} free); free "
        "some space (or move the workspace to a larger disk) and re-run: what is complete is kept"
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


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
