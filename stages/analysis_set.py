"""The models Study A analyses: every trained run at the analysed checkpoints, plus external models."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pipeline.core.config import Params
from pipeline.core.errors import InputError
from stages.layout import Layout

_SAFE = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class AnalysedModel:
    table_id: str  # `<run>@init` / `<run>@final`, or the hub id / path as given
    path_id: str  # `<run>.init` / `<run>.final`, or the hub id with `/` → `--`
    ref: str  # what `load_model` opens: a checkpoint dir or the external id
    revision: str | None
    trained: bool  # our own checkpoint: same tokenizer as the eval tokens


def path_id_for(table_id: str) -> str:
    path_id = table_id.replace("@", ".").replace("/", "--")
    if not _SAFE.match(path_id):
        raise ValueError(f"model id {table_id!r} gives an unsafe partition name {path_id!r}")
    return path_id


def analysed_models(params: Params, layout: Layout) -> list[AnalysedModel]:
    """Trained checkpoints (a diverged run's `final` is left out: its weights are not finite) and
    external models, checked in the driver so that a bad reference fails before any task starts."""
    trained = [
        AnalysedModel(f"{run}@{ckpt}", f"{run}.{ckpt}", str(layout.run_dir(run) / ckpt), None, True)
        for run in params.train.runs()
        for ckpt in params.analysis.checkpoints
        if not (ckpt == "final" and diverged(layout, run))
    ]
    external = [
        AnalysedModel(m.id, path_id_for(m.id.removeprefix("./").strip("/")), m.id, m.revision, False)
        for m in params.analysis.external_models
    ]
    return trained + external


def diverged(layout: Layout, run: str) -> bool:
    run_json = layout.run_dir(run) / "final" / "run.json"
    if not run_json.is_file():
        raise InputError(f"{run} has no final checkpoint ({run_json}): run `lmgeo train` (or `dvc repro train`) first")
    return bool(json.loads(run_json.read_text()).get("diverged"))


def model_source(layout: Layout, params: Params, model: AnalysedModel) -> str:
    """What to open for `model` (a resolved local dir or a hub id), after every safety check."""
    from pipeline.models.arch import check_model

    return check_model(
        model.ref, revision=model.revision, trust_remote_code=params.security.trust_remote_code,
        workspace=layout.root, allow_outside_paths=params.security.allow_outside_paths,
    )


def model_tokenizer(layout: Layout, params: Params, model: AnalysedModel):
    """An external model's own tokenizer (the eval text is re-encoded with it); never remote code."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model_source(layout, params, model), revision=model.revision, trust_remote_code=False
        )
    except (OSError, ValueError) as err:
        raise InputError(f"{model.ref}: no usable tokenizer beside the model ({err})") from None


def check_external_models(params: Params, layout: Layout) -> None:
    """Fail in the driver, before any task starts, on an external model that cannot be analysed."""
    for model in analysed_models(params, layout):
        if not model.trained:
            model_tokenizer(layout, params, model)


def open_model(layout: Layout, params: Params, model: AnalysedModel):
    """The model on the task's device (a GPU when Ray gave the task one), under the security params."""
    import torch

    from pipeline.models.arch import load_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net = load_model(
        model_source(layout, params, model), revision=model.revision,
        trust_remote_code=params.security.trust_remote_code,
    )
    return net.to(device), device
