"""`lmgeo check-model` (can Study A analyse this model?) and `lmgeo families` (which of transformers'
causal-LM families it verifies, written to `docs/families.md`; the coverage itself is `families.py` beside it).
Neither is a DVC stage."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from lmgeo.driver.layout import Layout
from lmgeo.params import Params


def check_model(params: Params, ref: str, revision: str | None) -> str:
    """Load `ref` as the pipeline would (the security params apply) and verify it; the report, or an
    `InputError` naming what failed."""
    from lmgeo.models.loading import load_model
    from lmgeo.study_a.verify import verify_model

    s = params.security
    model = load_model(
        ref,
        revision=revision,
        trust_remote_code=s.trust_remote_code,
        workspace=Layout.here().root,
        allow_outside_paths=s.allow_outside_paths,
        max_parameters=s.max_model_parameters,
    )
    verified = verify_model(model)
    checks = ", ".join(f"{name} (max relative difference {error:.1e})" for name, error in verified.max_error.items())
    return "\n".join(
        [
            f"{ref}: verified, Study A can analyse it",
            f"  model type {model.config.model_type}, {verified.n_blocks} blocks of width {verified.width}",
            f"  {verified.structure.describe()}",
            f"  checks passed: blocks, {checks}",
        ]
    )


def write_coverage(out: Path | None, only: list[str] | None) -> str:
    """Run the coverage over every causal-LM model type (or `only` those); write the table to `out`."""
    import torch

    from lmgeo.commands.verify.families import causal_lm_types, coverage, render_markdown
    from lmgeo.core.provenance import versions
    from lmgeo.core.store import atomic_write

    torch.set_num_threads(1)  # tiny models: more threads only contend
    rows = coverage(only or causal_lm_types())
    table = render_markdown(rows, shlex.join(["lmgeo", *sys.argv[1:]]), versions())
    if out is not None:
        atomic_write(out, table)
    return table
