"""`lmgeo external`: what the external models of `analysis.external_models` are right now, for DVC.

DVC cannot list a params-dependent set of folders as deps, so this small stage depends on the folder local
external models live in, `models/` (and on `analysis.external_models`), and writes `data/external.json`:
each model's id, revision and a digest of its local files. The file changes only when an analysed model
does, and `extract` depends on it, so DVC reruns the analysis exactly when an external model changed (and a
second `dvc repro` with nothing changed runs nothing). A model outside the workspace
(`security.allow_outside_paths`) is not watched: `dvc repro -f external` after changing it. No torch, no
Ray: files are hashed once and remembered by (path, inode, size, mtime) within the process.
"""

from __future__ import annotations

import json

from lmgeo.driver.layout import Layout
from lmgeo.params import Params


def run(params: Params, layout: Layout, ray_address: str | None = None) -> None:
    from lmgeo.core.contracts import external_table_id
    from lmgeo.core.store import atomic_write
    from lmgeo.models.weights import weights_digest

    models = {}
    for model in params.analysis.external_models:
        local = (layout.root / model.id).resolve()
        # a hub id: its revision is its identity; a folder: every file, its weights index naming only them
        digest = weights_digest(local, params.security.allow_outside_paths) if local.is_dir() else None
        record = {"id": model.id, "revision": model.revision, "files": digest}
        models[external_table_id(model.name or model.id)] = record
    text = json.dumps(models, indent=2, sort_keys=True) + "\n"
    target = layout.external
    if not target.is_file() or target.read_text() != text:
        atomic_write(target, text)
    print(f"external: {len(models)} external model(s) recorded in {target.relative_to(layout.root)}", flush=True)
