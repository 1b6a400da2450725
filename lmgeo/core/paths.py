"""Containment: the one rule for a path that a file names (SPEC §7).

A path read from a file a workspace holds — a shard manifest's entries, a model folder's weights index —
must name something inside the folder it is relative to: a relative POSIX path, no `..`, and no symlink on
the way that leads out. A file naming any other path is refused, naming it, before anything is opened,
hashed, served or deleted: such a file comes with `dvc pull` or a colleague's branch as easily as data does,
and the path it names is the one lmgeo would read, serve or unlink.

A path lmgeo writes, deletes or lists (`writable`) must stay inside its workspace the same way: no symlink
on the way from the workspace down to it, committed or not. The one exception is a link into the
workspace's own DVC cache (`cache.type: symlink`), which DVC made: it is read, and replaced, never written
through.
"""

from __future__ import annotations

import configparser
from pathlib import Path, PurePosixPath

from lmgeo.core.errors import InputError


class OutsidePath(InputError):
    """A path named by a file that leads outside the folder it must stay in; the message says how."""


def unsafe_name(name: object) -> str | None:
    """Why `name` cannot name a file inside a folder, read without the filesystem; None when it can."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if "\0" in name or "\\" in name:
        return "a NUL or backslash in it"
    if PurePosixPath(name).is_absolute():
        return "an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "an empty, '.' or '..' component"
    return None


def contained(root: Path, name: object, *, symlinked_file: bool = False) -> Path:
    """`root / name` when `name` stays inside `root`: a relative POSIX path without `..` (`unsafe_name`)
    whose folders resolve inside `root`, and which is not itself a symlink unless `symlinked_file` (a
    model folder's own files may be links that the folder's policy decides on). `OutsidePath` otherwise."""
    problem = unsafe_name(name)
    if problem is not None:
        raise OutsidePath(f"{name!r} is not a path inside {root}: {problem}")
    assert isinstance(name, str)
    path = Path(root) / name
    base = Path(root).resolve()
    if not path.parent.resolve().is_relative_to(base):
        raise OutsidePath(f"{name!r} leads outside {root} (through a symlink, to {path.parent.resolve()})")
    if path.is_symlink() and not symlinked_file and not in_dvc_cache(path):
        raise OutsidePath(f"{name!r} is a symlink (to {path.resolve()}), not a file inside {root}")
    return path


# The files that mark a workspace's root (as `lmgeo.driver.layout.WORKSPACE_FILES`).
_WORKSPACE_FILES = ("dvc.yaml", "params.yaml")


def workspace_of(path: Path) -> Path | None:
    """The nearest folder up from `path` (itself excluded) holding `dvc.yaml` or `params.yaml`; None if none."""
    absolute = Path(path).absolute()
    return next((f for f in absolute.parents if any((f / n).is_file() for n in _WORKSPACE_FILES)), None)


def dvc_caches(workspace: Path) -> list[Path]:
    """The workspace's DVC cache folders, resolved: `.dvc/cache` and the `cache.dir` that `.dvc/config` or
    `.dvc/config.local` set (`dvc cache dir`; a relative one is relative to `.dvc`)."""
    dvc = Path(workspace) / ".dvc"
    caches = [dvc / "cache"]
    for name in ("config", "config.local"):
        parser = configparser.ConfigParser()
        try:
            parser.read(dvc / name)
        except configparser.Error:
            continue  # DVC itself refuses a broken config; it configures no cache here
        if parser.has_option("cache", "dir"):
            caches.append(dvc / Path(parser.get("cache", "dir")).expanduser())
    return [cache.resolve() for cache in caches]


def in_dvc_cache(path: Path) -> bool:
    """True when `path` is a symlink that resolves into its workspace's DVC cache (a link DVC made)."""
    workspace = workspace_of(path)
    if workspace is None or not Path(path).is_symlink():
        return False
    target = Path(path).resolve()
    return any(target.is_relative_to(cache) for cache in dvc_caches(workspace))


def writable(path: Path, root: Path | None = None) -> Path:
    """`path` when lmgeo may write, delete or list it: no folder from `root` (its workspace by default) down to
    it is a symlink, nor is `path` itself unless it is a link into the DVC cache (`in_dvc_cache`), which a
    write replaces. `OutsidePath` naming the link otherwise, before anything is touched."""
    path = Path(path).absolute()
    root = Path(root).absolute() if root is not None else workspace_of(path)
    if root is None or not path.is_relative_to(root):
        return path  # not in a workspace: nothing to keep it inside
    for step in [*reversed(path.relative_to(root).parents), path.relative_to(root)][1:]:
        link = root / step
        if link.is_symlink() and not (link == path and in_dvc_cache(link)):
            raise OutsidePath(
                f"{link} is a symlink (to {link.resolve()}): lmgeo writes only inside {root}; replace the link "
                f"with a folder of the workspace (`rm {link}`, or `git rm` it where it is committed) and re-run"
            )
    return path
