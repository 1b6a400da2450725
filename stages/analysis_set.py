"""The models Study A analyses: every trained run at the analysed checkpoints, plus external models."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeline.core.contracts import ACTIVATIONS, external_table_id, path_id, trained_model_id
from pipeline.core.errors import InputError
from pipeline.core.store import verified_files
from pipeline.params import Params
from stages.layout import Layout


@dataclass(frozen=True)
class AnalysedModel:
    table_id: str  # `<run>@init` / `<run>@final`, or the hub id / workspace path
    ref: str  # what `load_model` opens: a checkpoint dir or the external id
    revision: str | None
    trained: bool  # our own checkpoint: same tokenizer as the eval tokens

    @property
    def path_id(self) -> str:
        return path_id(self.table_id)


def analysed_models(params: Params, layout: Layout) -> list[AnalysedModel]:
    """Trained checkpoints (a diverged run's `final` is left out: its weights are not finite) and
    external models."""
    trained = [
        AnalysedModel(trained_model_id(run, ckpt), str(layout.checkpoint(run, ckpt)), None, True)
        for run in params.train.runs()
        for ckpt in params.analysis.checkpoints
        if not (ckpt == "final" and diverged(layout, run))
    ]
    external = [AnalysedModel(external_table_id(m.id), m.id, m.revision, False) for m in params.analysis.external_models]
    return trained + external


def diverged(layout: Layout, run: str) -> bool:
    run_json = layout.checkpoint(run, "final") / "run.json"
    if not run_json.is_file():
        raise InputError(f"{run} has no final checkpoint ({run_json}): run `lmgeo train` (or `dvc repro train`) first")
    return bool(json.loads(run_json.read_text()).get("diverged"))


def layers_by_model(layout: Layout) -> dict[str, int]:
    """model path id → number of blocks L (activations hold layers 0..L), from the manifests' files."""
    top: dict[str, int] = {}
    for path in verified_files(layout.activations, rebuild="`lmgeo extract`"):
        values = ACTIVATIONS.partition_values(path.relative_to(layout.activations))
        top[values["model"]] = max(top.get(values["model"], 0), values["layer"])
    return top


def model_source(layout: Layout, params: Params, model: AnalysedModel) -> str:
    """What to open for `model` (a resolved local dir or a hub id), after every safety check."""
    from pipeline.models.loading import check_model

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

    from pipeline.models.loading import load_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net = load_model(
        model_source(layout, params, model), revision=model.revision,
        trust_remote_code=params.security.trust_remote_code,
    )
    return net.to(device), device
