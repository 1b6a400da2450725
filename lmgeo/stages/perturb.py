"""`lmgeo perturb`: for every fitted anchor, the KL of the next-token distribution when block l's output at
that token is replaced by T_i(h_l), and by the null patches of SPEC §4.5; one Ray task per
(model, layer) for every class (one clean pass per sequence for all of them), written to
`data/perturb/model=<m>/layer=<l>/fn=<class>/` (joins the fits' `real` rows on seq_id, pos)."""

from __future__ import annotations

import functools

import pyarrow as pa

from lmgeo.core.contracts import ACTIVATIONS, FITS, PERTURB, read
from lmgeo.core.execution import Load, Shard
from lmgeo.core.fingerprint import CodeSpec
from lmgeo.core.store import ManifestKey, ShardParts, dataset_digest, verified_files
from lmgeo.driver.analysis_set import EXTRACT, FIT, AnalysedModel, analysed_models
from lmgeo.driver.layout import Layout
from lmgeo.driver.opening import model_input, open_model
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


def perturb_task(
    params: Params,
    model: AnalysedModel,
    layer: int,
    files: dict[str, bytes] | None,
    tokens: pa.Table,
    outputs: pa.Table,
    fits: dict[str, pa.Table],
) -> ShardParts:
    """Ray task: the KLs of every class's patches at layer `layer` of the model (its `files`), from the eval
    `tokens` (layer 0's ids), the layer's `outputs` (h_{l+1}) and each class's `fits`."""
    from lmgeo.study_a.perturb import perturb_layer

    a = params.analysis
    net, _device = open_model(params, model, files)
    parts = ShardParts(metadata={"model": model.table_id})
    for fn, table in perturb_layer(net, tokens, outputs, fits, layer, a.seed, a.batch_size, a.null_directions).items():
        parts.write({"model": model.path_id, "layer": layer, "fn": fn}, table)
    return parts


def perturb_shard(
    layout: Layout,
    params: Params,
    model: AnalysedModel,
    layer: int,
    key: ManifestKey,
    name: str,
    reads: dict[str, dict[str, ManifestKey]],
    code: tuple[CodeSpec, str],
) -> Shard:
    """The shard `name`: the task reads the model, its planned fits and activations (`reads`: planned shards
    of each) and its KLs are written under `layout.perturb`."""
    stored = functools.partial(partition_input, layout.activations, ACTIVATIONS, reads["activations"], rebuild=EXTRACT)
    tokens = stored({"model": model.path_id, "layer": 0}, ["seq_id", "token_id"])
    outputs = stored({"model": model.path_id, "layer": layer + 1}, ["seq_id", "pos", "h"])
    classes = params.analysis.classes
    fits = Load(f"fits:{name}", functools.partial(stored_fits, layout, reads["fits"], model.path_id, layer, classes))
    args = (params, model, layer, model_input(layout, params, model), tokens, outputs, fits)
    return Shard(name, perturb_task, args, code=code, write=write_to(layout.perturb, name, key))


def stored_fits(
    layout: Layout, planned: dict[str, ManifestKey], model: str, layer: int, classes: list[str]
) -> dict[str, pa.Table]:
    """Each class's patched anchors of the verified fit shard `planned`, read by the driver."""
    files = verified_files(layout.fits, planned, rebuild=FIT)
    columns = ["sample", "seq_id", "pos", "patched"]
    return {fn: read(layout.fits, FITS, files, {"model": model, "layer": layer, "fn": fn}, columns) for fn in classes}


def code_spec(layout: Layout) -> CodeSpec:
    """A shard's code: the stage's, every family's (as in extract) and the schema of the KLs."""
    return stage_code("perturb", layout, members("lmgeo.models.families", layout), [PERTURB.declared_schema])


def plan(params: Params, layout: Layout) -> Plan:
    """One shard per fit shard (model, layer) of the current fit plan, whose verified fits it reads."""
    code = versioned(code_spec(layout), layout)
    fitted = planned_keys("fit", params, layout)
    extracted = planned_keys("extract", params, layout)
    verified_files(layout.fits, fitted, rebuild=FIT)  # every planned fit shard present, current and intact
    a = params.analysis
    patch_params = stage_params("perturb", params, a.batch_size, a.seed, a.null_directions, a.classes, params.security)
    planned = []
    for model in analysed_models(params, layout):
        activations = {shard: k for shard, k in extracted.items() if shard.startswith(f"{model.path_id}/")}
        for name in (shard for shard in fitted if shard.startswith(f"{model.path_id}/")):
            layer = int(name.split("/")[1].removeprefix("layer="))
            inputs = {"fits": dataset_digest(layout.fits, prefix=name), "model": model.digest}
            key = ManifestKey(inputs=inputs, params_hash=patch_params, code_version=code[1])
            reads = {"fits": {name: fitted[name]}, "activations": activations}
            planned.append((perturb_shard(layout, params, model, layer, key, name, reads, code), key))
    return planned


def run(params: Params, layout: Layout, ray_address: str | None = None) -> None:
    run_sharded_stage(
        "perturb",
        params,
        ray_address,
        layout,
        plan(params, layout),
        [layout.perturb],
        [layout.fits, layout.activations, layout.models],
    )
