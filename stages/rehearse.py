"""`lmgeo rehearse`: the seed-scale rehearsal of Study A (`pipeline.tools.rehearsal`), written to
`docs/scale.md` (and the raw measurements beside it as JSON). Not a DVC stage."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def rehearse(out: Path | None, only: list[str] | None, device: str, threads: int) -> str:
    import torch

    from pipeline.core.provenance import machine
    from pipeline.core.store import atomic_write
    from pipeline.tools.rehearsal import SEED_CONFIGS, Node, Slice, Study, as_json, rehearse_all, render_markdown

    torch.set_num_threads(threads)
    size = Slice()
    results = rehearse_all(only or list(SEED_CONFIGS), size, device)
    table = render_markdown(results, size, Study(), Node(), shlex.join(["lmgeo", *sys.argv[1:]]), machine(), threads)
    if out is not None:
        atomic_write(out, table)
        atomic_write(out.with_suffix(".json"), json.dumps(as_json(results, size), indent=1) + "\n")
    return table
