"""`lmgeo rehearse`: the paper-scale rehearsal of Study A (`tools/rehearsal.py`), written to
`docs/scale.md` (and the raw measurements beside it as JSON). Not a DVC stage."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from pipeline.params import Params, apply_overrides


def rehearse(params: Params, preset: Path, out: Path | None, only: list[str] | None, device: str, threads: int) -> str:
    """Each model in a fresh process with `threads` torch threads, and the cost of `preset`'s study (applied
    to `params`) extrapolated; the report, also written to `out`."""
    from pipeline.core.config import flatten_overrides, load_yaml
    from pipeline.core.provenance import machine
    from pipeline.core.store import atomic_write
    from tools.rehearsal import SEED_CONFIGS, Node, Slice, Study, as_json, rehearse_all, render_markdown

    study = Study.of(apply_overrides(params, flatten_overrides(load_yaml(preset))))
    size = Slice()
    results = rehearse_all(only or list(SEED_CONFIGS), size, device, threads)
    table = render_markdown(results, size, study, Node(), shlex.join(["lmgeo", *sys.argv[1:]]), machine(), threads)
    if out is not None:
        atomic_write(out, table)
        atomic_write(out.with_suffix(".json"), json.dumps(as_json(results, size), indent=1) + "\n")
    return table
