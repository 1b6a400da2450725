"""`lmgeo extract`: h_0 … h_L of every analysed model on the eval sequences, one Ray task per
(model, sequence shard), streamed into `data/activations/model=<m>/layer=<l>/`."""

from __future__ import annotations

import numpy as np

from pipeline.core.contracts import ACTIVATIONS
from pipeline.core.execution import Shard
from pipeline.core.fingerprint import CodeSpec
from pipeline.core.store import ManifestKey, ShardWriter, file_sha256
from pipeline.params import Params
from stages.analysis_set import AnalysedModel, analysed_models, model_tokenizer
from stages.layout import Layout
from stages.opening import check_external_models, open_model
from stages.sharded import Plan, members, run_sharded_stage, stage_code, stage_params, versioned


def eval_sequences(params: Params, layout: Layout, model: AnalysedModel) -> np.ndarray:
    """(n_seq, seq_len) token ids: our val windows, re-encoded for external models' own tokenizers."""
    from transformers import AutoTokenizer

    from pipeline.text.corpus import load_tokens
    from pipeline.text.evalset import eval_windows, retokenize

    n, seq_len = params.analysis.eval_sequences, params.prepare.seq_len
    tokens = load_tokens(layout.tokens, "val")
    if model.trained:
        return eval_windows(tokens, n, seq_len)
    ours = AutoTokenizer.from_pretrained(layout.tokenizer)
    theirs = model_tokenizer(layout, params, model)
    return retokenize(tokens, ours.decode, lambda text: theirs(text)["input_ids"], n, seq_len)


def extract_task(
    layout: Layout, params: Params, model: AnalysedModel, seq_ids: list[int], key: ManifestKey, shard: str
) -> int:
    from pipeline.study_a.extract import extract_batches

    net, device = open_model(layout, params, model)
    tokens = eval_sequences(params, layout, model)[seq_ids]
    metadata = {
        "model": model.table_id,
        "revision": model.revision or "",
        "dtype": params.analysis.vector_dtype,
        # Workspace-relative, so the same activations have the same bytes in every clone of the workspace.
        "tokenizer": layout.tokenizer.relative_to(layout.root).as_posix() if model.trained else model.ref,
    }
    rows = 0
    with ShardWriter(layout.activations, shard, key, metadata=metadata) as writer:
        for layer, batch in extract_batches(
            net, tokens, np.asarray(seq_ids, dtype=np.int32), params.analysis.batch_size, device,
            half=params.analysis.vector_dtype == "float16",
        ):
            writer.write({"model": model.path_id, "layer": layer}, batch)
            rows += batch.num_rows if layer == 0 else 0
    return rows


def shard_key(params: Params, layout: Layout, model: AnalysedModel, code: str) -> ManifestKey:
    """What an activation shard depends on: the eval tokens, the model's weights, the extraction params."""
    a = params.analysis
    inputs = {"tokens": file_sha256(layout.tokens / "meta.json"), "model": model.digest}
    extraction = (params.prepare, a.eval_sequences, a.sequences_per_shard, a.vector_dtype, params.security)
    return ManifestKey(inputs=inputs, params_hash=stage_params("extract", params, *extraction), code_version=code)


def code_spec(layout: Layout) -> CodeSpec:
    """A shard's code: the stage's, every family's (any model may take a registered family's structure
    overrides) and the schema of the activations."""
    families = members("pipeline.models.families", layout)
    return stage_code("extract", layout, families, [ACTIVATIONS.declared_schema])


def plan(params: Params, layout: Layout) -> Plan:
    code = versioned(code_spec(layout), layout)
    per_shard = params.analysis.sequences_per_shard
    seqs = list(range(params.analysis.eval_sequences))
    planned = []
    for model in analysed_models(params, layout):
        key = shard_key(params, layout, model, code[1])
        for start in range(0, len(seqs), per_shard):
            name = f"{model.path_id}/seq={start}"
            args = (layout, params, model, seqs[start : start + per_shard], key, name)
            planned.append((Shard(name, extract_task, args, code=code), key))
    return planned


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    check_external_models(params, layout)
    run_sharded_stage("extract", params, ray_address, [layout.activations], plan(params, layout))
