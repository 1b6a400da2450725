"""The registered model families, and the lookups every other module uses to find a model's parts (the
blocks, final norm and head of any causal LM, resolved from its structure; `lmgeo.models.structure`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from lmgeo.core.errors import InputError
from lmgeo.models.config import ModelSize
from lmgeo.models.families import FAMILIES
from lmgeo.models.family import ModelFamily
from lmgeo.models.structure import Overrides, Structure, resolve

__all__ = ["FAMILIES"]  # re-exported: callers look families up here, next to the lookups


class UnsupportedArchitecture(InputError):
    """A model that cannot be analysed (not a causal LM transformers knows) or trained (not registered)."""


def registered_family(model_type: str | None) -> ModelFamily | None:
    """The one family registered for `model_type` (a run's key holds its own family's code only, so two
    families of one model type would change a run's structure and groups without its key)."""
    found = [family for family in FAMILIES if family.model_type == model_type]
    if len(found) > 1:
        raise ValueError(f"model_type {model_type!r} is registered by {len(found)} families: {found}")
    return found[0] if found else None


def family_of(model: PreTrainedModel) -> ModelFamily:
    """The registered family of a model Study B trains (its config builder and optimizer groups)."""
    model_type = getattr(model.config, "model_type", None)
    family = registered_family(model_type)
    if family is None:
        registered = ", ".join(f"{f.model_type} ({f.name})" for f in FAMILIES)
        raise UnsupportedArchitecture(f"model_type {model_type!r} is not a registered family; registered: {registered}")
    return family


def structure_of(model: PreTrainedModel) -> Structure:
    """Where the model keeps its blocks, final norm and head: found from its structure, unless its
    registered family overrides a path."""
    family = registered_family(getattr(model.config, "model_type", None))
    return resolve(model, family.overrides if family is not None else Overrides())


def blocks_of(model: PreTrainedModel) -> nn.ModuleList:
    blocks = model.get_submodule(structure_of(model).blocks)
    assert isinstance(blocks, nn.ModuleList)
    return blocks


def final_norm_of(model: PreTrainedModel) -> nn.Module:
    return model.get_submodule(structure_of(model).final_norm)


def head_of(model: PreTrainedModel) -> nn.Linear:
    head = model.get_submodule(structure_of(model).head)
    assert isinstance(head, nn.Linear)
    return head


def logits_from_last_state(model: PreTrainedModel, h_last: torch.Tensor) -> torch.Tensor:
    """The model's logits from its last block's output `h_L`: final norm, head, then the family's
    documented logit map (what `lmgeo.study_a.verify` checks against the model's own forward)."""
    return structure_of(model).logit_map(head_of(model)(final_norm_of(model)(h_last)))


def assert_untied(model: PreTrainedModel) -> None:
    """The head must be its own parameter: Study B updates it independently of the input embedding."""
    head = head_of(model).weight
    embedding = model.get_input_embeddings().weight
    if head is embedding or head.data_ptr() == embedding.data_ptr():  # type: ignore[operator]
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
