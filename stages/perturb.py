"""`lmgeo perturb`: for every fitted anchor, the KL of the next-token distribution when block l's output
at that token is replaced by T_i(h_l); one Ray task per (model, layer, class), written to
`data/perturb/model=<m>/layer=<l>/fn=<class>/` (joins the fits on seq_id, pos)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.core.contracts import ACTIVATIONS, FITS, PERTURB, read
from pipeline.core.execution import Shard
from pipeline.core.store import ManifestKey, ShardWriter, arrow_to_vectors, dataset_digest, verified_files
from pipeline.params import Params
from stages.analysis_set import EXTRACT, FIT, AnalysedModel, analysed_models, open_model
from stages.layout import Layout
from stages.sharded import Plan, planned_keys, run_sharded_stage, stage_code, stage_params


def perturb_task(
    layout: Layout, params: Params, model: AnalysedModel, layer: int, fn: str, key: ManifestKey, shard: str,
    inputs: dict[str, dict[str, ManifestKey]],
) -> int:
    from pipeline.study_a.patching import patch_kl_anchors

    where = {"model": model.path_id, "layer": layer, "fn": fn}
    fits = read(layout.fits, FITS, verified_files(layout.fits, inputs["fits"], rebuild=FIT), where, ["seq_id", "pos", "patched"])
    seq_id, pos, patched = fits["seq_id"].to_numpy(), fits["pos"].to_numpy(), arrow_to_vectors(fits["patched"])
    # The sequences are replayed from the stored activations (layer 0 holds every token id).
    stored = read(layout.activations, ACTIVATIONS, verified_files(layout.activations, inputs["activations"], rebuild=EXTRACT),
                  {"model": model.path_id, "layer": 0}, ["seq_id", "pos", "token_id"])  # fmt: skip
    unique = np.unique(seq_id)
    wanted = np.isin(stored["seq_id"].to_numpy(), unique)
    tokens = stored["token_id"].to_numpy()[wanted].astype(np.int64).reshape(len(unique), -1)
    net, _device = open_model(layout, params, model)
    kl, kl_seq = patch_kl_anchors(net, tokens, np.searchsorted(unique, seq_id), pos, layer, patched, params.analysis.batch_size)
    table = pa.table({"seq_id": seq_id, "pos": pos, "kl": kl, "kl_seq": kl_seq}, schema=PERTURB.file_schema())
    with ShardWriter(layout.perturb, shard, key, metadata={"model": model.table_id, "fn": fn}) as writer:
        writer.write(where, table)
    return table.num_rows


def plan(params: Params, layout: Layout) -> Plan:
    """One shard per fit shard of the current fit plan, whose verified fits it reads."""
    code = stage_code("perturb", layout)
    fitted = planned_keys("fit", params, layout)
    extracted = planned_keys("extract", params, layout)
    verified_files(layout.fits, fitted, rebuild=FIT)  # every planned fit shard present, current and intact
    patch_params = stage_params("perturb", params, params.analysis.batch_size, params.security)
    planned = []
    for model in analysed_models(params, layout):
        activations = {shard: k for shard, k in extracted.items() if shard.startswith(f"{model.path_id}/")}
        for name in (shard for shard in fitted if shard.startswith(f"{model.path_id}/")):
            _, layer_part, fn_part = name.split("/")
            layer, fn = int(layer_part.removeprefix("layer=")), fn_part.removeprefix("fn=")
            inputs = {"fits": dataset_digest(layout.fits, prefix=name), "model": model.digest}
            key = ManifestKey(inputs=inputs, params_hash=patch_params, code_version=code)
            reads = {"fits": {name: fitted[name]}, "activations": activations}
            args = (layout, params, model, layer, fn, key, name, reads)
            planned.append((Shard(name, perturb_task, args, code=("stages.perturb", code)), key))
    return planned


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    run_sharded_stage("perturb", params, ray_address, [layout.perturb], plan(params, layout))
