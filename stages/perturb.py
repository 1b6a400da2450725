"""`lmgeo perturb`: for every fitted anchor, the KL of the next-token distribution when block l's output at
that token is replaced by T_i(h_l), and by the null patches of SPEC §4.5; one Ray task per
(model, layer) for every class (one clean pass per sequence for all of them), written to
`data/perturb/model=<m>/layer=<l>/fn=<class>/` (joins the fits' `real` rows on seq_id, pos)."""

from __future__ import annotations

from pipeline.core.contracts import ACTIVATIONS, FITS, PERTURB, read
from pipeline.core.execution import Shard
from pipeline.core.fingerprint import CodeSpec
from pipeline.core.store import ManifestKey, ShardWriter, dataset_digest, verified_files
from pipeline.params import Params
from stages.analysis_set import EXTRACT, FIT, AnalysedModel, analysed_models
from stages.layout import Layout
from stages.opening import open_model
from stages.sharded import Plan, members, planned_keys, run_sharded_stage, stage_code, stage_params, versioned


def perturb_task(
    layout: Layout, params: Params, model: AnalysedModel, layer: int, key: ManifestKey, shard: str,
    inputs: dict[str, dict[str, ManifestKey]],
) -> int:
    from pipeline.study_a.perturb import perturb_layer

    a = params.analysis
    fit_files = verified_files(layout.fits, inputs["fits"], rebuild=FIT)
    stored_files = verified_files(layout.activations, inputs["activations"], rebuild=EXTRACT)
    tokens = read(
        layout.activations, ACTIVATIONS, stored_files, {"model": model.path_id, "layer": 0}, ["seq_id", "token_id"]
    )
    outputs = read(
        layout.activations, ACTIVATIONS, stored_files, {"model": model.path_id, "layer": layer + 1},
        ["seq_id", "pos", "h"],
    )
    fits = {
        fn: read(layout.fits, FITS, fit_files, {"model": model.path_id, "layer": layer, "fn": fn},
                 ["sample", "seq_id", "pos", "patched"])
        for fn in a.classes
    }  # fmt: skip
    net, _device = open_model(layout, params, model)
    tables = perturb_layer(net, tokens, outputs, fits, layer, a.seed, a.batch_size, a.null_directions)
    with ShardWriter(layout.perturb, shard, key, metadata={"model": model.table_id}) as writer:
        for fn, table in tables.items():
            writer.write({"model": model.path_id, "layer": layer, "fn": fn}, table)
    return sum(table.num_rows for table in tables.values())


def code_spec(layout: Layout) -> CodeSpec:
    """A shard's code: the stage's, every family's (as in extract) and the schema of the KLs."""
    return stage_code("perturb", layout, members("pipeline.models.families", layout), [PERTURB.declared_schema])


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
            args = (layout, params, model, layer, key, name, reads)
            planned.append((Shard(name, perturb_task, args, code=code), key))
    return planned


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    run_sharded_stage("perturb", params, ray_address, [layout.perturb], plan(params, layout))
