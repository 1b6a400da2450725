"""Opening an analysed model in a task: its weights checked against the plan by the driver, which sends
the model's files to the task (`model_input`; a hub model is downloaded by the task's node), loaded under
the security params, and verified (`lmgeo.study_a.verify`) before any work. Only the stages that run a
model (extract, perturb) import this module, so the other stages' code versions do not depend on model
code."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from lmgeo.core.errors import InputError
from lmgeo.core.execution import Load
from lmgeo.core.store import read_folder, sha256_cached, verify_shard, write_folder
from lmgeo.driver.analysis_set import AnalysedModel, analysed_models, model_label, model_source, model_tokenizer
from lmgeo.driver.layout import Layout
from lmgeo.models.weights import weights_digest
from lmgeo.params import Params


def check_external_models(params: Params, layout: Layout) -> None:
    """Fail in the driver, before any task starts, on an external model that cannot be analysed."""
    for model in analysed_models(params, layout):
        if not model.trained:
            check_external_model(params, layout, model)


def check_external_model(params: Params, layout: Layout, model: AnalysedModel) -> Any:
    """Its tokenizer, and a local model itself, loaded on the CPU and verified (a hub model is verified in the
    task that opens it: the nodes have the network, the driver may not); the verified model, or None."""
    from lmgeo.study_a.verify import verify_model

    model_tokenizer(layout, params, model)
    source = model_source(layout, params, model.ref, model.revision)
    if not Path(source).is_dir():
        return None
    net = _load(layout.root, source, params, model.revision)
    verify_model(net)
    return net


def verify_weights(layout: Layout, params: Params, model: AnalysedModel) -> str:
    """What to load for `model`, after checking that its weights are still those it was planned with:
    a checkpoint against its training manifest, a local external folder against its digest."""
    if model.trained:
        assert model.run is not None
        verify_shard(layout.models, model.run)
        weights = Path(model.ref) / "model.safetensors"
        if sha256_cached(weights) != model.digest:
            raise InputError(
                f"{model.table_id} ({weights}): retrained after the stage was planned; run the stage again"
            )
        return model.ref
    source = model_source(layout, params, model.ref, model.revision)
    if Path(source).is_dir() and weights_digest(Path(source), params.security.allow_outside_paths) != model.digest:
        raise InputError(
            f"{model_label(model.ref, source)}: its files changed after the stage was planned; run the stage again"
        )
    return source


def model_input(layout: Layout, params: Params, model: AnalysedModel) -> Load:
    """A task's input: the model's files (relative path → bytes), read by the driver after checking them
    against the plan (`verify_weights`); None for a hub model, which the task's node downloads."""

    def read() -> dict[str, bytes] | None:
        source = Path(verify_weights(layout, params, model))
        return read_folder(source) if source.is_dir() else None

    return Load(f"model:{model.digest}", read)


def open_model(params: Params, model: AnalysedModel, files: dict[str, bytes] | None):
    """The model (its `files`, or its hub id when None) on the task's device (a GPU when Ray gave the task
    one), under the security params, its structure verified on that device before any work
    (`lmgeo.study_a.verify`).

    The worker keeps the last model it opened: a task runs consecutive shards of one model (its layers and
    classes), which then load it once."""
    import torch

    from lmgeo.study_a.verify import verify_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    key = (model.digest, str(device), params.security)
    if _opened.get("key") != key:
        _opened.clear()
        # A scratch folder of this node is the workspace the model is opened in: the files the driver sent
        # are written there, and a hub id cannot name a path of the node.
        with tempfile.TemporaryDirectory(prefix="lmgeo-model-") as scratch:
            ref = model.ref if files is None else "./model"
            write_folder(Path(scratch) / "model", files or {})
            net = _load(Path(scratch), ref, params, model.revision).to(device)
        verify_model(net)
        _opened.update(key=key, net=net)
    return _opened["net"], device


_opened: dict[str, Any] = {}  # this worker's last opened model (one, so memory stays bounded)


def _load(workspace: Path, source: str, params: Params, revision: str | None):
    from lmgeo.models.loading import load_model

    s = params.security
    return load_model(
        source,
        revision=revision,
        trust_remote_code=s.trust_remote_code,
        workspace=workspace,
        allow_outside_paths=s.allow_outside_paths,
        max_parameters=s.max_model_parameters,
    )
