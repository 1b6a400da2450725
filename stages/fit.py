"""`lmgeo fit`: tokenwise fits on nearest-neighbour pairs, one Ray task per (model, layer, class),
written to `data/fits/model=<m>/layer=<l>/fn=<class>/`."""

from __future__ import annotations

import numpy as np

from pipeline.core.config import Params, digest
from pipeline.core.execution import Shard
from pipeline.core.store import ManifestKey, code_version, dataset_digest
from stages.extract import HIVE_TYPES as ACTIVATION_TYPES
from pipeline.core.errors import InputError
from stages.analysis_set import analysed_models
from stages.layout import Layout
from stages.sharded import run_sharded_stage

HIVE_TYPES = {"model": "VARCHAR", "layer": "INTEGER", "fn": "VARCHAR"}


def read_layer(layout: Layout, model: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n, 3) int32 of seq_id, pos, token_id; vectors (n, d) float32) sorted by (seq_id, pos)."""
    from pipeline.core.store import arrow_to_vectors, read_dataset

    table = read_dataset(
        layout.activations, ACTIVATION_TYPES, where=f"model = '{model}' AND layer = {int(layer)}",
        order_by="seq_id, pos",
    )
    ids = np.stack([table[c].to_numpy() for c in ("seq_id", "pos", "token_id")], axis=1).astype(np.int32)
    return ids, arrow_to_vectors(table["h"])


def fit_task(layout: Layout, params: Params, model: str, layer: int, fn: str, key: ManifestKey, shard: str) -> int:
    import torch

    from pipeline.study_a.fits import choose_anchors, finite_rows, fit_layer
    from pipeline.core.store import ShardWriter

    torch.set_num_threads(max(1, int(params.ray.resources_for("fit").num_cpus)))
    ids, x = read_layer(layout, model, layer)
    ids_next, y = read_layer(layout, model, layer + 1)
    if not np.array_equal(ids, ids_next):
        raise RuntimeError(f"{model}: layers {layer} and {layer + 1} hold different tokens")
    a = params.analysis
    pool = _pool(len(x), a.pool_size, a.seed)
    x, y, ids = x[pool], y[pool], ids[pool]
    anchors = choose_anchors(len(x), a.anchors, a.seed, finite_rows(x, y))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table, _info = fit_layer(x, y, ids[:, 0], ids[:, 1], ids[:, 2], anchors, fn, a, device=device)
    with ShardWriter(layout.fits, shard, key, metadata={"model": model, "fn": fn}) as writer:
        writer.write({"model": model, "layer": layer, "fn": fn}, table)
    return table.num_rows


def _pool(n: int, pool_size: int | None, seed: int) -> np.ndarray:
    """A seeded subset of the stored tokens (all of them by default), in stored order."""
    if pool_size is None or pool_size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=pool_size, replace=False))


def layers_by_model(layout: Layout) -> dict[str, int]:
    """model path id → number of blocks L (activations hold layers 0..L)."""
    from pipeline.core.store import read_dataset

    table = read_dataset(layout.activations, ACTIVATION_TYPES, columns="model, max(layer) AS top", group_by="model")
    return dict(zip(table["model"].to_pylist(), table["top"].to_pylist(), strict=True))


def plan(params: Params, layout: Layout) -> list[tuple[Shard, ManifestKey]]:
    a = params.analysis
    fit_params = digest((a.model_dump(exclude={"checkpoints", "external_models"}), params.prepare.seq_len))
    planned = []
    stored = layers_by_model(layout)
    for model in (m.path_id for m in analysed_models(params, layout)):
        if model not in stored:
            raise InputError(f"no activations for {model}: run `lmgeo extract` (or `dvc repro extract`) first")
        n_blocks = stored[model]
        key = ManifestKey(
            inputs={"activations": dataset_digest(layout.activations, prefix=f"{model}/")},
            params_hash=fit_params, code_version=code_version(),
        )
        for layer in range(n_blocks):
            for fn in a.classes:
                name = f"{model}/layer={layer}/fn={fn}"
                args = (layout, params, model, layer, fn, key, name)
                planned.append((Shard(key=name, fn=fit_task, args=args), key))
    return planned


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    run_sharded_stage("fit", params, ray_address, layout.fits, plan(params, layout))
