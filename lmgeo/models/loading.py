"""Opening a causal LM safely: a local `save_pretrained` directory or a hub id, safetensors only, no remote
code unless trusted, causal-LM model types only, every file inside the workspace unless allowed, the
structure resolved and a parameter budget checked on the meta device before anything is allocated, and
every tensor of the checkpoint matched to the model (a missing, unexpected or mis-shaped tensor is an
error, never a randomly initialised weight)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lmgeo.models.registry import UnsupportedArchitecture, structure_of
from lmgeo.models.weights import WEIGHTS_INDEX, ModelLoadError, indexed_weights


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
        raise ModelLoadError(f"model path {ref!r} is not a directory (resolved to {path})")
    if workspace is not None and not allow_outside_paths:
        # The folder and every file in it: a symlinked `model.safetensors` counts like a symlinked folder.
        for inside in [path, *sorted(path.rglob("*"))]:
            if not inside.resolve().is_relative_to(workspace.resolve()):
                raise ModelLoadError(
                    f"model path {ref!r}: {inside} resolves to {inside.resolve()}, outside the workspace "
                    f"{workspace.resolve()}; set security.allow_outside_paths to allow it"
                )
    return path


def meta_model(config: dict[str, Any], trust_remote_code: bool = False) -> PreTrainedModel:
    """The model a config describes, on the meta device: its structure and size, nothing allocated."""
    settings = {k: v for k, v in config.items() if k not in ("model_type", "auto_map")}
    try:
        built = AutoConfig.for_model(config["model_type"], **settings)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(built, trust_remote_code=trust_remote_code)
    except (KeyError, ValueError, TypeError) as err:
        raise ModelLoadError(f"config.json does not describe a model transformers can build: {err}") from None


def check_budget(n_parameters: int, ref: str, max_parameters: int, dtype: torch.dtype) -> None:
    """Refuse a model over the params budget or over the memory this machine has free."""
    import psutil

    if n_parameters > max_parameters:
        raise ModelLoadError(
            f"{ref}: its config describes {n_parameters:,} parameters, over security.max_model_parameters "
            f"({max_parameters:,}); raise it if you mean to load a model this size"
        )
    needed = n_parameters * torch.finfo(dtype).bits // 8
    available = psutil.virtual_memory().available
    if needed > available:
        raise ModelLoadError(
            f"{ref}: {n_parameters:,} parameters need {needed / 2**30:.1f} GiB in {dtype}, but this machine "
            f"has {available / 2**30:.1f} GiB free"
        )


def _check_local_weights(path: Path, allow_outside_paths: bool) -> None:
    if (path / WEIGHTS_INDEX).exists():
        indexed_weights(path, allow_outside_paths)
        return
    if any(path.glob("*.safetensors")):
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
    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not ("auto_map" in config and trust_remote_code):
        raise UnsupportedArchitecture(
            f"{ref}: model_type {model_type!r} is not a causal LM transformers knows "
            "(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES); Study A analyses decoder-only causal LMs"
        )


def check_model(
    ref: str,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    workspace: Path | None = None,
    allow_outside_paths: bool = False,
    max_parameters: int = 10**10,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Everything `load_model` refuses, checked without reading any weight; returns what to load.

    Stages call it in the driver, so a bad model reference is one clear error before any task starts.
    """
    local = _local_dir(ref, workspace, allow_outside_paths)
    if local is not None and not (local / "config.json").is_file():
        raise ModelLoadError(f"{local} has no config.json; not a saved Hugging Face model")
    try:
        # transformers' own reader: it decodes what its writer encodes (an infinite `time_step_limit`
        # of Mamba-2 and the hybrids is saved as {"__float__": "Infinity"}).
        config, _ = PretrainedConfig.get_config_dict(str(local) if local is not None else ref, revision=revision)
    except OSError as err:
        where = (
            f"config.json of {local} is unreadable"
            if local is not None
            else "neither a local model directory nor a reachable hub model"
        )
        raise ModelLoadError(f"{ref!r}: {where}: {err}") from None
    _check_config(config, ref, trust_remote_code)
    skeleton = meta_model(config, trust_remote_code)
    structure_of(skeleton)  # no blocks, final norm or head: refused before any weight is read
    check_budget(sum(p.numel() for p in skeleton.parameters()), ref, max_parameters, dtype)
    if local is not None:
        _check_local_weights(local, allow_outside_paths)
    return str(local) if local is not None else ref


def load_model(
    ref: str,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    workspace: Path | None = None,
    allow_outside_paths: bool = False,
    max_parameters: int = 10**10,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A causal LM from a local `save_pretrained` directory or a hub id, in eval mode.

    The config is checked (remote code, supported family, parameter budget) before any weight is read,
    weights are read from safetensors only, and every tensor must match the model. Relative local paths
    are taken from `workspace` when given.
    """
    source = check_model(
        ref,
        revision=revision,
        trust_remote_code=trust_remote_code,
        workspace=workspace,
        allow_outside_paths=allow_outside_paths,
        max_parameters=max_parameters,
        dtype=dtype,
    )
    model: PreTrainedModel
    loading: dict[str, Any]
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(  # type: ignore[misc]  # a pair with output_loading_info
            source,
            revision=revision,
            trust_remote_code=trust_remote_code,
            use_safetensors=True,
            dtype=dtype,
            output_loading_info=True,
        )
    except Exception as err:  # noqa: BLE001 - safetensors, tokenizers and torch raise their own types
        raise ModelLoadError(f"cannot load model {ref!r}: {type(err).__name__}: {err}") from None
    _check_every_tensor_matched(ref, loading)
    structure_of(model)  # remote code could still build another structure than its config's
    return model.eval()


def _check_every_tensor_matched(ref: str, loading: dict[str, Any]) -> None:
    """transformers fills a weight the checkpoint lacks (or holds in another shape) with a fresh random
    init and warns; here that is an error naming the tensors."""
    problems = {
        "missing from the checkpoint": loading.get("missing_keys", []),
        "in the checkpoint but not in the model": loading.get("unexpected_keys", []),
        "of another shape than the model's": [
            str(m[0]) if isinstance(m, tuple) else str(m) for m in loading.get("mismatched_keys", [])
        ],
        "not loadable": loading.get("error_msgs", []),
    }
    found = {what: sorted(map(str, names)) for what, names in problems.items() if names}
    if found:
        detail = "; ".join(
            f"{len(n)} {what} ({', '.join(n[:6])}{', …' if len(n) > 6 else ''})" for what, n in found.items()
        )
        raise ModelLoadError(f"{ref}: the checkpoint does not match its config: {detail}")
