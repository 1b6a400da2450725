"""GPT-2 (`GPT2LMHeadModel`): learned positions, Conv1D projections stored (in, out)."""

from transformers import GPT2Config, PretrainedConfig

from lmgeo.models.config import ModelSize
from lmgeo.models.family import NORMS_AND_BIASES, GroupRule, ModelFamily


# Dropout is off and special-token ids are cleared: small research models are trained without dropout,
# and the family's default token ids (50256) do not exist in a small vocabulary. The activation is GPT-2's
# tanh GELU as one fused kernel (`gelu_pytorch_tanh`, torch's `gelu(approximate="tanh")`) instead of
# transformers' `gelu_new`, the same formula spelled as eight tensor ops (an eighth of a GPT-2-small step on
# an H200 went to them): the same function to float32 rounding (tests/test_arch.py), and the name
# GPT-2 checkpoints are loaded with elsewhere does not matter here, since these models are built from scratch.
def make_config(size: ModelSize, vocab_size: int, seq_len: int) -> PretrainedConfig:
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=size.d_model,
        n_layer=size.n_layers,
        n_head=size.n_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu_pytorch_tanh",
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )


FAMILY = ModelFamily(
    name="gpt2",
    model_type="gpt2",
    kind="transformer",
    make_config=make_config,
    param_groups=(
        GroupRule("embed", r"^transformer\.(?:wte|wpe)\.weight$"),
        GroupRule("hidden", r"\.\d+\.(?:attn|mlp)\.(?:c_attn|c_proj|c_fc)\.weight$"),
        GroupRule("scalar", NORMS_AND_BIASES),
    ),
    hidden_stored_transposed=True,
)
