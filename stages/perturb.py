"""`lmgeo perturb`: for every fitted anchor, the KL of the next-token distribution when block l's output
at that token is replaced by T_i(h_l); one Ray task per (model, layer, class), written to
`data/perturb/model=<m>/layer=<l>/fn=<class>/` (joins the fits on seq_id, pos)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.core.config import digest
from pipeline.core.contracts import ACTIVATIONS, FITS, PERTURB, read
from pipeline.core.execution import Shard
from pipeline.core.store import ManifestKey, ShardWriter, arrow_to_vectors, dataset_digest, verified_files
from pipeline.params import Params
from stages.analysis_set import AnalysedModel, analysed_models, layers_by_model, open_model
from stages.layout import Layout
from stages.sharded import Plan, run_sharded_stage, stage_code


def perturb_task(layout: Layout, params: Params, model: AnalysedModel, layer: int, fn: str, key: ManifestKey, shard: str) -> int:
    from pipeline.study_a.patching import patch_kl_anchors

    where = {"model": model.path_id, "layer": layer, "fn": fn}
    fits = read(layout.fits, FITS, verified_files(layout.fits, rebuild="`lmgeo fit`"), where, ["seq_id", "pos", "patched"])
    seq_id, pos, patched = fits["seq_id"].to_numpy(), fits["pos"].to_numpy(), arrow_to_vectors(fits["patched"])
    # The sequences are replayed from the stored activations (layer 0 holds every token id).
    stored = read(layout.activations, ACTIVATIONS, verified_files(layout.activations, rebuild="`lmgeo extract`"),
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
    code = stage_code("perturb", layout)
    stored = layers_by_model(layout)
    patch_params = digest((params.analysis.batch_size, params.security))
    planned = []
    for model in analysed_models(params, layout):
        for layer in range(stored.get(model.path_id, 0)):
            for fn in params.analysis.classes:
                name = f"{model.path_id}/layer={layer}/fn={fn}"
                key = ManifestKey(
                    inputs={"fits": dataset_digest(layout.fits, prefix=name)}, params_hash=patch_params, code_version=code,
                )
                args = (layout, params, model, layer, fn, key, name)
                planned.append((Shard(name, perturb_task, args, code=("stages.perturb", code)), key))
    return planned


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    run_sharded_stage("perturb", params, ray_address, [layout.perturb], plan(params, layout))
