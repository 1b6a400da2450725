"""Containment: the one rule for a path that a file names (SPEC §7).

A path read from a file a workspace holds — a shard manifest's entries, a model folder's weights index —
must name something inside the folder it is relative to: a relative POSIX path, no `..`, and no symlink on
the way that leads out. A file naming any other path is refused, naming it, before anything is opened,
hashed, served or deleted: such a file comes with `dvc pull` or a colleague's branch as easily as data does,
and the path it names is the one lmgeo would read, serve or unlink.
"""

from __future__ import annotations

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
    if path.is_symlink() and not symlinked_file:
        raise OutsidePath(f"{name!r} is a symlink (to {path.resolve()}), not a file inside {root}")
    return path
