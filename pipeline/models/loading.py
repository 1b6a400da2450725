"""Opening a causal LM safely: a local `save_pretrained` directory or a hub id, safetensors only, no remote
code unless trusted, registered families only."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from pipeline.core.errors import InputError
from pipeline.models.registry import family_for_model_type, family_of


class ModelLoadError(InputError):
    """A model reference that cannot be loaded safely; the message names the cause."""



# ------------------------------------------------------------------------------------------ loading
def _local_dir(ref: str, workspace: Path | None, allow_outside_paths: bool) -> Path | None:
    """The resolved directory when `ref` names a local path; None when it is a hub id."""
    raw = Path(ref).expanduser()
    path = (workspace / raw if workspace is not None and not raw.is_absolute() else raw).resolve()
    looks_like_path = raw.is_absolute() or ref.startswith((".", "~")) or ref.count("/") > 1
    if not path.exists():
        if looks_like_path:
            raise ModelLoadError(f"model path {ref!r} does not exist (resolved to {path})")
        return None
    if not path.is_dir():
        raise ModelLoadError(f"model path {ref!r} is not a directory")
    if workspace is not None and not allow_outside_paths and not path.is_relative_to(workspace.resolve()):
        raise ModelLoadError(
            f"model path {ref!r} resolves to {path}, outside the workspace {workspace.resolve()}; "
            "set security.allow_outside_paths to allow it"
        )
    return path


def _check_local_weights(path: Path) -> None:
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists():
        return
    if any(path.glob("pytorch_model*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ModelLoadError(
            f"{path} holds only pickle weights (pytorch_model.bin); lmgeo loads safetensors only. "
            "Convert them with save_pretrained(..., safe_serialization=True) in a trusted environment."
        )
    raise ModelLoadError(f"{path} holds no model weights (no *.safetensors file)")


def _check_config(config: dict, ref: str, trust_remote_code: bool) -> None:
    if "auto_map" in config and not trust_remote_code:
        raise ModelLoadError(
            f"{ref}: config.json asks for remote code (auto_map); refusing to run it. "
            "Set security.trust_remote_code: true only for a model you trust."
        )
    family_for_model_type(config.get("model_type"))


def check_model(
    ref: str,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    workspace: Path | None = None,
    allow_outside_paths: bool = False,
) -> str:
    """Everything `load_model` refuses, checked without reading any weight; returns what to load.

    Stages call it in the driver, so a bad model reference is one clear error before any task starts.
    """
    local = _local_dir(ref, workspace, allow_outside_paths)
    if local is not None:
        config_file = local / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{local} has no config.json; not a saved Hugging Face model")
        config = json.loads(config_file.read_text())
    else:
        try:
            config, _ = PretrainedConfig.get_config_dict(ref, revision=revision)
        except OSError as err:
            raise ModelLoadError(
                f"{ref!r} is neither a local model directory nor a reachable hub model: {err}"
            ) from None
    _check_config(config, ref, trust_remote_code)
    if local is not None:
        _check_local_weights(local)
    return str(local) if local is not None else ref


def load_model(
    ref: str,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    workspace: Path | None = None,
    allow_outside_paths: bool = False,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A causal LM from a local `save_pretrained` directory or a hub id, in eval mode.

    The config is checked (remote code, supported family) before any weight is read, and weights are
    read from safetensors only. Relative local paths are taken from `workspace` when given.
    """
    source = check_model(
        ref, revision=revision, trust_remote_code=trust_remote_code, workspace=workspace,
        allow_outside_paths=allow_outside_paths,
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            revision=revision,
            trust_remote_code=trust_remote_code,
            use_safetensors=True,
            dtype=dtype,
        )
    except OSError as err:
        raise ModelLoadError(f"cannot load model {ref!r}: {err}") from None
    family_of(model)  # remote code could still map to a class outside the registry
    return model.eval()
