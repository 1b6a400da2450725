"""Where a causal LM keeps its blocks, final norm and head, found from the model's own structure (SPEC §1, §4.1).

Resolution reads the module tree only (no forward, so it also works on the meta device, before any
weight is read):
- the head is what the model itself declares as its output embeddings (`get_output_embeddings()`);
- the blocks are the `ModuleList` inside the decoder with one entry per layer of the config
  (`num_hidden_layers`), preferring lists of the model's own block classes (`_no_split_modules`, which
  transformers declares for device placement) and, among several, the one with the most parameters;
- the final norm is the normalisation module beside the blocks: the only one there, or else the first
  registered after the blocks (transformers' pipeline-parallel plans list `layers` then `norm` in that
  order);
- the logit map is a family's documented transform of the head's output (a soft-cap, a scale), read from
  its config.

A registered family (`lmgeo.models.registry`) may name any of the three paths instead. What is found
is a hypothesis: `lmgeo.models.verify` checks it numerically on the loaded model before any work.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from lmgeo.core.errors import InputError


class StructureError(InputError):
    """A model whose blocks, final norm or head cannot be located; the message says which."""


@dataclass(frozen=True)
class LogitMap:
    """`logits = softcap(scale · head(final_norm(h_L)))`, the transform a family applies after its head."""

    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def describe(self) -> str:
        parts = [f"× {self.scale:g}"] if self.scale != 1.0 else []
        parts += [f"soft-cap {self.softcap:g}"] if self.softcap is not None else []
        return ", ".join(parts) or "none"


# Config keys by which families document a transform of the head's output, and what each does:
# Gemma 2/3/4 and nanochat (`final_logit_softcapping`), RecurrentGemma (`logits_soft_cap`) and xLSTM
# (`output_logit_soft_cap`) soft-cap, `cap · tanh(z / cap)`; Cohere multiplies by `logit_scale`; Granite
# (and MiniCPM3, which divides the hidden state before its bias-free head: the same map) divides by
# `logits_scaling`; Falcon-H1 multiplies by `lm_head_multiplier`. A family that reads a key differently
# (HyperCLOVAX multiplies by `logits_scaling`) overrides the map in its registered family, or else fails
# the readout check instead of being misread.
_SCALES = {"logit_scale": lambda v: v, "logits_scaling": lambda v: 1 / v, "lm_head_multiplier": lambda v: v}
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def logit_map_of(config: PretrainedConfig) -> LogitMap:
    """The documented logit map of a (text) config."""
    scale = 1.0
    for key, to_factor in _SCALES.items():
        value = _number(getattr(config, key, None))
        if value not in (None, 0.0):
            scale *= to_factor(value)
    caps = [cap for key in _SOFTCAPS if (cap := _number(getattr(config, key, None))) is not None and cap > 0]
    return LogitMap(scale, caps[0] if caps else None)


@dataclass(frozen=True)
class Structure:
    """Dotted paths (for `model.get_submodule`) and the logit map of one model."""

    blocks: str
    final_norm: str
    head: str
    logit_map: LogitMap

    def describe(self) -> str:
        return (
            f"blocks {self.blocks}, final norm {self.final_norm}, head {self.head}, "
            f"logit map {self.logit_map.describe()}"
        )


@dataclass(frozen=True)
class Overrides:
    """What a registered family states itself; None: found from the structure (or the config)."""

    blocks: str | None = None
    final_norm: str | None = None
    head: str | None = None
    logit_map: Callable[[PretrainedConfig], LogitMap] | None = None


# ------------------------------------------------------------------------------------------ resolution
_NORM_NAME = re.compile(r"norm", re.IGNORECASE)
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_resolved: weakref.WeakKeyDictionary[nn.Module, Structure] = weakref.WeakKeyDictionary()


def resolve(model: PreTrainedModel, overrides: Overrides = Overrides()) -> Structure:
    """The model's structure, found once per model object (a structure does not change after loading)."""
    if model not in _resolved:
        names = {module: name for name, module in model.named_modules(remove_duplicate=False)}
        head = overrides.head or _find_head(model, names)
        blocks = overrides.blocks or _find_blocks(model, names)
        final_norm = overrides.final_norm or _find_final_norm(model, blocks)
        logit_map = (overrides.logit_map or logit_map_of)(text_config(model))
        _resolved[model] = Structure(blocks, final_norm, head, logit_map)
    return _resolved[model]


def _find_head(model: PreTrainedModel, names: dict[nn.Module, str]) -> str:
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        found = "none" if head is None else type(head).__name__
        raise StructureError(f"no LM head: the model declares no linear output embeddings (found {found})")
    return names[head]


def text_config(model: PreTrainedModel) -> PretrainedConfig:
    """The config of the language model (a multimodal config nests it)."""
    try:
        return model.config.get_text_config(decoder=True)
    except ValueError:  # several candidates: the top-level config is the best description
        return model.config


def n_layers_of(model: PreTrainedModel) -> int | None:
    """The number of blocks the config declares (None when it declares none under the common names)."""
    value = getattr(text_config(model), "num_hidden_layers", None)
    return value if isinstance(value, int) and value > 0 else None


def _decoder(model: PreTrainedModel) -> nn.Module:
    """Where the language model's blocks live: a multimodal model also holds the blocks of its encoders."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        decoder = None
    return decoder if isinstance(decoder, nn.Module) else model.base_model


def _find_blocks(model: PreTrainedModel, names: dict[nn.Module, str]) -> str:
    n_layers = n_layers_of(model)
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    candidates = [
        module
        for module in _decoder(model).modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (n_layers is None or len(module) == n_layers)
    ]
    own_classes = [m for m in candidates if all(type(block).__name__ in block_classes for block in m)]
    chosen = own_classes or candidates
    if not chosen:
        wanted = f"{n_layers} blocks (the config's num_hidden_layers)" if n_layers else "blocks"
        raise StructureError(f"no list of {wanted} inside the decoder")
    largest = max(chosen, key=lambda m: sum(p.numel() for p in m.parameters()))
    return names[largest]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def _find_final_norm(model: PreTrainedModel, blocks: str) -> str:
    parent_path, _, blocks_name = blocks.rpartition(".")
    parent = model.get_submodule(parent_path)
    siblings = list(parent.named_children())
    norms = [(i, name) for i, (name, module) in enumerate(siblings) if _is_norm(module)]
    after = [name for i, name in norms if i > [n for n, _ in siblings].index(blocks_name)]
    if len(norms) == 1:
        chosen = norms[0][1]
    elif after:
        chosen = after[0]
    else:
        found = ", ".join(name for _, name in norms) or "none"
        raise StructureError(f"no final norm beside the blocks {blocks} (normalisation modules there: {found})")
    return f"{parent_path}.{chosen}" if parent_path else chosen
