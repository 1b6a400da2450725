"""The registered model families, and the lookups every other module uses to find a model's parts."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from pipeline.core.errors import InputError
from pipeline.core.registry import Registry
from pipeline.models import gpt2, mamba, neox
from pipeline.models.config import ModelSize
from pipeline.models.family import ModelFamily

FAMILIES: Registry[ModelFamily] = Registry("model family", [gpt2.FAMILY, neox.FAMILY, mamba.FAMILY])


class UnsupportedArchitecture(InputError):
    """A model whose family is not registered."""


def family_for_model_type(model_type: str | None) -> ModelFamily:
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    supported = ", ".join(f"{f.model_type} ({f.name})" for f in FAMILIES)
    raise UnsupportedArchitecture(f"unsupported model_type {model_type!r}; supported model types: {supported}")


def family_of(model: PreTrainedModel) -> ModelFamily:
    return family_for_model_type(getattr(model.config, "model_type", None))


def blocks_of(model: PreTrainedModel) -> nn.ModuleList:
    path = family_of(model).blocks
    blocks = model.get_submodule(path)
    assert isinstance(blocks, nn.ModuleList), f"{path} is not a ModuleList"
    return blocks


def final_norm_of(model: PreTrainedModel) -> nn.Module:
    return model.get_submodule(family_of(model).final_norm)


def head_of(model: PreTrainedModel) -> nn.Linear:
    path = family_of(model).head
    head = model.get_submodule(path)
    assert isinstance(head, nn.Linear), f"{path} is not a Linear layer"
    return head


def assert_untied(model: PreTrainedModel) -> None:
    """The head must be its own parameter: Study B updates it independently of the input embedding."""
    head = head_of(model).weight
    embedding = model.get_input_embeddings().weight
    if head is embedding or head.data_ptr() == embedding.data_ptr():
        raise AssertionError(f"{family_of(model).name}: the LM head shares its weight with the input embedding")


def build_model(arch: str, size: ModelSize, vocab_size: int, seq_len: int, seed: int) -> PreTrainedModel:
    """A randomly initialised model with an untied head; the same seed gives the same weights."""
    family = FAMILIES[arch]
    if family.make_config is None:
        raise UnsupportedArchitecture(f"{arch}: this family is analysed only; it cannot be built for training")
    config = family.make_config(size, vocab_size, seq_len)
    # A private RNG stream, so that building a model neither depends on nor disturbs the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert_untied(model)
    return model
