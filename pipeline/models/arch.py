"""The architecture table: where each model family keeps its blocks, final norm and head (SPEC §1, §4.1).

Extraction, patching and training all locate modules through `ARCHS`, so adding a family means adding
one row here and nothing elsewhere. Dotted paths are checked against transformers 5 for
`GPT2LMHeadModel`, `GPTNeoXForCausalLM` and `MambaForCausalLM` (in transformers 5 the NeoX head is
`lm_head`; checkpoints that call it `embed_out` are renamed on load).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    MambaConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from pipeline.core.config import ModelSize
from pipeline.core.errors import InputError


class UnsupportedArchitecture(InputError):
    """A model whose family is not in `ARCHS`."""


class ModelLoadError(InputError):
    """A model reference that cannot be loaded safely; the message names the cause."""


@dataclass(frozen=True)
class ArchSpec:
    name: str  # our short name, used in run ids
    model_type: str  # HF `config.model_type`
    blocks: str  # dotted path to the ModuleList of blocks
    final_norm: str  # dotted path to the norm applied after the last block
    head: str  # dotted path to the LM head (nn.Linear)
    make_config: Callable[[ModelSize, int, int], PretrainedConfig]  # (size, vocab_size, seq_len)


# Dropout is off and special-token ids are cleared: small research models are trained without dropout,
# and the families' default token ids (e.g. GPT-2's 50256) do not exist in a small vocabulary.
def _gpt2_config(size: ModelSize, vocab_size: int, seq_len: int) -> PretrainedConfig:
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=size.d_model,
        n_layer=size.n_layers,
        n_head=size.n_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )


def _neox_config(size: ModelSize, vocab_size: int, seq_len: int) -> PretrainedConfig:
    return GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=size.d_model,
        num_hidden_layers=size.n_layers,
        num_attention_heads=size.n_heads,
        intermediate_size=4 * size.d_model,
        max_position_embeddings=seq_len,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )


def _mamba_config(size: ModelSize, vocab_size: int, seq_len: int) -> PretrainedConfig:
    del seq_len  # a recurrent model has no position table
    return MambaConfig(
        vocab_size=vocab_size,
        hidden_size=size.d_model,
        num_hidden_layers=size.n_layers,
        state_size=size.d_state,
        expand=size.expand,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
        # Without the CUDA kernels, mambapy's parallel scan (pure PyTorch) trains ~3x faster on a CPU
        # than the sequential reference scan, with the same function.
        use_mambapy=True,
    )


ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("gpt2", "gpt2", "transformer.h", "transformer.ln_f", "lm_head", _gpt2_config),
        ArchSpec("neox", "gpt_neox", "gpt_neox.layers", "gpt_neox.final_layer_norm", "lm_head", _neox_config),
        ArchSpec("mamba", "mamba", "backbone.layers", "backbone.norm_f", "lm_head", _mamba_config),
    )
}
_BY_MODEL_TYPE = {spec.model_type: spec for spec in ARCHS.values()}


def _supported() -> str:
    return ", ".join(f"{s.model_type} ({s.name})" for s in ARCHS.values())


def spec_for_model_type(model_type: str | None) -> ArchSpec:
    try:
        return _BY_MODEL_TYPE[model_type]  # type: ignore[index]
    except KeyError:
        raise UnsupportedArchitecture(
            f"unsupported model_type {model_type!r}; supported model types: {_supported()}"
        ) from None


def spec_of(model: PreTrainedModel) -> ArchSpec:
    return spec_for_model_type(getattr(model.config, "model_type", None))


def blocks_of(model: PreTrainedModel) -> nn.ModuleList:
    blocks = model.get_submodule(spec_of(model).blocks)
    assert isinstance(blocks, nn.ModuleList), f"{spec_of(model).blocks} is not a ModuleList"
    return blocks


def final_norm_of(model: PreTrainedModel) -> nn.Module:
    return model.get_submodule(spec_of(model).final_norm)


def head_of(model: PreTrainedModel) -> nn.Linear:
    head = model.get_submodule(spec_of(model).head)
    assert isinstance(head, nn.Linear), f"{spec_of(model).head} is not a Linear layer"
    return head


def assert_untied(model: PreTrainedModel) -> None:
    """The head must be its own parameter: Study B updates it independently of the input embedding."""
    head = head_of(model).weight
    embedding = model.get_input_embeddings().weight
    if head is embedding or head.data_ptr() == embedding.data_ptr():
        raise AssertionError(f"{spec_of(model).name}: the LM head shares its weight with the input embedding")


def build_model(arch: str, size: ModelSize, vocab_size: int, seq_len: int, seed: int) -> PreTrainedModel:
    """A randomly initialised model with an untied head; the same seed gives the same weights."""
    if arch not in ARCHS:
        raise UnsupportedArchitecture(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    config = ARCHS[arch].make_config(size, vocab_size, seq_len)
    # A private RNG stream, so that building a model neither depends on nor disturbs the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert_untied(model)
    return model


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
    spec_for_model_type(config.get("model_type"))


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
    spec_of(model)  # remote code could still map to a class outside the table
    return model.eval()
