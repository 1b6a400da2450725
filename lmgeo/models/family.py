"""A registered model family: what the structure of a model cannot say by itself (SPEC §1, §3.2, §4.1).

Any decoder-only causal LM is analysed without registration: its blocks, final norm and head are found
from its structure (`lmgeo.models.structure`) and verified on the loaded model. A family is registered
only to be *trained* here (a config builder and the name patterns of its optimizer groups, torchtitan
style, with a partition assertion in `lmgeo.study_b.optim`), or to override a path that resolution
gets wrong. A family is one module of `lmgeo/models/families/` plus one line in its `__init__.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from transformers import PretrainedConfig

from lmgeo.models.config import ModelSize
from lmgeo.models.structure import Overrides

ConfigBuilder = Callable[[ModelSize, int, int], PretrainedConfig]  # (size, vocab_size, seq_len)


@dataclass(frozen=True)
class GroupRule:
    """Parameters whose qualified name matches `pattern` (re.search) belong to `group`: `embed`, `hidden`
    (2-D matrices for Muon) or `scalar` (norms, biases, SSM parameters). The head is assigned by identity."""

    group: Literal["embed", "hidden", "scalar"]
    pattern: str


# Biases, every norm's weight: the same rule in every family.
NORMS_AND_BIASES = r"\.bias$|(?:^|[._])(?:ln_\w+|\w*norm\w*)\.weight$"


@dataclass(frozen=True)
class ModelFamily:
    name: str  # our short name, used in run ids
    model_type: str  # Hugging Face `config.model_type`
    kind: Literal["transformer", "ssm"]  # how the report groups families
    overrides: Overrides = Overrides()  # paths that resolution would get wrong
    make_config: ConfigBuilder | None = None  # None: analysed only, never trained here
    param_groups: tuple[GroupRule, ...] = ()
    # Hidden matrices stored (in, out), like GPT-2's Conv1D, instead of nn.Linear's (out, in).
    hidden_stored_transposed: bool = False

    @property
    def trainable(self) -> bool:
        return self.make_config is not None
