"""A local model folder's weight files, read without torch: what the loader opens and what a folder's digest
covers, so the two are the same files (SPEC §7)."""

from __future__ import annotations

import json
from pathlib import Path

from lmgeo.core.errors import InputError
from lmgeo.core.paths import OutsidePath, contained
from lmgeo.core.store import folder_digest


class ModelLoadError(InputError):
    """A model reference that cannot be loaded safely; the message names the cause."""


# The file of a sharded checkpoint that names its weight files (transformers opens each name it maps to).
WEIGHTS_INDEX = "model.safetensors.index.json"


def indexed_weights(folder: Path, allow_outside_paths: bool = False) -> list[Path]:
    """The weight files `folder`'s weights index names, each a file inside the folder
    (`lmgeo.core.paths.contained`; itself a symlink only with `allow_outside_paths`, as for any file of
    the folder): an index naming any other path is refused before anything is loaded or hashed."""
    index = folder / WEIGHTS_INDEX
    try:
        names = json.loads(index.read_text())["weight_map"].values()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ModelLoadError(f"{index}: unreadable weights index ({type(err).__name__}: {err})") from None
    try:
        files = sorted({contained(folder, name, symlinked_file=allow_outside_paths) for name in names})
    except OutsidePath as err:
        raise ModelLoadError(f"{index}: names a weight file outside the model folder: {err}") from None
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise ModelLoadError(f"{index}: names weight files the folder lacks: {', '.join(missing[:6])}")
    return files


def weights_digest(folder: Path, allow_outside_paths: bool = False) -> str:
    """A hash of every file of a local model folder (`folder_digest`), after checking that its weights index,
    if any, names only files of the folder (`indexed_weights`): the digest then covers every weight loaded."""
    if (folder / WEIGHTS_INDEX).exists():
        indexed_weights(folder, allow_outside_paths)
    return folder_digest(folder)
