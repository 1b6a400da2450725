"""Mamba (`MambaForCausalLM`): a selective state-space model; no position table.

Its scan and convolution run on mamba-ssm's and causal-conv1d's CUDA kernels where those packages are
installed (`pip install lmgeo[gpu]`), for CUDA tensors only (`lmgeo.models.kernels`, routed here, before
any Mamba model is built or loaded), and on transformers' PyTorch reference everywhere else.
"""

from transformers import MambaConfig, PretrainedConfig

from lmgeo.models.config import ModelSize
from lmgeo.models.family import NORMS_AND_BIASES, GroupRule, ModelFamily
from lmgeo.models.kernels import route_mamba_kernels

route_mamba_kernels()


def make_config(size: ModelSize, vocab_size: int, seq_len: int) -> PretrainedConfig:
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


FAMILY = ModelFamily(
    name="mamba",
    model_type="mamba",
    kind="ssm",
    make_config=make_config,
    param_groups=(
        GroupRule("embed", r"^backbone\.embeddings\.weight$"),
        GroupRule("hidden", r"\.\d+\.mixer\.\w+_proj\.weight$"),
        GroupRule("scalar", NORMS_AND_BIASES + r"|\.A_log$|\.D$|\.conv1d\.weight$"),
    ),
)
