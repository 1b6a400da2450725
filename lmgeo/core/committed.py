"""What a workspace's `dvc.lock` records of a dataset: the anchor a stage checks its shards against before
keeping them, and a query before serving them (SPEC §7).

A shard's manifest vouches for its files, but a manifest is a file like any other: rewritten together with
the files it lists, it vouches for anything. What DVC recorded when the stage last finished under DVC is
another matter: `dvc.lock` names the output's listing (`<md5>.dir`, DVC's own list of the output's files
and their md5, kept in the DVC cache), and a manifest that differs from the one listed there, with the same
key, was not written by its stage. Where no listing is available (no `dvc.lock`, an output it does not
record yet, a cache without the listing) there is none: `Committed` is None and the shards' verified
content is all a reader has.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import yaml

from lmgeo.core.config import parse_yaml
from lmgeo.core.store import Committed

LOCK_FILE = "dvc.lock"
_MD5 = re.compile(r"^[0-9a-f]{32}(\.dir)?$")


def committed(workspace: Path, root: Path) -> Committed | None:
    """What `workspace/dvc.lock` records of the dataset under `root` (an output of one of its stages), from
    the DVC cache; None where that is not available."""
    workspace = Path(workspace).resolve()
    lock = workspace / LOCK_FILE
    try:
        relative = Path(root).resolve().relative_to(workspace).as_posix()
    except ValueError:
        return None
    out = _recorded_out(lock, relative) if lock.is_file() else None
    if out is None:
        return None
    cache = _cache(workspace, legacy=out.get("hash") != "md5")
    if cache is None:
        return None
    listing = _read(cache, out["md5"])
    try:
        entries = json.loads(listing) if listing is not None else None
        files = {entry["relpath"]: entry["md5"] for entry in entries} if isinstance(entries, list) else None
    except (ValueError, KeyError, TypeError):
        files = None
    if not files or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return None
    return Committed(f"{LOCK_FILE} ({relative}: {out['md5']})", files, lambda md5: _read(cache, md5))


def _recorded_out(lock: Path, relative: str) -> dict[str, Any] | None:
    """The entry of `dvc.lock` for the output at `relative` (a folder: its md5 ends in `.dir`), or None."""
    try:
        stages = parse_yaml(lock.read_text()).get("stages", {})  # no aliases: DVC writes none
        outs = [out for stage in stages.values() for out in stage.get("outs", [])]
    except (OSError, yaml.YAMLError, AttributeError, TypeError):
        return None
    found = [out for out in outs if isinstance(out, dict) and out.get("path") == relative]
    md5 = found[0].get("md5") if len(found) == 1 else None
    return found[0] if isinstance(md5, str) and md5.endswith(".dir") else None


@functools.lru_cache(maxsize=8)
def _cache(workspace: Path, legacy: bool) -> Any:
    """The workspace's local DVC cache (DVC 3's, or the legacy one of outputs DVC 2 recorded); None without DVC
    (a machine that runs tasks only) or outside a DVC repository. Opened once per workspace and process."""
    try:
        from dvc.exceptions import DvcException
        from dvc.repo import Repo
    except ImportError:
        return None
    try:
        with Repo(str(workspace)) as repo:
            return repo.cache.legacy if legacy else repo.cache.local
    except (DvcException, OSError):
        return None


def _read(cache: Any, md5: str) -> bytes | None:
    """An object of the cache by its md5 (read from dvc.lock or a listing: it must be one, not a path)."""
    if not isinstance(md5, str) or not _MD5.match(md5):
        return None
    path = Path(cache.oid_to_path(md5))
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None
