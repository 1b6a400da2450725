"""`lmgeo extract`: h_0 … h_L of every analysed model on the eval sequences, one Ray task per
(model, sequence shard), streamed into `data/activations/model=<m>/layer=<l>/`."""

from __future__ import annotations

import functools

import numpy as np

from lmgeo.core.contracts import ACTIVATIONS
from lmgeo.core.execution import Load, Shard
from lmgeo.core.fingerprint import CodeSpec
from lmgeo.core.store import ManifestKey, ShardParts, file_sha256
from lmgeo.driver.analysis_set import AnalysedModel, analysed_models, model_tokenizer
from lmgeo.driver.layout import Layout
from lmgeo.driver.opening import check_external_models, model_input, open_model
from lmgeo.driver.sharded import Plan, members, run_sharded_stage, stage_code, stage_params, versioned, write_to
from lmgeo.params import Params


def eval_sequences(params: Params, layout: Layout, model: AnalysedModel) -> np.ndarray:
    """(n_seq, seq_len) token ids: our val windows, re-encoded for external models' own tokenizers."""
    from transformers import AutoTokenizer

    from lmgeo.text.corpus import load_tokens
    from lmgeo.text.evalset import eval_windows, retokenize

    n, seq_len = params.analysis.eval_sequences, params.prepare.seq_len
    tokens = load_tokens(layout.tokens, "val")
    if model.trained:
        return eval_windows(tokens, n, seq_len)
    ours = AutoTokenizer.from_pretrained(layout.tokenizer)
    theirs = model_tokenizer(layout, params, model)
    return retokenize(
        tokens,
        ours.decode,  # type: ignore[arg-type]  # decode of a list is a str
        lambda text: theirs(text)["input_ids"],
        n,
        seq_len,
    )


def extract_task(
    params: Params,
    model: AnalysedModel,
    files: dict[str, bytes] | None,
    sequences: np.ndarray,
    seq_ids: list[int],
    metadata: dict[str, str],
) -> ShardParts:
    """Ray task: every layer's states of the model (its `files`) on the eval `sequences` numbered `seq_ids`."""
    from lmgeo.study_a.extract import extract_batches

    net, device = open_model(params, model, files)
    parts = ShardParts(metadata=metadata)
    for layer, batch in extract_batches(
        net,
        sequences[seq_ids],
        np.asarray(seq_ids, dtype=np.int32),
        params.analysis.batch_size,
        device,
        half=params.analysis.vector_dtype == "float16",
    ):
        parts.write({"model": model.path_id, "layer": layer}, batch)
    return parts


def shard_metadata(params: Params, layout: Layout, model: AnalysedModel) -> dict[str, str]:
    """What every activation file of the model says about where it comes from."""
    return {
        "model": model.table_id,
        "revision": model.revision or "",
        "dtype": params.analysis.vector_dtype,
        # Workspace-relative, so the same activations have the same bytes in every clone of the workspace.
        "tokenizer": layout.tokenizer.relative_to(layout.root).as_posix() if model.trained else model.ref,
    }


def shard_key(params: Params, layout: Layout, model: AnalysedModel, code: str) -> ManifestKey:
    """What an activation shard depends on: the eval tokens, the model's weights, the extraction params."""
    a = params.analysis
    inputs = {"tokens": file_sha256(layout.tokens / "meta.json"), "model": model.digest}
    extraction = (params.prepare, a.eval_sequences, a.sequences_per_shard, a.vector_dtype, params.security)
    return ManifestKey(inputs=inputs, params_hash=stage_params("extract", params, *extraction), code_version=code)


def code_spec(layout: Layout) -> CodeSpec:
    """A shard's code: the stage's, every family's (any model may take a registered family's structure
    overrides) and the schema of the activations."""
    families = members("lmgeo.models.families", layout)
    return stage_code("extract", layout, families, [ACTIVATIONS.declared_schema])


def plan(params: Params, layout: Layout) -> Plan:
    code = versioned(code_spec(layout), layout)
    per_shard = params.analysis.sequences_per_shard
    seqs = list(range(params.analysis.eval_sequences))
    planned = []
    for model in analysed_models(params, layout):
        key = shard_key(params, layout, model, code[1])
        # Read by the driver when the model's first shard is submitted, then shared by its shards.
        files = model_input(layout, params, model)
        sequences = Load(f"eval:{model.path_id}", functools.partial(eval_sequences, params, layout, model))
        metadata = shard_metadata(params, layout, model)
        for start in range(0, len(seqs), per_shard):
            name = f"{model.path_id}/seq={start}"
            args = (params, model, files, sequences, seqs[start : start + per_shard], metadata)
            write = write_to(layout.activations, name, key)
            planned.append((Shard(name, extract_task, args, code=code, write=write), key))
    return planned


def run(params: Params, layout: Layout, ray_address: str | None = None) -> None:
    check_external_models(params, layout)
    run_sharded_stage(
        "extract", params, ray_address, layout, plan(params, layout), [layout.activations], [layout.models]
    )
