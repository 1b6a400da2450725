"""`lmgeo perturb`: for every fitted anchor, the KL of the next-token distribution when block l's output
at that token is replaced by T_i(h_l); one Ray task per (model, layer, class), written to
`data/perturb/model=<m>/layer=<l>/fn=<class>/` (joins the fits on seq_id, pos)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.core.config import Params, digest
from pipeline.core.execution import Shard
from pipeline.core.store import ManifestKey, code_version, dataset_digest
from stages.analysis_set import AnalysedModel, analysed_models, open_model
from stages.extract import HIVE_TYPES as ACTIVATION_TYPES
from stages.fit import HIVE_TYPES as FIT_TYPES
from stages.layout import Layout
from stages.sharded import run_sharded_stage

SCHEMA = pa.schema([("seq_id", pa.int32()), ("pos", pa.int32()), ("kl", pa.float64()), ("kl_seq", pa.float64())])


def sequences(layout: Layout, model: str, seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique seq ids, their token ids (n_seq, seq_len)), replayed from the stored activations (layer 0)."""
    from pipeline.core.store import read_dataset

    unique = np.unique(seq_ids)
    table = read_dataset(
        layout.activations, ACTIVATION_TYPES, columns="seq_id, pos, token_id",
        where=f"model = '{model}' AND layer = 0 AND seq_id IN ({', '.join(str(int(s)) for s in unique)})",
        order_by="seq_id, pos",
    )
    return unique, table["token_id"].to_numpy().astype(np.int64).reshape(len(unique), -1)


def perturb_task(
    layout: Layout, params: Params, model: AnalysedModel, layer: int, fn: str, key: ManifestKey, shard: str
) -> int:
    import torch

    from pipeline.study_a.patching import patch_kl_anchors
    from pipeline.core.store import ShardWriter, arrow_to_vectors, read_dataset

    torch.set_num_threads(max(1, int(params.ray.resources_for("perturb").num_cpus)))
    fits = read_dataset(
        layout.fits, FIT_TYPES, columns="seq_id, pos, patched",
        where=f"model = '{model.path_id}' AND layer = {int(layer)} AND fn = '{fn}'", order_by="seq_id, pos",
    )
    seq_id, pos, patched = fits["seq_id"].to_numpy(), fits["pos"].to_numpy(), arrow_to_vectors(fits["patched"])
    net, _device = open_model(layout, params, model)
    unique, tokens = sequences(layout, model.path_id, seq_id)
    rows = np.searchsorted(unique, seq_id)
    kl, kl_seq = patch_kl_anchors(net, tokens, rows, pos, layer, patched, params.analysis.batch_size)
    table = pa.table({"seq_id": seq_id, "pos": pos, "kl": kl, "kl_seq": kl_seq}, schema=SCHEMA)
    with ShardWriter(layout.perturb, shard, key, metadata={"model": model.table_id, "fn": fn}) as writer:
        writer.write({"model": model.path_id, "layer": layer, "fn": fn}, table)
    return table.num_rows


def plan(params: Params, layout: Layout) -> list[tuple[Shard, ManifestKey]]:
    from stages.fit import layers_by_model

    stored = layers_by_model(layout)
    patch_params = digest((params.analysis.batch_size, params.security))
    planned = []
    for model in analysed_models(params, layout):
        for layer in range(stored.get(model.path_id, 0)):
            for fn in params.analysis.classes:
                name = f"{model.path_id}/layer={layer}/fn={fn}"
                key = ManifestKey(
                    inputs={"fits": dataset_digest(layout.fits, prefix=name)},
                    params_hash=patch_params, code_version=code_version(),
                )
                args = (layout, params, model, layer, fn, key, name)
                planned.append((Shard(key=name, fn=perturb_task, args=args), key))
    return planned


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    run_sharded_stage("perturb", params, ray_address, layout.perturb, plan(params, layout))
