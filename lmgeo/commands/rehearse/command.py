"""`lmgeo rehearse`: the paper-scale rehearsal of Study A (`lmgeo/commands/rehearse/rehearsal.py`), written to
`docs/scale.md` (and the raw measurements beside it as JSON), its GPU column from the GPU check's committed
`reports/gpu.json` when there is one. `--render` writes the report again from the JSON without measuring
(after a GPU check, say). Not a DVC stage."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from lmgeo.params import Params, apply_overrides

GPU_CHECK = Path("reports/gpu.json")  # the GPU check's `gpu.json`, committed (scripts/gpucheck/README.md)


def rehearse(
    params: Params,
    preset: Path,
    out: Path | None,
    only: list[str] | None,
    device: str,
    threads: int,
    render: Path | None = None,
) -> str:
    """Each model in a fresh process with `threads` torch threads (or the measurements recorded in `render`, a
    rehearsal's JSON), and the cost of `preset`'s study (applied to `params`) extrapolated; the report, also
    written to `out`."""
    from lmgeo.commands.rehearse.rehearsal import (
        SEED_CONFIGS,
        GpuCosts,
        Slice,
        Study,
        as_json,
        from_json,
        rehearse_all,
        render_markdown,
    )
    from lmgeo.core.config import flatten_overrides, load_yaml
    from lmgeo.core.provenance import machine
    from lmgeo.core.store import atomic_write

    study = Study.of(apply_overrides(params, flatten_overrides(load_yaml(preset))))
    if render is not None:
        recorded = json.loads(render.read_text())
        results, size = from_json(recorded)
        header = {key: recorded[key] for key in ("command", "machine", "threads")}
    else:
        size = Slice()
        results = rehearse_all(only or list(SEED_CONFIGS), size, device, threads)
        header = {"command": shlex.join(["lmgeo", *sys.argv[1:]]), "machine": machine(), "threads": threads}
    gpu = GpuCosts.from_check(json.loads(GPU_CHECK.read_text())) if GPU_CHECK.is_file() else None
    rendered_by = shlex.join(["lmgeo", *sys.argv[1:]]) if render is not None else None
    table = render_markdown(
        results, size, study, gpu, header["command"], header["machine"], header["threads"], rendered_by
    )
    if out is not None:
        atomic_write(out, table)
        if render is None:
            atomic_write(out.with_suffix(".json"), json.dumps(as_json(results, size, header), indent=1) + "\n")
    return table
