"""`lmgeo fit`: tokenwise fits on nearest-neighbour pairs, one Ray task per (model, layer, class),
written to `data/fits/model=<m>/layer=<l>/fn=<class>/`."""

from __future__ import annotations

from pipeline.core.config import digest
from pipeline.core.contracts import ACTIVATIONS, read
from pipeline.core.errors import InputError
from pipeline.core.execution import Shard
from pipeline.core.store import ManifestKey, ShardWriter, dataset_digest, verified_files
from pipeline.params import Params
from stages.analysis_set import analysed_models, layers_by_model
from stages.layout import Layout
from stages.sharded import Plan, run_sharded_stage, stage_code


def fit_task(layout: Layout, params: Params, model: str, layer: int, fn: str, key: ManifestKey, shard: str) -> int:
    import torch

    from pipeline.study_a.fits import fit_transition

    files = verified_files(layout.activations, rebuild="`lmgeo extract`")
    h_in, h_out = (read(layout.activations, ACTIVATIONS, files, {"model": model, "layer": l}) for l in (layer, layer + 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = fit_transition(h_in, h_out, fn, params.analysis, device)
    with ShardWriter(layout.fits, shard, key, metadata={"model": model, "fn": fn}) as writer:
        writer.write({"model": model, "layer": layer, "fn": fn}, table)
    return table.num_rows


def plan(params: Params, layout: Layout) -> Plan:
    code = stage_code("fit", layout)
    a = params.analysis
    fit_params = digest((a.model_dump(exclude={"checkpoints", "external_models"}), params.prepare.seq_len))
    planned = []
    stored = layers_by_model(layout)
    for model in (m.path_id for m in analysed_models(params, layout)):
        if model not in stored:
            raise InputError(f"no activations for {model}: run `lmgeo extract` (or `dvc repro extract`) first")
        key = ManifestKey(
            inputs={"activations": dataset_digest(layout.activations, prefix=f"{model}/")},
            params_hash=fit_params, code_version=code,
        )
        for layer in range(stored[model]):
            for fn in a.classes:
                name = f"{model}/layer={layer}/fn={fn}"
                args = (layout, params, model, layer, fn, key, name)
                planned.append((Shard(name, fit_task, args, code=("stages.fit", code)), key))
    return planned


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    run_sharded_stage("fit", params, ray_address, [layout.fits], plan(params, layout))
