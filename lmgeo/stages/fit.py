"""`lmgeo fit`: tokenwise fits on nearest-neighbour pairs, one Ray task per (model, layer) that searches the
neighbours once and fits every class on them (and on the null samples), written to
`data/fits/model=<m>/layer=<l>/fn=<class>/`."""

from __future__ import annotations

import pyarrow as pa

from lmgeo.core.contracts import ACTIVATIONS, FITS
from lmgeo.core.errors import InputError
from lmgeo.core.execution import Shard
from lmgeo.core.fingerprint import CodeSpec
from lmgeo.core.store import ManifestKey, ShardParts, dataset_digest, verified_files
from lmgeo.driver.analysis_set import EXTRACT, activation_shapes, analysed_models
from lmgeo.driver.layout import Layout
from lmgeo.driver.sharded import (
    Plan,
    members,
    partition_input,
    planned_keys,
    run_sharded_stage,
    stage_code,
    stage_params,
    versioned,
    write_to,
)
from lmgeo.params import Params
from lmgeo.study_a.config import AnalysisConfig


def fit_task(params: Params, model: str, layer: int, h_in: pa.Table, h_out: pa.Table) -> ShardParts:
    """Ray task: every class fitted on the transition from layer `layer` (`h_in`) to the next (`h_out`)."""
    import torch

    from lmgeo.study_a.fits import fit_transition

    device = "cuda" if torch.cuda.is_available() else "cpu"
    parts = ShardParts(metadata={"model": model})
    for fn, table in fit_transition(h_in, h_out, params.analysis, device).items():
        parts.write({"model": model, "layer": layer, "fn": fn}, table)
    return parts


def fit_shard(
    layout: Layout,
    params: Params,
    model: str,
    layer: int,
    key: ManifestKey,
    name: str,
    activations: dict[str, ManifestKey],
    code: tuple[CodeSpec, str] | None = None,
) -> Shard:
    """The shard `name`: the task reads layers `layer` and `layer + 1` of the model's `activations` (planned
    shards) and its fits are written under `layout.fits`."""
    h_in, h_out = (
        partition_input(layout.activations, ACTIVATIONS, activations, {"model": model, "layer": at}, rebuild=EXTRACT)
        for at in (layer, layer + 1)
    )
    return Shard(name, fit_task, (params, model, layer, h_in, h_out), code=code, write=write_to(layout.fits, name, key))


def code_spec(layout: Layout, classes: list[str]) -> CodeSpec:
    """A shard's code: the stage's, the classes it fits, and the schema of the fits."""
    return stage_code("fit", layout, members("lmgeo.study_a.classes", layout, classes), [FITS.declared_schema])


def plan(params: Params, layout: Layout) -> Plan:
    """One shard per (model, layer) of the verified activations of the current extract plan; every
    value a task will use is checked here, before anything is pruned."""
    code = versioned(code_spec(layout, params.analysis.classes), layout)
    a = params.analysis
    # Which models and layers are fitted selects shards; it changes no shard's numbers.
    selection = {"runs", "checkpoints", "external_models", "layers"}
    fit_params = stage_params("fit", params, a.model_dump(exclude=selection), params.prepare.seq_len)
    extracted = planned_keys("extract", params, layout)
    stored = activation_shapes(layout, verified_files(layout.activations, extracted, rebuild=EXTRACT))
    planned = []
    for model in (m.path_id for m in analysed_models(params, layout)):
        n_blocks, width = stored[model]
        check_identifiable(a, model, width)
        key = ManifestKey(
            inputs={"activations": dataset_digest(layout.activations, prefix=f"{model}/")},
            params_hash=fit_params,
            code_version=code[1],
        )
        own = {shard: k for shard, k in extracted.items() if shard.startswith(f"{model}/")}
        for layer in chosen_layers(a, model, n_blocks):
            name = f"{model}/layer={layer}"
            planned.append((fit_shard(layout, params, model, layer, key, name, own, code), key))
    return planned


def chosen_layers(a: AnalysisConfig, model: str, n_blocks: int) -> list[int]:
    """The transitions `analysis.layers` names (every one when null), each checked against the model's blocks."""
    if a.layers is None:
        return list(range(n_blocks))
    beyond = [layer for layer in a.layers if layer >= n_blocks]
    if beyond:
        raise InputError(
            f"analysis.layers: {', '.join(map(str, beyond))} beyond the {n_blocks} blocks of {model} (transitions "
            f"0..{n_blocks - 1})"
        )
    return sorted(a.layers)


def check_identifiable(a: AnalysisConfig, model: str, width: int) -> None:
    """`p` and `rank` fit the width, and `k` gives every local class the input rank it needs (SPEC §4.5)."""
    from lmgeo.study_a.classes import FIT_CLASSES

    for name, value in (("p", a.p), ("rank", a.rank)):
        if value > width:
            raise InputError(f"analysis.{name} ({value}) exceeds the width d = {width} of {model}; lower it")
    short = [fn for fn in a.classes if FIT_CLASSES[fn].local and a.k < FIT_CLASSES[fn].needs_rank(width)]
    if short:
        need = max(FIT_CLASSES[fn].needs_rank(width) for fn in short)
        raise InputError(
            f"analysis.k ({a.k}) is below the {need} independent neighbours that {', '.join(short)} need at the "
            f"width d = {width} of {model}: their local maps would not be determined by the data; raise "
            "analysis.k (and the pool) or drop these classes"
        )


def run(params: Params, layout: Layout, ray_address: str | None = None) -> None:
    run_sharded_stage("fit", params, ray_address, layout, plan(params, layout), [layout.fits], [layout.activations])
