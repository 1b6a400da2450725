"""The models Study A analyses: every trained run at the analysed checkpoints, plus external models, each
with a digest of its weights that the shards computed from it are keyed by and that is checked again
when a task opens it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lmgeo.core.contracts import (
    ACTIVATIONS,
    check_stored_vectors,
    external_table_id,
    path_id,
    trained_model_id,
    vector_shape,
)
from lmgeo.core.errors import InputError
from lmgeo.core.store import verified_files
from lmgeo.driver.layout import Layout
from lmgeo.params import Params

TRAIN = "`lmgeo train` (or `dvc repro train`)"
EXTRACT = "`lmgeo extract` (or `dvc repro extract`)"
FIT = "`lmgeo fit` (or `dvc repro fit`)"


@dataclass(frozen=True)
class AnalysedModel:
    table_id: str  # `<run>@init` / `<run>@final`, or the hub id / workspace path
    ref: str  # what `load_model` opens: a checkpoint dir or the external id
    revision: str | None
    run: str | None  # the trained run this checkpoint belongs to; None for an external model
    digest: str  # the weights: sha256 of a checkpoint's safetensors, a local folder's hash, a hub revision

    @property
    def trained(self) -> bool:
        """Our own checkpoint: same tokenizer as the eval tokens."""
        return self.run is not None

    @property
    def path_id(self) -> str:
        return path_id(self.table_id)


def analysed_models(params: Params, layout: Layout) -> list[AnalysedModel]:
    """The checkpoints of the runs `analysis.runs` selects, read from the verified checkpoints of the
    current train plan (a diverged run's `final` is left out: its weights are not finite), then external
    models. Each distinct weight file is analysed once: a checkpoint whose weights another one before it
    already has (the `init` of runs that differ only in their recipe) is left out."""
    from lmgeo.core.store import manifest_path
    from lmgeo.driver.sharded import planned_keys

    runs = [spec.run_id for spec in params.analysed_runs()]
    planned = {run: key for run, key in planned_keys("train", params, layout).items() if run in runs}
    checkpoints = verified_files(layout.models, planned, rebuild=TRAIN)
    weights = {
        entry["path"]: entry["sha256"]
        for run in runs
        for entry in json.loads(manifest_path(layout.models, run).read_text())["files"]
    }
    records = {p.parent.parent.name: json.loads(p.read_text()) for p in checkpoints if p.match("*/final/run.json")}
    trained = [
        AnalysedModel(
            trained_model_id(run, ckpt),
            str(layout.checkpoint(run, ckpt)),
            None,
            run,
            weights[f"{run}/{ckpt}/model.safetensors"],
        )
        for run in runs
        for ckpt in params.analysis.checkpoints
        if not (ckpt == "final" and records[run].get("diverged"))
    ]
    external = [external_model(params, layout, m.id, m.revision, m.name) for m in params.analysis.external_models]
    models = trained + external
    first: dict[str, AnalysedModel] = {}
    for model in models:
        first.setdefault(model.digest, model)
    return list(first.values())


def external_model(
    params: Params, layout: Layout, ref: str, revision: str | None, name: str | None = None
) -> AnalysedModel:
    """An external model (named `name` in tables, its id by default), its source checked (paths, remote code,
    budget) and its weights digested."""
    from lmgeo.models.weights import weights_digest

    source = model_source(layout, params, ref, revision)
    allowed = params.security.allow_outside_paths
    digest = weights_digest(Path(source), allowed) if Path(source).is_dir() else f"hub:{revision or 'main'}"
    return AnalysedModel(external_table_id(name or ref), ref, revision, None, digest)


def activation_shapes(layout: Layout, files: list[Path]) -> dict[str, tuple[int, int]]:
    """model path id → (number of blocks L, width d) of its stored activations (layers 0..L)."""
    import pyarrow.parquet as pq

    shapes: dict[str, tuple[int, int]] = {}
    for path in files:
        values = ACTIVATIONS.partition_values(path.relative_to(layout.activations))
        stored = pq.read_schema(path).field("h").type
        check_stored_vectors(path, ACTIVATIONS, stored)
        width = vector_shape(stored)[0]
        top, _ = shapes.get(values["model"], (0, width))
        shapes[values["model"]] = (max(top, values["layer"]), width)
    return shapes


def model_source(layout: Layout, params: Params, ref: str, revision: str | None) -> str:
    """What to open for `ref` (a resolved local dir or a hub id), after every safety check."""
    from lmgeo.models.loading import check_model

    s = params.security
    try:
        return check_model(
            ref,
            revision=revision,
            trust_remote_code=s.trust_remote_code,
            workspace=layout.root,
            allow_outside_paths=s.allow_outside_paths,
            max_parameters=s.max_model_parameters,
        )
    except InputError as err:
        # A config transformers cannot build, or a structure Study A cannot use, is refused without naming
        # the model (the loader's messages stay free of paths for `lmgeo families`' table): name it here.
        if ref not in str(err):
            err.args = (f"{ref}: {err}", *err.args[1:])
        raise


def model_label(ref: str, source: str) -> str:
    """An external model as the params name it, with the folder it resolved to when that differs."""
    return ref if source == ref else f"{ref} ({source})"


def model_tokenizer(layout: Layout, params: Params, model: AnalysedModel):
    """An external model's own tokenizer (the eval text is re-encoded with it); never remote code."""
    from transformers import AutoTokenizer

    source = model_source(layout, params, model.ref, model.revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=model.revision, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own exception types for bad files
        raise InputError(
            f"{model_label(model.ref, source)}: no usable tokenizer beside the model ({type(err).__name__}: {err})"
        ) from None
    if not tokenizer("The eval text is encoded with the model's own tokenizer.")["input_ids"]:
        raise InputError(
            f"{model_label(model.ref, source)}: its tokenizer encodes text to no tokens (was the model saved without "
            "its tokenizer? save it beside the weights with `tokenizer.save_pretrained(...)`)"
        )
    return tokenizer
